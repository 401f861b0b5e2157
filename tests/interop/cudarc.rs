//! cudarc interop (issue 20, part 3; feature `cudarc`): one process holding pinstream's static
//! runtime and cudarc's driver API shares one primary context — pointers, streams and events of
//! each are valid in the other. cudarc memory as pinstream sources and destinations
//! (`pinstream::cudarc::view` / `view_mut`) and pinstream memory lent to cudarc (`lend` /
//! `lend_mut`), ordered both ways without host waits: every trial holds one side behind a spin
//! kernel, so that a missing wait shows as wrong data (random inputs, poisoned outputs). A
//! cudarc stream as a prefetcher's consumer, and a delayed read on a cudarc stream racing the
//! refill of its batch's slot (it must lose). Leaked views (`mem::forget`) change nothing.
//! Ignored without a GPU.

use std::sync::Arc;
use std::time::Duration;

use crate::common::{ensure, random_bytes, same, R};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
use libtest_mimic::{Failed, Trial};
use pinstream::cudarc::{lend, lend_mut, view, view_mut};
use pinstream::kernels::{self, cpu, Layout, Normalize, Spec};
use pinstream::prefetch::{HostBatch, PrefetchConfig, Prefetcher, Source};
use pinstream::{
    Device, DeviceBuffer, Error, Event, ForeignBuffer, HostAlloc, PinnedBuffer, Stager,
    StagerConfig, Stream,
};

use crate::common::trial;

/// Prefix of this module's trial names (its path in the binary).
const PREFIX: &str = "cudarc/";

/// How long a spin holds one side: long enough that a missing wait cannot hide.
const HOLD: Duration = Duration::from_millis(200);

/// The trials of this module, named `cudarc/...`.
pub fn trials() -> Vec<Trial> {
    let no_gpu = !pinstream::available();
    vec![
        trial(PREFIX, "context/one_primary_context", one_primary_context),
        trial(PREFIX, "context/errors_are_typed", errors_are_typed),
        trial(
            PREFIX,
            "stream/copies_stager_normalize",
            copies_stager_normalize,
        ),
        trial(PREFIX, "events/order_both_ways", events_both_ways),
        trial(PREFIX, "views/ordered_across_streams", views_ordered),
        trial(PREFIX, "views/forget_is_safe", views_forget),
        trial(
            PREFIX,
            "views/cudarc_produces_pinstream_consumes",
            cudarc_produces,
        ),
        trial(PREFIX, "lend/ordered_both_ways", lend_both_ways),
        trial(PREFIX, "lend/panic_in_closure", lend_panic),
        trial(PREFIX, "prefetch/cudarc_stream_consumes", prefetch_consumer),
        trial(PREFIX, "prefetch/delayed_read_races_refill", prefetch_race),
    ]
    .into_iter()
    .map(|t| t.with_ignored_flag(no_gpu))
    .collect()
}

/// Device 0, cudarc's context on it (the primary one), a cudarc stream and pinstream's
/// `Stream` over it.
fn setup() -> Result<(Device, Arc<CudaContext>, Arc<CudaStream>, Stream), Failed> {
    let dev = Device::get(0)?;
    let ctx = CudaContext::new(0)?;
    let cs = ctx.new_stream()?;
    let stream = Stream::from_cudarc(&cs)?;
    Ok((dev, ctx, cs, stream))
}

/// The raw address of a cudarc slice (recording a read on `cs`).
fn address<T>(slice: &CudaSlice<T>, cs: &CudaStream) -> u64 {
    let (ptr, _record) = slice.device_ptr(cs);
    ptr
}

/// `n` random f32 in [-1000, 1000), never all zero.
fn random_f32(n: usize) -> (Vec<f32>, u64) {
    let (bytes, seed) = random_bytes(n * 4);
    let v = bytes
        .chunks_exact(4)
        .map(|c| {
            (u32::from_le_bytes([c[0], c[1], c[2], c[3]]) % 2_000_000) as f32 / 1000.0 - 1000.0
        })
        .collect();
    (v, seed)
}

