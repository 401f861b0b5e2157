//! Hostile trials of the interop API (issue 20): `ForeignBuffer`, `record_stream`, DLPack
//! export (`Tensor`, deleters), import (`Imported`, `HostTensor`) and prefetched batches
//! handed over with `into_dlpack`. Every attack uses safe code, plus the documented unsafe
//! constructors (`Stream::from_raw`, `ForeignBuffer::from_raw`, `Imported::from_*`) called
//! exactly as their contracts say. A trial passes when the library resisted (a typed error,
//! correct data, no hang) and fails when it broke. `finding/...` trials are the ones that broke
//! when written (each passes since its fix; see SAFETY.md); `held/...` the ones it resisted.

// The attacks drop and forget values on purpose, whether or not their types have a `Drop`
// today (a guard may gain one), and spell lengths out.
#![allow(clippy::len_zero, clippy::drop_non_drop, clippy::forget_non_drop)]

use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use crate::common::{ensure, random_bytes, same, within, R};
use libtest_mimic::{Failed, Trial};
use pinstream::dlpack::abi::{
    DLDataType, DLDevice, DLManagedTensor, DLManagedTensorVersioned, DLPackVersion, DLTensor,
    KDL_CPU, KDL_CUDA, KDL_CUDA_HOST,
};
use pinstream::dlpack::{Element, Imported, Tensor};
use pinstream::kernels::{cpu, Normalize, Spec};
use pinstream::prefetch::{HostBatch, PrefetchConfig, Prefetcher, Source};
use pinstream::{
    sys, Device, DeviceBuffer, Error, ForeignBuffer, HostAlloc, HostKind, PinnedBuffer, Pod, Stream,
};

use crate::common::trial;

/// Prefix of this module's trial names (its path in the binary).
const PREFIX: &str = "dlpack/hostile/";

pub mod release;
pub mod split;

const BOUND: Duration = Duration::from_secs(60);

/// The trials of this module, named `dlpack/hostile/...`.
pub fn trials() -> Vec<Trial> {
    let no_gpu = !pinstream::available();
    let t = |name: &str, f: fn() -> R| {
        let name = name.to_string();
        let what = name.clone();
        trial(PREFIX, name, move || within(&what, BOUND, f)).with_ignored_flag(no_gpu)
    };
    // Imports of host memory need no GPU: these run everywhere.
    let cpu = |name: &str, f: fn() -> R| {
        let name = format!("cpu/{name}");
        let what = name.clone();
        trial(PREFIX, name, move || within(&what, BOUND, f))
    };
    vec![
        cpu(
            "finding/byte_offset_wrapping_around_the_address_space",
            byte_offset_wraps,
        ),
        cpu(
            "held/imported_lies_refused_and_deleted_once",
            imported_lies_refused,
        ),
        cpu("held/imported_byte_views_of_odd_types", imported_byte_views),
        cpu(
            "held/imported_read_only_and_writable_views",
            imported_read_only_views,
        ),
        // Findings.
        t(
            "finding/batch_export_consumer_write_races_earlier_tracked_read",
            batch_export_races_consumer_read,
        ),
        t(
            "finding/batch_export_consumer_write_races_record_stream_user",
            batch_export_races_record_stream_user,
        ),
        t(
            "finding/per_thread_stream_consumer_released_on_other_thread_uaf",
            per_thread_stream_other_thread,
        ),
        t(
            "finding/host_view_of_device_memory_claimed_as_host",
            host_claim_over_device_memory,
        ),
        t(
            "finding/imported_write_races_pinstream_read_of_shared_export",
            imported_write_races_shared_read,
        ),
        t(
            "finding/imported_host_write_mutates_a_live_shared_pinned_slice",
            imported_write_mutates_shared_slice,
        ),
        t(
            "finding/all_held_error_hides_the_end_of_the_epoch",
            all_held_hides_end,
        ),
        // Held.
        t(
            "held/record_stream_on_imported_and_foreign_delays_the_release",
            record_stream_delays_release,
        ),
        t("held/batch_without_extras", batch_without_extras),
        t(
            "held/per_thread_stream_consumer_released_on_same_thread",
            per_thread_stream_same_thread,
        ),
        t("held/empty_exports", empty_exports),
        t("held/shape_and_stride_games", shape_games),
        t(
            "held/refused_handover_gives_the_tensor_back",
            refused_handover,
        ),
        t(
            "held/batch_deleters_on_many_threads_with_all_held_retries",
            batch_many_threads,
        ),
        t(
            "held/depth1_no_spares_next_loop_then_drop_then_release",
            depth1_no_spares,
        ),
        t(
            "held/record_stream_then_into_dlpack_refill_waits",
            record_stream_then_into_dlpack,
        ),
        t("held/legacy_null_stream", legacy_null_stream),
        t(
            "held/imported_pinned_cpu_source_dropped_in_flight",
            imported_pinned_source_in_flight,
        ),
        t(
            "held/host_mut_download_into_imported_cpu",
            host_mut_download,
        ),
        t(
            "held/legacy_null_strides_and_byte_offset",
            legacy_strides_and_offset,
        ),
        t("held/device_claims_refused", device_claims_refused),
        t("held/forget_games", forget_games),
        t(
            "held/pinned_export_with_dma_in_flight",
            pinned_export_dma_in_flight,
        ),
        t(
            "held/pixels_and_extras_released_at_once",
            pixels_extras_at_once,
        ),
    ]
}

// ---------------------------------------------------------------------------------------
// Helpers.

fn random<T: Pod>(n: usize) -> (Vec<T>, u64) {
    let (bytes, seed) = random_bytes(n * std::mem::size_of::<T>());
    (bytemuck::pod_collect_to_vec(&bytes), seed)
}

fn upload<T: Pod>(s: &Stream, v: &[T]) -> Result<DeviceBuffer<T>, Failed> {
    let mut d = DeviceBuffer::<T>::new(&s.device(), v.len())?;
    s.copy_h2d(v, &mut d)?.wait()?;
    Ok(d)
}

fn download<T: Pod, D: pinstream::DeviceSlice<T> + ?Sized>(
    s: &Stream,
    d: &D,
    n: usize,
) -> Result<Vec<T>, Failed> {
    let mut out = vec![T::zeroed(); n];
    bytemuck::cast_slice_mut::<T, u8>(&mut out).fill(0xA5);
    s.copy_d2h(d, &mut out[..])?.wait()?;
    Ok(out)
}

/// A d2d copy outside pinstream's trackers, as another library's kernel would queue it.
///
/// # Safety
///
/// Both are live device allocations of `bytes`.
unsafe fn raw_copy(
    dst: *mut c_void,
    src: *const c_void,
    bytes: usize,
    stream: sys::cudaStream_t,
) -> R {
    // SAFETY: the caller's.
    let err = unsafe {
        sys::cudaMemcpyAsync(
            dst,
            src,
            bytes,
            sys::cudaMemcpyKind::cudaMemcpyDeviceToDevice,
            stream,
        )
    };
    ensure(err == sys::cudaError::cudaSuccess, || format!("{err:?}"))
}

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

fn cuda_malloc(bytes: usize) -> Result<*mut c_void, Failed> {
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    let err = unsafe { sys::cudaMalloc(&mut p, bytes) };
    ensure(err == sys::cudaError::cudaSuccess, || format!("{err:?}"))?;
    Ok(p)
}

fn cuda_host_alloc(bytes: usize) -> Result<*mut c_void, Failed> {
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    let err = unsafe { sys::cudaHostAlloc(&mut p, bytes, 0) };
    ensure(err == sys::cudaError::cudaSuccess, || format!("{err:?}"))?;
    Ok(p)
}

const N: usize = 4;
const HW: usize = 24;
const LEN: usize = N * 3 * HW * HW;

fn batch_bytes(seed: u64, i: u64) -> Vec<u8> {
    (0..LEN)
        .map(|k| ((k as u64).wrapping_mul(2654435761) ^ i.wrapping_mul(0x9E37) ^ seed) as u8)
        .collect()
}

fn source(seed: u64, end: u64) -> Source<i64> {
    Source::new(move |i, b: &mut HostBatch<i64>| {
        if i >= end {
            return Ok(false);
        }
        b.spec = Spec::uniform(N, 3, HW, HW, Normalize::imagenet())?;
        let px = b.pageable();
        px.clear();
        px.extend(batch_bytes(seed, i));
        b.extras.clear();
        b.extras.extend((0..N as i64).map(|k| i as i64 * 100 + k));
        Ok(true)
    })
}

