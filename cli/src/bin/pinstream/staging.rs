//! `pinstream staging`: the staging engine against plain pageable and pinned copies in the same
//! run, many small tensors, files, and a tuning grid over threads and slot sizes.

use clap::Args;
use pinstream::{Device, Result, Stager, StagerConfig};
use pinstream_cli::bench::pool::PoolCost;
use pinstream_cli::bench::size_name;
use pinstream_cli::bench::staging::{self, Measure};
use serde::Serialize;

use crate::output::{self, Format};

#[derive(Args, Debug)]
pub struct StagingArgs {
    /// Device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Sizes to compare at (K, M, G: powers of 1024).
    #[arg(long, value_delimiter = ',', value_parser = parse_size, default_value = "4M,64M,256M,1G")]
    sizes: Vec<usize>,
    /// Samples per point (after one warm-up).
    #[arg(long, default_value_t = 7)]
    samples: usize,
    /// Threads (first value; a list with --tune). Default: the engine's default or
    /// PINSTREAM_STAGING_THREADS.
    #[arg(long, value_delimiter = ',')]
    threads: Vec<usize>,
    /// Slot size (first value; a list with --tune).
    #[arg(long, value_delimiter = ',', value_parser = parse_size)]
    slot: Vec<usize>,
    /// Slots per thread.
    #[arg(long, default_value_t = 2)]
    slots_per_thread: usize,
    /// Copies below this skip the engine (0: none do).
    #[arg(long, value_parser = parse_size_or_zero)]
    min_bytes: Option<usize>,
    /// Grid over --threads x --slot at each size (staged copies only, plus the plain peers once).
    #[arg(long)]
    tune: bool,
    /// Many small tensors, COUNTxELEMS f32 (e.g. 1000x1000); 0x0 to skip.
    #[arg(long, default_value = "1000x1000")]
    many: String,
    /// A file to read to the device (page cache warm after the first read).
    #[arg(long)]
    file: Option<std::path::PathBuf>,
    /// Bytes of the file to read.
    #[arg(long, value_parser = parse_size, default_value = "1G")]
    file_bytes: usize,
    /// Also read the file with O_DIRECT.
    #[arg(long)]
    direct: bool,
    /// Pinned pool cost at this size (fresh cudaHostAlloc, fresh mmap + register on
    /// --pool-threads threads, and a request served from the cache); 0 to skip.
    #[arg(long, value_parser = parse_size_or_zero, default_value = "1G")]
    pool_size: usize,
    /// Pre-faulting threads of the register backing.
    #[arg(long, default_value_t = 8)]
    pool_threads: usize,
    /// Output format. table: printed as measured; csv: the measurements, then (after an empty
    /// line) the pool's cost; json: one object with both, printed at the end.
    #[arg(long, value_enum, ignore_case = true, default_value_t = Format::Table)]
    format: Format,
}

use crate::bandwidth::parse_size;

/// `parse_size`, also accepting 0 (to turn a measurement or the threshold off).
fn parse_size_or_zero(s: &str) -> std::result::Result<usize, String> {
    if s.trim() == "0" {
        return Ok(0);
    }
    parse_size(s)
}

fn config(args: &StagingArgs, threads: Option<usize>, slot: Option<usize>) -> Result<StagerConfig> {
    let mut c = StagerConfig::from_env()?;
    if let Some(t) = threads {
        c.threads = t;
        c.slots = t * args.slots_per_thread.max(1);
    }
    if let Some(s) = slot {
        c.slot_bytes = s;
    }
    if let Some(m) = args.min_bytes {
        c.min_bytes = m;
    }
    Ok(c)
}

/// One measured way of moving some bytes: a line of the table and of the CSV, an element of the
/// JSON's `rows`.
#[derive(Debug, Serialize)]
struct StagingRow {
    /// e.g. `staged h2d`, `many: packed`.
    what: String,
    bytes: usize,
    /// Decimal GB/s (host clock): median, min and max of the samples.
    gbps_median: f64,
    gbps_min: f64,
    gbps_max: f64,
    /// Median milliseconds per sample.
    ms_median: f64,
    /// Process CPU seconds per GB moved.
    cpu_s_per_gb: f64,
    /// gbps_median over the median of the row named in `ratio_to`, where there is one.
    ratio: Option<f64>,
    /// The row compared with: pinned, pageable, loop or read+copy.
    ratio_to: Option<String>,
    note: String,
}