/// One primary context: cudarc's context is the one the runtime makes current; a cudarc pointer
/// in a pinstream copy and a pinstream pointer in a cudarc copy (raw, without the views); a
/// pinstream stream used by cudarc and a cudarc stream by pinstream.
fn one_primary_context() -> R {
    let (dev, ctx, cs, stream) = setup()?;
    ensure(
        std::ptr::eq(stream.as_raw().cast::<u8>(), cs.cu_stream().cast::<u8>())
            && !stream.is_owned(),
        || "Stream::from_cudarc does not wrap the cudarc stream".into(),
    )?;
    ensure(stream.cudarc().is_some_and(|c| Arc::ptr_eq(c, &cs)), || {
        "Stream::cudarc is not the stream it was made from".into()
    })?;
    // The runtime's context for device 0 is cudarc's.
    dev.make_current()?;
    drop(DeviceBuffer::<u8>::new(&dev, 256)?);
    ensure(
        cudarc::driver::result::ctx::get_current()? == Some(ctx.cu_ctx()),
        || "the runtime's current context is not cudarc's primary context".into(),
    )?;

    let n = 3 << 20;
    // cudarc's allocation, read by a pinstream copy on the cudarc stream.
    let (host, seed) = random_bytes(n);
    let theirs = cs.clone_htod(&host)?;
    let ptr = address(&theirs, &cs);
    {
        // SAFETY: `theirs` is n bytes on device 0, alive and not written until this is
        // dropped; the copy is on the stream cudarc wrote it on.
        let foreign = unsafe { ForeignBuffer::from_raw(&dev, ptr as usize as *mut u8, n)? };
        let mut back = vec![0u8; n];
        stream.copy_d2h(&foreign, &mut back[..])?.wait()?;
        same("cudarc memory read by pinstream", &back, &host, seed)?;
    }
    // pinstream's allocation, read by a cudarc (driver) copy.
    let (host2, seed2) = random_bytes(n);
    let mut ours = DeviceBuffer::<u8>::new(&dev, n)?;
    stream.copy_h2d(&host2[..], &mut ours)?.wait()?;
    let mut back2 = vec![0u8; n];
    // SAFETY: `ours` holds n bytes on device 0, written (the copy waited for); the copy into
    // `back2` is waited for below, before `back2` or `ours` is touched.
    unsafe {
        cudarc::driver::result::memcpy_dtoh_async(
            &mut back2,
            ours.as_device_ptr() as usize as u64,
            cs.cu_stream(),
        )?
    };
    cs.synchronize()?;
    same("pinstream memory read by cudarc", &back2, &host2, seed2)?;
    // A pinstream stream used by cudarc.
    let native = dev.stream()?;
    // SAFETY: `native` outlives `wrapped` (both dropped at the end, `wrapped` first); it is a
    // stream of the primary context.
    let wrapped =
        unsafe { ctx.wrap_borrowed_stream(native.as_raw() as cudarc::driver::sys::CUstream) };
    let (host3, seed3) = random_bytes(1 << 16);
    let c3 = wrapped.clone_htod(&host3)?;
    same(
        "a round trip through cudarc on a pinstream stream",
        &wrapped.clone_dtoh(&c3)?,
        &host3,
        seed3,
    )?;
    drop(c3);
    drop(wrapped);
    // The legacy default stream wraps too.
    let st = Stream::from_cudarc(&ctx.default_stream())?;
    let (h, sd) = random_bytes(4096);
    let mut d = DeviceBuffer::<u8>::new(&dev, h.len())?;
    st.copy_h2d(&h[..], &mut d)?;
    let mut b = vec![0u8; h.len()];
    st.copy_d2h(&d, &mut b[..])?.wait()?;
    same("a round trip on cudarc's default stream", &b, &h, sd)?;
    Ok(())
}

