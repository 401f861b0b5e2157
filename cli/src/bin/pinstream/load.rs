//! `pinstream load FILE`: a safetensors file onto the GPU with `pinstream::safetensors::load`,
//! timed (median of repeats after a warm-up load), optionally checked byte for byte.

use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use pinstream::safetensors::{self, Direct, Header, LoadOptions, Weights};
use pinstream::timing::Stats;
use pinstream::{Device, Error, Result, Stager, StagerConfig, Stream};
use serde::Serialize;

use crate::output::{self, one_of, Format};

#[derive(Args, Debug)]
pub struct LoadArgs {
    /// The safetensors file.
    file: PathBuf,
    /// Device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// How the data region is read: auto (O_DIRECT when most of it is not in the page cache,
    /// else the page cache), never (always the page cache), always (always O_DIRECT).
    #[arg(long, value_parser = one_of(&["auto", "never", "always"]), ignore_case = true, default_value = "auto")]
    direct: String,
    /// Timed loads, after one warm-up load (which also fills the page cache unless O_DIRECT is
    /// used); the median is reported.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=1000))]
    repeat: u32,
    /// Download the last load's data and compare every byte with the file.
    #[arg(long)]
    verify: bool,
    /// Also list every tensor: name, dtype, shape, bytes.
    #[arg(long)]
    list: bool,
    /// Output format: table, csv (a header line and one row) or json (one object).
    #[arg(long, value_enum, ignore_case = true, default_value_t = Format::Table)]
    format: Format,
}

/// One measured load: the table's numbers, the CSV's row, the JSON's object.
#[derive(Debug, Serialize)]
struct LoadRow {
    file: String,
    tensors: usize,
    /// Bytes of the data region (what is moved).
    bytes: u64,
    header_bytes: u64,
    /// `page cache` or `O_DIRECT`, as the last load read it.
    read: String,
    /// The `--direct` mode asked for.
    direct: String,
    repeats: usize,
    /// Wall seconds per load (header, allocation, upload, synchronize): median, min, max.
    seconds_median: f64,
    seconds_min: f64,
    seconds_max: f64,
    /// Decimal GB/s of the data region: median, min, max of the repeats.
    gbps_median: f64,
    gbps_min: f64,
    gbps_max: f64,
    /// The warm-up load (the first in the process: it also maps the arena's device memory).
    first_seconds: f64,
    /// Fraction of the data region in the page cache before the warm-up load (mincore).
    resident_before: Option<f64>,
    /// Building the stager (pinned slots, threads), once per process.
    stager_ms: f64,
    threads: usize,
    slot_bytes: usize,
    slots: usize,
    /// `Some(true)` when `--verify` found every byte equal to the file.
    verified: Option<bool>,
}

/// The JSON: the same fields, and the samples (which a CSV line cannot hold).
#[derive(Serialize)]
struct JsonRow<'a> {
    #[serde(flatten)]
    row: &'a LoadRow,
    gbps_samples: &'a [f64],
    seconds_samples: &'a [f64],
}

pub fn run(args: LoadArgs) -> Result<()> {
    let direct = match args.direct.as_str() {
        "never" => Direct::Never,
        "always" => Direct::Always,
        _ => Direct::Auto,
    };
    // The file first: a bad file is reported with or without a GPU.
    let header = Header::read(&args.file)?;
    let device = Device::get(args.device)?;
    let stream = device.stream()?;
    let config = StagerConfig::from_env()?;
    let started = Instant::now();
    let stager = Stager::new(&device, config.clone())?;
    let stager_ms = started.elapsed().as_secs_f64() * 1e3;
    let options = LoadOptions::new().direct(direct);
    let resident_before =
        safetensors::resident_fraction(&args.file, header.data_start(), header.data_len());

    let timed = |stager: &Stager| -> Result<(f64, Weights)> {
        let t = Instant::now();
        let w = safetensors::load(stager, &stream, &args.file, options.clone())?;
        w.synchronize()?;
        Ok((t.elapsed().as_secs_f64(), w))
    };
    let (first_seconds, w) = timed(&stager)?;
    drop(w);
    let mut seconds = Vec::new();
    let mut last = None;
    for _ in 0..args.repeat {
        // Freed (stream-ordered) before the next load allocates: the device's pool hands the
        // same memory back.
        drop(last.take());
        let (s, w) = timed(&stager)?;
        seconds.push(s);
        last = Some(w);
    }
    let Some(weights) = last else {
        return Err(Error::InvalidArgument {
            op: "pinstream load",
            reason: "--repeat must be at least 1".into(),
        });
    };
    let bytes = weights.header().data_len();
    let gbps: Vec<f64> = seconds
        .iter()
        .map(|&s| if s > 0.0 { bytes as f64 / s / 1e9 } else { 0.0 })
        .collect();
    let (Some(s), Some(g)) = (Stats::new(seconds.clone()), Stats::new(gbps.clone())) else {
        return Err(Error::InvalidArgument {
            op: "pinstream load",
            reason: "no timed load".into(),
        });
    };
    let verified = if args.verify {
        Some(verify(&stager, &stream, &weights)?)
    } else {
        None
    };
    let row = LoadRow {
        file: args.file.display().to_string(),
        tensors: weights.len(),
        bytes,
        header_bytes: header.header_len(),
        read: if weights.used_direct() {
            "O_DIRECT".into()
        } else {
            "page cache".into()
        },
        direct: args.direct.clone(),
        repeats: seconds.len(),
        seconds_median: s.median,
        seconds_min: s.min,
        seconds_max: s.max,
        gbps_median: g.median,
        gbps_min: g.min,
        gbps_max: g.max,
        first_seconds,
        resident_before,
        stager_ms,
        threads: config.threads,
        slot_bytes: config.slot_bytes,
        slots: config.slots,
        verified,
    };
    match args.format {
        Format::Json => print!(
            "{}",
            output::json(&JsonRow {
                row: &row,
                gbps_samples: &g.samples,
                seconds_samples: &s.samples,
            })?
        ),
        Format::Csv => print!("{}", output::csv(std::slice::from_ref(&row))?),
        Format::Table => table(&row, &weights, args.list),
    }
    if verified == Some(false) {
        return Err(Error::InvalidArgument {
            op: "pinstream load --verify",
            reason: "the data on the GPU differs from the file (see above)".into(),
        });
    }
    Ok(())
}

