//! Hostile trials of issue 30 (a restructuring that must not change behaviour) against the
//! pinned pool after its split into `memory/pool/{mod, backing, block}.rs`: a `PoolBlock` now
//! holds its pool as `Arc<dyn Home>` and computes its requested bytes as `len * size_of::<T>()`
//! instead of storing them. The attacks: every element size (zero-sized types, odd sizes, arrays),
//! empty blocks, blocks dropped in any order and from many threads, blocks outliving every handle
//! of their pool, and a prefetcher whose page-locked pixels change length batch after batch
//! (`HostBatch::pinned`: `set_len` and `discard` of reused blocks). The accounting
//! (`PoolStats::{requested_bytes, in_use_bytes}`) must stay exact: `requested_bytes` the sum of
//! `len * size_of::<T>()` of the blocks out, never above `in_use_bytes`, back to 0 when they are
//! all back.
//!
//! A trial passes when the library resisted and fails when it broke: `finding/...` would be one
//! that broke when written, `held/...` one that held. GPU trials are ignored without a device
//! (a pool needs a `Device`).

use std::sync::{Arc, Barrier};
use std::time::Duration;

use crate::common::{ensure, within, R};
use libtest_mimic::{Failed, Trial};
#[cfg(feature = "prefetch")]
use pinstream::kernels::{Normalize, Spec};
#[cfg(feature = "prefetch")]
use pinstream::prefetch::{HostBatch, PrefetchConfig, Prefetcher, Source};
use pinstream::{Device, HostAlloc, PinnedPool, PoolBacking, PoolBlock, PoolConfig, PoolStats};

use crate::common::trial;

/// Prefix of this module's trial names (its path in the binary).
const PREFIX: &str = "pool/hostile30/";

const BOUND: Duration = Duration::from_secs(120);

/// The trials of this module, named `pool/hostile30/...`.
pub fn trials() -> Vec<Trial> {
    let no_gpu = !pinstream::available();
    let gpu = |name: &str, f: fn() -> R| {
        let name = format!("held/gpu/{name}");
        let what = name.clone();
        trial(PREFIX, name, move || within(&what, BOUND, f)).with_ignored_flag(no_gpu)
    };
    #[allow(unused_mut)]
    let mut trials = vec![
        gpu(
            "requested_bytes_is_len_times_size_for_every_element_type",
            requested_bytes_every_type,
        ),
        gpu(
            "zero_sized_and_empty_blocks_account_nothing",
            zero_sized_and_empty,
        ),
        gpu(
            "blocks_from_threads_in_any_order_account_back_to_zero",
            blocks_from_threads,
        ),
        gpu("blocks_outlive_every_pool_handle", blocks_outlive_the_pool),
    ];
    #[cfg(feature = "prefetch")]
    trials.push(gpu(
        "prefetcher_pinned_pixels_of_changing_lengths_keep_requested_within_in_use",
        prefetcher_pinned_lengths,
    ));
    trials
}

fn pool() -> Result<PinnedPool, Failed> {
    Ok(PinnedPool::new(
        &Device::get(0)?,
        PoolConfig {
            backing: PoolBacking::HostAlloc(HostAlloc::DEFAULT),
            ..Default::default()
        },
    )?)
}

/// The class `PinnedPool` rounds `bytes` up to (its documented rule: a multiple of
/// `max(4096, p / 8)`, `p` the largest power of two not above `bytes`).
fn class(bytes: usize) -> usize {
    if bytes == 0 {
        return 0;
    }
    let p = 1usize << (usize::BITS - 1 - bytes.leading_zeros());
    let step = (p / 8).max(4096);
    bytes.div_ceil(step) * step
}

/// A block of any element type, type-erased for the bookkeeping below.
trait Held: Send {
    fn bytes(&self) -> usize;
}

impl<T: pinstream::Pod + Send> Held for PoolBlock<T> {
    fn bytes(&self) -> usize {
        self.len() * std::mem::size_of::<T>()
    }
}

fn expect(what: &str, s: PoolStats, requested: usize, in_use: Option<usize>) -> R {
    ensure(s.requested_bytes == requested, || {
        format!(
            "{what}: requested_bytes {} != {requested} ({s:?})",
            s.requested_bytes
        )
    })?;
    ensure(s.requested_bytes <= s.in_use_bytes, || {
        format!("{what}: requested above in use ({s:?})")
    })?;
    if let Some(u) = in_use {
        ensure(s.in_use_bytes == u, || {
            format!("{what}: in_use_bytes {} != {u} ({s:?})", s.in_use_bytes)
        })?;
    }
    Ok(())
}