/// Refusals are typed errors, with nothing queued: a stream not from cudarc, the per-thread
/// stream, a context that is not the primary one, a slice of another context, a length mismatch, an unreported cudarc
/// error (left stored for its owner).
fn errors_are_typed() -> R {
    let (dev, ctx, cs, stream) = setup()?;
    let invalid = |r: Result<(), Error>, what: &str| -> R {
        match r {
            Err(Error::InvalidArgument { .. }) => Ok(()),
            other => Err(format!("{what}: expected InvalidArgument, got {other:?}").into()),
        }
    };
    let mut a = cs.alloc_zeros::<f32>(1000)?;
    let native = dev.stream()?;
    invalid(view(&a, &native).map(drop), "view on a native stream")?;
    let mut buf = DeviceBuffer::<f32>::new(&dev, 10)?;
    invalid(lend(&buf, &native, |_| ()), "lend on a native stream")?;
    invalid(
        lend_mut(&mut buf, &native, |_| ()),
        "lend_mut on a native stream",
    )?;
    // The per-thread stream is another stream on every thread: refused.
    invalid(
        Stream::from_cudarc(&ctx.per_thread_stream()).map(drop),
        "the per-thread stream",
    )?;
    // A non-primary context: neither its stream nor its memory is accepted.
    let other = CudaContext::new_non_primary(0, 0)?;
    let os = other.new_stream()?;
    invalid(
        Stream::from_cudarc(&os).map(drop),
        "a non-primary context's stream",
    )?;
    let foreign_slice = os.alloc_zeros::<f32>(16)?;
    invalid(
        view(&foreign_slice, &stream).map(drop),
        "a slice of a non-primary context",
    )?;
    drop(foreign_slice);
    drop(os);
    drop(other);
    ctx.bind_to_thread()?;
    // Lengths.
    let host = vec![1.0f32; 1001];
    match stream.copy_h2d(&host[..], &mut view_mut(&mut a, &stream)?) {
        Err(Error::LengthMismatch { .. }) => {}
        other => return Err(format!("1001 into 1000: {other:?}").into()),
    }
    match view(&a, &stream)?.slice(990..1001) {
        Err(Error::InvalidArgument { .. }) => {}
        other => return Err(format!("a range past the end: {other:?}").into()),
    }
    // An error cudarc stored (as its drops do) and nobody has checked yet.
    let stored =
        cudarc::driver::DriverError(cudarc::driver::sys::CUresult::CUDA_ERROR_INVALID_VALUE);
    ctx.record_err::<()>(Err(stored));
    invalid(view(&a, &stream).map(drop), "a context holding an error")?;
    ensure(ctx.check_err() == Err(stored), || {
        "the stored error was not left for its owner".into()
    })?;
    // A device of its own, when there are two.
    if Device::count()? >= 2 {
        let ctx1 = CudaContext::new(1)?;
        let s1 = ctx1.new_stream()?;
        let b1 = s1.alloc_zeros::<f32>(8)?;
        match view(&b1, &stream) {
            Err(Error::WrongDevice { .. }) => {}
            other => return Err(format!("a slice of device 1: {other:?}").into()),
        }
    }
    ctx.check_err()?;
    Ok(())
}

/// A cudarc stream wrapped by pinstream: stager uploads into cudarc memory, the fused normalize
/// from cudarc memory into cudarc memory, downloads by copy and by the stager, all checked
/// against the CPU reference; read back by cudarc itself.
fn copies_stager_normalize() -> R {
    let (dev, _ctx, cs, stream) = setup()?;
    let (n, c, h, w) = (6usize, 3usize, 20usize, 24usize);
    let spec =
        Spec::uniform(n, c, h, w, Normalize::imagenet())?.layouts(Layout::Nhwc, Layout::Nchw);
    let (input, seed) = random_bytes(spec.input_len()?);
    let mut d_in = cs.alloc_zeros::<u8>(input.len())?;
    let mut d_out = cs.clone_htod(&vec![f32::NAN; spec.output_len()?])?;
    let stager = Stager::new(&dev, StagerConfig::default())?;
    stager.upload(&stream, &input, &mut view_mut(&mut d_in, &stream)?)?;
    kernels::normalize::<f32, _, _>(
        &stream,
        &view(&d_in, &stream)?,
        &spec,
        &mut view_mut(&mut d_out, &stream)?,
        None,
    )?;
    let exact = cpu::normalize_exact(&input, &spec, None)?;
    let check = |got: &[f32], how: &str| -> R {
        let worst = cpu::worst_error(got, &exact, spec.norm.shift)?;
        ensure(worst.is_none_or(|w| w.units <= 1.0), || {
            format!("normalize into cudarc memory, read {how}: {worst:?} (seed {seed})")
        })
    };
    check(&cs.clone_dtoh(&d_out)?, "by cudarc")?;
    let mut got = vec![f32::NAN; exact.len()];
    stream
        .copy_d2h(&view(&d_out, &stream)?, &mut got[..])?
        .wait()?;
    check(&got, "by copy_d2h")?;
    let mut got2 = vec![f32::NAN; exact.len()];
    stager.download(&stream, &view(&d_out, &stream)?, &mut got2)?;
    check(&got2, "by the stager")?;
    same(
        "the input as cudarc sees it",
        &cs.clone_dtoh(&d_in)?,
        &input,
        seed,
    )
}

