//! Measurement code behind `pinstream bandwidth` and the criterion benches: a gate kernel that
//! holds a stream while copies are queued, statistics, the transfer sweep, copies between GPUs,
//! the cost of pooled pinned memory, and the experiments of PyTorch's pin_memory / non_blocking
//! guide.

mod gate;
pub mod peer;
pub mod pool;
pub mod prefetch;
pub mod scenarios;
pub mod staging;
pub mod sweep;

pub use gate::Gate;

/// Median wall time in ms of `f` over 7 runs after three warm-up runs (host clock; `f`
/// synchronises).
pub(crate) fn median_ms(
    mut f: impl FnMut() -> crate::error::Result<()>,
) -> crate::error::Result<f64> {
    // Warm-up: the first calls also allocate (a stager's pool, its threads' first slots) and
    // were measured up to 35 % slow on the H100 with one warm-up call.
    for _ in 0..3 {
        f()?;
    }
    let mut t = Vec::new();
    for _ in 0..7 {
        let start = Instant::now();
        f()?;
        t.push(secs(start.elapsed()) * 1e3);
    }
    Ok(Stats::new(t).map_or(0.0, |s| s.median))
}

use std::time::{Duration, Instant};

/// Summary of repeated samples.
#[derive(Clone, Debug, PartialEq)]
pub struct Stats {
    /// The samples, in the order they were taken.
    pub samples: Vec<f64>,
    /// The middle sample (the mean of the two middle ones for an even count).
    pub median: f64,
    /// The smallest sample.
    pub min: f64,
    /// The largest sample.
    pub max: f64,
    /// Coefficient of variation: standard deviation over mean.
    pub cv: f64,
}

impl Stats {
    /// `None` for no samples.
    pub fn new(samples: Vec<f64>) -> Option<Stats> {
        if samples.is_empty() {
            return None;
        }
        let mut sorted = samples.clone();
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len();
        let median = if n % 2 == 1 {
            sorted[n / 2]
        } else {
            (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
        };
        let mean = sorted.iter().sum::<f64>() / n as f64;
        let var = sorted.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
        let cv = if mean != 0.0 { var.sqrt() / mean } else { 0.0 };
        Some(Stats {
            median,
            min: sorted[0],
            max: sorted[n - 1],
            cv,
            samples,
        })
    }
}

/// Decimal GB/s for `bytes` moved in `secs`.
pub fn gbps(bytes: f64, secs: f64) -> f64 {
    if secs > 0.0 {
        bytes / secs / 1e9
    } else {
        0.0
    }
}

/// `n` bytes of a random pattern in which no byte is zero (xorshift, seeded from the clock).
/// An error, not a panic or an abort, when `n` bytes cannot be allocated.
pub fn pattern(n: usize) -> crate::Result<Vec<u8>> {
    let mut x = Instant::now().elapsed().as_nanos() as u64
        ^ 0x9E37_79B9_7F4A_7C15
        ^ (n as u64).rotate_left(17);
    let mut out = crate::error::try_vec("bench::pattern", n)?;
    let mut chunk = [0u8; 8];
    while out.len() < n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes());
        for b in chunk.iter_mut() {
            *b |= (*b == 0) as u8;
        }
        let take = (n - out.len()).min(8);
        out.extend_from_slice(&chunk[..take]);
    }
    Ok(out)
}

/// Single-threaded host memcpy bandwidth (decimal GB/s, bytes counted once) over `bytes`:
/// the ceiling of any copy that stages through pageable memory on one thread. Each sample
/// repeats the copy for at least 5 ms, so small sizes measure the caches they fit in, as a
/// staged copy of that size would see them. `None` for zero bytes or a size that cannot be
/// allocated.
pub fn host_memcpy_gbps(bytes: usize, samples: usize) -> Option<Stats> {
    if bytes == 0 {
        return None;
    }
    let src = pattern(bytes).ok()?;
    // Place the destination half a page away from the source (mod 4096): two separate large
    // allocations both start at the same page offset, which makes `rep movsb` alias 4K
    // addresses and run at a fraction of its speed (seen: 4.2 GB/s at 1 MiB on the H100 host).
    let mut buf: Vec<u8> = crate::error::try_vec("bench", bytes.checked_add(4096)?).ok()?;
    buf.resize(bytes + 4096, 0);
    let off = ((src.as_ptr() as usize + 2048).wrapping_sub(buf.as_ptr() as usize)) % 4096;
    let dst = &mut buf[off..off + bytes];
    dst.copy_from_slice(&src); // touch every page first
    let t = Instant::now();
    dst.copy_from_slice(std::hint::black_box(&src));
    let one = t.elapsed().as_secs_f64().max(1e-9);
    let reps = ((5e-3 / one).ceil() as usize).clamp(1, 1_000_000);
    let mut out = Vec::new();
    for _ in 0..samples.max(1) {
        let t = Instant::now();
        for _ in 0..reps {
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&mut *dst);
        }
        out.push(gbps((bytes * reps) as f64, t.elapsed().as_secs_f64()));
    }
    Stats::new(out)
}

/// Seconds of a `Duration`.
pub(crate) fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// A size in binary units when it is a whole number of them: `4K`, `2M`, `1G`, else bytes.
pub fn size_name(bytes: usize) -> String {
    const UNITS: [(usize, &str); 3] = [(1 << 30, "G"), (1 << 20, "M"), (1 << 10, "K")];
    for (unit, name) in UNITS {
        if bytes >= unit && bytes % unit == 0 {
            return format!("{}{name}", bytes / unit);
        }
    }
    bytes.to_string()
}
