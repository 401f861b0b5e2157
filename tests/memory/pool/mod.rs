//! GPU trials of `PinnedPool` / `PoolBlock`. Each one is marked ignored at run time when the
//! machine has no CUDA device, so a machine without a GPU reports them as ignored, never as
//! passed. (The size-class arithmetic has CPU unit tests in `src/memory/pool.rs`.)

use std::time::Duration;

use crate::common::{ensure, random_bytes, same, R};
use libtest_mimic::Trial;
use pinstream::{
    Device, DeviceBuffer, Error, HostAlloc, HostRegister, PinnedPool, PoolBacking, PoolConfig,
    PoolStats,
};

use crate::common::trial;

/// Prefix of this module's trial names (its path in the binary).
const PREFIX: &str = "pool/";

#[cfg(feature = "dlpack")]
pub mod hostile;
pub mod hostile30;

const BACKINGS: &[(&str, PoolBacking)] = &[
    ("hostalloc", PoolBacking::HostAlloc(HostAlloc::DEFAULT)),
    (
        "hostalloc-portable",
        PoolBacking::HostAlloc(HostAlloc::PORTABLE),
    ),
    (
        "register",
        PoolBacking::Register {
            threads: 1,
            huge_pages: false,
            flags: HostRegister::DEFAULT,
        },
    ),
    (
        "register-4-threads-huge-pages",
        PoolBacking::Register {
            threads: 4,
            huge_pages: true,
            flags: HostRegister::DEFAULT,
        },
    ),
];

/// A trial run once per backing.
type PerBacking = fn(PoolBacking) -> R;

const SIZES: &[usize] = &[1, 4095, 65_537, (1 << 20) + 13, (16 << 20) - 7, 64 << 20];

/// The trials of this module, named `pool/...`.
pub fn trials() -> Vec<Trial> {
    let no_gpu = !pinstream::available();
    let mut trials = Vec::new();
    for &(name, backing) in BACKINGS {
        for &size in SIZES {
            trials.push(
                trial(PREFIX, format!("roundtrip/{name}/{size}"), move || {
                    roundtrip(backing, size)
                })
                .with_ignored_flag(no_gpu),
            );
        }
        let per_backing: [(&str, PerBacking); 5] = [
            ("soundness/busy_block_not_reused", busy_block_not_reused),
            ("reuse_hits_and_best_fit", reuse_hits_and_best_fit),
            ("huge_len_refused", huge_len_refused),
            ("pool_dropped_with_blocks_out", pool_dropped_with_blocks_out),
            ("blocks_dropped_from_threads", blocks_dropped_from_threads),
        ];
        for (trial, f) in per_backing {
            trials.push(
                crate::common::trial(PREFIX, format!("{trial}/{name}"), move || f(backing))
                    .with_ignored_flag(no_gpu),
            );
        }
    }
    let mut gpu = |name: &str, f: fn() -> R| {
        trials.push(trial(PREFIX, name, f).with_ignored_flag(no_gpu));
    };
    gpu("typed_blocks", typed_blocks);
    gpu("empty_blocks", empty_blocks);
    gpu("max_cached_bytes_respected", max_cached_bytes_respected);
    gpu("trim_frees_idle_blocks", trim_frees_idle_blocks);
    gpu("soundness/over_aligned_refused", over_aligned_refused);
    gpu("soundness/read_only_register", read_only_register);
    gpu("config_refused", config_refused);
    trials
}

fn dev0() -> Result<Device, Error> {
    Device::get(0)
}

fn pool(backing: PoolBacking) -> Result<PinnedPool, Error> {
    PinnedPool::new(
        &dev0()?,
        PoolConfig {
            backing,
            ..Default::default()
        },
    )
}

