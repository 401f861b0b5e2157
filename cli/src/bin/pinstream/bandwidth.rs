//! `pinstream bandwidth`: the transfer benchmark (sweep, latency, pinning cost, host memcpy,
//! optional peer-to-peer rows, scenarios and file reads), printed as a table, CSV or JSON,
//! optionally plotted.

use std::fmt::Write as _;
use std::io::IsTerminal;
use std::time::Duration;

use clap::Args;
use pinstream::{Device, Error, Result, Stager, StagerConfig};
use pinstream_cli::bench::peer;
use pinstream_cli::bench::scenarios::{self, Case};
use pinstream_cli::bench::sweep::{self, Direction, Latency, MemKind, Options, PinCost, Row};
use pinstream_cli::bench::{host_memcpy_gbps, size_name};
use serde::Serialize;

use crate::output::{self, Format, Ordered};

#[derive(Args, Debug)]
pub struct BandwidthArgs {
    /// Device ordinal, or `all` (each device alone, then all at once).
    #[arg(long, default_value = "0")]
    device: String,
    /// Sizes, e.g. 4K,1M,256M (binary units); default: every power of two from 4K to 1G.
    #[arg(long, value_delimiter = ',', value_parser = parse_size)]
    sizes: Vec<usize>,
    /// Memory kinds: pageable, pinned, write-combined (wc), portable, registered, staged
    /// (pageable memory through the staging engine: host clock, h2d and d2h only; its threads
    /// and slots come from PINSTREAM_STAGING_* and show in the note column). Default: all.
    #[arg(long, value_delimiter = ',', value_parser = parse_kind)]
    kinds: Vec<MemKind>,
    /// Directions: h2d, d2h, d2d, bidir (the default set), and p2p: copies between GPUs, every
    /// ordered pair of the machine's devices whatever --device says (rows p2p, p2p-read,
    /// p2p-bidir, p2p-bidir-sum; needs two devices).
    #[arg(long, value_delimiter = ',', value_parser = parse_direction)]
    directions: Vec<Direction>,
    /// Samples per point (at least 5 are taken).
    #[arg(long, default_value_t = 5)]
    samples: usize,
    /// Minimum length of one sample in milliseconds (at least 20).
    #[arg(long, default_value_t = 20)]
    min_sample_ms: u64,
    /// Output format. csv: the sweep's rows, then (with --scenarios, after an empty line) the
    /// scenarios; json: everything, samples included.
    #[arg(long, value_enum, ignore_case = true, default_value_t = Format::Table)]
    format: Format,
    /// Draw GB/s against size to this SVG file.
    #[arg(long)]
    plot: Option<std::path::PathBuf>,
    /// Also reproduce the experiments of PyTorch's non_blocking / pin_memory guide.
    #[arg(long)]
    scenarios: bool,
    /// Only the scenarios, no sweep.
    #[arg(long)]
    scenarios_only: bool,
    /// Issue each copy as consecutive pieces of at most this size (e.g. 16M; at most 64
    /// pieces per copy). Default: one call per copy, as other tools do.
    #[arg(long, value_parser = parse_size)]
    chunk: Option<usize>,
    /// Size used for the pinning-cost measurement.
    #[arg(long, value_parser = parse_size, default_value = "1G")]
    pin_size: usize,
    /// Also read this file to the (first) device (h2d rows, host clock): read() into pageable memory then
    /// a plain copy, the staging engine's upload_file with the page cache warm, and upload_file
    /// with O_DIRECT where the filesystem allows it (skipped with a note otherwise).
    #[arg(long)]
    file: Option<std::path::PathBuf>,
    /// Bytes of --file to read (at most the file's size).
    #[arg(long, value_parser = parse_size, default_value = "1G")]
    file_bytes: usize,
}

pub(crate) fn parse_size(s: &str) -> std::result::Result<usize, String> {
    let t = s.trim();
    let (num, mult) = match t.char_indices().find(|(_, c)| c.is_ascii_alphabetic()) {
        Some((i, _)) => {
            let unit = t[i..].to_ascii_uppercase();
            let m: usize = match unit.trim_end_matches("IB").trim_end_matches('B') {
                "" => 1,
                "K" => 1 << 10,
                "M" => 1 << 20,
                "G" => 1 << 30,
                _ => return Err(format!("`{s}`: unknown unit (use K, M or G)")),
            };
            (&t[..i], m)
        }
        None => (t, 1),
    };
    let n: usize = num
        .parse()
        .map_err(|_| format!("`{s}` is not a size like 4K, 1M or 256M"))?;
    n.checked_mul(mult)
        .filter(|&b| b > 0)
        .ok_or_else(|| format!("`{s}`: size must be between 1 byte and usize::MAX"))
}