fn table(row: &LoadRow, weights: &Weights, list: bool) {
    let h = weights.header();
    println!("file: {}", row.file);
    let meta: Vec<String> = h
        .metadata()
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    println!(
        "header: {} bytes, {} tensors, data region {} bytes{}",
        row.header_bytes,
        row.tensors,
        row.bytes,
        if meta.is_empty() {
            String::new()
        } else {
            format!(", metadata: {}", meta.join(" "))
        }
    );
    if list {
        for t in weights.iter() {
            println!(
                "  {:<48} {:<12} {:<24} {:>14}",
                t.name(),
                t.dtype().name(),
                format!("{:?}", t.shape()),
                t.byte_len()
            );
        }
    }
    println!(
        "stager: {} threads, {} slots of {} KiB (built once in {:.1} ms)",
        row.threads,
        row.slots,
        row.slot_bytes >> 10,
        row.stager_ms
    );
    println!(
        "{:<8} {:>14} {:>10} {:>8}   read",
        "tensors", "bytes", "seconds", "GB/s"
    );
    println!(
        "{:<8} {:>14} {:>10.4} {:>8.2}   {} (--direct {}); median of {} after a warm-up load of {:.4} s; GB/s {:.2} .. {:.2}",
        row.tensors,
        row.bytes,
        row.seconds_median,
        row.gbps_median,
        row.read,
        row.direct,
        row.repeats,
        row.first_seconds,
        row.gbps_min,
        row.gbps_max
    );
    if let Some(r) = row.resident_before {
        println!(
            "page cache: {:.0} % of the data region resident before the warm-up load",
            r * 100.0
        );
    }
    match row.verified {
        Some(true) => println!("verify: ok, all {} bytes equal to the file", row.bytes),
        Some(false) => println!("verify: FAILED"),
        None => {}
    }
}

/// Downloads the data region in pieces and compares it with the file; prints the first
/// difference (and its tensor) when there is one.
fn verify(stager: &Stager, stream: &Stream, w: &Weights) -> Result<bool> {
    const OP: &str = "pinstream load --verify";
    const PIECE: usize = 256 << 20;
    let h = w.header();
    let path = h.source().map(PathBuf::from).unwrap_or_default();
    let io = |offset: u64, e: std::io::Error| Error::Io {
        op: OP,
        path: h.path().to_string(),
        offset,
        len: PIECE,
        message: e.to_string(),
    };
    let file = std::fs::File::open(&path).map_err(|e| io(0, e))?;
    let total = usize::try_from(h.data_len()).unwrap_or(usize::MAX);
    let (mut got, mut want) = (vec![0u8; PIECE.min(total)], vec![0u8; PIECE.min(total)]);
    let mut at = 0usize;
    while at < total {
        let n = PIECE.min(total - at);
        let piece = w
            .arena()
            .slice(w.data_offset() + at..w.data_offset() + at + n)?;
        stager.download(stream, &piece, &mut got[..n])?;
        let offset = h.data_start() + at as u64;
        file.read_exact_at(&mut want[..n], offset)
            .map_err(|e| io(offset, e))?;
        if let Some(i) = got[..n].iter().zip(&want[..n]).position(|(a, b)| a != b) {
            let byte = at + i;
            let tensor = w
                .iter()
                .find(|t| t.data_offsets().contains(&byte))
                .map_or("?", |t| t.name());
            println!(
                "verify: byte {byte} of the data region (tensor {tensor:?}) is {} on the GPU, {} in the file",
                got[i], want[i]
            );
            return Ok(false);
        }
        at += n;
    }
    Ok(true)
}