/// The runtime's view of a host address: `cudaMemoryTypeHost` while pinned or registered,
/// `cudaMemoryTypeUnregistered` once freed.
fn memory_type(ptr: *const u8) -> Result<pinstream::sys::cudaMemoryType, Error> {
    use pinstream::sys;
    let mut attr = std::mem::MaybeUninit::<sys::cudaPointerAttributes>::zeroed();
    // SAFETY: `attr` is a valid out-pointer; the runtime only inspects the address.
    let err = unsafe { sys::cudaPointerGetAttributes(attr.as_mut_ptr(), ptr.cast()) };
    if err != sys::cudaError::cudaSuccess {
        return Err(Error::InvalidArgument {
            op: "cudaPointerGetAttributes",
            reason: format!("{err:?}"),
        });
    }
    // SAFETY: zero-initialised, then filled in by the runtime; plain data.
    Ok(unsafe { attr.assume_init() }.type_)
}

fn is_pinned(ptr: *const u8) -> Result<bool, Error> {
    Ok(memory_type(ptr)? == pinstream::sys::cudaMemoryType_cudaMemoryTypeHost)
}

/// H2D then D2H of random bytes through two blocks, twice: once with fresh memory, once with
/// the same blocks served again from the cache (holding the first round's bytes).
fn roundtrip(backing: PoolBacking, size: usize) -> R {
    let dev = dev0()?;
    let stream = dev.stream()?;
    let pool = pool(backing)?;
    let mut d = DeviceBuffer::<u8>::new(&dev, size)?;
    for round in 0..2 {
        let (data, seed) = random_bytes(size);
        let what = format!("{backing:?}, {size} bytes, round {round}");
        let mut src = pool.alloc::<u8>(size)?;
        ensure(src.as_ptr() as usize % 4096 == 0, || {
            format!("{what}: block at {:p} is not page-aligned", src.as_ptr())
        })?;
        if round == 0 {
            ensure(src.as_slice()?.iter().all(|&b| b == 0), || {
                format!("{what}: fresh memory is not zero")
            })?;
        }
        src.as_mut_slice()?.copy_from_slice(&data);
        stream.memset(&mut d, 0x5A)?;
        stream.copy_h2d(&src, &mut d)?;
        let mut dst = pool.alloc::<u8>(size)?;
        for b in dst.as_mut_slice()? {
            *b = !*b;
        }
        let got = stream.copy_d2h(&d, &mut dst)?.wait()?;
        same(&what, got, &data, seed)?;
        same(
            &format!("{what}, source after"),
            src.as_slice()?,
            &data,
            seed,
        )?;
    }
    let s = pool.stats();
    ensure(
        s.misses == 2 && s.allocations == 2 && s.hits == 2 && s.in_use_bytes == 0,
        || format!("{backing:?}, {size} bytes: {s:?}"),
    )?;
    ensure(s.cached_bytes >= 2 * size && s.requested_bytes == 0, || {
        format!("{backing:?}, {size} bytes: {s:?}")
    })
}

/// Blocks of other element types, and one block reused under another type.
fn typed_blocks() -> R {
    let dev = dev0()?;
    let stream = dev.stream()?;
    let pool = pool(PoolBacking::HostAlloc(HostAlloc::DEFAULT))?;
    let n = 300_001;
    let (bytes, seed) = random_bytes(n * 4);
    let data: Vec<f32> = bytemuck::pod_collect_to_vec(&bytes);
    let mut src = pool.alloc::<f32>(n)?;
    src.as_mut_slice()?.copy_from_slice(&data);
    let mut d = DeviceBuffer::<f32>::new(&dev, n)?;
    stream.copy_h2d(&src, &mut d)?;
    let mut dst = pool.alloc::<f32>(n)?;
    let got = stream.copy_d2h(&d, &mut dst)?.wait()?;
    same(
        "f32 round trip (bits)",
        bytemuck::cast_slice::<f32, u8>(got),
        &bytes,
        seed,
    )?;
    drop(dst);
    stream.synchronize()?;
    // The same memory as u16: the old bytes, reinterpreted (any bit pattern is a valid Pod).
    // Both cached blocks hold `bytes`, so whichever comes back holds them.
    drop(src);
    let again = pool.alloc::<u16>(n * 2)?;
    ensure(pool.stats().hits == 1, || format!("{:?}", pool.stats()))?;
    let want: Vec<u16> = bytemuck::pod_collect_to_vec(&bytes);
    same("reused as u16", again.as_slice()?, &want, seed)
}