fn parse_kind(s: &str) -> std::result::Result<MemKind, String> {
    MemKind::parse(&s.to_ascii_lowercase()).ok_or_else(|| {
        let names: Vec<&str> = MemKind::ALL.iter().map(|k| k.name()).collect();
        format!("`{s}` is not a memory kind ({})", names.join(", "))
    })
}

fn parse_direction(s: &str) -> std::result::Result<Direction, String> {
    Direction::parse(&s.to_ascii_lowercase()).ok_or_else(|| {
        let names: Vec<&str> = Direction::ALL.iter().map(|d| d.name()).collect();
        format!("`{s}` is not a direction ({})", names.join(", "))
    })
}

fn bad(op: &'static str, reason: impl Into<String>) -> Error {
    Error::InvalidArgument {
        op,
        reason: reason.into(),
    }
}

struct Report {
    context: Vec<(String, String)>,
    rows: Vec<Row>,
    latency: Vec<Latency>,
    pinning: Vec<PinCost>,
    scenarios: Vec<Case>,
    warnings: Vec<String>,
}

pub fn run(args: BandwidthArgs) -> Result<()> {
    let devices = if args.device.eq_ignore_ascii_case("all") {
        Device::all()?
    } else {
        let i: usize = args.device.parse().map_err(|_| {
            bad(
                "bandwidth",
                format!("--device `{}`: give an ordinal or `all`", args.device),
            )
        })?;
        vec![Device::get(i)?]
    };
    let mut opts = Options {
        min_samples: args.samples.max(5),
        min_sample_time: Duration::from_millis(args.min_sample_ms.max(20)),
        chunk: args.chunk,
        ..Options::default()
    };
    if !args.sizes.is_empty() {
        opts.sizes = args.sizes.clone();
        opts.sizes.sort_unstable();
        opts.sizes.dedup();
    }
    if !args.kinds.is_empty() {
        opts.kinds = args.kinds.clone();
    }
    if !args.directions.is_empty() {
        opts.directions = args.directions.clone();
    }

    let mut report = Report {
        context: Vec::new(),
        rows: Vec::new(),
        latency: Vec::new(),
        pinning: Vec::new(),
        scenarios: Vec::new(),
        warnings: Vec::new(),
    };
    let ctx = &mut report.context;
    ctx.push(("runtime".into(), Device::runtime_version()?.to_string()));
    ctx.push((
        "driver".into(),
        match (Device::driver_version()?, Device::driver_release()) {
            (None, _) => "none".into(),
            (Some(v), None) => format!("CUDA {v}"),
            (Some(v), Some(r)) => format!("CUDA {v}, kernel module {r}"),
        },
    ));
    let mut link_gbps = None;
    for dev in &devices {
        let link = dev.pcie_link();
        link_gbps = link_gbps.or(link.and_then(|l| l.current_gbps()));
        ctx.push((
            format!("device {}", dev.ordinal()),
            format!(
                "{}, {} copy engines, PCIe {}, NUMA node {}, bus {}",
                dev.name()?,
                dev.async_engine_count()?,
                link.map_or("link unknown".into(), |l| {
                    format!(
                        "{l}, {:.1} GB/s theoretical",
                        l.current_gbps().unwrap_or(0.0)
                    )
                }),
                dev.numa_node().map_or("unknown".into(), |n| n.to_string()),
                dev.pci_bus_id()?
            ),
        ));
    }
    let memcpy = host_memcpy_gbps(256 << 20, 5);
    if let Some(m) = &memcpy {
        ctx.push((
            "host memcpy, 1 thread".into(),
            format!(
                "{:.1} GB/s (what caps pageable copies staged on one thread)",
                m.median
            ),
        ));
    }
    let p2p = opts.directions.contains(&Direction::P2P);
    let peers = if p2p { Device::all()? } else { Vec::new() };
    if p2p {
        ctx.push(("peer access".into(), peer_access(&peers)?));
    }
    if let Some(c) = args.chunk {
        ctx.push((
            "copies".into(),
            format!(
                "issued as pieces of at most {} (at most {} per copy)",
                size_name(c),
                sweep::MAX_PIECES
            ),
        ));
    }
    if args.format == Format::Table {
        for (k, v) in &report.context {
            println!("{k:>22}: {v}");
        }
    }

    if !args.scenarios_only {
        for dev in &devices {
            let total = opts.row_count();
            let bar = progress_bar(total as u64);
            let rows = sweep::run(dev, &opts, &mut |r| {
                if let Some(b) = &bar {
                    b.inc(1);
                    b.set_message(format!("{} {} {}", r.kind, r.direction, size_name(r.bytes)));
                }
            })?;
            if let Some(b) = bar {
                b.finish_and_clear();
            }
            report.rows.extend(rows);
            report
                .latency
                .extend(sweep::latency(dev, 200)?.into_iter().map(|mut l| {
                    l.what = format!("device {}: {}", dev.ordinal(), l.what);
                    l
                }));
        }
        if p2p {
            let bar = progress_bar(peer::row_count(peers.len(), &opts) as u64);
            let measured = peer::run(&peers, &opts, &mut |r| {
                if let Some(b) = &bar {
                    b.inc(1);
                    b.set_message(format!(
                        "{} {} {}",
                        r.device,
                        r.direction,
                        size_name(r.bytes)
                    ));
                }
            })?;
            if let Some(b) = bar {
                b.finish_and_clear();
            }
            report.rows.extend(measured.rows);
            report.warnings.extend(measured.notes);
        }
        if devices.len() > 1 {
            let size = opts
                .sizes
                .iter()
                .copied()
                .max()
                .unwrap_or(1 << 28)
                .min(1 << 28);
            report
                .rows
                .extend(sweep::all_devices(&devices, size, &opts)?);
        }
        report.pinning = sweep::pinning_cost(&devices[0], args.pin_size, 3)?;
        warn_slow(&mut report, link_gbps);
    }
    if let Some(path) = &args.file {
        let dev = &devices[0];
        let stager = Stager::new(dev, StagerConfig::from_env()?)?;
        let rows = sweep::file_rows(
            &stager,
            &dev.stream()?,
            path,
            args.file_bytes,
            opts.min_samples,
        )?;
        let direct = if rows.iter().any(|r| r.kind == "file O_DIRECT") {
            ""
        } else {
            "; O_DIRECT skipped (see stderr)"
        };
        let bytes = rows.first().map_or(0, |r| r.bytes);
        let line = format!("{}, {} bytes read{direct}", path.display(), bytes);
        if args.format == Format::Table {
            println!("{:>22}: {line}", "file");
        }
        report.context.push(("file".into(), line));
        report.rows.extend(rows);
    }
    if args.scenarios || args.scenarios_only {
        report.scenarios = scenarios::run(&devices[0])?;
    }

    match args.format {
        Format::Csv => print!("{}", csv(&report)?),
        Format::Json => print!("{}", json(&report)?),
        Format::Table => print!("{}", table(&report)),
    }
    for w in &report.warnings {
        eprintln!("warning: {w}");
    }
    if let Some(path) = &args.plot {
        plot(&report.rows, link_gbps, path).map_err(|e| bad("bandwidth --plot", e))?;
        eprintln!("plot written to {}", path.display());
    }
    if report.rows.iter().any(|r| !r.verified) {
        return Err(bad(
            "bandwidth",
            "some copies did not deliver the data (column ok = no)",
        ));
    }
    Ok(())
}

