//! `pinstream`: the command-line front end. Thin over the library and `pinstream_cli::bench`.
//! Its one `unsafe` block restores the default SIGPIPE action.

#![deny(unsafe_code)]

mod bandwidth;
mod info;
mod load;
mod normalize;
mod output;
mod prefetch;
mod staging;

use std::process::ExitCode;

use clap::error::ErrorKind;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "pinstream",
    version,
    about = "Host <-> GPU transfers and kernels over the CUDA runtime",
    arg_required_else_help = true
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Devices, driver and runtime, PCI id, PCIe link, SMs, memory, copy engines.
    Info(info::InfoArgs),
    /// Transfer bandwidth: memory kinds x directions x sizes, latency, pinning cost, scenarios.
    Bandwidth(bandwidth::BandwidthArgs),
    /// Normalize images with the fused kernel (or the CPU reference) into a .npy file.
    Normalize(normalize::NormalizeArgs),
    /// The staging engine against pageable and pinned copies: sizes, many tensors, files, tuning.
    Staging(staging::StagingArgs),
    /// A training loop fed three ways (serial, APEX-style, the prefetcher) against the ideal.
    Prefetch(prefetch::PrefetchArgs),
    /// A safetensors file onto the GPU (model weights): tensors, bytes, seconds, GB/s.
    Load(load::LoadArgs),
}

/// Exit status when the machine has no usable CUDA device or driver.
pub const EXIT_NO_DEVICE: u8 = 2;

/// `--version`: the crate's version and the CUDA runtime it links (the runtime answers without
/// a driver, as it is linked statically).
fn version() -> String {
    let runtime = pinstream::Device::runtime_version()
        .map_or_else(|e| format!("unknown: {e}"), |v| v.to_string());
    format!(
        "{} (CUDA runtime {runtime}, linked statically)",
        env!("CARGO_PKG_VERSION")
    )
}

/// Parses the command line with the version string filled in.
fn parse() -> Result<Cli, clap::Error> {
    // Leaked once: clap wants a `'static` version string.
    let version: &'static str = Box::leak(version().into_boxed_str());
    let matches = Cli::command().version(version).try_get_matches()?;
    Cli::from_arg_matches(&matches)
}

fn main() -> ExitCode {
    // `pinstream info | head` should end quietly, as other command-line tools do, not panic in
    // `println!` when the reader goes away: restore the default SIGPIPE action (Rust ignores it).
    // SAFETY: `signal` with a valid signal number and `SIG_DFL` only changes this process's
    // disposition; no handler runs Rust code, and no other thread exists yet.
    #[allow(unsafe_code)]
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = match parse() {
        Ok(cli) => cli,
        // `pinstream` alone prints the help to stdout, status 0, like `--help`.
        Err(e) if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            print!("{}", e.render());
            return ExitCode::SUCCESS;
        }
        // --help and --version print as usual; argument errors are one line and status 1.
        Err(e) if !e.use_stderr() => e.exit(),
        Err(e) => {
            let msg = e.to_string();
            let first = msg.lines().next().unwrap_or("bad arguments");
            eprintln!("pinstream: {}", first.trim_start_matches("error: "));
            return ExitCode::FAILURE;
        }
    };
    // `info` prints the driver's status and the advice itself; other commands put it in the
    // error line.
    let is_info = matches!(cli.command, Command::Info(_));
    let result = match cli.command {
        Command::Info(args) => info::run(args),
        Command::Bandwidth(args) => bandwidth::run(args),
        Command::Normalize(args) => normalize::run(args),
        Command::Staging(args) => staging::run(args),
        Command::Prefetch(args) => prefetch::run(args),
        Command::Load(args) => load::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.is_no_device() => {
            if is_info {
                eprintln!(
                    "pinstream: no usable CUDA device: {}",
                    e.cuda().map_or_else(|| e.to_string(), |c| c.to_string())
                );
            } else {
                // The error's own message starts with "no usable CUDA device or driver".
                eprintln!("pinstream: {e}");
            }
            ExitCode::from(EXIT_NO_DEVICE)
        }
        Err(e) => {
            eprintln!("pinstream: {e}");
            ExitCode::FAILURE
        }
    }
}
