//! `pinstream prefetch`: time per batch of a training loop fed three ways (serial, APEX-style,
//! the prefetcher) next to the ideal, over a sweep of compute times. `--source` picks where the
//! prefetcher's loaders put the pixels (pageable memory, page-locked memory, a file); the serial
//! and APEX-style loops, the peers, always load into pageable memory.

use std::time::Duration;

use clap::Args;
use pinstream::kernels::Layout;
use pinstream::{Device, Error, Result};
use pinstream_cli::bench::prefetch::{self, Parts, PixelSource, Setup};
use serde::Serialize;

use crate::output::{self, Format};

#[derive(Args, Debug)]
pub struct PrefetchArgs {
    /// Samples per batch.
    #[arg(long, default_value_t = 256)]
    batch: usize,
    /// Sample shape CxHxW.
    #[arg(long, default_value = "3x224x224", value_parser = parse_shape)]
    shape: (usize, usize, usize),
    /// Input layout of the synthetic u8 batches (the output is NCHW f32).
    #[arg(long, value_parser = output::one_of(&["nchw", "nhwc"]), ignore_case = true, default_value = "nchw")]
    layout: String,
    /// GPU time of the training step in ms (a list sweeps it).
    #[arg(long, value_delimiter = ',', default_value = "4")]
    compute_ms: Vec<f64>,
    /// Measured batches per point.
    #[arg(long, default_value_t = 200)]
    batches: usize,
    /// Batches before the clock starts.
    #[arg(long, default_value_t = 10)]
    warmup: usize,
    /// Prefetcher depth (device slots).
    #[arg(long, default_value_t = 2)]
    depth: usize,
    /// Loader threads (also the APEX-style loader's workers).
    #[arg(long, default_value_t = 4)]
    threads: usize,
    /// Host batches the loaders may hold ahead of the upload (`PrefetchConfig::ahead`);
    /// 0 adapts it between 2 and depth + loader threads.
    #[arg(long, default_value_t = 0)]
    ahead: usize,
    /// Device ordinal, or `all` (the prefetcher on every device, one shard each).
    #[arg(long, default_value = "0")]
    device: String,
    /// Which ways to run.
    #[arg(long, value_delimiter = ',', value_parser = output::lower, default_value = "serial,apex,pinstream")]
    modes: Vec<String>,
    /// Where the prefetcher's loaders put the pixels: `pageable` (a Vec, staged upload),
    /// `pinned` (page-locked memory, one DMA), `file` (ranges of a temporary file, read with
    /// pread into the stager's slots) or `resident` (ranges of one portable pinned buffer
    /// filled before the run and shared by every device, one DMA, nothing written per batch).
    /// `serial` and `apex` always use pageable memory.
    #[arg(long, default_value_t = PixelSource::Pageable)]
    source: PixelSource,
    /// Leave the prefetcher's threads wherever the OS puts them, instead of on the CPUs next
    /// to each device (`PrefetchConfig::numa_local`).
    #[arg(long)]
    no_numa_local: bool,
    /// Output format.
    #[arg(long, value_enum, ignore_case = true, default_value_t = Format::Table)]
    format: Format,
}

fn parse_shape(s: &str) -> std::result::Result<(usize, usize, usize), String> {
    let v: Vec<usize> = s
        .split('x')
        .map(|p| p.trim().parse::<usize>())
        .collect::<std::result::Result<_, _>>()
        .map_err(|_| format!("{s:?} is not CxHxW"))?;
    match v[..] {
        [c, h, w] if (1..=4).contains(&c) && h > 0 && w > 0 => Ok((c, h, w)),
        _ => Err(format!("{s:?} is not CxHxW with C in 1..=4")),
    }
}

/// One (mode, compute time) point.
#[derive(Serialize)]
struct Row {
    mode: String,
    source: String,
    compute_ms: f64,
    ms_per_batch: f64,
    batches_per_s: f64,
    ideal_ms: f64,
    vs_ideal: f64,
    /// The issue's `max(host + transfer + normalize, compute)`, loaders charged.
    issue_ideal_ms: f64,
    vs_issue_ideal: f64,
    note: String,
}