/// "0->1 yes, 1->0 yes": whether each ordered pair reaches the other's memory directly.
fn peer_access(devices: &[Device]) -> Result<String> {
    if devices.len() < 2 {
        return Ok(format!("p2p needs two devices; {} here", devices.len()));
    }
    let mut pairs = Vec::new();
    for a in devices {
        for b in devices.iter().filter(|b| *b != a) {
            let yes = if a.can_access_peer(b)? { "yes" } else { "no" };
            pairs.push(format!("{}->{} {yes}", a.ordinal(), b.ordinal()));
        }
    }
    Ok(pairs.join(", "))
}

fn progress_bar(total: u64) -> Option<indicatif::ProgressBar> {
    if total == 0 || !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = indicatif::ProgressBar::new(total);
    if let Ok(style) = indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} {msg}") {
        bar.set_style(style);
    }
    Some(bar)
}

/// Pinned results under 80 % of the link's theoretical rate deserve a word.
fn warn_slow(report: &mut Report, link: Option<f64>) {
    let Some(link) = link else { return };
    let largest = report.rows.iter().map(|r| r.bytes).max().unwrap_or(0);
    if largest < (64 << 20) {
        return;
    }
    for r in &report.rows {
        let pinned = r.kind != "pageable"
            && r.kind != "device"
            && r.kind != MemKind::Staged.name()
            && !r.kind.starts_with("file");
        if pinned
            && r.bytes == largest
            && (r.direction == "h2d" || r.direction == "d2h")
            && r.gbps.median < 0.8 * link
        {
            report.warnings.push(format!(
                "{} {} at {}: {:.1} GB/s is under 80% of the link's {:.1} GB/s",
                r.kind,
                r.direction,
                size_name(r.bytes),
                r.gbps.median,
                link
            ));
        }
    }
    for r in &report.rows {
        if r.partly_alone {
            report.warnings.push(format!(
                "device {} {} {} {}: one direction outran the other by over 1.5x, so part of \
                 the slower one's time ran alone",
                r.device,
                r.kind,
                r.direction,
                size_name(r.bytes)
            ));
        }
        if r.gate_timed_out {
            report.warnings.push(format!(
                "device {} {} {} {}: the gate timed out; enqueue time is in this figure",
                r.device,
                r.kind,
                r.direction,
                size_name(r.bytes)
            ));
        }
    }
}