/// Events across the two libraries, with safe calls only: pinstream records into a cudarc
/// event after a spin and its write, the cudarc stream waits for it before cudarc reads; cudarc
/// records after a spin and its write, a pinstream stream waits before pinstream reads; and a
/// raw pinstream event waited for by the driver directly. The memory is touched through raw
/// addresses, so that the events are the only ordering.
fn events_both_ways() -> R {
    let (dev, ctx, cs, stream) = setup()?;
    let ours = dev.stream()?;
    let n = 1 << 20;
    let mut d = DeviceBuffer::<u8>::new(&dev, n)?;
    let mut pinned = PinnedBuffer::<u8>::new(&dev, n, HostAlloc::DEFAULT)?;
    let mut back = PinnedBuffer::<u8>::new(&dev, n, HostAlloc::DEFAULT)?;
    // pinstream -> cudarc, once through a cudarc event and once through a raw pinstream one.
    for raw in [false, true] {
        ours.memset(&mut d, 0xA5)?;
        ours.synchronize()?;
        let (host, seed) = random_bytes(n);
        pinned.as_mut_slice()?.copy_from_slice(&host);
        ours.spin(HOLD)?;
        drop(ours.copy_h2d(&pinned, &mut d)?);
        if raw {
            let ev = Event::new(&dev)?;
            ours.record(&ev)?;
            // SAFETY: both handles are live (and of the one primary context) for the call.
            unsafe {
                cudarc::driver::result::stream::wait_event(
                    cs.cu_stream(),
                    ev.as_raw() as cudarc::driver::sys::CUevent,
                    cudarc::driver::sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
                )?
            };
        } else {
            let ev = ctx.new_event(None)?;
            ours.record(&ev)?; // a cudarc event, recorded on a pinstream stream
            cs.wait(&ev)?;
        }
        // SAFETY: `d` holds n bytes and `back` n bytes (page-locked: the copy is
        // asynchronous), both alive until after the synchronize below; nothing else touches
        // `back` meanwhile.
        unsafe {
            cudarc::driver::result::memcpy_dtoh_async(
                back.as_mut_slice()?,
                d.as_device_ptr() as usize as u64,
                cs.cu_stream(),
            )?
        };
        let after = cs.record_event(None)?;
        ensure(!after.is_complete(), || {
            format!("raw {raw}: the cudarc stream ran ahead of the pinstream work it waits for")
        })?;
        cs.synchronize()?;
        let what = format!("raw {raw}: cudarc read after a pinstream event");
        same(&what, back.as_slice()?, &host, seed)?;
    }

    // cudarc -> pinstream: cudarc's work (a spin queued on its stream, its own copy), then a
    // pinstream stream waits for cudarc's event.
    let (host2, seed2) = random_bytes(n);
    let mut theirs = cs.clone_htod(&vec![0x5Au8; n])?;
    cs.synchronize()?;
    stream.spin(HOLD)?;
    cs.memcpy_htod(&host2, &mut theirs)?;
    let ptr = address(&theirs, &cs);
    let cev = cs.record_event(None)?;
    ours.wait(&cev)?;
    {
        // SAFETY: `theirs` is n bytes on device 0, alive past this block; written only by the
        // copy the event follows.
        let foreign = unsafe { ForeignBuffer::from_raw(&dev, ptr as usize as *mut u8, n)? };
        let pending = ours.copy_d2h(&foreign, &mut back)?;
        let done = Event::new(&dev)?;
        ours.record(&done)?;
        ensure(!done.is_complete()?, || {
            "the pinstream stream ran ahead of the cudarc event it waits for".into()
        })?;
        same(
            "pinstream read after a cudarc event",
            pending.wait()?,
            &host2,
            seed2,
        )?;
    }
    // A cudarc event of another device cannot be recorded on this one's stream: typed error.
    if Device::count()? >= 2 {
        let ev1 = CudaContext::new(1)?.new_event(None)?;
        match ours.record(&ev1) {
            Err(Error::WrongDevice { .. }) => {}
            other => return Err(format!("a device-1 event on device 0: {other:?}").into()),
        }
    }
    ctx.check_err()?;
    Ok(())
}

