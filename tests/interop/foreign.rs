//! Streams and events pinstream did not create (issue 20, part 1): `Stream::from_raw` and
//! `Event::from_raw` borrow another library's handles — here raw runtime handles made through
//! `pinstream::sys`, as PyTorch or cudarc would hand them over. Copies, the stager, the fused
//! normalize (with a per-sample table) and a prefetcher work on a borrowed stream; events order
//! pinstream's streams after foreign work and foreign streams after pinstream's; dropping a
//! borrowed handle leaves it alive. Ignored without a GPU.

use std::time::Duration;

use crate::common::{ensure, random_bytes, R};
use libtest_mimic::{Failed, Trial};
use pinstream::kernels::{self, cpu, Crop, Layout, Normalize, Spec};
use pinstream::prefetch::{HostBatch, PrefetchConfig, Prefetcher, Source};
use pinstream::{sys, Device, DeviceBuffer, Event, Stager, StagerConfig, Stream};

use crate::common;
use crate::common::trial;

/// Prefix of this module's trial names (its path in the binary).
const PREFIX: &str = "";

/// The trials of this module, named `...`.
pub fn trials() -> Vec<Trial> {
    let no_gpu = !pinstream::available();
    vec![
        trial(PREFIX, "foreign/stream_borrowed", stream_borrowed),
        trial(
            PREFIX,
            "foreign/legacy_default_stream",
            legacy_default_stream,
        ),
        trial(
            PREFIX,
            "foreign/events_order_both_ways",
            events_order_both_ways,
        ),
        trial(
            PREFIX,
            "foreign/prefetcher_consumes_on_it",
            prefetcher_on_foreign,
        ),
    ]
    .into_iter()
    .map(|t| t.with_ignored_flag(no_gpu))
    .collect()
}

fn ok(err: sys::cudaError_t, what: &str) -> R {
    ensure(err == sys::cudaError::cudaSuccess, || {
        format!("{what}: {err:?}")
    })
}

/// A raw non-blocking stream of device 0's primary context, as another library would own it.
fn raw_stream(dev: &Device) -> Result<sys::cudaStream_t, Failed> {
    dev.make_current()?;
    let mut raw = std::ptr::null_mut();
    // SAFETY: a valid out-pointer and flag.
    let err = unsafe { sys::cudaStreamCreateWithPriority(&mut raw, sys::cudaStreamNonBlocking, 0) };
    ok(err, "cudaStreamCreateWithPriority")?;
    Ok(raw)
}

fn raw_event(dev: &Device) -> Result<sys::cudaEvent_t, Failed> {
    dev.make_current()?;
    let mut raw = std::ptr::null_mut();
    // SAFETY: a valid out-pointer and flag.
    let err = unsafe { sys::cudaEventCreateWithFlags(&mut raw, sys::cudaEventDisableTiming) };
    ok(err, "cudaEventCreateWithFlags")?;
    Ok(raw)
}

/// Copies, the stager and a normalize with crops and mirrors on a borrowed stream, checked
/// against the CPU reference; dropping every clone leaves the stream alive (the owner destroys
/// it afterwards, once).
fn stream_borrowed() -> R {
    let dev = Device::get(0)?;
    let raw = raw_stream(&dev)?;
    {
        // SAFETY: `raw` is live until the end of this function, after every clone is gone.
        let s = unsafe { Stream::from_raw(&dev, raw)? };
        ensure(!s.is_owned() && s.as_raw() == raw, || {
            "not the borrowed handle".into()
        })?;
        let clone = s.clone();
        // A normalize with a per-sample table, input through the stager.
        let (n, side) = (5usize, 12usize);
        let mut spec = Spec::uniform(n, 3, side, side, Normalize::imagenet())?
            .layouts(Layout::Nhwc, Layout::Nchw);
        for (k, smp) in spec.samples.iter_mut().enumerate() {
            smp.crop = Some(Crop {
                x: k,
                y: 1,
                w: 6,
                h: 5,
            });
            smp.mirror = k % 2 == 1;
        }
        let (input, seed) = random_bytes(spec.input_len()?);
        let stager = Stager::new(&dev, StagerConfig::default())?;
        let mut d_in = DeviceBuffer::<u8>::new(&dev, input.len())?;
        stager.upload(&clone, &input, &mut d_in)?;
        let mut d_out = DeviceBuffer::<f32>::new(&dev, spec.output_len()?)?;
        kernels::normalize::<f32, _, _>(&s, &d_in, &spec, &mut d_out, None)?;
        let mut got = vec![f32::NAN; d_out.len()];
        s.copy_d2h(&d_out, &mut got[..])?.wait()?;
        let exact = cpu::normalize_exact(&input, &spec, None)?;
        let worst = cpu::worst_error(&got, &exact, spec.norm.shift)?;
        ensure(worst.is_none_or(|w| w.units <= 1.0), || {
            format!("normalize on a borrowed stream: {worst:?} (seed {seed})")
        })?;
    }
    // Every clone is gone: the stream must still be usable by its owner.
    // SAFETY: the owner's handle, live.
    ok(
        unsafe { sys::cudaStreamSynchronize(raw) },
        "the owner's stream after the drop",
    )?;
    // SAFETY: destroyed once, by its owner.
    ok(unsafe { sys::cudaStreamDestroy(raw) }, "cudaStreamDestroy")
}