pub fn run(args: PrefetchArgs) -> Result<()> {
    let devices = if args.device.eq_ignore_ascii_case("all") {
        Device::all()?
    } else {
        let ordinal = args
            .device
            .parse::<usize>()
            .map_err(|_| Error::InvalidArgument {
                op: "pinstream prefetch",
                reason: format!("--device {:?} is not an ordinal or `all`", args.device),
            })?;
        vec![Device::get(ordinal)?]
    };
    for m in &args.modes {
        if !matches!(m.as_str(), "serial" | "apex" | "pinstream") {
            return Err(Error::InvalidArgument {
                op: "pinstream prefetch",
                reason: format!("unknown mode {m:?} (serial, apex, pinstream)"),
            });
        }
    }
    let first = devices[0];
    let mut rows = Vec::new();
    let mut parts_seen: Vec<(f64, Parts)> = Vec::new();
    let bar = indicatif::ProgressBar::new((args.compute_ms.len() * (args.modes.len() + 1)) as u64);
    if args.format != Format::Table {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    for &c in &args.compute_ms {
        let setup = Setup {
            batch: args.batch,
            chw: args.shape,
            layout: if args.layout == "nhwc" {
                Layout::Nhwc
            } else {
                Layout::Nchw
            },
            compute: Duration::from_secs_f64(c.max(0.0) / 1e3),
            batches: args.batches,
            warmup: args.warmup,
            depth: args.depth,
            threads: args.threads,
            ahead: args.ahead,
            source: args.source,
            numa_local: !args.no_numa_local,
        };
        let parts = prefetch::parts(&first, &setup)?;
        bar.inc(1);
        for m in &args.modes {
            bar.set_message(format!("{m}, compute {c} ms"));
            let (ms, note, per_device, source) = match m.as_str() {
                "serial" => (prefetch::serial(&first, &setup)?, "load, pageable copy, fused normalize, step; one at a time".to_string(), 1, PixelSource::Pageable),
                "apex" => (prefetch::apex(&first, &setup)?, format!("1 deep, pageable copy on a side stream, 3-pass normalize, {} loader threads", args.threads), 1, PixelSource::Pageable),
                _ => {
                    let (ms, stats) = prefetch::pinstream(&devices, &setup)?;
                    // The loaders' window at the end and the uploads that waited for them.
                    let windows = stats
                        .iter()
                        .map(|l| format!("{} ({}/{} waits)", l.ahead, l.waits, l.uploads))
                        .collect::<Vec<_>>()
                        .join(", ");
                    (
                    ms,
                    format!(
                        "depth {}, {} loader threads, ahead {windows}, {} device(s), {}",
                        args.depth,
                        args.threads,
                        devices.len(),
                        match args.source {
                            PixelSource::Pageable => "staged upload",
                            PixelSource::Pinned => "one DMA from page-locked memory",
                            PixelSource::File => "pread into the stager's slots (no synth)",
                            PixelSource::Resident => "one DMA from a resident portable pinned buffer (no synth)",
                        }
                    ),
                    devices.len(),
                    args.source,
                    )
                }
            };
            // For several devices, the aggregate: time per batch of all devices together, against
            // the ideal divided among them.
            let ideal_ms = parts.ideal_ms(source) / per_device as f64;
            let issue_ideal_ms = parts.issue_ideal_ms(source, args.threads) / per_device as f64;
            rows.push(Row {
                mode: if per_device > 1 {
                    format!("pinstream x{per_device}")
                } else {
                    m.clone()
                },
                source: source.to_string(),
                compute_ms: parts.compute_ms,
                ms_per_batch: ms,
                batches_per_s: 1e3 / ms,
                ideal_ms,
                vs_ideal: ms / ideal_ms,
                issue_ideal_ms,
                vs_issue_ideal: ms / issue_ideal_ms,
                note,
            });
            bar.inc(1);
        }
        parts_seen.push((c, parts));
    }
    bar.finish_and_clear();
    let mb = (args.batch * args.shape.0 * args.shape.1 * args.shape.2) as f64 / 1e6;
    match args.format {
        Format::Csv => print!("{}", output::csv(&rows)?),
        Format::Json => print!("{}", output::json(&rows)?),
        Format::Table => {
            println!(
                "batch {} x {}x{}x{} u8 {} ({mb:.1} MB) -> NCHW f32, {} batches after {} warm-up",
                args.batch,
                args.shape.0,
                args.shape.1,
                args.shape.2,
                args.layout,
                args.batches,
                args.warmup
            );
            for (c, p) in &parts_seen {
                println!(
                    "parts at compute {c} ms: step {:.3} ms, staged upload {:.3} ms ({:.1} GB/s), pinned {:.3}, pageable {:.3}, fused normalize {:.3}, synth on one thread {:.3}; ideal {:.3} ms (staged), {:.3} ms (pinned); ideal = max(step, upload + normalize) with the loaders assumed free, issue ideal = max(step, loaders' time per batch + upload + normalize)",
                    p.compute_ms, p.staged_ms, mb / p.staged_ms, p.pinned_ms, p.pageable_ms, p.normalize_ms, p.synth_ms,
                    p.ideal_ms(PixelSource::Pageable), p.ideal_ms(PixelSource::Pinned)
                );
            }
            println!(
                "{:<14} {:<9} {:>10} {:>12} {:>10} {:>10} {:>9} {:>10} {:>9}  note",
                "mode",
                "source",
                "step ms",
                "ms/batch",
                "batch/s",
                "ideal ms",
                "vs ideal",
                "issue ms",
                "vs issue"
            );
            for r in &rows {
                println!(
                    "{:<14} {:<9} {:>10.3} {:>12.3} {:>10.1} {:>10.3} {:>8.3}x {:>10.3} {:>8.3}x  {}",
                    r.mode,
                    r.source,
                    r.compute_ms,
                    r.ms_per_batch,
                    r.batches_per_s,
                    r.ideal_ms,
                    r.vs_ideal,
                    r.issue_ideal_ms,
                    r.vs_issue_ideal,
                    r.note
                );
            }
        }
    }
    Ok(())
}