/// Views on other streams than the one they are lent on: pinstream writes a cudarc slice on a
/// native stream behind a spin, cudarc reads it on a second cudarc stream at once; cudarc
/// writes on the second stream behind a spin, pinstream reads on a native stream at once.
fn views_ordered() -> R {
    let (dev, ctx, cs, stream) = setup()?;
    let cs2 = ctx.new_stream()?;
    let stream2 = Stream::from_cudarc(&cs2)?;
    let ours = dev.stream()?;
    let n = 1 << 20;
    let mut a = cs.clone_htod(&vec![0x33u8; n])?;
    let (host, seed) = random_bytes(n);
    let mut pinned = PinnedBuffer::<u8>::new(&dev, n, HostAlloc::DEFAULT)?;
    pinned.as_mut_slice()?.copy_from_slice(&host);
    ours.spin(HOLD)?;
    drop(ours.copy_h2d(&pinned, &mut view_mut(&mut a, &stream)?)?);
    // cudarc on another stream: waits for the slice's write event.
    same(
        "cudarc read on another stream after a pinstream write",
        &cs2.clone_dtoh(&a)?,
        &host,
        seed,
    )?;

    // cudarc writes behind a spin on cs2; pinstream reads on a native stream.
    let (host2, seed2) = random_bytes(n);
    stream2.spin(HOLD)?;
    cs2.memcpy_htod(&host2, &mut a)?;
    let mut pin_back = PinnedBuffer::<u8>::new(&dev, n, HostAlloc::DEFAULT)?;
    let got = ours
        .copy_d2h(&view(&a, &stream)?, &mut pin_back)?
        .wait()?
        .to_vec();
    same(
        "pinstream read on a native stream after a cudarc write",
        &got,
        &host2,
        seed2,
    )?;
    // A pinstream read, then a cudarc write on cs2 must wait for it: the read is held behind
    // a spin, the write would otherwise land first.
    let (host3, seed3) = random_bytes(n);
    ours.spin(HOLD)?;
    let mut pin_back2 = PinnedBuffer::<u8>::new(&dev, n, HostAlloc::DEFAULT)?;
    let pending = ours.copy_d2h(&view(&a, &stream)?, &mut pin_back2)?;
    cs2.memcpy_htod(&host3, &mut a)?;
    same(
        "a pinstream read overtaken by a later cudarc write",
        pending.wait()?,
        &host2,
        seed2,
    )?;
    same("the cudarc write", &cs2.clone_dtoh(&a)?, &host3, seed3)?;
    ctx.check_err()?;
    Ok(())
}

