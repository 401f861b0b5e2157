//! Hostile trials of issue 30 (a restructuring that must not change behaviour) against the
//! DLPack release seams: deferred releases are now boxed closures run by the background thread
//! (`src/deferred.rs`, was `dlpack/reaper.rs`; `dlpack/export.rs` builds `owner.release(Nobody);
//! drop(owner)`), and a prefetched batch's export is split into `DeviceBatch::lease` +
//! `BatchLease` (prefetch) and `into_dlpack` + `LeaseOwner` (`dlpack/batch.rs`), with
//! `Lease::{order_before, release_after}`.
//!
//! The attacks: owners shared with the caller released from many threads without a stream
//! (the closure must drop every owner, and the pending count must come back to 0), a batch's
//! tensors dropped without a handover one at a time (the lease keeps the slot until the last),
//! a batch handed to a stream only lent for the call (`Stream::from_raw`: the release is
//! deferred) whose slow read must finish before the slot is refilled, and releases that run
//! after the prefetcher and its consumer stream are gone.
//!
//! A trial passes when the library resisted and fails when it broke: `finding/...` would be one
//! that broke when written, `held/...` one that held. GPU trials are ignored without a device.

use std::ffi::c_void;
use std::sync::{Arc, Barrier};
use std::time::Duration;

use crate::common::{ensure, within, R};
use libtest_mimic::{Failed, Trial};
use pinstream::dlpack::abi::DLManagedTensorVersioned;
use pinstream::dlpack::{wait_for_releases, Tensor};
use pinstream::kernels::{cpu, Normalize, Spec};
use pinstream::prefetch::{HostBatch, PrefetchConfig, Prefetcher, Source};
use pinstream::{sys, Device, DeviceBuffer, HostAlloc, PinnedBuffer, Stream};

use crate::common::trial;

/// Prefix of this module's trial names (its path in the binary).
const PREFIX: &str = "dlpack/hostile30/";

const BOUND: Duration = Duration::from_secs(120);

/// The trials of this module, named `dlpack/hostile30/...`.
pub fn trials() -> Vec<Trial> {
    let no_gpu = !pinstream::available();
    let gpu = |name: &str, f: fn() -> R| {
        let name = format!("held/gpu/{name}");
        let what = name.clone();
        trial(PREFIX, name, move || within(&what, BOUND, f)).with_ignored_flag(no_gpu)
    };
    let cpu = |name: &str, f: fn() -> R| {
        let name = format!("held/cpu/{name}");
        let what = name.clone();
        trial(PREFIX, name, move || within(&what, BOUND, f))
    };
    vec![
        cpu(
            "wait_for_releases_with_nothing_pending_returns_at_once",
            nothing_pending,
        ),
        gpu(
            "deferred_closures_drop_every_shared_owner_from_many_threads",
            closures_drop_owners,
        ),
        gpu(
            "batch_tensors_dropped_unhanded_one_at_a_time",
            batch_tensors_dropped_one_at_a_time,
        ),
        gpu(
            "batch_lent_to_a_from_raw_stream_is_not_refilled_under_its_read",
            lent_stream_read_before_refill,
        ),
        gpu(
            "releases_after_the_prefetcher_and_its_stream_are_gone",
            releases_after_everything_dropped,
        ),
    ]
}

// ---------------------------------------------------------------------------------------
// Helpers.

/// Calls a versioned tensor's deleter, as its consumer.
///
/// # Safety
///
/// `p` was handed over and not released yet.
unsafe fn release(p: *mut DLManagedTensorVersioned) {
    // SAFETY: the caller's.
    unsafe {
        if let Some(d) = (*p).deleter {
            d(p)
        }
    }
}

fn leaked() -> u64 {
    pinstream::memory::leaked().allocations
}

const N: usize = 4;
const HW: usize = 24;
const LEN: usize = N * 3 * HW * HW;

fn batch_bytes(i: u64) -> Vec<u8> {
    (0..LEN)
        .map(|k| ((k as u64).wrapping_mul(2654435761) ^ i.wrapping_mul(0x9E37)) as u8)
        .collect()
}

fn source(end: u64) -> Source<i64> {
    Source::new(move |i, b: &mut HostBatch<i64>| {
        if i >= end {
            return Ok(false);
        }
        b.spec = Spec::uniform(N, 3, HW, HW, Normalize::imagenet())?;
        let px = b.pageable();
        px.clear();
        px.extend(batch_bytes(i));
        b.extras.clear();
        b.extras.extend((0..N as i64).map(|k| i as i64 * 100 + k));
        Ok(true)
    })
}

