//! Measurement code behind `pinstream bandwidth`, `staging` and `prefetch`: the transfer sweep,
//! copies between GPUs, the staging engine against plain copies, the cost of pooled pinned
//! memory, the prefetcher against a serial loop and APEX's, and the experiments of PyTorch's
//! pin_memory / non_blocking guide. Built on the library's timing API ([`pinstream::timing`]:
//! statistics, the gate, copy loops), re-exported here.

pub mod peer;
pub mod pool;
pub mod prefetch;
pub mod scenarios;
pub mod staging;
pub mod sweep;
mod thp;

pub use pinstream::timing::{gbps, Gate, Stats};

use std::time::{Duration, Instant};

use pinstream::{Error, Result};

/// Median wall time in ms of `f` over 7 runs after three warm-up runs (host clock; `f`
/// synchronises).
pub(crate) fn median_ms(mut f: impl FnMut() -> Result<()>) -> Result<f64> {
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

/// `n` bytes of a random pattern in which no byte is zero (xorshift, seeded from the clock).
/// An error, not a panic or an abort, when `n` bytes cannot be allocated.
pub fn pattern(n: usize) -> Result<Vec<u8>> {
    let mut x = Instant::now().elapsed().as_nanos() as u64
        ^ 0x9E37_79B9_7F4A_7C15
        ^ (n as u64).rotate_left(17);
    let mut out = try_vec("bench::pattern", n)?;
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
    let mut buf: Vec<u8> = try_vec("bench", bytes.checked_add(4096)?).ok()?;
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

/// An `InvalidArgument` error of `op`.
pub(crate) fn invalid(op: &'static str, reason: impl Into<String>) -> Error {
    Error::InvalidArgument {
        op,
        reason: reason.into(),
    }
}

/// An empty vector with room for `len` elements, or an error (not an abort) where there is none.
pub(crate) fn try_vec<T>(op: &'static str, len: usize) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|e| {
        invalid(
            op,
            format!(
                "cannot allocate {len} elements of {} bytes of host memory: {e}",
                std::mem::size_of::<T>()
            ),
        )
    })?;
    Ok(v)
}