/// The legacy default stream (null) borrowed: a round trip through it.
fn legacy_default_stream() -> R {
    let dev = Device::get(0)?;
    // SAFETY: the legacy default stream lives as long as the context.
    let s = unsafe { Stream::from_raw(&dev, std::ptr::null_mut())? };
    let (host, seed) = random_bytes(1 << 16);
    let mut d = DeviceBuffer::<u8>::new(&dev, host.len())?;
    s.copy_h2d(&host[..], &mut d)?;
    let mut back = vec![0u8; host.len()];
    s.copy_d2h(&d, &mut back[..])?.wait()?;
    common::same("legacy default stream round trip", &back, &host, seed)
}

/// A borrowed event recorded by the other library after 200 ms of its work: a pinstream
/// stream that waits on it runs after that work. And the other way: pinstream records into a
/// borrowed event after 200 ms of its own work, the other library's stream waits on it. Both
/// events survive their wrappers.
fn events_order_both_ways() -> R {
    let dev = Device::get(0)?;
    let (raw_s, raw_e) = (raw_stream(&dev)?, raw_event(&dev)?);
    let ours = dev.stream()?;
    {
        // SAFETY: both handles are live until the end of this function.
        let foreign = unsafe { Stream::from_raw(&dev, raw_s)? };
        // SAFETY: as above.
        let ev = unsafe { Event::from_raw(&dev, raw_e) };
        // Foreign work, then the foreign library records its event.
        foreign.spin(Duration::from_millis(200))?;
        // SAFETY: live handles of one device.
        ok(
            unsafe { sys::cudaEventRecord(raw_e, raw_s) },
            "cudaEventRecord",
        )?;
        ours.wait(&ev)?;
        let done = Event::new(&dev)?;
        ours.record(&done)?;
        ensure(!done.is_complete()?, || {
            "our stream ran ahead of the foreign work it waits for".into()
        })?;
        done.synchronize()?;
        ensure(ev.is_complete()?, || "foreign event not complete".into())?;
        // The other way: our work, recorded into the borrowed event; the foreign stream waits.
        ours.spin(Duration::from_millis(200))?;
        ours.record(&ev)?;
        // SAFETY: live handles.
        ok(
            unsafe { sys::cudaStreamWaitEvent(raw_s, raw_e, 0) },
            "cudaStreamWaitEvent",
        )?;
        let after = Event::new(&dev)?;
        foreign.record(&after)?;
        ensure(!after.is_complete()?, || {
            "the foreign stream ran ahead of our work it waits for".into()
        })?;
        after.synchronize()?;
    }
    // Both handles survive their wrappers.
    // SAFETY: live handles, destroyed once by their owner.
    unsafe {
        ok(
            sys::cudaEventQuery(raw_e),
            "the owner's event after the drop",
        )?;
        ok(sys::cudaEventDestroy(raw_e), "cudaEventDestroy")?;
        ok(sys::cudaStreamDestroy(raw_s), "cudaStreamDestroy")
    }
}

/// A prefetcher whose consumer stream is borrowed: every batch equals the reference.
fn prefetcher_on_foreign() -> R {
    let dev = Device::get(0)?;
    let raw = raw_stream(&dev)?;
    let (n, hw, end) = (3usize, 16usize, 12u64);
    let seed = rand::random::<u64>();
    let bytes = move |i: u64| -> Vec<u8> {
        (0..n * 3 * hw * hw)
            .map(|k| ((k as u64).wrapping_mul(31) ^ i ^ seed) as u8)
            .collect()
    };
    {
        // SAFETY: `raw` is live until the end of this function, after the prefetcher and the
        // stream are dropped.
        let s = unsafe { Stream::from_raw(&dev, raw)? };
        let source = Source::new(move |i, b: &mut HostBatch<i64>| {
            if i >= end {
                return Ok(false);
            }
            b.spec = Spec::uniform(n, 3, hw, hw, Normalize::imagenet())?;
            let px = b.pageable();
            px.clear();
            px.extend(bytes(i));
            b.extras.clear();
            b.extras.push(i as i64);
            Ok(true)
        });
        let mut p = Prefetcher::<f32, i64>::new(&s, source, PrefetchConfig::default())?;
        let mut i = 0u64;
        loop {
            let Some(b) = p.next() else { break };
            let b = b?;
            let px = b.pixels()?;
            let mut got = vec![f32::NAN; px.len()];
            s.copy_d2h(&px, &mut got[..])?.wait()?;
            let spec = Spec::uniform(n, 3, hw, hw, Normalize::imagenet())?;
            let exact = cpu::normalize_exact(&bytes(i), &spec, None)?;
            let worst = cpu::worst_error(&got, &exact, 0.0)?;
            ensure(worst.is_none_or(|w| w.units <= 1.0), || {
                format!("batch {i} on a borrowed consumer stream: {worst:?}")
            })?;
            i += 1;
        }
        ensure(i == end, || format!("{i} batches of {end}"))?;
    }
    // SAFETY: the owner's handle, destroyed once.
    ok(unsafe { sys::cudaStreamDestroy(raw) }, "cudaStreamDestroy")
}
