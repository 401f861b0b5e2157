//! `pinstream`: the command-line front end. Thin over the library.

mod info;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "pinstream",
    version,
    about = "Host <-> GPU transfers and kernels over the CUDA runtime"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Devices, driver and runtime, PCI id, PCIe link, SMs, memory, copy engines.
    Info,
}

/// Exit status when the machine has no usable CUDA device or driver.
pub const EXIT_NO_DEVICE: u8 = 2;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Info => info::run(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.is_no_device() => {
            eprintln!(
                "pinstream: no usable CUDA device: {}",
                e.cuda().map_or_else(|| e.to_string(), |c| c.to_string())
            );
            ExitCode::from(EXIT_NO_DEVICE)
        }
        Err(e) => {
            eprintln!("pinstream: {e}");
            ExitCode::FAILURE
        }
    }
}