fn empty_blocks() -> R {
    let dev = dev0()?;
    let stream = dev.stream()?;
    let pool = pool(PoolBacking::HostAlloc(HostAlloc::DEFAULT))?;
    let mut e = pool.alloc::<u64>(0)?;
    ensure(e.is_empty() && e.as_slice()?.is_empty(), || {
        "not empty".into()
    })?;
    let mut d = DeviceBuffer::<u64>::new(&dev, 0)?;
    stream.copy_h2d(&e, &mut d)?;
    ensure(stream.copy_d2h(&d, &mut e)?.wait()?.is_empty(), || {
        "d2h into an empty block".into()
    })?;
    let zst = pool.alloc::<()>(1 << 40)?;
    ensure(zst.len() == 1 << 40, || "zero-sized elements".into())?;
    drop((e, zst));
    let s = pool.stats();
    ensure(s == PoolStats::default(), || {
        format!("stats after empty blocks: {s:?}")
    })
}

/// A block whose copy is still queued behind a spin kernel goes back to the pool, and the same
/// size is asked for at once: the pool must hand out other memory, and the copy must read the
/// old bytes. Once the GPU is done, the old block is served again.
fn busy_block_not_reused(backing: PoolBacking) -> R {
    let dev = dev0()?;
    let stream = dev.stream()?;
    let pool = pool(backing)?;
    let n = 8 << 20;
    let (old, seed) = random_bytes(n);
    let (new, _) = random_bytes(n);
    let mut d = DeviceBuffer::<u8>::new(&dev, n)?;

    // Host to device: the block is the source.
    let mut a = pool.alloc::<u8>(n)?;
    a.as_mut_slice()?.copy_from_slice(&old);
    let a_ptr = a.as_ptr() as usize;
    stream.spin(Duration::from_millis(300))?;
    stream.copy_h2d(&a, &mut d)?;
    drop(a); // back to the pool, the copy still queued
    let mut b = pool.alloc::<u8>(n)?;
    let b_ptr = b.as_ptr() as usize;
    ensure(b_ptr != a_ptr, || {
        format!("the pool handed out {a_ptr:#x} while a copy from it was still queued")
    })?;
    b.as_mut_slice()?.copy_from_slice(&new);
    let s = pool.stats();
    ensure(s.hits == 0 && s.misses == 2, || {
        format!("busy block: {s:?}")
    })?;
    stream.synchronize()?;
    let mut back = vec![0u8; n];
    same(
        "device data after reusing the size while the copy was queued",
        stream.copy_d2h(&d, &mut back[..])?.wait()?,
        &old,
        seed,
    )?;
    drop(b);
    // Now idle: the old memory comes back, with its old bytes.
    let c = pool.alloc::<u8>(n)?;
    ensure(pool.stats().hits == 1, || format!("{:?}", pool.stats()))?;
    let c_ptr = c.as_ptr() as usize;
    ensure(c_ptr == a_ptr || c_ptr == b_ptr, || {
        format!("idle blocks {a_ptr:#x}, {b_ptr:#x} but got {c_ptr:#x}")
    })?;
    drop(c);

    // Device to host: the block is the destination and its `Pending` is forgotten.
    let n2 = 4 << 20;
    let (data, seed2) = random_bytes(n2);
    let mut d2 = DeviceBuffer::<u8>::new(&dev, n2)?;
    stream.copy_h2d(&data[..], &mut d2)?;
    let mut dst = pool.alloc::<u8>(n2)?;
    let dst_ptr = dst.as_ptr() as usize;
    stream.spin(Duration::from_millis(300))?;
    std::mem::forget(stream.copy_d2h(&d2, &mut dst)?);
    drop(dst);
    let other = pool.alloc::<u8>(n2)?;
    ensure(other.as_ptr() as usize != dst_ptr, || {
        format!("the pool handed out {dst_ptr:#x} while a copy into it was still queued")
    })?;
    drop(other);
    stream.synchronize()?;
    // Both idle now; whichever comes back first, one of them is the copy's destination.
    let x = pool.alloc::<u8>(n2)?;
    let y = pool.alloc::<u8>(n2)?;
    let dst_block = if x.as_ptr() as usize == dst_ptr {
        &x
    } else {
        &y
    };
    ensure(dst_block.as_ptr() as usize == dst_ptr, || {
        format!("{dst_ptr:#x} did not come back from the cache")
    })?;
    same(
        "a reused block holds what the device wrote",
        dst_block.as_slice()?,
        &data,
        seed2,
    )
}