/// `mem::forget` of a view after a write queued behind a spin, then the slice dropped at once
/// and a new one allocated on the same stream (the pool hands the same memory back in stream
/// order): the delayed write must land before the free, so the new slice keeps its data.
fn views_forget() -> R {
    let (dev, ctx, cs, stream) = setup()?;
    let ours = dev.stream()?;
    let n = 1 << 20;
    for round in 0..4 {
        let mut a = cs.clone_htod(&vec![0x11u8; n])?;
        cs.synchronize()?;
        let (host, seed) = random_bytes(n);
        let mut pinned = PinnedBuffer::<u8>::new(&dev, n, HostAlloc::DEFAULT)?;
        pinned.as_mut_slice()?.copy_from_slice(&host);
        ours.spin(HOLD)?;
        let mut v = view_mut(&mut a, &stream)?;
        drop(ours.copy_h2d(&pinned, &mut v)?);
        std::mem::forget(v);
        let queued = Event::new(&dev)?;
        ours.record(&queued)?;
        if round % 2 == 0 {
            // Read by cudarc on its stream: after the forgotten write.
            same(
                "cudarc read after a forgotten view",
                &cs.clone_dtoh(&a)?,
                &host,
                seed,
            )?;
            continue;
        }
        drop(a);
        ensure(!queued.is_complete()?, || {
            "the write finished before the free: the trial proves nothing".into()
        })?;
        let (fresh, seed2) = random_bytes(n);
        let b = cs.clone_htod(&fresh)?;
        dev.synchronize()?;
        same(
            "a new slice after the old one (with a forgotten view) was freed",
            &cs.clone_dtoh(&b)?,
            &fresh,
            seed2,
        )?;
        drop(pinned);
    }
    ctx.check_err()?;
    Ok(())
}

/// cudarc as producer: cudarc writes images into its memory behind a spin; pinstream's
/// normalize reads them on a native stream, the stager downloads them; both checked.
fn cudarc_produces() -> R {
    let (dev, ctx, cs, stream) = setup()?;
    let ours = dev.stream()?;
    let spec = Spec::uniform(4, 3, 32, 32, Normalize::imagenet())?;
    let (input, seed) = random_bytes(spec.input_len()?);
    let mut images = cs.clone_htod(&vec![0u8; input.len()])?;
    cs.synchronize()?;
    stream.spin(HOLD)?; // cudarc's stream is busy
    cs.memcpy_htod(&input, &mut images)?;
    let mut out = DeviceBuffer::<f32>::new(&dev, spec.output_len()?)?;
    kernels::fill(&ours, &mut out, f32::NAN)?;
    kernels::normalize::<f32, _, _>(&ours, &view(&images, &stream)?, &spec, &mut out, None)?;
    let mut got = vec![f32::NAN; out.len()];
    ours.copy_d2h(&out, &mut got[..])?.wait()?;
    let exact = cpu::normalize_exact(&input, &spec, None)?;
    let worst = cpu::worst_error(&got, &exact, spec.norm.shift)?;
    ensure(worst.is_none_or(|w| w.units <= 1.0), || {
        format!("normalize of cudarc's images: {worst:?} (seed {seed})")
    })?;
    let stager = Stager::new(&dev, StagerConfig::default())?;
    let (input2, seed2) = random_bytes(input.len());
    stream.spin(HOLD)?;
    cs.memcpy_htod(&input2, &mut images)?;
    let mut back = vec![0u8; input.len()];
    stager.download(&ours, &view(&images, &stream)?, &mut back)?;
    same(
        "a stager download of cudarc's images",
        &back,
        &input2,
        seed2,
    )?;
    ctx.check_err()?;
    Ok(())
}

