//! Hostile review of the reworked DLPack releases (issue 29 findings 1, 7, 8; commits
//! 35c1a88..18a466e): deferred releases through the background reaper, kept consumer streams,
//! prefetched batches, `primary_context_active`. Each trial tries to make the release path hang,
//! crash, corrupt, leak or deadlock. GPU trials are ignored without a GPU.

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::{ensure, random_bytes, same, within, R};
use libtest_mimic::{Failed, Trial};
use pinstream::dlpack::abi::DLManagedTensorVersioned;
use pinstream::dlpack::{wait_for_releases, Part, Tensor};
use pinstream::kernels::{Normalize, Spec};
use pinstream::prefetch::{HostBatch, PrefetchConfig, Prefetcher, Source};
use pinstream::sys::driver::primary_context_active;
use pinstream::timing::Gate;
use pinstream::{sys, Device, DeviceBuffer, HostAlloc, PinnedBuffer, PinnedPool, Stream};

use crate::common::trial;

/// Prefix of this module's trial names (its path in the binary).
const PREFIX: &str = "dlpack/hostile/release/";

const CHILD: &str = "PINSTREAM_HOSTILE_RELEASE_CHILD";

/// A child process of one of these trials (this executable again, with the variable set): runs
/// its part and returns true, or exits; false in the test runner.
pub fn child_mode() -> bool {
    if let Ok(which) = std::env::var(CHILD) {
        let r = match which.as_str() {
            "exit_gated" => child_exit(true),
            "exit_busy" => child_exit(false),
            "exit_backlog" => child_exit_backlog(),
            other => Err(format!("unknown child {other}").into()),
        };
        match r {
            Ok(()) => println!("CHILD-OK"),
            Err(e) => println!("CHILD-FAILED: {e:?}"),
        }
        return true; // process exit with releases still queued
    }
    false
}

/// The trials of this module, named `dlpack/hostile/release/...`.
pub fn trials() -> Vec<Trial> {
    let no_gpu = !pinstream::available();
    let cpu = vec![trial(
        PREFIX,
        "host/primary_context_active_bad_ordinals",
        bad_ordinals,
    )];
    let gpu = vec![
        trial(
            PREFIX,
            "gpu/prefetch/next_after_gated_deferred_release",
            next_after_gated,
        ),
        trial(
            PREFIX,
            "gpu/prefetch/next_after_deferred_release_loop",
            next_release_loop,
        ),
        trial(
            PREFIX,
            "gpu/prefetch/dropped_while_batches_in_reaper",
            prefetcher_dropped,
        ),
        trial(PREFIX, "gpu/split/half_stream_half_none", split_mixed),
        trial(PREFIX, "gpu/legacy_handles_0_1_2", legacy_handles),
        trial(
            PREFIX,
            "gpu/owned_stream_dropped_after_handover",
            owned_dropped,
        ),
        trial(PREFIX, "gpu/many_deferred_releases_while_gated", many_gated),
        trial(PREFIX, "gpu/host_pool_growth_while_gated", host_pool_growth),
        trial(PREFIX, "gpu/wait_for_releases_races", wait_races),
        trial(PREFIX, "gpu/exit_with_pending_releases", exit_pending),
        trial(PREFIX, "gpu/fork_child_releases", fork_child),
        trial(
            PREFIX,
            "gpu/primary_context_active_bad_ordinals_gpu",
            bad_ordinals,
        ),
    ]
    .into_iter()
    .map(|t| t.with_ignored_flag(no_gpu));
    cpu.into_iter().chain(gpu).collect()
}

// ---------------------------------------------------------------------------------------

fn random(n: usize) -> (Vec<u8>, u64) {
    random_bytes(n)
}

fn download(s: &Stream, d: &DeviceBuffer<u8>, n: usize) -> Result<Vec<u8>, Failed> {
    let mut out = vec![0xA5u8; n];
    s.copy_d2h(d, &mut out[..])?.wait()?;
    Ok(out)
}

/// Calls the deleter, as a consumer does.
unsafe fn release(raw: *mut DLManagedTensorVersioned) {
    // SAFETY: the caller's: `raw` is a live handed-over tensor, released once.
    unsafe {
        if let Some(d) = (*raw).deleter {
            d(raw)
        }
    }
}