/// Same size twice hits; the smallest fitting block wins; a block more than an eighth larger
/// than the class is not used.
fn reuse_hits_and_best_fit(backing: PoolBacking) -> R {
    let pool = pool(backing)?;
    let mib = 1 << 20;
    let step = mib / 8; // the class step between 1 and 2 MiB
    let check = |what: &str, want: PoolStats| -> R {
        let s = pool.stats();
        ensure(
            (s.hits, s.misses, s.allocations, s.frees)
                == (want.hits, want.misses, want.allocations, want.frees)
                && s.cached_bytes == want.cached_bytes
                && s.in_use_bytes == want.in_use_bytes
                && s.requested_bytes == want.requested_bytes,
            || format!("{what}: got {s:?}, want {want:?}"),
        )
    };
    let stats = |hits, misses, cached_bytes, in_use_bytes, requested_bytes| PoolStats {
        hits,
        misses,
        allocations: misses,
        cached_bytes,
        in_use_bytes,
        requested_bytes,
        ..Default::default()
    };

    let a = pool.alloc::<u8>(mib)?;
    let b = pool.alloc::<u8>(mib + step)?;
    let (a_ptr, b_ptr) = (a.as_ptr(), b.as_ptr());
    check("two fresh", stats(0, 2, 0, 2 * mib + step, 2 * mib + step))?;
    drop(b);
    drop(a);
    check("both cached", stats(0, 2, 2 * mib + step, 0, 0))?;

    // 1 MiB - 5: class 1 MiB. Best fit is `a` (exact), not `b`, though `b` fits too.
    let x = pool.alloc::<u8>(mib - 5)?;
    ensure(x.as_ptr() == a_ptr, || {
        "best fit did not take the exact block".into()
    })?;
    check("hit", stats(1, 2, mib + step, mib, mib - 5))?;
    // Again 1 MiB: `b` is one class (an eighth) larger, within the bound.
    let y = pool.alloc::<u32>(mib / 4)?;
    ensure(y.as_ptr().cast::<u8>() == b_ptr, || {
        "the next class up was not used".into()
    })?;
    check(
        "hit one class up",
        stats(2, 2, 0, 2 * mib + step, 2 * mib - 5),
    )?;
    drop((x, y));

    // 512 KiB must not take a 1 MiB block (100 % waste): a miss.
    let small = pool.alloc::<u8>(mib / 2)?;
    ensure(small.as_ptr() != a_ptr && small.as_ptr() != b_ptr, || {
        "a 512 KiB request took a block of 1 MiB or more".into()
    })?;
    check(
        "too large blocks are not used",
        stats(2, 3, 2 * mib + step, mib / 2, mib / 2),
    )?;
    // 1 MiB + 2 steps: its class is larger than both cached blocks.
    let big = pool.alloc::<u8>(mib + 2 * step)?;
    check(
        "too small blocks are not used",
        stats(
            2,
            4,
            2 * mib + step,
            mib / 2 + mib + 2 * step,
            mib / 2 + mib + 2 * step,
        ),
    )?;
    drop((small, big));
    // The same size, over and over: one allocation, hits from then on.
    for _ in 0..50 {
        drop(pool.alloc::<u8>(3 * mib)?);
    }
    let s = pool.stats();
    ensure(s.allocations == 5 && s.hits == 2 + 49, || {
        format!("repeated requests: {s:?}")
    })?;
    ensure(s.alloc_seconds > 0.0, || {
        format!("no allocation time: {s:?}")
    })
}

