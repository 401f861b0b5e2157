//! `pinstream bandwidth`: the transfer benchmark (sweep, latency, pinning cost, host memcpy,
//! optional scenarios and file reads), printed as a table, CSV or JSON, optionally plotted.

use std::fmt::Write as _;
use std::io::IsTerminal;
use std::time::Duration;

use clap::Args;
use pinstream::bench::scenarios::{self, Case};
use pinstream::bench::sweep::{self, Direction, Latency, MemKind, Options, PinCost, Row};
use pinstream::bench::{host_memcpy_gbps, size_name, Stats};
use pinstream::{Device, Error, Result, Stager, StagerConfig};

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
    /// Directions: h2d, d2h, d2d, bidir.
    #[arg(long, value_delimiter = ',', value_parser = parse_direction)]
    directions: Vec<Direction>,
    /// Samples per point (at least 5 are taken).
    #[arg(long, default_value_t = 5)]
    samples: usize,
    /// Minimum length of one sample in milliseconds (at least 20).
    #[arg(long, default_value_t = 20)]
    min_sample_ms: u64,
    /// Output format.
    #[arg(long, value_parser = ["table", "csv", "json"], default_value = "table")]
    format: String,
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
    MemKind::parse(s).ok_or_else(|| {
        let names: Vec<&str> = MemKind::ALL.iter().map(|k| k.name()).collect();
        format!("`{s}` is not a memory kind ({})", names.join(", "))
    })
}