/// One measured point of the sweep: a line of the table, a line of the CSV, an element of the
/// JSON's `rows` (which also holds the samples).
#[derive(Debug, Serialize)]
struct BandwidthRow {
    /// "0", "1", ... or "all"; "0->1" on peer rows (source->destination).
    device: String,
    kind: &'static str,
    direction: &'static str,
    bytes: usize,
    copies_per_sample: usize,
    /// Decimal GB/s: median, min, max and coefficient of variation of the samples.
    gbps_median: f64,
    gbps_min: f64,
    gbps_max: f64,
    gbps_cv: f64,
    /// Median GB/s by the host clock, where measured.
    host_gbps_median: Option<f64>,
    /// One thread's host memcpy GB/s at this size (pageable rows).
    host_memcpy_gbps: Option<f64>,
    verified: bool,
    gate_timed_out: bool,
    partly_alone: bool,
    note: Option<String>,
}

impl From<&Row> for BandwidthRow {
    fn from(r: &Row) -> Self {
        BandwidthRow {
            device: r.device.clone(),
            kind: r.kind,
            direction: r.direction,
            bytes: r.bytes,
            copies_per_sample: r.copies_per_sample,
            gbps_median: r.gbps.median,
            gbps_min: r.gbps.min,
            gbps_max: r.gbps.max,
            gbps_cv: r.gbps.cv,
            host_gbps_median: r.host_gbps.as_ref().map(|h| h.median),
            host_memcpy_gbps: r.host_memcpy_gbps,
            verified: r.verified,
            gate_timed_out: r.gate_timed_out,
            partly_alone: r.partly_alone,
            note: r.note.clone(),
        }
    }
}

/// A row of the JSON: the same fields, and the samples (which a CSV line cannot hold).
#[derive(Serialize)]
struct JsonRow<'a> {
    #[serde(flatten)]
    row: BandwidthRow,
    gbps_samples: &'a [f64],
    host_gbps_samples: Option<&'a [f64]>,
}

/// Host-observed latency of one small copy, in microseconds.
#[derive(Debug, Serialize)]
struct LatencyRow<'a> {
    what: &'a str,
    micros_median: f64,
    micros_min: f64,
    micros_max: f64,
    micros_samples: &'a [f64],
}

/// Seconds per GiB to pin and to unpin.
#[derive(Debug, Serialize)]
struct PinningRow<'a> {
    what: &'a str,
    bytes: usize,
    pin_s_per_gib_median: f64,
    unpin_s_per_gib_median: f64,
    pin_s_per_gib_samples: &'a [f64],
    unpin_s_per_gib_samples: &'a [f64],
}