/// Sizes that cannot be served come back as errors (never a panic, an abort or the OOM killer),
/// and the pool still works afterwards.
fn huge_len_refused(backing: PoolBacking) -> R {
    let pool = pool(backing)?;
    let invalid = |r: Result<_, Error>, what: &str| -> R {
        match r {
            Err(Error::InvalidArgument { .. }) => Ok(()),
            Err(e) => Err(format!("{what}: {e}, want InvalidArgument").into()),
            Ok(_) => Err(format!("{what}: allocated").into()),
        }
    };
    invalid(pool.alloc::<u8>(usize::MAX).map(drop), "usize::MAX bytes")?;
    invalid(
        pool.alloc::<u64>(usize::MAX / 4).map(drop),
        "bytes overflow",
    )?;
    invalid(
        pool.alloc::<u8>(usize::MAX - 100).map(drop),
        "class overflow",
    )?;
    // Representable, but more than any machine here has.
    invalid(pool.alloc::<u8>(1 << 50).map(drop), "1 PiB")?;
    invalid(pool.alloc::<f64>(1 << 47).map(drop), "1 PiB of f64")?;
    let s = pool.stats();
    ensure(s.allocations == 0 && s.in_use_bytes == 0, || {
        format!("{s:?}")
    })?;
    let mut b = pool.alloc::<u8>(4096)?;
    b.as_mut_slice()?.fill(1);
    Ok(())
}

/// The last handle goes while blocks are out: they stay usable, and their memory is freed when
/// the last of them goes (the pool's cache with it).
fn pool_dropped_with_blocks_out(backing: PoolBacking) -> R {
    let dev = dev0()?;
    let stream = dev.stream()?;
    let n = (2 << 20) + 3;
    let (data, seed) = random_bytes(n);
    let pool = pool(backing)?;
    let clone = pool.clone();
    let mut a = clone.alloc::<u8>(n)?;
    let mut b = pool.alloc::<u8>(n)?;
    let cached = pool.alloc::<u8>(n)?;
    let cached_ptr = cached.as_ptr();
    drop(cached); // stays in the cache until the pool goes
    drop(pool);
    ensure(clone.stats().cached_bytes > 0, || {
        "the clone lost the cache".into()
    })?;
    drop(clone);
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    for p in [pa, pb, cached_ptr] {
        ensure(is_pinned(p)?, || {
            format!("{p:p} is not pinned while the pool lives")
        })?;
    }
    a.as_mut_slice()?.copy_from_slice(&data);
    let mut d = DeviceBuffer::<u8>::new(&dev, n)?;
    stream.spin(Duration::from_millis(100))?;
    stream.copy_h2d(&a, &mut d)?;
    drop(a); // with its copy in flight, into a pool without handles
    let got = stream.copy_d2h(&d, &mut b)?.wait()?;
    same(
        "round trip through blocks of a dropped pool",
        got,
        &data,
        seed,
    )?;
    ensure(is_pinned(pb)?, || "b freed while still held".into())?;
    drop(b); // the last one: everything is freed
    for p in [pa, pb, cached_ptr] {
        ensure(!is_pinned(p)?, || {
            format!("{p:p} is still pinned after the pool and its blocks are gone")
        })?;
    }
    ensure(pinstream::memory::leaked().allocations == 0, || {
        format!("{:?}", pinstream::memory::leaked())
    })
}