fn parse_direction(s: &str) -> std::result::Result<Direction, String> {
    Direction::parse(s).ok_or_else(|| format!("`{s}` is not a direction (h2d, d2h, d2d, bidir)"))
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
    let devices = if args.device == "all" {
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
    if args.format == "table" {
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
        if args.format == "table" {
            println!("{:>22}: {line}", "file");
        }
        report.context.push(("file".into(), line));
        report.rows.extend(rows);
    }
    if args.scenarios || args.scenarios_only {
        report.scenarios = scenarios::run(&devices[0])?;
    }

    match args.format.as_str() {
        "csv" => print!("{}", csv(&report)),
        "json" => println!("{}", json(&report)),
        _ => print!("{}", table(&report)),
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

fn progress_bar(total: u64) -> Option<indicatif::ProgressBar> {
    if !std::io::stderr().is_terminal() {
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
                "{} {} {}: one direction outran the other by over 1.5x, so part of the slower \
                 one's time ran alone",
                r.kind,
                r.direction,
                size_name(r.bytes)
            ));
        }
        if r.gate_timed_out {
            report.warnings.push(format!(
                "{} {} {}: the gate timed out; enqueue time is in this figure",
                r.kind,
                r.direction,
                size_name(r.bytes)
            ));
        }
    }
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
        for row in &r.rows {
            let host = row
                .host_gbps
                .as_ref()
                .map_or("-".to_string(), |h| format!("{:.2}", h.median));
            let line = format!(
                "{:<6} {:<16} {:<10} {:>6} {:>9.2} {:>8.2} {:>8.2} {:>6.2} {:>10} {:>7} {:>3}",
                row.device,
                row.kind,
                row.direction,
                size_name(row.bytes),
                row.gbps.median,
                row.gbps.min,
                row.gbps.max,
                row.gbps.cv * 100.0,
                host,
                row.host_memcpy_gbps
                    .map_or("-".to_string(), |m| format!("{m:.2}")),
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
        let _ = writeln!(s, "(decimal GB/s from CUDA events, median of samples; host GB/s: host clock, on pageable,\n staged and file rows, whose GB/s is the host clock too (the host does that work: no gate);\n memcpy: one thread's host memcpy at that size, what caps a pageable copy staged on one thread;\n note: the staging engine's threads and slots, or how a file was read;\n bidir-h2d/-d2h: each direction with the other kept busy, bidir-sum: their sum,\n bidir-pair: 2 x size over the time until both directions' copies are done)");
    }
    if !r.latency.is_empty() {
        let _ = writeln!(
            s,
            "\nlatency (host-observed, copy + synchronize)      median      min      max"
        );
        for l in &r.latency {
            let m = &l.micros;
            let _ = writeln!(
                s,
                "  {:<44} {:>7.1} µs {:>6.1} {:>8.1}",
                l.what, m.median, m.min, m.max
            );
        }
    }
    if !r.pinning.is_empty() {
        let _ = writeln!(
            s,
            "\npinning cost                       size      pin s/GiB   unpin s/GiB"
        );
        for p in &r.pinning {
            let _ = writeln!(
                s,
                "  {:<32} {:>6} {:>12.4} {:>13.4}",
                p.what,
                size_name(p.bytes),
                p.pin_s_per_gib.median,
                p.unpin_s_per_gib.median
            );
        }
    }
    if !r.scenarios.is_empty() {
        let _ = writeln!(
            s,
            "\nscenarios (PyTorch non_blocking/pin_memory guide), median wall ms"
        );
        for c in &r.scenarios {
            let _ = writeln!(
                s,
                "  ({}) {:<52} {:>9.3}  {}",
                c.scenario, c.case, c.ms, c.note
            );
        }
    }
    s
}

fn stats_fields(st: &Stats) -> String {
    format!("{:.4},{:.4},{:.4},{:.5}", st.median, st.min, st.max, st.cv)
}

fn csv(r: &Report) -> String {
    let mut s = String::from("device,kind,direction,bytes,copies_per_sample,gbps_median,gbps_min,gbps_max,gbps_cv,host_gbps_median,host_memcpy_gbps,verified,gate_timed_out,partly_alone,note\n");
    for row in &r.rows {
        let _ = writeln!(
            s,
            "{},{},{},{},{},{},{},{},{},{},{},{}",
            row.device,
            row.kind,
            row.direction,
            row.bytes,
            row.copies_per_sample,
            stats_fields(&row.gbps),
            row.host_gbps
                .as_ref()
                .map_or(String::new(), |h| format!("{:.4}", h.median)),
            row.host_memcpy_gbps
                .map_or(String::new(), |m| format!("{m:.4}")),
            row.verified,
            row.gate_timed_out,
            row.partly_alone,
            row.note.as_deref().map_or(String::new(), csv_field)
        );
    }
    for c in &r.scenarios {
        let _ = writeln!(
            s,
            "scenario,{},{},,,{:.4},,,,,,,,,{}",
            c.scenario,
            csv_field(&c.case),
            c.ms,
            csv_field(&c.note)
        );
    }
    s
}

/// A CSV field: quoted (inner quotes doubled) where it holds a comma, quote or line break.
fn csv_field(v: &str) -> String {
    if v.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", v.replace('"', "\"\""))
    } else {
        v.to_string()
    }
}