/// One case of the PyTorch guide's scenarios.
#[derive(Debug, Serialize)]
struct ScenarioRow<'a> {
    scenario: &'a str,
    case: &'a str,
    /// Median wall milliseconds.
    ms: f64,
    note: &'a str,
}

impl<'a> From<&'a Case> for ScenarioRow<'a> {
    fn from(c: &'a Case) -> Self {
        ScenarioRow {
            scenario: c.scenario,
            case: &c.case,
            ms: c.ms,
            note: &c.note,
        }
    }
}

/// The whole report as JSON.
#[derive(Serialize)]
struct JsonReport<'a> {
    context: Ordered,
    rows: Vec<JsonRow<'a>>,
    latency: Vec<LatencyRow<'a>>,
    pinning: Vec<PinningRow<'a>>,
    scenarios: Vec<ScenarioRow<'a>>,
    warnings: &'a [String],
}

fn rows(r: &Report) -> Vec<BandwidthRow> {
    r.rows.iter().map(BandwidthRow::from).collect()
}

fn table(r: &Report) -> String {
    let mut s = String::new();
    if !r.rows.is_empty() {
        let _ = writeln!(
            s,
            "\n{:<6} {:<16} {:<10} {:>6} {:>9} {:>8} {:>8} {:>6} {:>10} {:>7} {:>3}  note",
            "device",
            "kind",
            "direction",
            "size",
            "GB/s",
            "min",
            "max",
            "cv%",
            "host GB/s",
            "memcpy",
            "ok"
        );
        let dash = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.2}"));
        for row in rows(r) {
            let line = format!(
                "{:<6} {:<16} {:<10} {:>6} {:>9.2} {:>8.2} {:>8.2} {:>6.2} {:>10} {:>7} {:>3}",
                row.device,
                row.kind,
                row.direction,
                size_name(row.bytes),
                row.gbps_median,
                row.gbps_min,
                row.gbps_max,
                row.gbps_cv * 100.0,
                dash(row.host_gbps_median),
                dash(row.host_memcpy_gbps),
                if row.verified { "yes" } else { "NO" }
            );
            match &row.note {
                Some(note) => {
                    let _ = writeln!(s, "{line}  {note}");
                }
                None => {
                    let _ = writeln!(s, "{line}");
                }
            }
        }
        let _ = writeln!(s, "(decimal GB/s from CUDA events, median of samples; host GB/s: host clock, on pageable,\n staged and file rows, whose GB/s is the host clock too (the host does that work: no gate);\n memcpy: one thread's host memcpy at that size, what caps a pageable copy staged on one thread;\n note: the staging engine's threads and slots, or how a file was read;\n bidir-h2d/-d2h: each direction with the other kept busy, bidir-sum: their sum,\n bidir-pair: 2 x size over the time until both directions' copies are done;\n peer rows (device a->b): p2p on a's stream (a pushes), p2p-read on b's (b pulls),\n p2p-bidir: a->b while b->a runs, p2p-bidir-sum: both directions)");
    }
    let latency = latency_rows(r);
    if !latency.is_empty() {
        let _ = writeln!(
            s,
            "\nlatency (host-observed, copy + synchronize)      median      min      max"
        );
        for l in &latency {
            let _ = writeln!(
                s,
                "  {:<44} {:>7.1} µs {:>6.1} {:>8.1}",
                l.what, l.micros_median, l.micros_min, l.micros_max
            );
        }
    }
    let pinning = pinning_rows(r);
    if !pinning.is_empty() {
        let _ = writeln!(
            s,
            "\npinning cost                       size      pin s/GiB   unpin s/GiB"
        );
        for p in &pinning {
            let _ = writeln!(
                s,
                "  {:<32} {:>6} {:>12.4} {:>13.4}",
                p.what,
                size_name(p.bytes),
                p.pin_s_per_gib_median,
                p.unpin_s_per_gib_median
            );
        }
    }
    if !r.scenarios.is_empty() {
        let _ = writeln!(
            s,
            "\nscenarios (PyTorch non_blocking/pin_memory guide), median wall ms"
        );
        for c in r.scenarios.iter().map(ScenarioRow::from) {
            let _ = writeln!(
                s,
                "  ({}) {:<52} {:>9.3}  {}",
                c.scenario, c.case, c.ms, c.note
            );
        }
    }
    s
}