impl StagingRow {
    fn new(m: &Measure, peer: Option<(&str, f64)>) -> StagingRow {
        let peer = peer.filter(|(_, g)| *g > 0.0);
        StagingRow {
            what: m.what.clone(),
            bytes: m.bytes,
            gbps_median: m.gbps.median,
            gbps_min: m.gbps.min,
            gbps_max: m.gbps.max,
            ms_median: m.ms,
            cpu_s_per_gb: m.cpu_s_per_gb,
            ratio: peer.map(|(_, g)| m.gbps.median / g),
            ratio_to: peer.map(|(name, _)| name.to_string()),
            note: m.note.clone(),
        }
    }
}

/// The pinned pool's cost at one size: the table's `pool` line, the second CSV block, the
/// JSON's `pool`.
#[derive(Debug, Serialize)]
struct PoolRow {
    bytes: usize,
    /// Seconds for a fresh block by `cudaHostAlloc`.
    host_alloc_s: f64,
    /// Pre-faulting threads of the mmap + cudaHostRegister backing.
    register_threads: usize,
    /// Seconds for a fresh block by mmap, pre-faulting and `cudaHostRegister`.
    register_s: f64,
    /// Median and slowest microseconds of a request served from the cache.
    cached_us_median: f64,
    cached_us_max: f64,
    cached_hits: u64,
    cached_samples: usize,
}

impl From<&PoolCost> for PoolRow {
    fn from(c: &PoolCost) -> Self {
        PoolRow {
            bytes: c.bytes,
            host_alloc_s: c.host_alloc_seconds,
            register_threads: c.register_threads,
            register_s: c.register_seconds,
            cached_us_median: c.cached_us,
            cached_us_max: c.cached_max_us,
            cached_hits: c.cached_hits,
            cached_samples: c.cached_samples,
        }
    }
}

#[derive(Debug, Serialize)]
struct JsonReport<'a> {
    rows: &'a [StagingRow],
    pool: Option<&'a PoolRow>,
}

/// Prints the table as rows come in; keeps them for CSV and JSON, printed by `finish`.
struct Printer {
    format: Format,
    header_done: bool,
    rows: Vec<StagingRow>,
    pool: Option<PoolRow>,
}

impl Printer {
    fn row(&mut self, m: &Measure, peer: Option<(&str, f64)>) {
        let row = StagingRow::new(m, peer);
        if self.format == Format::Table {
            self.print(&row);
        }
        self.rows.push(row);
    }

    fn pool(&mut self, c: &PoolCost) {
        let p = PoolRow::from(c);
        if self.format == Format::Table {
            println!(
                "pool {}: cudaHostAlloc {:.3} s, mmap + {} threads + cudaHostRegister {:.3} s ({:.2}x faster), \
                 from the cache {:.1} us median ({:.1} max, {} of {} hits)",
                size_name(p.bytes),
                p.host_alloc_s,
                p.register_threads,
                p.register_s,
                p.host_alloc_s / p.register_s.max(1e-9),
                p.cached_us_median,
                p.cached_us_max,
                p.cached_hits,
                p.cached_samples
            );
        }
        self.pool = Some(p);
    }

    /// CSV or JSON of everything measured; nothing for the table, printed already.
    fn finish(&self) -> Result<()> {
        match self.format {
            Format::Table => {}
            Format::Csv => print!(
                "{}",
                output::csv_blocks(&[output::csv(&self.rows)?, output::csv(self.pool.as_slice())?])
            ),
            Format::Json => print!(
                "{}",
                output::json(&JsonReport {
                    rows: &self.rows,
                    pool: self.pool.as_ref(),
                })?
            ),
        }
        Ok(())
    }

    fn print(&mut self, m: &StagingRow) {
        let ratio = match (m.ratio, &m.ratio_to) {
            (Some(r), Some(name)) => format!("{r:.2}x {name}"),
            _ => String::new(),
        };
        if !self.header_done {
            println!(
                "{:<28} {:>6} {:>8} {:>10} {:>9}  {:<18} note",
                "what", "size", "GB/s", "ms", "CPU s/GB", "vs"
            );
            self.header_done = true;
        }
        println!(
            "{:<28} {:>6} {:>8.2} {:>10.4} {:>9.3}  {:<18} {}",
            m.what,
            size_name(m.bytes),
            m.gbps_median,
            m.ms_median,
            m.cpu_s_per_gb,
            ratio,
            m.note
        );
    }
}

