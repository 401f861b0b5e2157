//! What pinned memory from a [`PinnedPool`] costs: a fresh block from each backing, and a block
//! served again from the cache.

use std::time::Instant;

use super::Stats;
use pinstream::memory::{HostAlloc, HostRegister, PinnedPool, PoolBacking, PoolConfig};
use pinstream::Device;
use pinstream::Result;

/// Requests timed for the cached case.
const CACHED_SAMPLES: usize = 21;

/// The cost of pooled pinned memory of one size, from [`pool_cost`].
#[derive(Clone, Debug, PartialEq)]
pub struct PoolCost {
    /// The size asked for, in bytes.
    pub bytes: usize,
    /// The size class the pool allocated for it, in bytes.
    pub class_bytes: usize,
    /// Seconds for a fresh block from a `PoolBacking::HostAlloc(HostAlloc::DEFAULT)` pool:
    /// `cudaHostAlloc` and zeroing.
    pub host_alloc_seconds: f64,
    /// Seconds for a fresh block from a `PoolBacking::Register` pool (default flags, no huge
    /// pages): `mmap`, pre-faulting on `register_threads` threads and `cudaHostRegister`.
    pub register_seconds: f64,
    /// The pre-faulting threads of the `Register` measurement.
    pub register_threads: usize,
    /// Median microseconds of a request of the same size served from the cache (the block
    /// dropped between requests, never touched by the GPU).
    pub cached_us: f64,
    /// The slowest of those requests, in microseconds.
    pub cached_max_us: f64,
    /// How many of the timed requests the cache served (all of them, unless something is off).
    pub cached_hits: u64,
    /// How many requests were timed for `cached_us`.
    pub cached_samples: usize,
}

/// Measures, on `device`, a fresh `bytes`-byte block from a `HostAlloc` pool, a fresh one from a
/// `Register` pool pre-faulted on `register_threads` threads, and the median of repeated requests
/// of the same size served from the cache. Each pool is dropped (its memory freed) before this
/// returns. Zero bytes or zero threads are `Error::InvalidArgument`.
pub fn pool_cost(device: &Device, bytes: usize, register_threads: usize) -> Result<PoolCost> {
    if bytes == 0 {
        return Err(super::invalid("bench::pool_cost", "nothing to allocate"));
    }
    let register = PinnedPool::new(
        device,
        PoolConfig {
            backing: PoolBacking::Register {
                threads: register_threads,
                huge_pages: false,
                flags: HostRegister::DEFAULT,
            },
            ..Default::default()
        },
    )?;
    let host = PinnedPool::new(
        device,
        PoolConfig {
            backing: PoolBacking::HostAlloc(HostAlloc::DEFAULT),
            ..Default::default()
        },
    )?;
    // Make the context before timing anything: the first CUDA call of a process pays for it.
    device.make_current()?;

    let t = Instant::now();
    let block = host.alloc::<u8>(bytes)?;
    let host_alloc_seconds = t.elapsed().as_secs_f64();
    // The only block out: what is in use is its class.
    let class_bytes = host.stats().in_use_bytes;

    let t = Instant::now();
    let reg_block = register.alloc::<u8>(bytes)?;
    let register_seconds = t.elapsed().as_secs_f64();
    drop(reg_block);
    drop(register);

    drop(block);
    let before = host.stats().hits;
    let mut samples = Vec::with_capacity(CACHED_SAMPLES);
    for _ in 0..CACHED_SAMPLES {
        let t = Instant::now();
        let block = host.alloc::<u8>(bytes)?;
        samples.push(t.elapsed().as_secs_f64() * 1e6);
        drop(block);
    }
    let cached_hits = host.stats().hits.saturating_sub(before);
    let stats =
        Stats::new(samples).ok_or_else(|| super::invalid("bench::pool_cost", "no samples"))?;
    Ok(PoolCost {
        bytes,
        class_bytes,
        host_alloc_seconds,
        register_seconds,
        register_threads,
        cached_us: stats.median,
        cached_max_us: stats.max,
        cached_hits,
        cached_samples: CACHED_SAMPLES,
    })
}
