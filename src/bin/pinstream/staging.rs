//! `pinstream staging`: the staging engine against plain pageable and pinned copies in the same
//! run, many small tensors, files, and a tuning grid over threads and slot sizes.

use clap::Args;
use pinstream::bench::size_name;
use pinstream::bench::staging::{self, Measure};
use pinstream::{Device, Result, Stager, StagerConfig};

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
    /// Output format.
    #[arg(long, value_parser = ["table", "csv"], default_value = "table")]
    format: String,
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

struct Printer {
    csv: bool,
    header_done: bool,
}

impl Printer {
    fn row(&mut self, m: &Measure, peer: Option<(&str, f64)>) {
        let ratio = peer
            .filter(|(_, g)| *g > 0.0)
            .map(|(name, g)| format!("{:.2}x {name}", m.gbps.median / g))
            .unwrap_or_default();
        if self.csv {
            if !self.header_done {
                println!(
                    "what,bytes,gbps_median,gbps_min,gbps_max,ms_median,cpu_s_per_gb,ratio,note"
                );
                self.header_done = true;
            }
            println!(
                "{},{},{:.3},{:.3},{:.3},{:.4},{:.4},{},{}",
                m.what,
                m.bytes,
                m.gbps.median,
                m.gbps.min,
                m.gbps.max,
                m.ms,
                m.cpu_s_per_gb,
                ratio,
                m.note
            );
            return;
        }
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
            m.gbps.median,
            m.ms,
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
        csv: args.format == "csv",
        header_done: false,
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
                    if !out.csv {
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
        return Ok(());
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
        let c = pinstream::bench::pool::pool_cost(&device, args.pool_size, args.pool_threads)?;
        println!(
            "pool {}: cudaHostAlloc {:.3} s, mmap + {} threads + cudaHostRegister {:.3} s ({:.2}x faster), \
             from the cache {:.1} us median ({:.1} max, {} of {} hits)",
            size_name(c.bytes),
            c.host_alloc_seconds,
            c.register_threads,
            c.register_seconds,
            c.host_alloc_seconds / c.register_seconds.max(1e-9),
            c.cached_us,
            c.cached_max_us,
            c.cached_hits,
            c.cached_samples
        );
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
    Ok(())
}