fn median_of(ms: &[Measure], what: &str) -> Option<f64> {
    ms.iter().find(|m| m.what == what).map(|m| m.gbps.median)
}

pub fn run(args: StagingArgs) -> Result<()> {
    let device = Device::get(args.device)?;
    let stream = device.stream()?;
    let mut out = Printer {
        format: args.format,
        header_done: false,
        rows: Vec::new(),
        pool: None,
    };
    let print_compare = |out: &mut Printer, ms: &[Measure]| {
        let pageable_up = median_of(ms, "pageable h2d");
        let pinned_up = median_of(ms, "pinned h2d");
        let pageable_down = median_of(ms, "pageable d2h");
        let pinned_down = median_of(ms, "pinned d2h");
        for m in ms {
            let peer = match m.what.as_str() {
                "staged h2d" => pinned_up.map(|g| ("pinned", g)),
                "staged d2h" => pinned_down.map(|g| ("pinned", g)),
                "pinned h2d" => pageable_up.map(|g| ("pageable", g)),
                "pinned d2h" => pageable_down.map(|g| ("pageable", g)),
                _ => None,
            };
            out.row(m, peer);
            if m.what.starts_with("staged") {
                let plain = if m.what.ends_with("h2d") {
                    pageable_up
                } else {
                    pageable_down
                };
                if let Some(p) = plain.filter(|&p| p > 0.0) {
                    if out.format == Format::Table {
                        println!(
                            "{:<28} {:>6} {:>8}   = {:.2}x pageable",
                            "",
                            "",
                            "",
                            m.gbps.median / p
                        );
                    }
                }
            }
        }
    };

    if args.tune {
        let threads = if args.threads.is_empty() {
            vec![1, 2, 4, 6, 8, 12, 16]
        } else {
            args.threads.clone()
        };
        let slots = if args.slot.is_empty() {
            vec![256 << 10, 1 << 20, 2 << 20, 4 << 20]
        } else {
            args.slot.clone()
        };
        for &bytes in &args.sizes {
            let mut first = true;
            for &t in &threads {
                for &s in &slots {
                    let stager = Stager::new(&device, config(&args, Some(t), Some(s))?)?;
                    let ms = staging::compare(&stager, &stream, bytes, args.samples)?;
                    let keep: Vec<Measure> = ms
                        .into_iter()
                        .filter(|m| first || m.what.starts_with("staged"))
                        .collect();
                    print_compare(&mut out, &keep);
                    first = false;
                }
            }
        }
        return out.finish();
    }

    let stager = Stager::new(
        &device,
        config(
            &args,
            args.threads.first().copied(),
            args.slot.first().copied(),
        )?,
    )?;
    for &bytes in &args.sizes {
        let ms = staging::compare(&stager, &stream, bytes, args.samples)?;
        print_compare(&mut out, &ms);
    }
    if let Some((count, elems)) = args.many.split_once('x') {
        let count: usize = count.trim().parse().unwrap_or(0);
        let elems: usize = elems.trim().parse().unwrap_or(0);
        if count > 0 && elems > 0 {
            let ms = staging::many(&stager, &stream, count, elems, args.samples)?;
            let base = median_of(&ms, "many: loop of copies");
            for m in &ms {
                out.row(
                    m,
                    base.filter(|_| !m.what.contains("loop"))
                        .map(|g| ("loop", g)),
                );
            }
        }
    }
    if args.pool_size > 0 {
        let c = pinstream_cli::bench::pool::pool_cost(&device, args.pool_size, args.pool_threads)?;
        out.pool(&c);
    }
    if let Some(path) = &args.file {
        let ms = staging::file(
            &stager,
            &stream,
            path,
            args.file_bytes,
            args.samples,
            args.direct,
        )?;
        let base = median_of(&ms, "file: read + copy");
        for m in &ms {
            out.row(
                m,
                base.filter(|_| !m.what.contains("read +"))
                    .map(|g| ("read+copy", g)),
            );
        }
    }
    out.finish()
}