fn data_of(raw: *mut DLManagedTensorVersioned) -> usize {
    // SAFETY: live tensor.
    unsafe { (*raw).dl_tensor.data as usize }
}

/// Queues on `stream` a slow read (spin, then copy) of `n` bytes at `ptr` into `out`.
fn slow_read(stream: &Stream, ptr: usize, out: &mut DeviceBuffer<u8>, n: usize) -> R {
    stream.spin(Duration::from_millis(300))?;
    // SAFETY: test code standing in for a foreign library.
    let err = unsafe {
        sys::cudaMemcpyAsync(
            out.as_device_mut_ptr().cast(),
            ptr as *const c_void,
            n,
            sys::cudaMemcpyKind::cudaMemcpyDeviceToDevice,
            stream.as_raw(),
        )
    };
    ensure(err == sys::cudaError::cudaSuccess, || format!("{err:?}"))
}

/// The memory's next owners write it at once on `s`.
fn poison(s: &Stream, n: usize) -> R {
    for _ in 0..4 {
        let mut junk = DeviceBuffer::<u8>::new_async(s, n)?;
        s.memset(&mut junk, 0x5A)?;
        drop(junk);
    }
    Ok(())
}

fn leaked() -> u64 {
    pinstream::memory::leaked().allocations
}

const N: usize = 4;
const HW: usize = 24;

fn source(end: u64) -> Source<i64> {
    Source::new(move |i, b: &mut HostBatch<i64>| {
        if i >= end {
            return Ok(false);
        }
        b.spec = Spec::uniform(N, 3, HW, HW, Normalize::imagenet())?;
        let px = b.pageable();
        px.clear();
        px.extend((0..N * 3 * HW * HW).map(|k| (k as u64 ^ i) as u8));
        b.extras.clear();
        b.extras.extend((0..N as i64).map(|k| i as i64 * 100 + k));
        Ok(true)
    })
}

// ---------------------------------------------------------------------------------------
// primary_context_active with bad ordinals.

fn bad_ordinals() -> R {
    let mut seen = Vec::new();
    for o in [-1, i32::MIN, i32::MAX, 64, 1_000_000, 0] {
        let r = primary_context_active(o);
        seen.push((o, r));
        if o != 0 {
            ensure(r != Some(true), || format!("ordinal {o}: {r:?}"))?;
        }
    }
    eprintln!("primary_context_active: {seen:?}");
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Prefetcher: next() right after the consumer released every held batch without a stream.

fn export_release_none(b: pinstream::prefetch::DeviceBatch<'_, f32, i64>) -> Result<u64, Failed> {
    let i = b.index();
    let (px, ex) = b.into_dlpack()?;
    let a = px.into_versioned(None)?;
    let e = ex.into_versioned(None)?;
    // SAFETY: handed over just above; released once.
    unsafe {
        release(a);
        release(e);
    }
    Ok(i)
}

/// depth 2, no spares: two batches handed over with stream=-1 and released at once (the
/// consumer is done with them) while another stream's work holds the device. The contract
/// of the refusal says "release one and call next() again": they are released. next() must
/// give batch 2 (once the device is free), not the "not released" error.
fn next_after_gated() -> R {
    within("next_after_gated", Duration::from_secs(90), || {
        let dev = Device::get(0)?;
        let s = dev.stream()?;
        let other = dev.stream()?;
        let config = PrefetchConfig {
            depth: 2,
            export_spares: 0,
            ..PrefetchConfig::default()
        };
        let mut p = Prefetcher::<f32, i64>::new(&s, source(20), config)?;
        let gate = Arc::new(Gate::new(&dev, Duration::from_secs(30))?);
        gate.close(&other)?;
        for want in 0..2u64 {
            let b = p.next().ok_or("ended")??;
            let i = export_release_none(b)?;
            ensure(i == want, || format!("index {i}"))?;
        }
        // Let the feeder load batch 2 and wait for a slot.
        std::thread::sleep(Duration::from_millis(500));
        let g = gate.clone();
        let opener = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(1500));
            g.open();
        });
        let t0 = Instant::now();
        let r = p.next();
        let took = t0.elapsed();
        let _ = opener.join();
        match r {
            Some(Ok(b)) => ensure(b.index() == 2, || format!("index {}", b.index())),
            Some(Err(e)) => Err(format!(
                "BROKE: both batches were released (deleters called), yet next() after {took:?} \
                 says: {e}"
            )
            .into()),
            None => Err("ended".into()),
        }
    })
}