#[derive(Clone, Copy, bytemuck::Zeroable, bytemuck::Pod)]
#[repr(C)]
struct Odd([u8; 3]);

#[derive(Clone, Copy, bytemuck::Zeroable, bytemuck::Pod)]
#[repr(C)]
struct Wide([u32; 5]);

/// Blocks of u8, f16, f32, f64, 3-byte and 20-byte elements, of lengths around the class
/// edges; after each allocation and each drop (in a scrambled order) the stats are the sums.
fn requested_bytes_every_type() -> R {
    let pool = pool()?;
    let lens = [1usize, 7, 1365, 1366, 4095, 4096, 4097, 65_537, 1 << 20];
    let mut held: Vec<Box<dyn Held>> = Vec::new();
    let (mut requested, mut in_use) = (0usize, 0usize);
    for &n in &lens {
        let blocks: Vec<Box<dyn Held>> = vec![
            Box::new(pool.alloc::<u8>(n)?),
            Box::new(pool.alloc::<pinstream::f16>(n)?),
            Box::new(pool.alloc::<f32>(n)?),
            Box::new(pool.alloc::<f64>(n)?),
            Box::new(pool.alloc::<Odd>(n)?),
            Box::new(pool.alloc::<Wide>(n)?),
        ];
        // All six are allocated before the check (the review checked after each push, while
        // the pool already counted all six: a fault of the trial, not of the pool).
        for b in blocks {
            requested += b.bytes();
            in_use += class(b.bytes());
            held.push(b);
        }
        expect(
            &format!("after allocating {n}"),
            pool.stats(),
            requested,
            Some(in_use),
        )?;
    }
    // Drop in a scrambled order.
    let mut k = 0usize;
    while !held.is_empty() {
        k = (k + 7) % held.len();
        let b = held.swap_remove(k);
        requested -= b.bytes();
        in_use -= class(b.bytes());
        drop(b);
        expect("after a drop", pool.stats(), requested, Some(in_use))?;
    }
    // Served again from the cache, under other types: the same sums.
    let a = pool.alloc::<Odd>(1365)?;
    let b = pool.alloc::<f64>(512)?;
    expect("cache hits", pool.stats(), 1365 * 3 + 512 * 8, None)?;
    ensure(pool.stats().hits >= 2, || format!("{:?}", pool.stats()))?;
    drop((a, b));
    expect("all back", pool.stats(), 0, Some(0))
}

/// A zero-sized element type at any length, and `len == 0` of any type, allocate nothing and
/// count nothing; their slices have the length asked for.
fn zero_sized_and_empty() -> R {
    let pool = pool()?;
    let before = pool.stats();
    let z = pool.alloc::<()>(usize::MAX)?;
    ensure(
        z.len() == usize::MAX && z.as_slice()?.len() == usize::MAX,
        || format!("zero-sized block of {} elements", z.len()),
    )?;
    let z2 = pool.alloc::<[u64; 0]>(12345)?;
    let e = pool.alloc::<u8>(0)?;
    let e2 = pool.alloc::<Wide>(0)?;
    ensure(e.is_empty() && e2.as_slice()?.is_empty(), || {
        "empty blocks".into()
    })?;
    let s = pool.stats();
    expect("zero-sized and empty blocks out", s, 0, Some(0))?;
    ensure(s.allocations == before.allocations, || {
        format!("they allocated: {s:?}")
    })?;
    drop((z, z2, e, e2));
    let s = pool.stats();
    expect("zero-sized and empty blocks back", s, 0, Some(0))?;
    ensure(s.cached_bytes == 0, || format!("they were cached: {s:?}"))
}