/// Threads allocate, copy through and drop blocks of a shared pool at once; the counters add up.
fn blocks_dropped_from_threads(backing: PoolBacking) -> R {
    let dev = dev0()?;
    let pool = pool(backing)?;
    let threads = 8;
    let rounds = 20;
    let results: Vec<R> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let pool = pool.clone();
                scope.spawn(move || -> R {
                    let s = dev.stream()?;
                    let n = (t + 1) * 40_000;
                    let mut d = DeviceBuffer::<u8>::new(&dev, n)?;
                    for i in 0..rounds {
                        let v = (t * 16 + i % 16 + 1) as u8;
                        let mut src = pool.alloc::<u8>(n)?;
                        src.as_mut_slice()?.fill(v);
                        s.copy_h2d(&src, &mut d)?;
                        // Dropped with the copy possibly still running.
                        drop(src);
                        let mut dst = pool.alloc::<u8>(n)?;
                        let got = s.copy_d2h(&d, &mut dst)?.wait()?;
                        ensure(got.iter().all(|&b| b == v), || {
                            format!("thread {t} round {i}: wrong data")
                        })?;
                    }
                    Ok(())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("thread panicked".into())))
            .collect()
    });
    results.into_iter().collect::<R>()?;
    let s = pool.stats();
    let requests = (threads * rounds * 2) as u64;
    ensure(
        s.hits + s.misses == requests
            && s.allocations == s.misses
            && s.in_use_bytes == 0
            && s.requested_bytes == 0
            && s.frees == 0,
        || format!("after {requests} requests: {s:?}"),
    )?;
    ensure(s.hits > 0, || format!("no reuse at all: {s:?}"))?;
    dev.synchronize()?;
    let freed = pool.trim()?;
    let after = pool.stats();
    ensure(freed == s.cached_bytes && after.cached_bytes == 0, || {
        format!("trim freed {freed} of {s:?}: {after:?}")
    })
}

/// Dropping a block that would push the cache past `max_cached_bytes` frees it instead.
fn max_cached_bytes_respected() -> R {
    let dev = dev0()?;
    let mib = 1 << 20;
    for backing in [BACKINGS[0].1, BACKINGS[2].1] {
        let pool = PinnedPool::new(
            &dev,
            PoolConfig {
                backing,
                max_cached_bytes: 3 * mib,
            },
        )?;
        let blocks = (0..4)
            .map(|_| pool.alloc::<u8>(mib))
            .collect::<Result<Vec<_>, _>>()?;
        let ptrs: Vec<_> = blocks.iter().map(|b| b.as_ptr()).collect();
        drop(blocks);
        let s = pool.stats();
        ensure(s.cached_bytes == 3 * mib && s.frees == 1, || {
            format!("{backing:?}: {s:?}")
        })?;
        ensure(!is_pinned(ptrs[3])?, || {
            "the block over the limit was not freed".into()
        })?;
        // A block larger than the whole limit is never cached.
        drop(pool.alloc::<u8>(4 * mib)?);
        let s = pool.stats();
        ensure(s.cached_bytes == 3 * mib && s.frees == 2, || {
            format!("{backing:?}, block over the limit: {s:?}")
        })?;
        // No cache at all.
        let none = PinnedPool::new(
            &dev,
            PoolConfig {
                backing,
                max_cached_bytes: 0,
            },
        )?;
        for _ in 0..3 {
            drop(none.alloc::<u8>(mib)?);
        }
        let s = none.stats();
        ensure(
            s.cached_bytes == 0 && s.allocations == 3 && s.frees == 3 && s.hits == 0,
            || format!("{backing:?}, max_cached_bytes 0: {s:?}"),
        )?;
    }
    Ok(())
}