fn latency_rows(r: &Report) -> Vec<LatencyRow<'_>> {
    r.latency
        .iter()
        .map(|l| LatencyRow {
            what: &l.what,
            micros_median: l.micros.median,
            micros_min: l.micros.min,
            micros_max: l.micros.max,
            micros_samples: &l.micros.samples,
        })
        .collect()
}

fn pinning_rows(r: &Report) -> Vec<PinningRow<'_>> {
    r.pinning
        .iter()
        .map(|p| PinningRow {
            what: p.what,
            bytes: p.bytes,
            pin_s_per_gib_median: p.pin_s_per_gib.median,
            unpin_s_per_gib_median: p.unpin_s_per_gib.median,
            pin_s_per_gib_samples: &p.pin_s_per_gib.samples,
            unpin_s_per_gib_samples: &p.unpin_s_per_gib.samples,
        })
        .collect()
}

/// The sweep's rows, then (after an empty line, with their own header) the scenarios.
fn csv(r: &Report) -> Result<String> {
    let scenarios: Vec<ScenarioRow> = r.scenarios.iter().map(ScenarioRow::from).collect();
    Ok(output::csv_blocks(&[
        output::csv(&rows(r))?,
        output::csv(&scenarios)?,
    ]))
}

fn json(r: &Report) -> Result<String> {
    output::json(&JsonReport {
        context: Ordered(r.context.clone()),
        rows: r
            .rows
            .iter()
            .map(|row| JsonRow {
                row: BandwidthRow::from(row),
                gbps_samples: &row.gbps.samples,
                host_gbps_samples: row.host_gbps.as_ref().map(|h| &h.samples[..]),
            })
            .collect(),
        latency: latency_rows(r),
        pinning: pinning_rows(r),
        scenarios: r.scenarios.iter().map(ScenarioRow::from).collect(),
        warnings: &r.warnings,
    })
}