/// Eight threads allocate and drop blocks of mixed types and lengths, in lockstep rounds
/// (every thread's blocks out at once, then some dropped by another thread than the one
/// that made them): the sums are exact at each round's end and 0 at the end.
fn blocks_from_threads() -> R {
    let pool = pool()?;
    const THREADS: usize = 8;
    let barrier = Arc::new(Barrier::new(THREADS + 1));
    let (tx, rx) = std::sync::mpsc::channel::<Box<dyn Held>>();
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let pool = pool.clone();
            let barrier = barrier.clone();
            let tx = tx.clone();
            std::thread::spawn(move || -> Result<usize, String> {
                let mut mine: Vec<Box<dyn Held>> = Vec::new();
                let mut sent = 0;
                for round in 0..20usize {
                    let n = 1 + (t * 7919 + round * 104_729) % 300_000;
                    let b: Box<dyn Held> = match (t + round) % 3 {
                        0 => Box::new(pool.alloc::<u8>(n).map_err(|e| e.to_string())?),
                        1 => Box::new(pool.alloc::<Odd>(n).map_err(|e| e.to_string())?),
                        _ => Box::new(pool.alloc::<f32>(n).map_err(|e| e.to_string())?),
                    };
                    if round % 4 == 0 {
                        // Handed to the main thread, which drops it.
                        sent += b.bytes();
                        tx.send(b).map_err(|e| e.to_string())?;
                    } else {
                        mine.push(b);
                    }
                    if round % 5 == 4 {
                        mine.clear();
                    }
                }
                barrier.wait();
                Ok(sent + mine.iter().map(|b| b.bytes()).sum::<usize>())
            })
        })
        .collect();
    drop(tx);
    barrier.wait();
    let received: Vec<Box<dyn Held>> = rx.iter().collect();
    let mut out = 0usize;
    for h in handles {
        out += h.join().map_err(|_| "a thread panicked")??;
    }
    // The threads' own blocks dropped when they returned; what they sent is held here.
    let sent: usize = received.iter().map(|b| b.bytes()).sum();
    ensure(out >= sent, || format!("sums: {out} < {sent}"))?;
    expect("the sent blocks still out", pool.stats(), sent, None)?;
    drop(received);
    expect("all back", pool.stats(), 0, Some(0))
}

/// Every handle of the pool is dropped while blocks of several types are out (the blocks hold
/// the pool through `Arc<dyn Home>`): the blocks stay usable, and dropping them (one with a copy
/// in flight) frees their memory without a crash or a hang.
fn blocks_outlive_the_pool() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let pool = pool()?;
    let mut a = pool.alloc::<u32>(300_000)?;
    let b = pool.alloc::<Odd>(5)?;
    let c = pool.alloc::<u8>(0)?;
    drop(pool);
    a.as_mut_slice()?
        .iter_mut()
        .enumerate()
        .for_each(|(i, v)| *v = i as u32);
    let mut d = pinstream::DeviceBuffer::<u32>::new(&dev, 300_000)?;
    stream.spin(Duration::from_millis(100))?;
    stream.copy_h2d(&a, &mut d)?;
    drop(a); // copy in flight, pool gone: freed after the copy
    drop(b);
    drop(c);
    let mut back = vec![0u32; 300_000];
    let got = stream.copy_d2h(&d, &mut back[..])?.wait()?;
    ensure(got.iter().enumerate().all(|(i, &v)| v == i as u32), || {
        "the copy read a block freed under it".into()
    })
}

#[cfg(feature = "prefetch")]
/// A prefetcher whose source writes page-locked pixels of a different length every batch
/// (shrinking, growing, then far smaller: blocks reused with `set_len`, stale ones discarded):
/// at every batch the pool's `requested_bytes` stays within `in_use_bytes` (a block's
/// requested bytes are recomputed from its length; a length changed without its accounting, or
/// a discard counted twice, shows here), and the data is the source's.
fn prefetcher_pinned_lengths() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let sides = [
        64usize, 60, 48, 64, 96, 20, 8, 96, 100, 12, 4, 64, 30, 96, 2, 64,
    ];
    let end = sides.len() as u64 * 3;
    let source = Source::new(move |i, b: &mut HostBatch<i64>| {
        if i >= end {
            return Ok(false);
        }
        let side = sides[(i as usize) % sides.len()];
        b.spec = Spec::uniform(2, 3, side, side, Normalize::new(&[0.0; 3], &[1.0; 3]))?;
        let px = b.pinned(2 * 3 * side * side)?;
        px.fill((i % 251) as u8);
        b.extras.clear();
        b.extras.push(i as i64);
        Ok(true)
    });
    let config = PrefetchConfig {
        depth: 2,
        loader_threads: 3,
        ..PrefetchConfig::default()
    };
    let mut p = Prefetcher::<f32, i64>::new(&stream, source, config)?;
    let mut seen = 0u64;
    while let Some(batch) = p.next() {
        let batch = batch?;
        let s = batch.pinned_stats();
        ensure(s.requested_bytes <= s.in_use_bytes, || {
            format!("batch {}: requested above in use: {s:?}", batch.index())
        })?;
        let px = batch.pixels()?;
        let mut got = vec![0f32; px.len()];
        batch.stream().copy_d2h(&px, &mut got[..])?.wait()?;
        let want = (batch.index() % 251) as f32;
        ensure(got.iter().all(|&v| v == want), || {
            format!("batch {}: pixels are not {want}", batch.index())
        })?;
        seen += 1;
    }
    ensure(seen == end, || format!("{seen} of {end} batches"))?;
    let s = p.pinned_stats();
    ensure(s.requested_bytes <= s.in_use_bytes, || {
        format!("at the end: requested above in use: {s:?}")
    })
}