/// `trim` frees the idle cached blocks, keeps the busy one, and frees that too once idle.
fn trim_frees_idle_blocks() -> R {
    let dev = dev0()?;
    let stream = dev.stream()?;
    let pool = pool(PoolBacking::HostAlloc(HostAlloc::DEFAULT))?;
    let mib = 1 << 20;
    let sizes = [mib, 2 * mib, 3 * mib];
    let blocks = sizes
        .iter()
        .map(|&n| pool.alloc::<u8>(n))
        .collect::<Result<Vec<_>, _>>()?;
    let busy_len = 5 * mib;
    let busy = pool.alloc::<u8>(busy_len)?;
    let busy_ptr = busy.as_ptr();
    let mut d = DeviceBuffer::<u8>::new(&dev, busy_len)?;
    stream.spin(Duration::from_millis(300))?;
    stream.copy_h2d(&busy, &mut d)?;
    drop(busy);
    drop(blocks);
    let before = pool.stats();
    ensure(before.cached_bytes == 11 * mib, || format!("{before:?}"))?;
    let freed = pool.trim()?;
    let after = pool.stats();
    ensure(
        freed == 6 * mib && after.cached_bytes == busy_len && after.frees == 3,
        || format!("trim with one busy block freed {freed}: {after:?}"),
    )?;
    ensure(is_pinned(busy_ptr)?, || "the busy block was freed".into())?;
    stream.synchronize()?;
    let freed = pool.trim()?;
    let after = pool.stats();
    ensure(
        freed == busy_len && after.cached_bytes == 0 && after.frees == 4,
        || format!("second trim freed {freed}: {after:?}"),
    )?;
    ensure(!is_pinned(busy_ptr)?, || "still pinned after trim".into())?;
    ensure(pool.trim()? == 0, || "a third trim freed something".into())
}

#[repr(C, align(8192))]
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
struct Aligned8K([[u8; 4096]; 2]);

#[repr(C, align(4096))]
#[derive(Clone, Copy, Debug, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
struct Aligned4K([u8; 4096]);

fn over_aligned_refused() -> R {
    for &(name, backing) in BACKINGS {
        let pool = pool(backing)?;
        for len in [0, 1, 3] {
            let r = pool.alloc::<Aligned8K>(len);
            ensure(matches!(r, Err(Error::InvalidArgument { .. })), || {
                format!("{name}: an 8 KiB-aligned type x {len}: {r:?}")
            })?;
        }
        let b = pool.alloc::<Aligned4K>(3)?;
        ensure(b.as_slice()?.as_ptr() as usize % 4096 == 0, || {
            format!("{name}: a 4 KiB-aligned type at {:p}", b.as_ptr())
        })?;
    }
    Ok(())
}

/// A `READ_ONLY` registered pool: its blocks are sources only, also as plain slices.
fn read_only_register() -> R {
    let dev = dev0()?;
    let stream = dev.stream()?;
    let pool = pool(PoolBacking::Register {
        threads: 2,
        huge_pages: false,
        flags: HostRegister::READ_ONLY,
    })?;
    let n = 1 << 16;
    let (data, seed) = random_bytes(n);
    let mut b = pool.alloc::<u8>(n)?;
    b.as_mut_slice()?.copy_from_slice(&data);
    let mut d = DeviceBuffer::<u8>::new(&dev, n)?;
    stream.copy_h2d(&b, &mut d)?;
    let mut back = vec![0u8; n];
    same(
        "from a read-only block",
        stream.copy_d2h(&d, &mut back[..])?.wait()?,
        &data,
        seed,
    )?;
    let e = stream.copy_d2h(&d, &mut b).err();
    ensure(matches!(e, Some(Error::InvalidArgument { .. })), || {
        format!("d2h into a read-only block: {e:?}")
    })?;
    let plain = b.as_mut_slice()?;
    let e = stream.copy_d2h(&d, &mut plain[..]).err();
    ensure(matches!(e, Some(Error::InvalidArgument { .. })), || {
        format!("d2h into a read-only block as a plain slice: {e:?}")
    })?;
    // Once the pool has freed the memory, the address range is no longer read-only.
    let p = b.as_ptr();
    drop(b);
    ensure(pool.trim()? > 0, || "nothing trimmed".into())?;
    ensure(!is_pinned(p)?, || "still registered".into())
}

fn config_refused() -> R {
    let r = PinnedPool::new(
        &dev0()?,
        PoolConfig {
            backing: PoolBacking::Register {
                threads: 0,
                huge_pages: true,
                flags: HostRegister::DEFAULT,
            },
            ..Default::default()
        },
    );
    ensure(matches!(r, Err(Error::InvalidArgument { .. })), || {
        format!("zero threads: {r:?}")
    })
}