fn plot(
    rows: &[Row],
    link: Option<f64>,
    path: &std::path::Path,
) -> std::result::Result<(), String> {
    use plotters::prelude::*;
    let series: Vec<(String, Vec<(f64, f64)>)> = {
        let mut keys: Vec<(String, &str, &str, &str)> = Vec::new();
        for r in rows {
            let k = (
                format!("{} {} {}", r.device, r.kind, r.direction),
                r.device.as_str(),
                r.kind,
                r.direction,
            );
            // File rows are one size each: no line to draw.
            if r.device != "all" && !r.kind.starts_with("file") && !keys.iter().any(|x| x.0 == k.0)
            {
                keys.push(k);
            }
        }
        keys.into_iter()
            .map(|(label, device, kind, dir)| {
                let pts = rows
                    .iter()
                    .filter(|r| r.device == device && r.kind == kind && r.direction == dir)
                    .map(|r| (r.bytes as f64, r.gbps.median))
                    .collect();
                (label, pts)
            })
            .collect()
    };
    let xmin = rows.iter().map(|r| r.bytes).min().unwrap_or(4096) as f64;
    let xmax = (rows.iter().map(|r| r.bytes).max().unwrap_or(1 << 30) as f64).max(xmin * 2.0);
    let ymax = rows
        .iter()
        .map(|r| r.gbps.median)
        .fold(link.unwrap_or(10.0), f64::max)
        * 1.1;
    let root = SVGBackend::new(path, (1200, 800)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "pinstream bandwidth (decimal GB/s, median)",
            ("sans-serif", 24),
        )
        .margin(20)
        .x_label_area_size(50)
        .y_label_area_size(60)
        .build_cartesian_2d((xmin..xmax).log_scale(), 0f64..ymax)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("bytes per copy")
        .y_desc("GB/s")
        .x_label_formatter(&|x| size_name(*x as usize))
        .draw()
        .map_err(|e| e.to_string())?;
    for (i, (label, pts)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))
            .map_err(|e| e.to_string())?
            .label(label.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    if let Some(l) = link {
        chart
            .draw_series(LineSeries::new(
                vec![(xmin, l), (xmax, l)],
                BLACK.stroke_width(1),
            ))
            .map_err(|e| e.to_string())?
            .label(format!("PCIe link, theoretical ({l:.1} GB/s)"))
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use pinstream_cli::bench::Stats;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("4K"), Ok(4096));
        assert_eq!(parse_size("1M"), Ok(1 << 20));
        assert_eq!(parse_size("256MiB"), Ok(256 << 20));
        assert_eq!(parse_size("1g"), Ok(1 << 30));
        assert_eq!(parse_size("1000"), Ok(1000));
        assert!(parse_size("0").is_err());
        assert!(parse_size("12Q").is_err());
        assert!(parse_size("K").is_err());
        assert_eq!(size_name(4096), "4K");
        assert_eq!(size_name(1 << 30), "1G");
        assert_eq!(size_name(1000), "1000");
    }

    #[test]
    fn kinds_parse() {
        assert_eq!(parse_kind("staged"), Ok(MemKind::Staged));
        assert_eq!(parse_kind("wc"), Ok(MemKind::WriteCombined));
        let e = parse_kind("bogus").unwrap_err();
        assert!(e.contains("registered, staged"), "{e}");
    }

    #[test]
    fn new_arguments_parse() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            args: BandwidthArgs,
        }
        let cli = Cli::try_parse_from([
            "bandwidth",
            "--kinds",
            "staged,pinned",
            "--file",
            "/tmp/x.bin",
            "--file-bytes",
            "256M",
        ])
        .unwrap();
        assert_eq!(cli.args.kinds, vec![MemKind::Staged, MemKind::Pinned]);
        assert_eq!(
            cli.args.file.as_deref(),
            Some(std::path::Path::new("/tmp/x.bin"))
        );
        assert_eq!(cli.args.file_bytes, 256 << 20);
        let cli = Cli::try_parse_from(["bandwidth"]).unwrap();
        assert!(cli.args.kinds.is_empty() && cli.args.file.is_none());
        assert_eq!(cli.args.file_bytes, 1 << 30);
        assert!(Cli::try_parse_from(["bandwidth", "--file-bytes", "0"]).is_err());
        let cli = Cli::try_parse_from(["bandwidth", "--directions", "p2p,d2d"]).unwrap();
        assert_eq!(cli.args.directions, vec![Direction::P2P, Direction::D2D]);
        let e = parse_direction("peer").unwrap_err();
        assert!(e.contains("bidir, p2p"), "{e}");
        assert!(Cli::try_parse_from(["bandwidth", "--kinds", "staged,nope"]).is_err());
    }

    /// Enum-valued options take any letter case: `--directions D2H`, `--kinds PINNED,WC`,
    /// `--format JSON`, `--device ALL`.
    #[test]
    fn values_in_upper_case_parse() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            args: BandwidthArgs,
        }
        let cli = Cli::try_parse_from([
            "bandwidth",
            "--directions",
            "D2H,H2d,P2P",
            "--kinds",
            "PINNED,WC,Staged",
            "--format",
            "JSON",
        ])
        .unwrap();
        assert_eq!(
            cli.args.directions,
            vec![Direction::D2H, Direction::H2D, Direction::P2P]
        );
        assert_eq!(
            cli.args.kinds,
            vec![MemKind::Pinned, MemKind::WriteCombined, MemKind::Staged]
        );
        assert_eq!(cli.args.format, Format::Json);
        let e = parse_direction("D2X").unwrap_err();
        assert!(e.contains("`D2X` is not a direction"), "{e}");
    }

    #[test]
    fn peer_rows_print_their_pair() {
        let stats = Stats::new(vec![300.0, 310.0, 320.0]).unwrap();
        let row = |device: &str, direction| Row {
            device: device.into(),
            kind: peer::KIND,
            direction,
            bytes: 512 << 20,
            copies_per_sample: 12,
            gbps: stats.clone(),
            host_gbps: None,
            host_memcpy_gbps: None,
            verified: true,
            gate_timed_out: false,
            partly_alone: false,
            note: Some("on 0 (push)".into()),
        };
        let report = Report {
            context: Vec::new(),
            rows: vec![row("0->1", "p2p"), row("1->0", "p2p-bidir-sum")],
            latency: Vec::new(),
            pinning: Vec::new(),
            scenarios: Vec::new(),
            warnings: Vec::new(),
        };
        let table = table(&report);
        let line = table.lines().find(|l| l.starts_with("0->1")).unwrap();
        assert_eq!(
            line,
            "0->1   peer             p2p          512M    310.00   300.00   320.00   2.63          -       - yes  on 0 (push)"
        );
        assert!(
            table.contains("1->0   peer             p2p-bidir-sum"),
            "{table}"
        );
        let out = csv(&report).unwrap();
        assert!(out
            .lines()
            .nth(1)
            .unwrap()
            .starts_with("0->1,peer,p2p,536870912,12,310.0,"));
    }

    #[test]
    fn csv_lines_have_the_header_s_columns() {
        let stats = Stats::new(vec![1.0, 2.0, 3.0]).unwrap();
        let row = |kind, memcpy, note: Option<&str>| Row {
            device: "0".into(),
            kind,
            direction: "h2d",
            bytes: 4096,
            copies_per_sample: 10,
            gbps: stats.clone(),
            host_gbps: Some(stats.clone()),
            host_memcpy_gbps: memcpy,
            verified: true,
            gate_timed_out: false,
            partly_alone: false,
            note: note.map(String::from),
        };
        let report = Report {
            context: vec![("runtime".into(), "13.0".into())],
            rows: vec![
                row("pageable", Some(9.5), None),
                row("pinned", None, None),
                row("staged", None, Some("threads=8 slot=2M slots=16")),
            ],
            latency: vec![Latency {
                what: "pinned h2d 4 B".into(),
                micros: stats.clone(),
            }],
            pinning: vec![PinCost {
                what: "cudaHostAlloc",
                bytes: 1 << 30,
                pin_s_per_gib: stats.clone(),
                unpin_s_per_gib: stats.clone(),
            }],
            scenarios: vec![Case {
                scenario: "a",
                case: "4 MB \"pinned\" copy".into(),
                ms: 0.1,
                note: String::new(),
            }],
            warnings: Vec::new(),
        };
        let out = csv(&report).unwrap();
        let lines: Vec<&str> = out.lines().collect();
        // Three rows, an empty line, the scenarios' header and row.
        assert_eq!(lines.len(), 7, "{out}");
        assert_eq!(
            lines[0],
            "device,kind,direction,bytes,copies_per_sample,gbps_median,gbps_min,gbps_max,gbps_cv,\
             host_gbps_median,host_memcpy_gbps,verified,gate_timed_out,partly_alone,note"
        );
        let want = lines[0].split(',').count();
        for l in &lines[1..4] {
            assert_eq!(l.split(',').count(), want, "{l}");
        }
        assert_eq!(
            lines[1],
            "0,pageable,h2d,4096,10,2.0,1.0,3.0,0.408248290463863,2.0,9.5,true,false,false,"
        );
        assert!(
            lines[2].ends_with(",2.0,,true,false,false,"),
            "{}",
            lines[2]
        );
        assert!(lines[3].ends_with(",threads=8 slot=2M slots=16"));
        assert_eq!(lines[4], "");
        assert_eq!(lines[5], "scenario,case,ms,note");
        assert_eq!(lines[6], "a,\"4 MB \"\"pinned\"\" copy\",0.1,");

        let json = json(&report).unwrap();
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        let rows = v["rows"].as_array().unwrap();
        assert_eq!(rows.len(), 3);
        // The same names as the CSV's columns, and the samples.
        let first = rows[0].as_object().unwrap();
        for name in lines[0].split(',') {
            assert!(first.contains_key(name), "{name} missing from {json}");
        }
        assert_eq!(rows[0]["host_memcpy_gbps"], 9.5);
        assert!(rows[1]["host_memcpy_gbps"].is_null());
        assert_eq!(rows[2]["note"], "threads=8 slot=2M slots=16");
        assert!(rows[0]["note"].is_null());
        assert_eq!(rows[0]["gbps_samples"], serde_json::json!([1.0, 2.0, 3.0]));
        assert_eq!(v["scenarios"][0]["case"], "4 MB \"pinned\" copy");
        assert_eq!(v["context"]["runtime"], "13.0");
        assert_eq!(v["latency"][0]["micros_median"], 2.0);
        assert_eq!(v["pinning"][0]["pin_s_per_gib_median"], 2.0);

        let table = table(&report);
        let staged = table
            .lines()
            .find(|l| l.contains("staged"))
            .expect("a staged line");
        assert!(
            staged.ends_with("yes  threads=8 slot=2M slots=16"),
            "{staged}"
        );
        let pageable = table
            .lines()
            .find(|l| l.contains("pageable"))
            .expect("a pageable line");
        assert_eq!(
            pageable,
            "0      pageable         h2d            4K      2.00     1.00     3.00  40.82       2.00    9.50 yes"
        );
    }
}