fn check_batch(got: &[f32], i: u64) -> R {
    let spec = Spec::uniform(N, 3, HW, HW, Normalize::imagenet())?;
    let exact = cpu::normalize_exact(&batch_bytes(i), &spec, None)?;
    let worst = cpu::worst_error(got, &exact, 0.0)?;
    ensure(worst.is_none_or(|w| w.units <= 1.0), || {
        format!("batch {i}: {worst:?}")
    })
}

fn config(depth: usize, spares: usize) -> PrefetchConfig {
    PrefetchConfig {
        depth,
        export_spares: spares,
        loader_threads: 2,
        ..PrefetchConfig::default()
    }
}

// ---------------------------------------------------------------------------------------
// Trials.

fn nothing_pending() -> R {
    // Bounded by what it answers, not by a clock: with nothing pending, a zero timeout must
    // already say `true` (it cannot have waited for anything).
    ensure(wait_for_releases(Duration::ZERO), || {
        "wait_for_releases(0) with nothing exported said false".into()
    })?;
    ensure(wait_for_releases(Duration::from_secs(5)), || {
        "wait_for_releases(5 s) with nothing exported said false".into()
    })
}

/// A device buffer and a pinned buffer, each shared (`Arc`) between the caller and 64 tensors
/// handed over with no stream (`-1`) and released from 8 threads at once, while the device is
/// busy: every release is deferred to the background thread, whose closure must release and
/// drop its owner. Once `wait_for_releases` says they are done, the caller's `Arc`s are the only
/// ones left, and nothing was leaked.
fn closures_drop_owners() -> R {
    let dev = Device::get(0)?;
    let busy = dev.stream()?;
    let before = leaked();
    let d = Arc::new(DeviceBuffer::<f32>::new(&dev, 1 << 16)?);
    let h = Arc::new(PinnedBuffer::<u16>::new(&dev, 1 << 16, HostAlloc::DEFAULT)?);
    let mut raws = Vec::new();
    for k in 0..64 {
        let t = if k % 2 == 0 {
            Tensor::from_device(d.clone())?
        } else {
            Tensor::from_pinned(h.clone())?
        };
        raws.push(t.into_versioned(None)? as usize);
    }
    busy.spin(Duration::from_millis(300))?;
    let barrier = Arc::new(Barrier::new(8));
    let chunks: Vec<Vec<usize>> = raws.chunks(8).map(|c| c.to_vec()).collect();
    let handles: Vec<_> = chunks
        .into_iter()
        .map(|mine| {
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                barrier.wait();
                for p in mine {
                    // SAFETY: handed over above, released once.
                    unsafe { release(p as *mut DLManagedTensorVersioned) };
                }
            })
        })
        .collect();
    for th in handles {
        th.join().map_err(|_| "a releasing thread panicked")?;
    }
    ensure(wait_for_releases(Duration::from_secs(60)), || {
        "the deferred releases never finished".into()
    })?;
    ensure(
        Arc::strong_count(&d) == 1 && Arc::strong_count(&h) == 1,
        || {
            format!(
                "owners left after the releases: device {} pinned {} (want 1 each)",
                Arc::strong_count(&d),
                Arc::strong_count(&h)
            )
        },
    )?;
    ensure(leaked() == before, || {
        format!("{} leaks", leaked() - before)
    })
}

/// depth 1, no spares: the batch's two tensors are dropped without a handover, pixels first.
/// While the extras live the slot is still leased (`next()` says every slot is held, without
/// finishing the prefetcher); once they drop, `next()` gives batch 1 with its own data.
fn batch_tensors_dropped_one_at_a_time() -> R {
    let dev = Device::get(0)?;
    let s = dev.stream()?;
    let mut p = Prefetcher::<f32, i64>::new(&s, source(6), config(1, 0))?;
    let b = p.next().ok_or("ended at 0")??;
    let (px, ex) = b.into_dlpack()?;
    drop(px);
    // The feeder loads batch 1 and waits for a slot.
    std::thread::sleep(Duration::from_millis(300));
    match p.next() {
        Some(Err(_)) => {}
        Some(Ok(b)) => {
            return Err(format!(
                "batch {} came out while the extras still hold the only slot",
                b.index()
            )
            .into())
        }
        None => return Err("ended while the extras hold the only slot".into()),
    }
    drop(ex);
    let b = p.next().ok_or("ended after the release")??;
    ensure(b.index() == 1, || format!("index {}", b.index()))?;
    let px = b.pixels()?;
    let mut got = vec![0f32; px.len()];
    b.stream().copy_d2h(&px, &mut got[..])?.wait()?;
    check_batch(&got, 1)
}