/// The same without a gate, as a training loop does it: each batch handed over with no
/// stream (or a lent stream), a short kernel queued on it, the tensors released, next().
fn next_release_loop() -> R {
    within("next_release_loop", Duration::from_secs(120), || {
        let dev = Device::get(0)?;
        let s = dev.stream()?;
        let work = dev.stream()?;
        let config = PrefetchConfig {
            depth: 1,
            export_spares: 0,
            ..PrefetchConfig::default()
        };
        let total = 300u64;
        let mut p = Prefetcher::<f32, i64>::new(&s, source(total), config)?;
        let mut errors = Vec::new();
        let mut got = 0u64;
        loop {
            match p.next() {
                None => break,
                Some(Ok(b)) => {
                    got += 1;
                    let (px, ex) = b.into_dlpack()?;
                    let a = px.into_versioned(None)?;
                    let e = ex.into_versioned(None)?;
                    // The consumer's "training step" on its own stream.
                    work.spin(Duration::from_micros(500))?;
                    // SAFETY: handed over just above.
                    unsafe {
                        release(a);
                        release(e);
                    }
                }
                Some(Err(e)) => {
                    errors.push(format!("after {got} batches: {e}"));
                    break;
                }
            }
        }
        ensure(errors.is_empty() && got == total, || {
            format!(
                "BROKE: {got} of {total} batches; a consumer that releases every batch got {}",
                errors.join(" | ")
            )
        })
    })
}

/// Batches released without a stream wait in the reaper (device held) while the prefetcher
/// is dropped: no hang, and once the device is free, the releases finish without leaks.
fn prefetcher_dropped() -> R {
    within("prefetcher_dropped", Duration::from_secs(90), || {
        let dev = Device::get(0)?;
        let s = dev.stream()?;
        let other = dev.stream()?;
        let before = leaked();
        let config = PrefetchConfig {
            depth: 2,
            export_spares: 1,
            ..PrefetchConfig::default()
        };
        let mut p = Prefetcher::<f32, i64>::new(&s, source(20), config)?;
        let gate = Arc::new(Gate::new(&dev, Duration::from_secs(20))?);
        gate.close(&other)?;
        for _ in 0..3 {
            let b = p.next().ok_or("ended")??;
            export_release_none(b)?;
        }
        let g = gate.clone();
        let opener = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(1500));
            g.open()
        });
        let t0 = Instant::now();
        drop(p);
        let dropped_in = t0.elapsed();
        let opened = opener.join().map_err(|_| "opener panicked")?;
        ensure(wait_for_releases(Duration::from_secs(30)), || {
            "the deferred releases never finished".into()
        })?;
        eprintln!("prefetcher dropped in {dropped_in:?}; gate opened in time: {opened}");
        ensure(leaked() == before, || {
            format!("{} leaks", leaked() - before)
        })
    })
}

// ---------------------------------------------------------------------------------------
// Tensor::split: one part released on a pinstream stream, the other with no stream.