/// pinstream memory lent to cudarc: pinstream writes behind a spin, cudarc reads on a second
/// cudarc stream inside `lend`; cudarc writes behind a spin inside `lend_mut`, pinstream reads
/// on a native stream right after.
fn lend_both_ways() -> R {
    let (dev, ctx, _cs, stream) = setup()?;
    let cs2 = ctx.new_stream()?;
    let stream2 = Stream::from_cudarc(&cs2)?;
    let ours = dev.stream()?;
    let n = 1 << 18;
    let (host, seed) = random_f32(n);
    let mut pinned = PinnedBuffer::<f32>::new(&dev, n, HostAlloc::DEFAULT)?;
    pinned.as_mut_slice()?.copy_from_slice(&host);
    let mut buf = DeviceBuffer::<f32>::new(&dev, n)?;
    ours.spin(HOLD)?;
    drop(ours.copy_h2d(&pinned, &mut buf)?);
    // cudarc copies on its second stream; lent on the first.
    let mut copy = cs2.alloc_zeros::<f32>(n)?;
    lend(&buf, &stream, |v| cs2.memcpy_dtod(&v, &mut copy))??;
    same(
        "cudarc's copy of lent memory",
        &cs2.clone_dtoh(&copy)?,
        &host,
        seed,
    )?;

    // cudarc writes into lent memory behind a spin; pinstream reads at once.
    let (host2, seed2) = random_f32(n);
    lend_mut(&mut buf, &stream2, |mut v| {
        stream2.spin(HOLD)?;
        cs2.memcpy_htod(&host2, &mut v)?;
        Ok::<(), Box<dyn std::error::Error>>(())
    })?
    .map_err(|e| e.to_string())?;
    let mut back = PinnedBuffer::<f32>::new(&dev, n, HostAlloc::DEFAULT)?;
    let got = ours.copy_d2h(&buf, &mut back)?.wait()?.to_vec();
    same(
        "pinstream read after cudarc wrote lent memory",
        &got,
        &host2,
        seed2,
    )?;

    // A pinstream write after a slow cudarc read of lent memory waits for the read.
    let mut copy2 = cs2.alloc_zeros::<f32>(n)?;
    lend(&buf, &stream2, |v| {
        stream2.spin(HOLD)?;
        cs2.memcpy_dtod(&v, &mut copy2)?;
        Ok::<(), Box<dyn std::error::Error>>(())
    })?
    .map_err(|e| e.to_string())?;
    ours.memset(&mut buf, 0)?;
    same(
        "a slow cudarc read overtaken by a pinstream write",
        &cs2.clone_dtoh(&copy2)?,
        &host2,
        seed2,
    )?;
    ctx.check_err()?;
    Ok(())
}

/// A panic inside `lend_mut` after cudarc queued a write behind a spin: the memory is given
/// back all the same, and pinstream's read comes after the write.
fn lend_panic() -> R {
    let (dev, ctx, _cs, stream) = setup()?;
    let cs2 = ctx.new_stream()?;
    let stream2 = Stream::from_cudarc(&cs2)?;
    let ours = dev.stream()?;
    let n = 1 << 18;
    let mut buf = DeviceBuffer::<u8>::new(&dev, n)?;
    ours.memset(&mut buf, 0x77)?;
    let (host, seed) = random_bytes(n);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        lend_mut(&mut buf, &stream, |mut v| {
            let _ = stream2.spin(HOLD);
            let _ = cs2.memcpy_htod(&host, &mut v);
            panic!("the closure panics after queuing its write");
        })
    }));
    ensure(r.is_err(), || "the panic did not come through".into())?;
    let mut back = vec![0u8; n];
    ours.copy_d2h(&buf, &mut back[..])?.wait()?;
    same("pinstream read after a panicking lend", &back, &host, seed)?;
    ctx.check_err()?;
    Ok(())
}

/// A prefetch source of `end` batches of `n` random images (`hw` x `hw`, NHWC), the spec, and
/// the input of batch `i`.
type Inputs = Arc<dyn Fn(u64) -> Vec<u8> + Send + Sync>;

fn batches(n: usize, hw: usize, end: u64) -> Result<(Source<i64>, Spec, Inputs), Failed> {
    let seed = rand::random::<u64>();
    let spec = Spec::uniform(n, 3, hw, hw, Normalize::imagenet())?;
    let inputs: Inputs = Arc::new(move |i: u64| {
        let mut x = (i ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n * 3 * hw * hw)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 24) as u8
            })
            .collect()
    });
    let (src_inputs, src_spec) = (inputs.clone(), spec.clone());
    let source = Source::new(move |i, b: &mut HostBatch<i64>| {
        if i >= end {
            return Ok(false);
        }
        b.spec = src_spec.clone();
        let px = b.pageable();
        px.clear();
        px.extend(src_inputs(i));
        b.extras.clear();
        b.extras.push(i as i64);
        Ok(true)
    });
    Ok((source, spec, inputs))
}

fn check_batch(what: &str, i: u64, got: &[f32], spec: &Spec, inputs: &Inputs) -> R {
    let exact = cpu::normalize_exact(&inputs(i), spec, None)?;
    let worst = cpu::worst_error(got, &exact, spec.norm.shift)?;
    ensure(worst.is_none_or(|w| w.units <= 1.0), || {
        format!("{what}: batch {i}: {worst:?}")
    })
}