/// depth 1, no spares: batch 0 is handed over to a stream the consumer only lends for the call
/// (`Stream::from_raw` of a stream pinstream does not own here), which queues a slow read of the
/// pixels (300 ms spin, then a raw copy) and releases the tensors at once. The release is
/// deferred (pinstream may not touch the lent stream); the next batch needs the slot, and must
/// not be written into it before the read is over: the read must see batch 0.
fn lent_stream_read_before_refill() -> R {
    let dev = Device::get(0)?;
    let s = dev.stream()?;
    let lender = dev.stream()?;
    let mut p = Prefetcher::<f32, i64>::new(&s, source(4), config(1, 0))?;
    let b = p.next().ok_or("ended at 0")??;
    ensure(b.index() == 0, || format!("index {}", b.index()))?;
    let (px, ex) = b.into_dlpack()?;
    // SAFETY: `lender` outlives `lent` (dropped right after the handover below).
    let lent = unsafe { Stream::from_raw(&dev, lender.as_raw())? };
    let a = px.into_versioned(Some(&lent)).map_err(|r| r.error)?;
    let e = ex.into_versioned(Some(&lent)).map_err(|r| r.error)?;
    drop(lent);
    // SAFETY: live tensor.
    let (ptr, bytes) = unsafe {
        let t = &(*a).dl_tensor;
        let n: i64 = std::slice::from_raw_parts(t.shape, t.ndim as usize)
            .iter()
            .product();
        (t.data as usize, n as usize * 4)
    };
    let mut out = DeviceBuffer::<f32>::new(&dev, bytes / 4)?;
    lender.spin(Duration::from_millis(300))?;
    // SAFETY: `ptr` is the exported pixels (alive until the release is done), `out` has room.
    let err = unsafe {
        sys::cudaMemcpyAsync(
            out.as_device_mut_ptr().cast(),
            ptr as *const c_void,
            bytes,
            sys::cudaMemcpyKind::cudaMemcpyDeviceToDevice,
            lender.as_raw(),
        )
    };
    ensure(err == sys::cudaError::cudaSuccess, || format!("{err:?}"))?;
    // SAFETY: handed over above, released once.
    unsafe {
        release(a);
        release(e);
    }
    let b = p.next().ok_or("ended at 1")??;
    ensure(b.index() == 1, || format!("index {}", b.index()))?;
    lender.synchronize()?;
    let mut got = vec![0f32; bytes / 4];
    lender.copy_d2h(&out, &mut got[..])?.wait()?;
    check_batch(&got, 0).map_err(|e| -> Failed {
        format!("the lent stream's read of batch 0 saw other data (slot refilled under it): {e:?}")
            .into()
    })?;
    let px = b.pixels()?;
    let mut got = vec![0f32; px.len()];
    b.stream().copy_d2h(&px, &mut got[..])?.wait()?;
    check_batch(&got, 1)
}

/// Batches exported with and without a stream, then the prefetcher and its consumer stream are
/// dropped, then the tensors are released from another thread (the leases' slots return to a
/// feeder that is gone): no hang, no crash, every deferred release finishes and nothing leaks.
fn releases_after_everything_dropped() -> R {
    let dev = Device::get(0)?;
    let before = leaked();
    let mine = dev.stream()?;
    let mut raws = Vec::new();
    {
        let s = dev.stream()?;
        let mut p = Prefetcher::<f32, i64>::new(&s, source(10), config(2, 2))?;
        for k in 0..4 {
            let b = p.next().ok_or("ended")??;
            let (px, ex) = b.into_dlpack()?;
            let consumer = if k % 2 == 0 { Some(&mine) } else { None };
            raws.push(px.into_versioned(consumer).map_err(|r| r.error)? as usize);
            raws.push(ex.into_versioned(consumer).map_err(|r| r.error)? as usize);
        }
        mine.spin(Duration::from_millis(200))?;
        drop(p);
        drop(s);
    }
    let releaser = std::thread::spawn(move || {
        for p in raws {
            // SAFETY: handed over above, released once.
            unsafe { release(p as *mut DLManagedTensorVersioned) };
        }
    });
    releaser
        .join()
        .map_err(|_| "the releasing thread panicked")?;
    ensure(wait_for_releases(Duration::from_secs(60)), || {
        "the deferred releases never finished".into()
    })?;
    mine.synchronize()?;
    ensure(leaked() == before, || {
        format!("{} leaks", leaked() - before)
    })
}