fn split_mixed() -> R {
    let dev = Device::get(0)?;
    let s = dev.stream()?;
    let n = 1 << 22;
    for order in 0..2 {
        let (v, seed) = random(2 * n);
        let mut d = DeviceBuffer::<u8>::new_async(&s, 2 * n)?;
        s.copy_h2d(&v[..], &mut d)?.wait()?;
        let mut out_a = DeviceBuffer::<u8>::new(&dev, n)?;
        let mut out_b = DeviceBuffer::<u8>::new(&dev, n)?;
        let own = dev.stream()?;
        let reader = dev.stream()?;
        let mut parts =
            Tensor::from_device(d)?.split(&[Part::of::<u8>(0, &[n]), Part::of::<u8>(n, &[n])])?;
        let b = parts.pop().ok_or("no part")?.into_versioned(None)?;
        let a = parts.pop().ok_or("no part")?.into_versioned(Some(&own))?;
        slow_read(&own, data_of(a), &mut out_a, n)?;
        slow_read(&reader, data_of(b), &mut out_b, n)?;
        let (a, b) = (a as usize, b as usize);
        std::thread::spawn(move || {
            let (x, y) = if order == 0 { (a, b) } else { (b, a) };
            // SAFETY: handed over above; each released once.
            unsafe {
                release(x as *mut _);
                release(y as *mut _);
            }
        })
        .join()
        .map_err(|_| "release thread panicked")?;
        poison(&s, 2 * n)?;
        s.synchronize()?;
        dev.synchronize()?;
        let ga = download(&s, &out_a, n)?;
        let gb = download(&s, &out_b, n)?;
        same(
            &format!("order {order}: part a (stream)"),
            &ga,
            &v[..n],
            seed,
        )?;
        same(&format!("order {order}: part b (none)"), &gb, &v[n..], seed)?;
    }
    ensure(wait_for_releases(Duration::from_secs(30)), || {
        "releases never finished".into()
    })
}

// ---------------------------------------------------------------------------------------
// The legacy default stream lent as 0 and as 0x1; the per-thread stream 0x2.