/// A prefetcher consuming on a cudarc stream: each batch's pixels lent to cudarc (zero copy)
/// and copied by cudarc into a slice of its own; every copy equals its batch's reference.
fn prefetch_consumer() -> R {
    let (_dev, ctx, cs, stream) = setup()?;
    let (n, hw, end) = (4usize, 24usize, 12u64);
    let (source, spec, inputs) = batches(n, hw, end)?;
    let config = PrefetchConfig {
        depth: 2,
        ..PrefetchConfig::default()
    };
    let mut p = Prefetcher::<f32, i64>::new(&stream, source, config)?;
    let mut copies = Vec::new();
    while let Some(batch) = p.next() {
        let batch = batch?;
        let px = batch.pixels()?;
        let mut copy = cs.alloc_zeros::<f32>(px.len())?;
        lend(&px, batch.stream(), |v| cs.memcpy_dtod(&v, &mut copy))??;
        copies.push((batch.index(), copy));
    }
    ensure(copies.len() as u64 == end, || {
        format!("{} batches of {end}", copies.len())
    })?;
    for (i, copy) in &copies {
        check_batch(
            "a cudarc copy of a batch",
            *i,
            &cs.clone_dtoh(copy)?,
            &spec,
            &inputs,
        )?;
    }
    ctx.check_err()?;
    Ok(())
}

/// The consumer reads each batch late, on a second cudarc stream behind a spin (cudarc's copy
/// of the lent pixels, and pinstream's copy into cudarc memory on that stream), and drops the
/// batch at once: the prefetcher refills the slot meanwhile (depth 1 and 2). The refill must
/// wait: every late read equals its own batch, never the next.
fn prefetch_race() -> R {
    let (_dev, ctx, _cs, stream) = setup()?;
    // Two late readers, on two cudarc streams of their own: cudarc through `lend`, pinstream
    // through a view.
    let (cs2, cs3) = (ctx.new_stream()?, ctx.new_stream()?);
    let (late2, late3) = (Stream::from_cudarc(&cs2)?, Stream::from_cudarc(&cs3)?);
    for depth in [1usize, 2] {
        let (n, hw, end) = (4usize, 24usize, 10u64);
        let (source, spec, inputs) = batches(n, hw, end)?;
        let config = PrefetchConfig {
            depth,
            ..PrefetchConfig::default()
        };
        let mut p = Prefetcher::<f32, i64>::new(&stream, source, config)?;
        let (mut by_cudarc, mut by_pinstream) = (Vec::new(), Vec::new());
        let mut raced = 0;
        while let Some(batch) = p.next() {
            let batch = batch?;
            let px = batch.pixels()?;
            let mut c1 = cs2.alloc_zeros::<f32>(px.len())?;
            let mut c2 = cs3.alloc_zeros::<f32>(px.len())?;
            late2.spin(Duration::from_millis(40))?;
            lend(&px, &late2, |v| cs2.memcpy_dtod(&v, &mut c1))??;
            late3.spin(Duration::from_millis(40))?;
            late3.copy_d2d(&px, &mut view_mut(&mut c2, &late3)?)?;
            let reads = [cs2.record_event(None)?, cs3.record_event(None)?];
            let i = batch.index();
            drop(batch); // the slot may be refilled now, while the late reads wait
            if reads.iter().all(|r| !r.is_complete()) {
                raced += 1;
            }
            by_cudarc.push((i, c1));
            by_pinstream.push((i, c2));
        }
        drop(p);
        ensure(raced > 0, || {
            "no late read was still pending at its batch's drop: the trial proves nothing".into()
        })?;
        ensure(by_cudarc.len() as u64 == end, || {
            format!("depth {depth}: {} batches of {end}", by_cudarc.len())
        })?;
        for ((i, c1), (_, c2)) in by_cudarc.iter().zip(&by_pinstream) {
            let what = format!("depth {depth}, a late cudarc read");
            check_batch(&what, *i, &cs2.clone_dtoh(c1)?, &spec, &inputs)?;
            let what = format!("depth {depth}, a late pinstream read on a cudarc stream");
            check_batch(&what, *i, &cs3.clone_dtoh(c2)?, &spec, &inputs)?;
        }
    }
    ctx.check_err()?;
    Ok(())
}