fn json_str(v: &str) -> String {
    let mut out = String::from("\"");
    for ch in v.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn json_stats(st: &Stats) -> String {
    let samples: Vec<String> = st.samples.iter().map(|x| format!("{x:.4}")).collect();
    format!(
        "{{\"median\":{:.4},\"min\":{:.4},\"max\":{:.4},\"cv\":{:.5},\"samples\":[{}]}}",
        st.median,
        st.min,
        st.max,
        st.cv,
        samples.join(",")
    )
}

fn json(r: &Report) -> String {
    let ctx: Vec<String> = r
        .context
        .iter()
        .map(|(k, v)| format!("{}:{}", json_str(k), json_str(v)))
        .collect();
    let rows: Vec<String> = r
        .rows
        .iter()
        .map(|row| {
            format!(
                "{{\"device\":{},\"kind\":{},\"direction\":{},\"bytes\":{},\"copies_per_sample\":{},\"gbps\":{},\"host_gbps\":{},\"host_memcpy_gbps\":{},\"verified\":{},\"gate_timed_out\":{},\"partly_alone\":{},\"note\":{}}}",
                json_str(&row.device),
                json_str(row.kind),
                json_str(row.direction),
                row.bytes,
                row.copies_per_sample,
                json_stats(&row.gbps),
                row.host_gbps.as_ref().map_or("null".to_string(), json_stats),
                row.host_memcpy_gbps
                    .map_or("null".to_string(), |m| format!("{m:.4}")),
                row.verified,
                row.gate_timed_out,
                row.partly_alone,
                row.note.as_deref().map_or("null".to_string(), json_str)
            )
        })
        .collect();
    let lat: Vec<String> = r
        .latency
        .iter()
        .map(|l| {
            format!(
                "{{\"what\":{},\"micros\":{}}}",
                json_str(&l.what),
                json_stats(&l.micros)
            )
        })
        .collect();
    let pin: Vec<String> = r
        .pinning
        .iter()
        .map(|p| {
            format!(
                "{{\"what\":{},\"bytes\":{},\"pin_s_per_gib\":{},\"unpin_s_per_gib\":{}}}",
                json_str(p.what),
                p.bytes,
                json_stats(&p.pin_s_per_gib),
                json_stats(&p.unpin_s_per_gib)
            )
        })
        .collect();
    let sc: Vec<String> = r
        .scenarios
        .iter()
        .map(|c| {
            format!(
                "{{\"scenario\":{},\"case\":{},\"ms\":{:.4},\"note\":{}}}",
                json_str(c.scenario),
                json_str(&c.case),
                c.ms,
                json_str(&c.note)
            )
        })
        .collect();
    format!(
        "{{\"context\":{{{}}},\"rows\":[{}],\"latency\":[{}],\"pinning\":[{}],\"scenarios\":[{}]}}",
        ctx.join(","),
        rows.join(","),
        lat.join(","),
        pin.join(","),
        sc.join(",")
    )
}

fn plot(
    rows: &[Row],
    link: Option<f64>,
    path: &std::path::Path,
) -> std::result::Result<(), String> {
    use plotters::prelude::*;
    let series: Vec<(String, Vec<(f64, f64)>)> = {
        let mut keys: Vec<(String, &str, &str)> = Vec::new();
        for r in rows {
            let k = (
                format!("{} {} {}", r.device, r.kind, r.direction),
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
            .map(|(label, kind, dir)| {
                let pts = rows
                    .iter()
                    .filter(|r| r.kind == kind && r.direction == dir && r.device != "all")
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
        assert!(Cli::try_parse_from(["bandwidth", "--kinds", "staged,nope"]).is_err());
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
            context: Vec::new(),
            rows: vec![
                row("pageable", Some(9.5), None),
                row("pinned", None, None),
                row("staged", None, Some("threads=8 slot=2M slots=16")),
            ],
            latency: Vec::new(),
            pinning: Vec::new(),
            scenarios: vec![Case {
                scenario: "a",
                case: "4 MB \"pinned\" copy".into(),
                ms: 0.1,
                note: String::new(),
            }],
            warnings: Vec::new(),
        };
        let out = csv(&report);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 5);
        let want = lines[0].split(',').count();
        for l in &lines {
            assert_eq!(l.split(',').count(), want, "{l}");
        }
        assert!(lines[0].ends_with(",note"));
        assert!(lines[1].contains(",9.5000,"));
        assert!(lines[3].ends_with(",threads=8 slot=2M slots=16"));
        assert!(
            lines[4].contains(",\"4 MB \"\"pinned\"\" copy\","),
            "{}",
            lines[4]
        );
        let json = json(&report);
        assert!(json.contains("\"host_memcpy_gbps\":9.5000"));
        assert!(json.contains("\"host_memcpy_gbps\":null"));
        assert!(json.contains("\"note\":\"threads=8 slot=2M slots=16\""));
        assert!(json.contains("\"note\":null"));
        let table = table(&report);
        let staged = table
            .lines()
            .find(|l| l.contains("staged"))
            .expect("a staged line");
        assert!(
            staged.ends_with("yes  threads=8 slot=2M slots=16"),
            "{staged}"
        );
        assert_eq!(csv_field("a,b"), "\"a,b\"");
        assert_eq!(csv_field("plain"), "plain");
    }

    #[test]
    fn json_escapes() {
        assert_eq!(json_str("a\"b\\c\n"), "\"a\\\"b\\\\c\\u000a\"");
    }
}