fn check_batch(got: &[f32], seed: u64, i: u64) -> R {
    let spec = Spec::uniform(N, 3, HW, HW, Normalize::imagenet())?;
    let exact = cpu::normalize_exact(&batch_bytes(seed, i), &spec, None)?;
    let worst = cpu::worst_error(got, &exact, 0.0)?;
    ensure(worst.is_none_or(|w| w.units <= 1.0), || {
        format!("batch {i}: {worst:?} (seed {seed})")
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
// A foreign producer: any memory, any device claim, a deleter that can look at the world.

#[repr(C)]
struct Foreign {
    managed: DLManagedTensorVersioned,
    shape: Vec<i64>,
    strides: Option<Vec<i64>>,
    on_delete: Option<Box<dyn FnOnce() + Send>>,
}

unsafe extern "C" fn foreign_deleter(p: *mut DLManagedTensorVersioned) {
    // SAFETY: made by `foreign`; called once.
    let mut b = unsafe { Box::from_raw(p.cast::<Foreign>()) };
    if let Some(f) = b.on_delete.take() {
        f();
    }
}

fn foreign(
    data: *mut c_void,
    device: DLDevice,
    dtype: DLDataType,
    shape: Vec<i64>,
    strides: Option<Vec<i64>>,
    byte_offset: u64,
    on_delete: Option<Box<dyn FnOnce() + Send>>,
) -> *mut DLManagedTensorVersioned {
    let mut b = Box::new(Foreign {
        managed: DLManagedTensorVersioned {
            version: DLPackVersion { major: 1, minor: 3 },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(foreign_deleter),
            flags: 0,
            dl_tensor: DLTensor {
                data,
                device,
                ndim: shape.len() as i32,
                dtype,
                shape: std::ptr::null_mut(),
                strides: std::ptr::null_mut(),
                byte_offset,
            },
        },
        shape,
        strides,
        on_delete,
    });
    b.managed.dl_tensor.shape = b.shape.as_mut_ptr();
    if let Some(s) = b.strides.as_mut() {
        b.managed.dl_tensor.strides = s.as_mut_ptr();
    }
    Box::into_raw(b).cast()
}

const CPU: DLDevice = DLDevice {
    device_type: KDL_CPU,
    device_id: 0,
};

fn cuda(id: i32) -> DLDevice {
    DLDevice {
        device_type: KDL_CUDA,
        device_id: id,
    }
}

// ---------------------------------------------------------------------------------------
// Findings.

/// The consumer's stream reads the batch through pinstream (a tracked `copy_d2d`, queued
/// behind a spin), then the batch is handed over to a DLPack consumer on another stream, which
/// writes the (not read-only) pixels at once. `into_versioned(Some(&c))` promises that `c`
/// "waits on the GPU for pinstream's work on the memory"; for a batch it waits only for the
/// slot's `ready` event, not for the `release` recorded on the consumer's stream (nor the
/// output buffer's tracker), so the write lands before the earlier read.
fn batch_export_races_consumer_read() -> R {
    let dev = Device::get(0)?;
    let s = dev.stream()?;
    let c = dev.stream()?;
    let seed = rand::random::<u64>();
    let mut p = Prefetcher::<f32, i64>::new(&s, source(seed, 4), config(2, 2))?;
    let b = p.next().ok_or("no batch")??;
    let mut out = DeviceBuffer::<f32>::new(&dev, LEN)?;
    s.spin(Duration::from_millis(300))?;
    s.copy_d2d(&b.pixels()?, &mut out)?;
    let (px, ex) = b.into_dlpack()?;
    // SAFETY: handed over just above; nobody else writes it.
    let mut imp = unsafe { Imported::from_versioned(px.into_versioned(Some(&c))?)? };
    // The consumer writes its tensor on its stream (an in-place op, say).
    c.memset(&mut imp.device_mut::<f32>()?, 0xFF)?;
    s.synchronize()?;
    c.synchronize()?;
    let got = download(&s, &out, LEN)?;
    drop(imp);
    drop(ex);
    drop(p);
    check_batch(&got, seed, 0).map_err(|e| {
        format!("pinstream's own read, queued before into_dlpack, saw the consumer's later write: {e:?}")
            .into()
    })
}

/// As above for a stream named by `DeviceBatch::record_stream`: its read is ordered before
/// the slot's refill (its event joins the release), but not before the DLPack consumer.
fn batch_export_races_record_stream_user() -> R {
    let dev = Device::get(0)?;
    let s = dev.stream()?;
    let f = dev.stream()?;
    let c = dev.stream()?;
    let seed = rand::random::<u64>();
    let mut p = Prefetcher::<f32, i64>::new(&s, source(seed, 4), config(2, 2))?;
    let b = p.next().ok_or("no batch")??;
    let mut out = DeviceBuffer::<f32>::new(&dev, LEN)?;
    b.record_stream(&f)?;
    f.spin(Duration::from_millis(300))?;
    // SAFETY: both live device allocations of LEN f32; `record_stream` covers the read.
    unsafe {
        raw_copy(
            out.as_device_mut_ptr().cast(),
            b.pixels()?.as_device_ptr().cast(),
            LEN * 4,
            f.as_raw(),
        )?
    };
    let (px, ex) = b.into_dlpack()?;
    // SAFETY: handed over just above; nobody else writes it.
    let mut imp = unsafe { Imported::from_versioned(px.into_versioned(Some(&c))?)? };
    c.memset(&mut imp.device_mut::<f32>()?, 0xFF)?;
    f.synchronize()?;
    c.synchronize()?;
    let got = download(&s, &out, LEN)?;
    drop(imp);
    drop(ex);
    drop(p);
    check_batch(&got, seed, 0).map_err(|e| {
        format!("a record_stream user's read saw the DLPack consumer's write: {e:?}").into()
    })
}

/// `Stream::from_raw` documents `cudaStreamPerThread` as a valid handle, and the DLPack docs
/// let the consumer call the deleter "from any thread". The consumer hands the per-thread
/// stream over on thread A, queues a slow read there, and releases the tensor on thread M: the
/// release event is recorded on M's per-thread stream (idle), so the stream-ordered free (and
/// the next allocation's poison) runs before A's read: a use after free.
fn per_thread_stream_other_thread() -> R {
    per_thread_stream(false)
}

/// The control: the same, with the deleter on thread A.
fn per_thread_stream_same_thread() -> R {
    per_thread_stream(true)
}

/// Fixed: `Stream::from_raw` refuses `cudaStreamPerThread` (it names another stream on each
/// thread, so a deleter on another thread would record on the wrong one).
fn per_thread_stream(_same_thread: bool) -> R {
    let dev = Device::get(0)?;
    // SAFETY: the special handle; refused before it is used.
    let r = unsafe { Stream::from_raw(&dev, 0x2 as pinstream::sys::cudaStream_t) };
    ensure(matches!(r, Err(Error::InvalidArgument { .. })), || {
        format!("cudaStreamPerThread accepted: {r:?}")
    })
}

/// A producer claims `kDLCPU` (or `kDLCUDAHost`) for device memory. `host()` already asks the
/// runtime what the address is (`pointer_kind`) but only to tell pinned from pageable; a
/// device address comes out as a "pageable" host view whose `as_slice()` dereferences device
/// memory on the host (a segfault). Not dereferenced here: the trial fails when `host()`
/// accepts it.
fn host_claim_over_device_memory() -> R {
    let dev = Device::get(0)?;
    dev.make_current()?;
    let n = 1024usize;
    let mem = cuda_malloc(n * 4)?;
    let mut accepted = Vec::new();
    for (what, device) in [
        ("kDLCPU", CPU),
        (
            "kDLCUDAHost",
            DLDevice {
                device_type: KDL_CUDA_HOST,
                device_id: 0,
            },
        ),
    ] {
        let p = foreign(mem, device, f32::DTYPE, vec![n as i64], None, 0, None);
        // SAFETY: a live tensor (its memory outlives it); ownership passes.
        let imp = unsafe { Imported::from_versioned(p)? };
        if let Ok(h) = imp.host::<f32>() {
            accepted.push(format!("{what}: host() = {h:?}"));
        }
    }
    // SAFETY: the owner's free, after the imports are gone.
    unsafe {
        let _ = sys::cudaFree(mem);
    }
    ensure(accepted.is_empty(), || {
        format!(
            "device memory accepted as a host view (as_slice() would read device memory on \
             the host): {accepted:?}"
        )
    })
}

/// A shared (`Arc`) buffer is exported and imported back (the natural Rust consumer). The
/// import writes its tensor through `device_mut` on the consumer's stream while pinstream
/// reads the same buffer through the `Arc` on another stream (queued behind a spin). Nothing
/// orders the two: `from_device` says the uses are ordered "at the handover and at the
/// release, not in between", and `Imported::from_versioned`'s contract forbids others'
/// writes only, not others' reads while pinstream writes (`ForeignBuffer::from_raw`'s does).
fn imported_write_races_shared_read() -> R {
    let dev = Device::get(0)?;
    let r = dev.stream()?;
    let c = dev.stream()?;
    let n = 1 << 22;
    let (v, seed) = random::<u8>(n);
    let buf = Arc::new(upload(&r, &v)?);
    let mut out = DeviceBuffer::<u8>::new(&dev, n)?;
    // SAFETY: handed over just above; nobody else writes it.
    let mut imp = unsafe {
        Imported::from_versioned(Tensor::from_device(buf.clone())?.into_versioned(Some(&c))?)?
    };
    // Fixed: an export of a shared buffer is read-only, so the import cannot write it.
    ensure(
        imp.is_read_only() && imp.device_mut::<u8>().is_err(),
        || "a shared export is writable".into(),
    )?;
    r.spin(Duration::from_millis(300))?;
    r.copy_d2d(&*buf, &mut out)?;
    r.synchronize()?;
    c.synchronize()?;
    drop(imp);
    same(
        "pinstream's read of the shared buffer",
        &download(&r, &out, n)?,
        &v,
        seed,
    )
}

// ---------------------------------------------------------------------------------------
// Held.

/// Empty buffers, empty slices, scalars: null data, shape [0], a working deleter, and imports
/// of them.
fn empty_exports() -> R {
    let dev = Device::get(0)?;
    let s = dev.stream()?;
    let empty = Arc::new(DeviceBuffer::<f32>::new(&dev, 0)?);
    let weak = Arc::downgrade(&empty);
    let raw = Tensor::from_device(empty)?.into_versioned(Some(&s))?;
    // SAFETY: handed over just above.
    let (data, ndim, shape0, stride0) = unsafe {
        let t = &(*raw).dl_tensor;
        (t.data, t.ndim, *t.shape, *t.strides)
    };
    ensure(
        data.is_null() && ndim == 1 && shape0 == 0 && stride0 == 1,
        || format!("empty: data {data:p} ndim {ndim} shape {shape0} stride {stride0}"),
    )?;
    // SAFETY: ownership passes.
    let imp = unsafe { Imported::from_versioned(raw)? };
    let view = imp.device_view::<f32>()?;
    ensure(view.len() == 0, || "len".into())?;
    let mut o = DeviceBuffer::<f32>::new(&dev, 0)?;
    s.copy_d2d(&view, &mut o)?;
    drop(imp);
    ensure(weak.upgrade().is_none(), || "empty buffer kept".into())?;
    // Legacy, an empty slice of a non-empty buffer.
    let (v, _) = random::<u32>(10);
    let t = Tensor::from_device(upload(&s, &v)?)?.slice(3..3)?;
    let raw = t.into_legacy(Some(&s))?;
    // SAFETY: as above.
    let imp = unsafe { Imported::from_legacy(raw)? };
    ensure(
        imp.len() == 0 && imp.device_view::<u32>()?.len() == 0,
        || format!("{imp:?}"),
    )?;
    drop(imp);
    // reshape of an empty tensor: [] is refused, [0, 5] fine.
    let t = Tensor::from_device(DeviceBuffer::<u8>::new(&dev, 0)?)?;
    let t = match t.reshape(&[]) {
        Ok(t) => return Err(format!("a scalar of nothing: {t:?}").into()),
        Err(_) => Tensor::from_device(DeviceBuffer::<u8>::new(&dev, 0)?)?,
    };
    let t = t.reshape(&[0, 5])?;
    // SAFETY: as above.
    drop(unsafe { Imported::from_versioned(t.into_versioned(None)?)? });
    // Empty pinned.
    if let Ok(pb) = PinnedBuffer::<u16>::new(&dev, 0, HostAlloc::DEFAULT) {
        let raw = Tensor::from_pinned(pb)?.into_versioned(Some(&s))?;
        // SAFETY: as above.
        let imp = unsafe { Imported::from_versioned(raw)? };
        ensure(imp.host::<u16>()?.as_slice()?.is_empty(), || {
            "pinned".into()
        })?;
    }
    // An empty ForeignBuffer over null.
    // SAFETY: no bytes.
    let fb = unsafe { ForeignBuffer::<f32>::from_raw(&dev, std::ptr::null_mut(), 0)? };
    let mut o = DeviceBuffer::<f32>::new(&dev, 0)?;
    s.copy_d2d(&fb.slice(..)?, &mut o)?;
    fb.release_to(&s)?;
    // A scalar (ndim 0) of one element.
    let t = Tensor::from_device(upload(&s, &[42u32])?)?.reshape(&[])?;
    // SAFETY: as above.
    let imp = unsafe { Imported::from_versioned(t.into_versioned(Some(&s))?)? };
    ensure(imp.shape().is_empty() && imp.len() == 1, || {
        format!("{imp:?}")
    })?;
    let got = download(&s, &imp.device_view::<u32>()?, 1)?;
    ensure(got == [42], || format!("scalar {got:?}"))
}

/// Huge, zero, overflowing and mismatched shapes and strides: typed errors or valid tensors,
/// never a panic; an export with more dimensions than the importer reads is given back.
fn shape_games() -> R {
    let dev = Device::get(0)?;
    let s = dev.stream()?;
    const M: usize = usize::MAX;
    let m = M;
    let mk = |n: usize| -> Result<Tensor, Failed> {
        Ok(Tensor::from_device(DeviceBuffer::<f32>::new(&dev, n)?)?)
    };
    type Case = (usize, &'static [usize], Option<&'static [usize]>, bool);
    let cases: &[Case] = &[
        (12, &[M, 0], None, false),
        (0, &[M, 0], None, false),
        (0, &[0, 1 << 62, 4], None, false),
        (12, &[3, 4], Some(&[M, 1]), false),
        (12, &[1, 12], Some(&[M, 1]), false),
        (1, &[M], Some(&[0]), false),
        (1, &[1 << 40], Some(&[0]), true),
        (12, &[2, 3], Some(&[3]), false),
        (12, &[4, 3], Some(&[1, 4]), true),
        (12, &[4, 3], Some(&[1, 5]), false),
        (12, &[0, M], Some(&[M, M]), false),
        (12, &[0, 7], Some(&[1 << 62, 1]), true),
        (12, &[2, 2, 3], None, true),
        (12, &[5, 3], None, false),
        (12, &[M / 2 + 1, 2], None, false),
        (1, &[], None, true),
        (1, &[], Some(&[]), true),
        (0, &[], Some(&[]), false),
    ];
    for &(len, shape, strides, ok) in cases {
        let t = mk(len)?;
        let r = match strides {
            None => t.reshape(shape),
            Some(st) => t.with_strides(shape, st),
        };
        match (r, ok) {
            (Ok(t), true) => {
                // Hand it over and back: the importer reads what was written.
                // SAFETY: handed over just above.
                let imp = unsafe { Imported::from_versioned(t.into_versioned(Some(&s))?)? };
                let want: Vec<i64> = shape.iter().map(|&n| n as i64).collect();
                ensure(imp.shape() == want, || format!("{shape:?}: {imp:?}"))?;
            }
            (Err(Error::InvalidArgument { .. }), false) => {}
            (r, _) => {
                return Err(format!(
                    "len {len} shape {shape:?} strides {strides:?}: {:?}",
                    r.map(|t| format!("{t:?}"))
                )
                .into())
            }
        }
    }
    // 65 dimensions: exported, refused by the importer, which gives it back (buffer freed).
    let buf = Arc::new(DeviceBuffer::<f32>::new(&dev, 1)?);
    let weak = Arc::downgrade(&buf);
    let ones = vec![1usize; 65];
    let t = Tensor::from_device(buf)?.with_strides(&ones, &ones)?;
    // SAFETY: handed over just above.
    let r = unsafe { Imported::from_versioned(t.into_versioned(Some(&s))?) };
    ensure(r.is_err(), || "65 dimensions imported".into())?;
    ensure(weak.upgrade().is_none(), || {
        "a refused import kept the buffer".into()
    })?;
    // Slices out of range.
    for (a, b) in [(5usize, 4usize), (0, 13), (13, 13), (m, m)] {
        ensure(mk(12)?.slice(a..b).is_err(), || format!("slice {a}..{b}"))?;
    }
    ensure(mk(12)?.slice(..=m).is_err(), || "..=MAX".into())?;
    Ok(())
}

/// A refused handover gives the tensor back unchanged; it can be handed over again.
fn refused_handover() -> R {
    let dev = Device::get(0)?;
    let s = dev.stream()?;
    let (v, seed) = random::<f32>(64);
    let t = Tensor::from_device(upload(&s, &v)?)?
        .reshape(&[8, 8])?
        .read_only();
    let t = match t.into_legacy(Some(&s)) {
        Ok(_) => return Err("read-only handed over as legacy".into()),
        Err(r) => r.tensor,
    };
    ensure(t.shape() == [8, 8], || format!("{t:?}"))?;
    // SAFETY: handed over just above.
    let mut imp = unsafe { Imported::from_versioned(t.into_versioned(Some(&s))?)? };
    ensure(
        imp.is_read_only() && imp.device_mut::<f32>().is_err(),
        || format!("{imp:?}"),
    )?;
    let got = download(&s, &imp.device_view::<f32>()?, 64)?;
    let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<u32>>();
    same("after a refusal", &bits(&got), &bits(&v), seed)
}

/// Batches exported one after another, each checked, then their tensors released by 8 threads
/// in random order with random delays; `next()` answers "all held" while they hold every slot
/// and goes on after a release (never finishes for good). At the end the spares have retired:
/// device memory is back to the depth's.
fn batch_many_threads() -> R {
    let dev = Device::get(0)?;
    let s = dev.stream()?;
    let seed = rand::random::<u64>();
    let end = 48u64;
    let (depth, spares) = (2, 2);
    let mut p = Prefetcher::<f32, i64>::new(&s, source(seed, end), config(depth, spares))?;
    let (tx, rx) = mpsc::channel::<usize>();
    let rx = Arc::new(Mutex::new(rx));
    let released = Arc::new(AtomicUsize::new(0));
    let workers: Vec<_> = (0..8)
        .map(|k| {
            let rx = rx.clone();
            let released = released.clone();
            std::thread::spawn(move || {
                let mut x = 0x9E3779B97F4A7C15u64 ^ k;
                loop {
                    let got = rx.lock().map(|r| r.recv());
                    let Ok(Ok(raw)) = got else { return };
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    std::thread::sleep(Duration::from_micros(x % 3000));
                    // SAFETY: handed over on the main thread, released once, here.
                    unsafe { release(raw as *mut DLManagedTensorVersioned) };
                    released.fetch_add(1, Ordering::SeqCst);
                }
            })
        })
        .collect();
    let mut check = DeviceBuffer::<f32>::new(&dev, LEN)?;
    let mut held = Vec::new();
    let mut refusals = 0u64;
    let mut i = 0u64;
    let mut max_bytes = 0usize;
    let t0 = Instant::now();
    let slot = LEN * (1 + 4) + N * 8;
    let mut mid_epoch = None;
    loop {
        if i == 40 && mid_epoch.is_none() {
            // Everything released (and waited for) mid-epoch: the spares must retire.
            for raw in held.drain(..) {
                tx.send(raw).map_err(|_| "workers gone")?;
            }
            let t1 = Instant::now();
            while released.load(Ordering::SeqCst) < 2 * i as usize {
                ensure(t1.elapsed() < Duration::from_secs(20), || {
                    "releases stalled".into()
                })?;
                std::thread::sleep(Duration::from_millis(1));
            }
            mid_epoch = Some(p.device_bytes());
        }
        let b = match p.next() {
            None => break,
            Some(Err(Error::InvalidArgument { .. })) => {
                refusals += 1;
                ensure(t0.elapsed() < Duration::from_secs(40), || {
                    format!("still refused after 40 s at batch {i}")
                })?;
                // Release the oldest two held batches (their four tensors) in random order.
                for raw in held.drain(..held.len().min(4)) {
                    tx.send(raw).map_err(|_| "workers gone")?;
                }
                std::thread::sleep(Duration::from_millis(1));
                continue;
            }
            Some(Err(e)) => return Err(format!("batch {i}: {e}").into()),
            Some(Ok(b)) => b,
        };
        ensure(b.index() == i, || format!("index {} for {i}", b.index()))?;
        max_bytes = max_bytes.max(b.device_bytes());
        let (px, ex) = b.into_dlpack()?;
        let px = px.into_versioned(Some(&s))?;
        let ex = ex.into_versioned(Some(&s))?;
        // SAFETY: the pixels' memory (LEN f32) and `check`; on the consumer stream it was
        // handed to.
        unsafe {
            raw_copy(
                check.as_device_mut_ptr().cast(),
                (*px).dl_tensor.data,
                LEN * 4,
                s.as_raw(),
            )?
        };
        check_batch(&download(&s, &check, LEN)?, seed, i)?;
        let mut e = vec![0i64; N];
        // SAFETY: the extras' memory, N i64, on the stream it was handed to.
        let err = unsafe {
            sys::cudaMemcpyAsync(
                e.as_mut_ptr().cast(),
                (*ex).dl_tensor.data,
                N * 8,
                sys::cudaMemcpyKind::cudaMemcpyDeviceToHost,
                s.as_raw(),
            )
        };
        ensure(err == sys::cudaError::cudaSuccess, || format!("{err:?}"))?;
        s.synchronize()?;
        ensure(e[0] == i as i64 * 100 && e[3] == i as i64 * 100 + 3, || {
            format!("extras of {i}: {e:?}")
        })?;
        // Pixels and extras go to different workers, in either order.
        if i % 2 == 0 {
            held.push(px as usize);
            held.push(ex as usize);
        } else {
            held.push(ex as usize);
            held.push(px as usize);
        }
        i += 1;
    }
    ensure(i == end, || format!("{i} batches of {end}"))?;
    for raw in held.drain(..) {
        tx.send(raw).map_err(|_| "workers gone")?;
    }
    drop(tx);
    for w in workers {
        w.join().map_err(|_| "a deleter thread panicked")?;
    }
    ensure(released.load(Ordering::SeqCst) == 2 * end as usize, || {
        "not every tensor released".into()
    })?;
    // Spares are parked, not freed (no slot made or freed per batch): nothing beyond
    // `depth + export_spares` slots' worth stays allocated.
    let now = mid_epoch.unwrap_or(usize::MAX);
    ensure(now <= (depth + spares) * (slot + 4096), || {
        format!("{now} device bytes after every release (max {max_bytes}, one slot {slot})")
    })?;
    ensure(refusals > 0, || {
        "never refused: the trial did not reach all-held".into()
    })?;
    eprintln!("    ({refusals} refusals, max {max_bytes} device bytes, {now} at the end)");
    Ok(())
}

/// Depth 1, no spares: after one export `next()` is refused at once, a thousand times, and is
/// not finished by it; a release on another thread lets it go on. Then the prefetcher is
/// dropped with an export outstanding (and a tensor never handed over), and both are released
/// after.
fn depth1_no_spares() -> R {
    let dev = Device::get(0)?;
    let s = dev.stream()?;
    let seed = rand::random::<u64>();
    let mut p = Prefetcher::<f32, i64>::new(&s, source(seed, 10), config(1, 0))?;
    let (px, ex) = p.next().ok_or("no batch 0")??.into_dlpack()?;
    let px = px.into_versioned(Some(&s))? as usize;
    let ex = ex.into_versioned(None)? as usize;
    let t0 = Instant::now();
    for k in 0..1000 {
        match p.next() {
            Some(Err(Error::InvalidArgument { .. })) => {}
            other => {
                return Err(format!(
                    "next() #{k} with the only slot held: {:?}",
                    other.map(|r| r.map(|b| b.index()))
                )
                .into())
            }
        }
    }
    // A watchdog against a refusal that waits, not a speed bound.
    ensure(t0.elapsed() < Duration::from_secs(60), || {
        format!("1000 refusals took {:?}", t0.elapsed())
    })?;
    std::thread::spawn(move || {
        // SAFETY: handed over above, released once.
        unsafe {
            release(ex as *mut DLManagedTensorVersioned);
            release(px as *mut DLManagedTensorVersioned);
        }
    })
    .join()
    .map_err(|_| "deleter thread panicked")?;
    let b = p.next().ok_or("finished by the refusals")??;
    ensure(b.index() == 1, || format!("index {}", b.index()))?;
    check_batch(&download(&s, &b.pixels()?, LEN)?, seed, 1)?;
    let (px, ex) = b.into_dlpack()?;
    drop(p);
    // Handed over only after the prefetcher is gone; the extras never handed over.
    let px = px.into_versioned(Some(&s))? as usize;
    drop(ex);
    std::thread::spawn(move || {
        // SAFETY: as above.
        unsafe { release(px as *mut DLManagedTensorVersioned) };
    })
    .join()
    .map_err(|_| "deleter thread panicked")?;
    Ok(())
}

/// `record_stream` on a batch, a slow foreign read, then `into_dlpack` and both tensors dropped
/// unhanded: the slot goes straight back (depth 1, no spares); its refill must still wait for
/// the foreign read.
fn record_stream_then_into_dlpack() -> R {
    let dev = Device::get(0)?;
    let s = dev.stream()?;
    let f = dev.stream()?;
    let seed = rand::random::<u64>();
    let mut p = Prefetcher::<f32, i64>::new(&s, source(seed, 4), config(1, 0))?;
    let mut outs = Vec::new();
    for i in 0..4u64 {
        let b = p.next().ok_or("ended")??;
        ensure(b.index() == i, || format!("index {}", b.index()))?;
        let mut out = DeviceBuffer::<f32>::new(&dev, LEN)?;
        b.record_stream(&f)?;
        f.spin(Duration::from_millis(150))?;
        // SAFETY: LEN f32 each; `record_stream` covers the read.
        unsafe {
            raw_copy(
                out.as_device_mut_ptr().cast(),
                b.pixels()?.as_device_ptr().cast(),
                LEN * 4,
                f.as_raw(),
            )?
        };
        let (px, ex) = b.into_dlpack()?;
        drop(px);
        drop(ex);
        outs.push(out);
    }
    f.synchronize()?;
    for (i, o) in outs.iter().enumerate() {
        check_batch(&download(&s, o, LEN)?, seed, i as u64)?;
    }
    Ok(())
}

/// The legacy default stream (`Stream::from_raw(&dev, null)`) as a `record_stream` user of a
/// buffer and of a batch, and as a DLPack consumer released on another thread.
fn legacy_null_stream() -> R {
    let dev = Device::get(0)?;
    let s = dev.stream()?;
    // SAFETY: null, the legacy default stream, which `from_raw` documents.
    let legacy = unsafe { Stream::from_raw(&dev, std::ptr::null_mut())? };
    let n = 1 << 22;
    let (v, seed) = random::<u8>(n);
    // (a) A buffer's view.
    let mut d = upload(&s, &v)?;
    let mut out = DeviceBuffer::<u8>::new(&dev, n)?;
    s.synchronize()?;
    legacy.spin(Duration::from_millis(200))?;
    // SAFETY: n bytes each; `record_stream` covers the read.
    unsafe {
        raw_copy(
            out.as_device_mut_ptr().cast(),
            d.as_device_ptr().cast(),
            n,
            legacy.as_raw(),
        )?
    };
    d.slice(..)?.record_stream(&legacy)?;
    s.memset(&mut d, 0xEE)?;
    legacy.synchronize()?;
    same(
        "legacy read before the overwrite",
        &download(&s, &out, n)?,
        &v,
        seed,
    )?;
    // (b) A DLPack consumer on it, released on another thread; the free is stream-ordered.
    let mut d = DeviceBuffer::<u8>::new_async(&s, n)?;
    s.copy_h2d(&v[..], &mut d)?.wait()?;
    let raw = Tensor::from_device(d)?.into_versioned(Some(&legacy))?;
    legacy.spin(Duration::from_millis(200))?;
    // SAFETY: n bytes each: the consumer's read.
    unsafe {
        raw_copy(
            out.as_device_mut_ptr().cast(),
            (*raw).dl_tensor.data,
            n,
            legacy.as_raw(),
        )?
    };
    let r = raw as usize;
    std::thread::spawn(move || {
        // SAFETY: released once.
        unsafe { release(r as *mut DLManagedTensorVersioned) }
    })
    .join()
    .map_err(|_| "deleter panicked")?;
    let mut junk = DeviceBuffer::<u8>::new_async(&s, n)?;
    s.memset(&mut junk, 0x5A)?;
    s.synchronize()?;
    legacy.synchronize()?;
    same(
        "legacy consumer across the release",
        &download(&s, &out, n)?,
        &v,
        seed,
    )?;
    // (c) A batch's record_stream user, depth 1.
    let seed = rand::random::<u64>();
    let mut p = Prefetcher::<f32, i64>::new(&s, source(seed, 3), config(1, 0))?;
    let mut outs = Vec::new();
    while let Some(b) = p.next() {
        let b = b?;
        let mut o = DeviceBuffer::<f32>::new(&dev, LEN)?;
        b.record_stream(&legacy)?;
        legacy.spin(Duration::from_millis(100))?;
        // SAFETY: LEN f32 each; covered by record_stream.
        unsafe {
            raw_copy(
                o.as_device_mut_ptr().cast(),
                b.pixels()?.as_device_ptr().cast(),
                LEN * 4,
                legacy.as_raw(),
            )?
        };
        outs.push(o);
    }
    legacy.synchronize()?;
    for (i, o) in outs.iter().enumerate() {
        check_batch(&download(&s, o, LEN)?, seed, i as u64)?;
    }
    Ok(())
}

/// What the foreign deleters saw.
static SAW: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// A `kDLCPU` tensor that is really `cudaHostAlloc` memory: a page-locked copy source. The
/// upload is queued behind a spin, its `InFlight` and the host view are forgotten, and the
/// import is dropped: the producer's deleter (which frees the memory) must come after the DMA.
fn imported_pinned_source_in_flight() -> R {
    let dev = Device::get(0)?;
    dev.make_current()?;
    let s = dev.stream()?;
    let n = 1 << 22;
    let (v, seed) = random::<u8>(n);
    let host = cuda_host_alloc(n)?;
    // SAFETY: n fresh bytes.
    unsafe { std::slice::from_raw_parts_mut(host.cast::<u8>(), n) }.copy_from_slice(&v);
    let watch = s.clone();
    let h = host as usize;
    let p = foreign(
        host,
        CPU,
        u8::DTYPE,
        vec![n as i64],
        None,
        0,
        Some(Box::new(move || {
            let idle = watch.is_idle();
            SAW.lock()
                .unwrap()
                .push(format!("pinned source deleter: idle {idle:?}"));
            // SAFETY: the producer's free, once.
            unsafe {
                let _ = sys::cudaFreeHost(h as *mut c_void);
            }
        })),
    );
    SAW.lock().unwrap().clear();
    let mut d = DeviceBuffer::<u8>::new(&dev, n)?;
    // SAFETY: a live tensor; ownership passes.
    let imp = unsafe { Imported::from_versioned(p)? };
    let hv = imp.host::<u8>()?;
    ensure(hv.kind() == HostKind::Pinned, || format!("{hv:?}"))?;
    s.spin(Duration::from_millis(300))?;
    let inflight = s.copy_h2d(&hv, &mut d)?;
    std::mem::forget(inflight);
    drop(hv);
    drop(imp);
    let saw = SAW.lock().unwrap().clone();
    ensure(saw == ["pinned source deleter: idle Ok(true)"], || {
        format!("deleter ran while the upload was in flight: {saw:?}")
    })?;
    same(
        "upload from the imported pinned tensor",
        &download(&s, &d, n)?,
        &v,
        seed,
    )
}

/// `host_mut` downloads into an imported CPU tensor: pageable (synchronous) and page-locked
/// (the `Pending` forgotten, the import dropped: the deleter must see the finished data); a
/// read-only host view is refused as a destination; reads through `host()` wait for writes.
fn host_mut_download() -> R {
    let dev = Device::get(0)?;
    dev.make_current()?;
    let s = dev.stream()?;
    let n = 1 << 20;
    let (v, seed) = random::<u32>(n);
    let d = upload(&s, &v)?;
    // Pageable.
    let mut store = vec![0u32; n];
    let p = foreign(
        store.as_mut_ptr().cast(),
        CPU,
        u32::DTYPE,
        vec![n as i64],
        None,
        0,
        None,
    );
    // SAFETY: `store` outlives the import; ownership passes.
    let mut imp = unsafe { Imported::from_versioned(p)? };
    {
        let mut ro = imp.host::<u32>()?;
        ensure(s.copy_d2h(&d, &mut ro).is_err(), || {
            "a read-only host view as a destination".into()
        })?;
    }
    {
        let mut h = imp.host_mut::<u32>()?;
        let pending = s.copy_d2h(&d, &mut h)?;
        std::mem::forget(pending);
    }
    same(
        "pageable download",
        imp.host::<u32>()?.as_slice()?,
        &v,
        seed,
    )?;
    drop(imp);
    // Page-locked, behind a spin, pending forgotten, import dropped.
    let host = cuda_host_alloc(n * 4)?;
    let h = host as usize;
    let want = v.clone();
    SAW.lock().unwrap().clear();
    let p = foreign(
        host,
        CPU,
        u32::DTYPE,
        vec![n as i64],
        None,
        0,
        Some(Box::new(move || {
            // SAFETY: n u32 the producer owns, read before its free.
            let got = unsafe { std::slice::from_raw_parts(h as *const u32, n) };
            let ok = got == &want[..];
            SAW.lock()
                .unwrap()
                .push(format!("data at the deleter: {ok}"));
            // SAFETY: once.
            unsafe {
                let _ = sys::cudaFreeHost(h as *mut c_void);
            }
        })),
    );
    // SAFETY: a live tensor; ownership passes.
    let mut imp = unsafe { Imported::from_versioned(p)? };
    s.spin(Duration::from_millis(300))?;
    {
        let mut hm = imp.host_mut::<u32>()?;
        ensure(hm.kind() == HostKind::Pinned, || format!("{hm:?}"))?;
        std::mem::forget(s.copy_d2h(&d, &mut hm)?);
        std::mem::forget(hm);
    }
    // A host read waits for the write.
    same(
        "pinned download read back",
        imp.host::<u32>()?.as_slice()?,
        &v,
        seed,
    )?;
    drop(imp);
    let saw = SAW.lock().unwrap().clone();
    ensure(saw == ["data at the deleter: true"], || format!("{saw:?}"))
}

/// Legacy producers: null strides, a non-zero byte offset (host and device); a misaligned
/// offset is refused.
fn legacy_strides_and_offset() -> R {
    let dev = Device::get(0)?;
    dev.make_current()?;
    let s = dev.stream()?;
    #[repr(C)]
    struct L {
        managed: DLManagedTensor,
        shape: [i64; 2],
    }
    unsafe extern "C" fn del(p: *mut DLManagedTensor) {
        // SAFETY: made below, once.
        drop(unsafe { Box::from_raw(p.cast::<L>()) });
    }
    let make = |data: *mut c_void, device: DLDevice, off: u64, shape: [i64; 2]| {
        let mut b = Box::new(L {
            managed: DLManagedTensor {
                dl_tensor: DLTensor {
                    data,
                    device,
                    ndim: 2,
                    dtype: f32::DTYPE,
                    shape: std::ptr::null_mut(),
                    strides: std::ptr::null_mut(),
                    byte_offset: off,
                },
                manager_ctx: std::ptr::null_mut(),
                deleter: Some(del),
            },
            shape,
        });
        b.managed.dl_tensor.shape = b.shape.as_mut_ptr();
        Box::into_raw(b).cast::<DLManagedTensor>()
    };
    let (v, seed) = random::<f32>(64);
    let mut host = v.clone();
    // SAFETY: `host` outlives it.
    let imp = unsafe { Imported::from_legacy(make(host.as_mut_ptr().cast(), CPU, 12, [3, 5]))? };
    ensure(imp.strides() == [5, 1] && imp.is_contiguous(), || {
        format!("{imp:?}")
    })?;
    // Compared as bytes: random bits make NaNs, which never equal themselves.
    same(
        "host offset",
        bytemuck::cast_slice::<f32, u8>(imp.host::<f32>()?.as_slice()?),
        bytemuck::cast_slice::<f32, u8>(&v[3..18]),
        seed,
    )?;
    drop(imp);
    // SAFETY: as above.
    let imp = unsafe { Imported::from_legacy(make(host.as_mut_ptr().cast(), CPU, 2, [3, 5]))? };
    ensure(imp.host::<f32>().is_err(), || {
        "misaligned host offset".into()
    })?;
    drop(imp);
    let d = upload(&s, &v)?;
    // SAFETY: `d` outlives it; nobody writes it meanwhile.
    let imp = unsafe {
        Imported::from_legacy(make(
            d.as_device_ptr().cast_mut().cast(),
            cuda(0),
            40,
            [2, 3],
        ))?
    };
    same(
        "device offset",
        bytemuck::cast_slice::<f32, u8>(&download(&s, &imp.device_view::<f32>()?, 6)?),
        bytemuck::cast_slice::<f32, u8>(&v[10..16]),
        seed,
    )?;
    drop(imp);
    // SAFETY: as above.
    let imp = unsafe {
        Imported::from_legacy(make(
            d.as_device_ptr().cast_mut().cast(),
            cuda(0),
            6,
            [2, 3],
        ))?
    };
    ensure(imp.device_view::<f32>().is_err(), || {
        "misaligned device offset".into()
    })?;
    drop(imp);
    drop(host);
    Ok(())
}

/// `kDLCUDA` claims that are false: pageable and pinned host memory, device 7, device -1.
fn device_claims_refused() -> R {
    let dev = Device::get(0)?;
    dev.make_current()?;
    let mut pageable = vec![0f32; 256];
    let pinned = cuda_host_alloc(1024)?;
    let devmem = cuda_malloc(1024)?;
    let cases: [(&str, *mut c_void, i32); 4] = [
        ("pageable host memory", pageable.as_mut_ptr().cast(), 0),
        ("pinned host memory", pinned, 0),
        ("device 7", devmem, 7),
        ("device -1", devmem, -1),
    ];
    let mut accepted = Vec::new();
    for (what, ptr, id) in cases {
        let p = foreign(ptr, cuda(id), f32::DTYPE, vec![256], None, 0, None);
        // SAFETY: the memory outlives the import; ownership passes.
        let mut imp = unsafe { Imported::from_versioned(p)? };
        if imp.device_view::<f32>().is_ok() {
            accepted.push(format!("{what} (view)"));
        }
        if imp.device_mut::<f32>().is_ok() {
            accepted.push(format!("{what} (mut)"));
        }
    }
    // SAFETY: once, after the imports.
    unsafe {
        let _ = sys::cudaFreeHost(pinned);
        let _ = sys::cudaFree(devmem);
    }
    drop(pageable);
    ensure(accepted.is_empty(), || format!("accepted: {accepted:?}"))
}

/// `mem::forget` of views and in-flight guards over a `ForeignBuffer`: its drop still waits
/// for the queued upload; `release_to` orders the owner's later read after it.
fn forget_games() -> R {
    let dev = Device::get(0)?;
    dev.make_current()?;
    let s = dev.stream()?;
    let owner = dev.stream()?;
    let n = 1 << 22;
    let (v, seed) = random::<u8>(n);
    let src = PinnedBuffer::from_slice(&dev, &v, HostAlloc::DEFAULT)?;
    let mem = cuda_malloc(n)?;
    {
        // SAFETY: n bytes of `mem`, freed only after this value is dropped.
        let mut fb = unsafe { ForeignBuffer::from_raw(&dev, mem.cast::<u8>(), n)? };
        s.spin(Duration::from_millis(300))?;
        {
            let mut view = fb.slice_mut(..)?;
            let inflight = s.copy_h2d(&src, &mut view)?;
            std::mem::forget(inflight);
            std::mem::forget(view);
        }
        drop(fb);
    }
    // A state check, not a clock: the drop waited for the upload queued behind the spin.
    ensure(s.is_idle()?, || {
        "upload still running after the drop".into()
    })?;
    // release_to: the owner's read comes after the forgotten upload.
    let out = cuda_malloc(n)?;
    let zeros = vec![0u8; n];
    let src2 = PinnedBuffer::from_slice(&dev, &zeros, HostAlloc::DEFAULT)?;
    {
        // SAFETY: as above, until the owner stream has passed the release point.
        let mut fb = unsafe { ForeignBuffer::from_raw(&dev, mem.cast::<u8>(), n)? };
        s.copy_h2d(&src2, &mut fb)?.wait()?;
        s.spin(Duration::from_millis(300))?;
        std::mem::forget(s.copy_h2d(&src, &mut fb)?);
        fb.release_to(&owner)?;
    }
    // SAFETY: n bytes each; ordered after pinstream's upload by `release_to`.
    unsafe { raw_copy(out, mem, n, owner.as_raw())? };
    owner.synchronize()?;
    let mut got = vec![0u8; n];
    // SAFETY: n bytes; `owner` is idle.
    let err = unsafe {
        sys::cudaMemcpyAsync(
            got.as_mut_ptr().cast(),
            out,
            n,
            sys::cudaMemcpyKind::cudaMemcpyDeviceToHost,
            owner.as_raw(),
        )
    };
    ensure(err == sys::cudaError::cudaSuccess, || format!("{err:?}"))?;
    owner.synchronize()?;
    s.synchronize()?;
    // SAFETY: every use is over.
    unsafe {
        let _ = sys::cudaFree(mem);
        let _ = sys::cudaFree(out);
    }
    same("owner's read after release_to", &got, &v, seed)
}

/// A pinned buffer whose download is still in flight (the `Pending` forgotten) is exported:
/// the handover waits for it, so the host consumer reads the finished data.
fn pinned_export_dma_in_flight() -> R {
    let dev = Device::get(0)?;
    let s = dev.stream()?;
    let n = 1 << 22;
    let (v, seed) = random::<u8>(n);
    let d = upload(&s, &v)?;
    let mut pb = PinnedBuffer::<u8>::new(&dev, n, HostAlloc::DEFAULT)?;
    s.spin(Duration::from_millis(300))?;
    std::mem::forget(s.copy_d2h(&d, &mut pb)?);
    let raw = Tensor::from_pinned(pb)?.into_versioned(None)?;
    // SAFETY: handed over; we read it on the host, as a CPU consumer would, then release.
    let got = unsafe { std::slice::from_raw_parts((*raw).dl_tensor.data.cast::<u8>(), n).to_vec() };
    // SAFETY: once.
    unsafe { release(raw) };
    same("host consumer of an exported pinned buffer", &got, &v, seed)
}

/// Pixels and extras of one batch released at the same instant from two threads, many times,
/// depth 1 with one spare.
fn pixels_extras_at_once() -> R {
    let dev = Device::get(0)?;
    let s = dev.stream()?;
    let seed = rand::random::<u64>();
    let end = 40u64;
    let mut p = Prefetcher::<f32, i64>::new(&s, source(seed, end), config(1, 1))?;
    let mut i = 0;
    while let Some(b) = p.next() {
        let b = b?;
        ensure(b.index() == i, || format!("index {}", b.index()))?;
        let (px, ex) = b.into_dlpack()?;
        let c1 = dev.stream()?;
        let c2 = dev.stream()?;
        let a = px.into_versioned(Some(&c1))? as usize;
        let e = ex.into_versioned(Some(&c2))? as usize;
        let bar = Arc::new(Barrier::new(2));
        let hs: Vec<_> = [a, e]
            .into_iter()
            .map(|r| {
                let bar = bar.clone();
                std::thread::spawn(move || {
                    bar.wait();
                    // SAFETY: released once.
                    unsafe { release(r as *mut DLManagedTensorVersioned) }
                })
            })
            .collect();
        for h in hs {
            h.join().map_err(|_| "deleter panicked")?;
        }
        i += 1;
    }
    ensure(i == end, || format!("{i} of {end}"))
}

/// The pinned twin of the race above, on the host, where it is Rust-level undefined
/// behaviour: `PinnedBuffer::as_slice` promises that no copy into the buffer can start while
/// the `&[T]` lives ("that needs `&mut self`"). A shared (`Arc`) pinned buffer is exported,
/// imported back (its contract only forbids *others'* writes) and written through
/// `Imported::host_mut` while a `&[u8]` from the `Arc` is alive: the slice changes under its
/// borrow. A real DLPack consumer (an in-place op in PyTorch) does the same with no unsafe
/// code on the Rust side at all.
fn imported_write_mutates_shared_slice() -> R {
    let dev = Device::get(0)?;
    let s = dev.stream()?;
    let n = 1 << 16;
    let (v, _) = random::<u8>(n);
    let _d = upload(&s, &vec![0x77u8; n])?;
    let pb = Arc::new(PinnedBuffer::from_slice(&dev, &v, HostAlloc::DEFAULT)?);
    let raw = Tensor::from_pinned(pb.clone())?.into_versioned(None)?;
    // SAFETY: handed over just above; nobody else writes it.
    let mut imp = unsafe { Imported::from_versioned(raw)? };
    let live: &[u8] = pb.as_slice()?;
    let before = live[..16].to_vec();
    // Fixed: a shared pinned export is read-only, so `host_mut` is refused.
    ensure(imp.host_mut::<u8>().is_err(), || {
        "a shared pinned export is writable".into()
    })?;
    let after = std::hint::black_box(live)[..16].to_vec();
    drop(imp);
    ensure(before == after, || {
        format!(
            "a live &[u8] from Arc<PinnedBuffer>::as_slice changed under its borrow: {:?} -> {:?}",
            &before[..4],
            &after[..4]
        )
    })
}

/// A short epoch collected whole (every batch exported and held to the end, as for a small
/// validation set): `next()` should say the epoch is over (`None`), but the all-held check runs
/// before the feeder's `End` is read, so the end of a good epoch comes out as an error.
fn all_held_hides_end() -> R {
    let dev = Device::get(0)?;
    let s = dev.stream()?;
    let seed = rand::random::<u64>();
    let mut p = Prefetcher::<f32, i64>::new(&s, source(seed, 3), config(2, 1))?;
    let mut held = Vec::new();
    for _ in 0..3 {
        let b = p.next().ok_or("ended early")??;
        held.push(b.into_dlpack()?);
    }
    // Let the feeder see the end of the source.
    std::thread::sleep(Duration::from_millis(200));
    let r = p.next().map(|r| r.map(|b| b.index()));
    drop(held);
    // After the releases: is it over, or does the epoch go on?
    let again = p.next().map(|r| r.map(|b| b.index()));
    ensure(r.is_none(), || {
        format!("next() after the last batch, all held: {r:?} (after the releases: {again:?})")
    })
}

/// `record_stream` on a view of an `Imported` and on a `ForeignBuffer`: the drop (and so the
/// producer's deleter, or the owner's free) waits for the foreign stream's read.
fn record_stream_delays_release() -> R {
    let dev = Device::get(0)?;
    dev.make_current()?;
    let f = dev.stream()?;
    let n = 1 << 20;
    let mem = cuda_malloc(n)?;
    let out = cuda_malloc(n)?;
    let watch = f.clone();
    SAW.lock().unwrap().clear();
    let p = foreign(
        mem,
        cuda(0),
        u8::DTYPE,
        vec![n as i64],
        None,
        0,
        Some(Box::new(move || {
            let idle = watch.is_idle();
            SAW.lock().unwrap().push(format!("idle {idle:?}"));
        })),
    );
    // SAFETY: `mem` outlives it; ownership passes.
    let imp = unsafe { Imported::from_versioned(p)? };
    f.spin(Duration::from_millis(300))?;
    // SAFETY: n bytes each: the foreign read.
    unsafe { raw_copy(out, mem, n, f.as_raw())? };
    imp.device_view::<u8>()?.record_stream(&f)?;
    drop(imp);
    let saw = SAW.lock().unwrap().clone();
    ensure(saw == ["idle Ok(true)"], || {
        format!("Imported's deleter ran while a recorded stream still read it: {saw:?}")
    })?;
    // ForeignBuffer: its drop waits for the recorded read.
    // SAFETY: `mem` is freed below, after the drop.
    let fb = unsafe { ForeignBuffer::from_raw(&dev, mem.cast::<u8>(), n)? };
    f.spin(Duration::from_millis(300))?;
    // SAFETY: as above.
    unsafe { raw_copy(out, mem, n, f.as_raw())? };
    fb.record_stream(&f)?;
    drop(fb);
    ensure(f.is_idle()?, || {
        "ForeignBuffer dropped before the recorded read".into()
    })?;
    // SAFETY: every use is over.
    unsafe {
        let _ = sys::cudaFree(mem);
        let _ = sys::cudaFree(out);
    }
    Ok(())
}

/// A batch without extras: an empty extras tensor (null data, shape [0]) shares the slot's
/// lease with the pixels; released in either order.
fn batch_without_extras() -> R {
    let dev = Device::get(0)?;
    let s = dev.stream()?;
    let seed = rand::random::<u64>();
    let src = Source::new(move |i, b: &mut HostBatch<i64>| {
        if i >= 6 {
            return Ok(false);
        }
        b.spec = Spec::uniform(N, 3, HW, HW, Normalize::imagenet())?;
        let px = b.pageable();
        px.clear();
        px.extend(batch_bytes(seed, i));
        b.extras.clear();
        Ok(true)
    });
    let mut p = Prefetcher::<f32, i64>::new(&s, src, config(1, 1))?;
    let mut i = 0u64;
    while let Some(b) = p.next() {
        let (px, ex) = b?.into_dlpack()?;
        ensure(ex.shape() == [0], || format!("extras {:?}", ex.shape()))?;
        let ex = ex.into_versioned(Some(&s))?;
        // SAFETY: handed over just above.
        ensure(unsafe { (*ex).dl_tensor.data.is_null() }, || {
            "data of nothing".into()
        })?;
        // SAFETY: handed over just above.
        let imp = unsafe { Imported::from_versioned(px.into_versioned(Some(&s))?)? };
        check_batch(&download(&s, &imp.device_view::<f32>()?, LEN)?, seed, i)?;
        if i % 2 == 0 {
            drop(imp);
            // SAFETY: once.
            unsafe { release(ex) };
        } else {
            // SAFETY: once.
            unsafe { release(ex) };
            drop(imp);
        }
        i += 1;
    }
    ensure(i == 6, || format!("{i} of 6"))
}

// ---------------------------------------------------------------------------------------
// Imports of host memory (no GPU): producers that lie, views of odd types, read-only flags.

/// A foreign host tensor whose deleter counts its calls in `deleted`.
fn counted(
    data: *mut c_void,
    dtype: DLDataType,
    shape: Vec<i64>,
    strides: Option<Vec<i64>>,
    byte_offset: u64,
    deleted: &Arc<AtomicUsize>,
) -> *mut DLManagedTensorVersioned {
    let d = deleted.clone();
    foreign(
        data,
        CPU,
        dtype,
        shape,
        strides,
        byte_offset,
        Some(Box::new(move || {
            d.fetch_add(1, Ordering::SeqCst);
        })),
    )
}

fn dt(code: u8, bits: u8, lanes: u16) -> DLDataType {
    DLDataType { code, bits, lanes }
}

/// FINDING (hardening): a byte offset that wraps the first element's address around the
/// address space (here to null, from a non-null `data`) was accepted: the null check looked
/// at `data`, not at `data + byte_offset`, and `host_bytes().into_slice()` then made a slice
/// at address 0 (undefined behaviour; a debug build aborts on it). Refused at the import now,
/// with the deleter called, as the other malformed tensors are.
fn byte_offset_wraps() -> R {
    let deleted = Arc::new(AtomicUsize::new(0));
    let u8t = dt(1, 8, 1);
    let base = 0x1000usize as *mut c_void;
    let cases: [(&str, u64, Vec<i64>); 3] = [
        ("to null", (u64::MAX - 0xFFF), vec![8]),
        ("past the end", u64::MAX - 0x1000 - 3, vec![8]),
        ("offset u64::MAX", u64::MAX, vec![1]),
    ];
    let mut accepted = Vec::new();
    for (what, off, shape) in cases {
        let before = deleted.load(Ordering::SeqCst);
        let p = counted(base, u8t, shape, None, off, &deleted);
        // SAFETY: ownership passes; the tensor lies about its memory, which is what the import
        // must refuse before any view exists (nothing here reads the data).
        match unsafe { Imported::from_versioned(p) } {
            Err(Error::InvalidArgument { .. }) => {}
            Err(e) => accepted.push(format!("{what}: {e}")),
            Ok(imp) => {
                accepted.push(format!("{what}: accepted, data {:p}", imp.data_ptr()));
                // Not viewed: a view would be the undefined behaviour described above.
                drop(imp);
            }
        }
        ensure(deleted.load(Ordering::SeqCst) == before + 1, || {
            format!("{what}: deleter not called once")
        })?;
    }
    // An empty tensor may point anywhere.
    let p = counted(base, u8t, vec![0, 5], None, u64::MAX, &deleted);
    // SAFETY: as above; empty, so there is nothing to read.
    let imp = unsafe { Imported::from_versioned(p)? };
    ensure(imp.host_bytes()?.into_slice()?.is_empty(), || {
        "empty".into()
    })?;
    drop(imp);
    ensure(accepted.is_empty(), || format!("{accepted:?}"))
}

/// Malformed tensors — negative or huge ndim, a null shape, negative or overflowing sizes, a
/// type of no whole bytes or no lanes, null data for a non-empty tensor, more bytes than
/// `isize::MAX`, another major version — are refused (`InvalidArgument`) and given back: the
/// deleter runs exactly once, for versioned and legacy tensors alike.
fn imported_lies_refused() -> R {
    let deleted = Arc::new(AtomicUsize::new(0));
    let mut host = vec![0u8; 64];
    let data: *mut c_void = host.as_mut_ptr().cast();
    let u8t = dt(1, 8, 1);
    let f32t = f32::DTYPE;
    type Poke = fn(&mut DLManagedTensorVersioned);
    /// What, data, dtype, shape, and a change to the header.
    type Case = (
        &'static str,
        *mut c_void,
        DLDataType,
        Vec<i64>,
        Option<Poke>,
    );
    let cases: Vec<Case> = vec![
        (
            "ndim -1",
            data,
            u8t,
            vec![4],
            Some(|m| m.dl_tensor.ndim = -1),
        ),
        (
            "ndim i32::MIN",
            data,
            u8t,
            vec![4],
            Some(|m| m.dl_tensor.ndim = i32::MIN),
        ),
        (
            "ndim 65",
            data,
            u8t,
            vec![4],
            Some(|m| m.dl_tensor.ndim = 65),
        ),
        (
            "null shape",
            data,
            u8t,
            vec![4],
            Some(|m| m.dl_tensor.shape = std::ptr::null_mut()),
        ),
        ("negative size", data, u8t, vec![4, -1], None),
        ("i64::MIN size", data, u8t, vec![i64::MIN], None),
        ("negative size beside zero", data, u8t, vec![0, -3], None),
        (
            "sizes overflow",
            data,
            u8t,
            vec![i64::MAX, i64::MAX, 4],
            None,
        ),
        (
            "bytes past isize::MAX",
            data,
            f32t,
            vec![i64::MAX / 2],
            None,
        ),
        ("nibbles", data, dt(1, 4, 1), vec![4], None),
        ("three nibbles", data, dt(1, 4, 3), vec![4], None),
        ("zero lanes", data, dt(1, 8, 0), vec![4], None),
        ("null data", std::ptr::null_mut(), u8t, vec![4], None),
        ("major 0", data, u8t, vec![4], Some(|m| m.version.major = 0)),
        ("major 2", data, u8t, vec![4], Some(|m| m.version.major = 2)),
        (
            "major u32::MAX",
            data,
            u8t,
            vec![4],
            Some(|m| m.version.major = u32::MAX),
        ),
    ];
    let mut accepted = Vec::new();
    for (what, data, dtype, shape, poke) in cases {
        let before = deleted.load(Ordering::SeqCst);
        let p = counted(data, dtype, shape, None, 0, &deleted);
        if let Some(poke) = poke {
            // SAFETY: `p` is the live box `counted` made; only its header fields change.
            poke(unsafe { &mut *p });
        }
        // SAFETY: ownership passes; `host` outlives the import.
        match unsafe { Imported::from_versioned(p) } {
            Err(Error::InvalidArgument { .. }) => {}
            other => accepted.push(format!("{what}: {:?}", other.map(|i| format!("{i:?}")))),
        }
        ensure(deleted.load(Ordering::SeqCst) == before + 1, || {
            format!(
                "{what}: the deleter ran {} times",
                deleted.load(Ordering::SeqCst) - before
            )
        })?;
    }
    // A null tensor: refused, nothing to delete.
    // SAFETY: null is refused before it is read.
    let r = unsafe { Imported::from_versioned(std::ptr::null_mut()) };
    ensure(r.is_err(), || "a null tensor".into())?;
    // SAFETY: as above.
    let r = unsafe { Imported::from_legacy(std::ptr::null_mut()) };
    ensure(r.is_err(), || "a null legacy tensor".into())?;
    // A tensor without a deleter (a producer that frees it itself): refused without a call.
    let p = counted(data, u8t, vec![-1], None, 0, &deleted);
    // SAFETY: `p` is live; the deleter is taken out (and run here, once, to free the box).
    let d = unsafe { (*p).deleter.take() };
    // SAFETY: ownership passes; the import refuses it and has no deleter to call.
    let r = unsafe { Imported::from_versioned(p) };
    ensure(r.is_err(), || "no deleter, negative size".into())?;
    if let Some(d) = d {
        // SAFETY: `p` was never deleted: free it once now.
        unsafe { d(p) };
    }
    drop(host);
    ensure(accepted.is_empty(), || format!("accepted: {accepted:?}"))
}

/// Byte views of types with no `Element`: 3-byte lanes, 1-bit lanes filling a byte, 255-byte
/// elements; size-1 dimensions with any stride are compact; a type of zero bits imports (it is
/// a DLPack type) but has no byte view; device views of host memory are refused.
fn imported_byte_views() -> R {
    let deleted = Arc::new(AtomicUsize::new(0));
    let (v, seed) = random::<u8>(4096);
    let mut host = v.clone();
    let data: *mut c_void = host.as_mut_ptr().cast();
    /// What, dtype, shape, strides, byte offset, bytes.
    type Case = (
        &'static str,
        DLDataType,
        Vec<i64>,
        Option<Vec<i64>>,
        u64,
        usize,
    );
    let cases: [Case; 5] = [
        ("3-byte lanes", dt(1, 8, 3), vec![4, 5], None, 1, 60),
        ("bit lanes", dt(6, 1, 8), vec![7], None, 3, 7),
        (
            "255-byte elements",
            dt(1, 255, 8),
            vec![2, 3],
            None,
            100,
            1530,
        ),
        (
            "size-1 dims, odd strides",
            dt(2, 32, 1),
            vec![1, 8, 1],
            Some(vec![-77, 1, 12345]),
            16,
            32,
        ),
        (
            "empty, odd strides",
            dt(2, 32, 1),
            vec![3, 0, 2],
            Some(vec![-1, 99, 7]),
            0,
            0,
        ),
    ];
    for (what, dtype, shape, strides, off, bytes) in cases {
        let p = counted(data, dtype, shape, strides, off, &deleted);
        // SAFETY: `host` outlives the import and nobody writes it meanwhile.
        let imp = unsafe { Imported::from_versioned(p)? };
        ensure(imp.byte_len()? == bytes, || format!("{what}: {imp:?}"))?;
        let got = imp.host_bytes()?.into_slice()?;
        let o = off as usize;
        same(what, got, &v[o..o + bytes], seed)?;
        let d = imp.device_bytes();
        ensure(matches!(d, Err(Error::InvalidArgument { .. })), || {
            format!("{what}: device view of host memory: {:?}", d.map(|_| ()))
        })?;
    }
    // Zero bits: a DLPack type, but no bytes to view.
    let p = counted(data, dt(1, 0, 1), vec![1 << 40], None, 0, &deleted);
    // SAFETY: as above (no view of it is made).
    let imp = unsafe { Imported::from_versioned(p)? };
    ensure(
        imp.byte_len().is_err() && imp.host_bytes().is_err() && imp.host::<u8>().is_err(),
        || "a zero-bit type has a byte view".into(),
    )?;
    drop(imp);
    // Not compact: refused.
    let p = counted(data, dt(1, 8, 1), vec![4, 4], Some(vec![1, 4]), 0, &deleted);
    // SAFETY: as above.
    let imp = unsafe { Imported::from_versioned(p)? };
    ensure(imp.host_bytes().is_err(), || {
        "a transposed byte view".into()
    })?;
    drop(imp);
    // Empty with a null data pointer.
    let p = counted(
        std::ptr::null_mut(),
        dt(2, 32, 1),
        vec![0],
        None,
        0,
        &deleted,
    );
    // SAFETY: empty: nothing is read.
    let imp = unsafe { Imported::from_versioned(p)? };
    ensure(imp.host_bytes()?.into_slice()?.is_empty(), || {
        "empty".into()
    })?;
    drop(imp);
    ensure(deleted.load(Ordering::SeqCst) == 8, || {
        format!(
            "{} deleter calls for 8 imports",
            deleted.load(Ordering::SeqCst)
        )
    })?;
    drop(host);
    Ok(())
}

/// A read-only tensor gives read views (and slices that outlive the view), never a writable
/// one; a writable view (`host_mut`) cannot become a slice that outlives it.
fn imported_read_only_views() -> R {
    let deleted = Arc::new(AtomicUsize::new(0));
    let (v, seed) = random::<u8>(256);
    let mut host = v.clone();
    let p = counted(
        host.as_mut_ptr().cast(),
        dt(1, 8, 1),
        vec![256],
        None,
        0,
        &deleted,
    );
    // SAFETY: `p` is live; only the flags change.
    unsafe { (*p).flags |= pinstream::dlpack::abi::FLAG_READ_ONLY };
    // SAFETY: `host` outlives the import and nobody writes it meanwhile.
    let mut imp = unsafe { Imported::from_versioned(p)? };
    ensure(imp.is_read_only(), || "flag lost".into())?;
    let slice = imp.host_bytes()?.into_slice()?;
    same("read-only bytes", slice, &v, seed)?;
    let refusals = [
        imp.host_mut::<u8>().map(|_| ()),
        imp.device_bytes_mut().map(|_| ()),
        imp.device_mut::<u8>().map(|_| ()),
    ];
    ensure(
        refusals
            .iter()
            .all(|r| matches!(r, Err(Error::InvalidArgument { .. }))),
        || format!("{refusals:?}"),
    )?;
    drop(imp);
    // Writable: `host_mut` is a copy destination, not a slice to keep.
    let p = counted(
        host.as_mut_ptr().cast(),
        dt(1, 8, 1),
        vec![256],
        None,
        0,
        &deleted,
    );
    // SAFETY: as above.
    let mut imp = unsafe { Imported::from_versioned(p)? };
    let r = imp.host_mut::<u8>()?.into_slice().map(|s| s.len());
    ensure(matches!(r, Err(Error::InvalidArgument { .. })), || {
        format!("writable view into a slice: {r:?}")
    })?;
    same("writable bytes", imp.host_bytes()?.into_slice()?, &v, seed)?;
    drop(imp);
    ensure(deleted.load(Ordering::SeqCst) == 2, || {
        "deleter calls".into()
    })?;
    drop(host);
    Ok(())
}