fn legacy_handles() -> R {
    let dev = Device::get(0)?;
    let s = dev.stream()?;
    let n = 1 << 22;
    // SAFETY: the per-thread handle is a special handle the runtime accepts.
    let pt = unsafe { Stream::from_raw(&dev, 0x2usize as sys::cudaStream_t) };
    ensure(pt.is_err(), || "from_raw(0x2) accepted".into())?;
    for raw in [0usize, 1usize] {
        let (v, seed) = random(n);
        let mut d = DeviceBuffer::<u8>::new_async(&s, n)?;
        s.copy_h2d(&v[..], &mut d)?.wait()?;
        let mut out = DeviceBuffer::<u8>::new(&dev, n)?;
        s.synchronize()?;
        // SAFETY: the legacy default stream, never destroyed.
        let lent = unsafe { Stream::from_raw(&dev, raw as sys::cudaStream_t)? };
        let t = Tensor::from_device(d)?.into_versioned(Some(&lent))?;
        slow_read(&lent, data_of(t), &mut out, n)?;
        let tu = t as usize;
        // Released on a thread whose current device was never set.
        std::thread::spawn(move || unsafe { release(tu as *mut _) })
            .join()
            .map_err(|_| "release thread panicked")?;
        drop(lent);
        poison(&s, n)?;
        s.synchronize()?;
        dev.synchronize()?;
        same(
            &format!("legacy handle {raw:#x}"),
            &download(&s, &out, n)?,
            &v,
            seed,
        )?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// A pinstream-owned stream dropped by the user right after the handover.

fn owned_dropped() -> R {
    let dev = Device::get(0)?;
    let s = dev.stream()?;
    let n = 1 << 22;
    let (v, seed) = random(n);
    let mut d = DeviceBuffer::<u8>::new_async(&s, n)?;
    s.copy_h2d(&v[..], &mut d)?.wait()?;
    let mut out = DeviceBuffer::<u8>::new(&dev, n)?;
    s.synchronize()?;
    let own = dev.stream()?;
    let handle = own.as_raw() as usize;
    let t = Tensor::from_device(d)?.into_versioned(Some(&own))?;
    slow_read(&own, data_of(t), &mut out, n)?;
    drop(own);
    let fresh: Vec<Stream> = (0..16).map(|_| dev.stream()).collect::<Result<_, _>>()?;
    let reused = fresh.iter().any(|f| f.as_raw() as usize == handle);
    let tu = t as usize;
    std::thread::spawn(move || unsafe { release(tu as *mut _) })
        .join()
        .map_err(|_| "release thread panicked")?;
    poison(&s, n)?;
    s.synchronize()?;
    dev.synchronize()?;
    same(
        &format!("owned stream dropped after the handover (handle reused: {reused})"),
        &download(&s, &out, n)?,
        &v,
        seed,
    )?;
    ensure(!reused, || {
        "the handle was reused while the Ctx held a clone".into()
    })
}

// ---------------------------------------------------------------------------------------
// Thousands of deferred releases behind a held device: does the deleter ever block, does
// the queue hold, does everything come back?

fn many_gated() -> R {
    within("many_gated", Duration::from_secs(120), || {
        let dev = Device::get(0)?;
        let s = dev.stream()?;
        let other = dev.stream()?;
        let before = leaked();
        let free0 = dev.memory_info()?.free;
        let gate = Gate::new(&dev, Duration::from_secs(40))?;
        gate.close(&other)?;
        let count = 3000;
        let sz = 64 << 10;
        let t0 = Instant::now();
        for _ in 0..count {
            let d = DeviceBuffer::<u8>::new_async(&s, sz)?;
            let t = Tensor::from_device(d)?.into_versioned(None)?;
            // SAFETY: handed over just above.
            unsafe { release(t) };
        }
        let loop_took = t0.elapsed();
        let free1 = dev.memory_info()?.free;
        let early = wait_for_releases(Duration::ZERO);
        let held_ok = !gate.timed_out();
        gate.open();
        ensure(wait_for_releases(Duration::from_secs(60)), || {
            "the releases never finished".into()
        })?;
        s.synchronize()?;
        let free2 = dev.memory_info()?.free;
        eprintln!(
            "{count} x {sz} B released while gated in {loop_took:?}; device free {} -> {} -> {} MiB; \
             back before the gate opened: {early}; gate held: {held_ok}",
            free0 >> 20,
            free1 >> 20,
            free2 >> 20
        );
        ensure(!early, || "released before the device was free".into())?;
        ensure(leaked() == before, || {
            format!("{} leaks", leaked() - before)
        })
    })
}

/// Host consumers (numpy) of pool blocks release with no stream; with the device busy, each
/// new block is a fresh pinned allocation: how far does the pool grow?
fn host_pool_growth() -> R {
    within("host_pool_growth", Duration::from_secs(120), || {
        let dev = Device::get(0)?;
        let other = dev.stream()?;
        let pool = PinnedPool::new(&dev, Default::default())?;
        let gate = Gate::new(&dev, Duration::from_secs(40))?;
        // Warm: one block through the cache.
        drop(pool.alloc::<u8>(1 << 20)?);
        gate.close(&other)?;
        let rounds = 256;
        for _ in 0..rounds {
            let b = pool.alloc::<u8>(1 << 20)?;
            let t = Tensor::from_pool_block(b)?
                .host_as_cpu()
                .map_err(|r| r.error)?
                .into_versioned(None)?;
            // SAFETY: handed over just above.
            unsafe { release(t) };
        }
        let st = pool.stats();
        gate.open();
        ensure(wait_for_releases(Duration::from_secs(60)), || {
            "the releases never finished".into()
        })?;
        let st2 = pool.stats();
        eprintln!(
            "{rounds} x 1 MiB host blocks released while gated: in use {} MiB, allocations {}, \
             misses {}; after: in use {} MiB cached {} MiB",
            st.in_use_bytes >> 20,
            st.allocations,
            st.misses,
            st2.in_use_bytes >> 20,
            st2.cached_bytes >> 20
        );
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------
// Releases from many threads racing wait_for_releases.

fn wait_races() -> R {
    within("wait_races", Duration::from_secs(120), || {
        let dev = Device::get(0)?;
        let before = leaked();
        let stop = Arc::new(AtomicBool::new(false));
        let waits = Arc::new(AtomicUsize::new(0));
        let mut waiters = Vec::new();
        for k in 0..2 {
            let (stop, waits) = (stop.clone(), waits.clone());
            waiters.push(std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let d = if k == 0 {
                        Duration::ZERO
                    } else {
                        Duration::from_millis(1)
                    };
                    wait_for_releases(d);
                    waits.fetch_add(1, Ordering::Relaxed);
                }
            }));
        }
        let mut workers = Vec::new();
        for _ in 0..4 {
            workers.push(std::thread::spawn(move || -> Result<(), String> {
                let s = dev.stream().map_err(|e| e.to_string())?;
                let host = PinnedBuffer::<u8>::new(&dev, 4096, HostAlloc::DEFAULT)
                    .map_err(|e| e.to_string())?;
                drop(host);
                for i in 0..500 {
                    let d = DeviceBuffer::<u8>::new_async(&s, 4096).map_err(|e| e.to_string())?;
                    let t = Tensor::from_device(d).map_err(|e| e.to_string())?;
                    let raw = if i % 3 == 0 {
                        t.into_versioned(Some(&s))
                            .map_err(|e| e.error.to_string())?
                    } else {
                        t.into_versioned(None).map_err(|e| e.error.to_string())?
                    };
                    // SAFETY: handed over just above.
                    unsafe { release(raw) };
                }
                Ok(())
            }));
        }
        for w in workers {
            w.join().map_err(|_| "worker panicked")??;
        }
        stop.store(true, Ordering::Relaxed);
        for w in waiters {
            w.join().map_err(|_| "waiter panicked")?;
        }
        ensure(wait_for_releases(Duration::from_secs(30)), || {
            "releases never finished".into()
        })?;
        ensure(leaked() == before, || {
            format!("{} leaks", leaked() - before)
        })
    })
}

// ---------------------------------------------------------------------------------------
// Process exit with releases queued (the reaper mid-wait or mid-free).

fn child_exit(gated: bool) -> R {
    let dev = Device::get(0)?;
    let s = dev.stream()?;
    if gated {
        let other = dev.stream()?;
        let gate = Gate::new(&dev, Duration::from_secs(3))?;
        gate.close(&other)?;
        for _ in 0..200 {
            let d = DeviceBuffer::<u8>::new_async(&s, 1 << 16)?;
            let t = Tensor::from_device(d)?.into_versioned(None)?;
            // SAFETY: handed over just above.
            unsafe { release(t) };
        }
        // Never opened: the reaper waits in cudaDeviceSynchronize while the process exits.
        std::mem::forget(gate);
    } else {
        for i in 0..2000 {
            let d = DeviceBuffer::<u8>::new(&dev, 1 << 12 << (i % 8))?;
            let t = Tensor::from_device(d)?.into_versioned(None)?;
            // SAFETY: handed over just above.
            unsafe { release(t) };
        }
        let p = PinnedBuffer::<u8>::new(&dev, 1 << 20, HostAlloc::DEFAULT)?;
        let t = Tensor::from_pinned(p)?.into_versioned(None)?;
        // SAFETY: as above.
        unsafe { release(t) };
    }
    Ok(())
}

/// A thread releases many tiny device tensors with no stream, then the process exits at once
/// with the reaper's backlog still queued (this crashed at exit before the reaper stopped at
/// `atexit`).
fn child_exit_backlog() -> R {
    let dev = Device::get(0)?;
    let h = std::thread::spawn(move || -> R {
        let s = dev.stream()?;
        for _ in 0..200_000 {
            let d = DeviceBuffer::<u8>::new_async(&s, 256)?;
            let t = Tensor::from_device(d)?.into_versioned(None)?;
            // SAFETY: handed over just above.
            unsafe { release(t) };
        }
        Ok(())
    });
    h.join().map_err(|_| "release thread panicked")?
}

fn exit_pending() -> R {
    let exe = std::env::current_exe()?;
    let mut bad = Vec::new();
    for round in 0..10 {
        let which = match round % 3 {
            0 => "exit_busy",
            1 => "exit_gated",
            _ => "exit_backlog",
        };
        let mut child = std::process::Command::new(&exe)
            .env(CHILD, which)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()?;
        let t0 = Instant::now();
        let status = loop {
            if let Some(st) = child.try_wait()? {
                break Some(st);
            }
            if t0.elapsed() > Duration::from_secs(120) {
                let _ = child.kill();
                break None;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let out = child.wait_with_output()?;
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        let ok = status.is_some_and(|s| s.success()) && text.contains("CHILD-OK");
        eprintln!("{which}: {status:?} in {:?}", t0.elapsed());
        if !ok || text.contains("panicked") {
            bad.push(format!("{which}: {status:?}\n{text}"));
        }
    }
    ensure(bad.is_empty(), || {
        format!("BROKE:\n{}", bad.join("\n---\n"))
    })
}

// ---------------------------------------------------------------------------------------
// fork: the reaper thread does not exist in the child; another parent thread may hold the
// reaper's locks at the fork.

extern "C" {
    fn fork() -> i32;
    fn _exit(code: i32) -> !;
    fn waitpid(pid: i32, status: *mut i32, options: i32) -> i32;
    fn alarm(secs: u32) -> u32;
    fn kill(pid: i32, sig: i32) -> i32;
}

fn fork_child() -> R {
    within("fork_child", Duration::from_secs(150), || {
        let dev = Device::get(0)?;
        let s = dev.stream()?;
        let kids = 120usize;
        // One handed-over tensor per child, released there: most with no stream, a few on a
        // pinstream stream (the child's release then calls CUDA).
        let mut raws = Vec::new();
        for k in 0..kids {
            let d = DeviceBuffer::<u8>::new_async(&s, 4096)?;
            let t = Tensor::from_device(d)?;
            let raw = if k % 20 == 19 {
                t.into_versioned(Some(&s))?
            } else {
                t.into_versioned(None)?
            };
            raws.push(raw as usize);
        }
        s.synchronize()?;
        // A parent thread hammering the reaper's locks.
        let stop = Arc::new(AtomicBool::new(false));
        let st = stop.clone();
        let hammer = std::thread::spawn(move || -> Result<u64, String> {
            let s = dev.stream().map_err(|e| e.to_string())?;
            let mut n = 0u64;
            while !st.load(Ordering::Relaxed) {
                let d = DeviceBuffer::<u8>::new_async(&s, 256).map_err(|e| e.to_string())?;
                let t = Tensor::from_device(d)
                    .map_err(|e| e.to_string())?
                    .into_versioned(None)
                    .map_err(|e| e.error.to_string())?;
                // SAFETY: handed over just above.
                unsafe { release(t) };
                n += 1;
            }
            Ok(n)
        });
        std::thread::sleep(Duration::from_millis(100));
        let mut outcomes: std::collections::BTreeMap<String, Vec<usize>> = Default::default();
        for (k, &raw) in raws.iter().enumerate() {
            // SAFETY: fork in a test; the child only releases one tensor and _exits.
            let pid = unsafe { fork() };
            if pid == 0 {
                // SAFETY: child side.
                unsafe {
                    alarm(10);
                    release(raw as *mut DLManagedTensorVersioned);
                    let done = wait_for_releases(Duration::from_millis(200));
                    _exit(if done { 0 } else { 3 });
                }
            }
            ensure(pid > 0, || "fork failed".into())?;
            let mut status = 0i32;
            let t0 = Instant::now();
            loop {
                // SAFETY: our own child.
                let r = unsafe {
                    waitpid(pid, &mut status, 1 /* WNOHANG */)
                };
                if r == pid {
                    break;
                }
                if t0.elapsed() > Duration::from_secs(15) {
                    // SAFETY: our own child.
                    unsafe { kill(pid, 9) };
                    unsafe { waitpid(pid, &mut status, 0) };
                    break;
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            let what = if status & 0x7f == 0 {
                format!("exit {}", (status >> 8) & 0xff)
            } else {
                format!("signal {}", status & 0x7f)
            };
            let kind = if k % 20 == 19 { "stream" } else { "none" };
            outcomes
                .entry(format!("{kind}: {what}"))
                .or_default()
                .push(k);
        }
        stop.store(true, Ordering::Relaxed);
        let n = hammer.join().map_err(|_| "hammer panicked")??;
        eprintln!("hammer: {n} releases; children: {outcomes:?}");
        // Exit 3: the child's deferred release never ran (no reaper in the child): expected,
        // bounded. Signal 14 (SIGALRM) or 9: the child hung; another signal: it crashed.
        let hung_or_crashed: Vec<_> = outcomes
            .keys()
            .filter(|k| k.contains("signal"))
            .cloned()
            .collect();
        ensure(hung_or_crashed.is_empty(), || {
            format!("BROKE: children hung or crashed: {outcomes:?}")
        })
    })
}
