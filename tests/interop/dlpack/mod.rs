//! DLPack and foreign memory (issue 20): export → import round trips of every dtype and
//! layout, deleters from other threads, the consumer's stream ordering both ways, prefetched
//! batches handed over (the slot comes back only at the release; a consumer that never
//! releases gets an error, not a hang), `record_stream` against a racing refill, and
//! `ForeignBuffer` over memory pinstream did not allocate. CPU trials run everywhere (imports
//! of host tensors); GPU trials are ignored without a GPU.

use std::ffi::c_void;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::{ensure, random_bytes, same, within, R};
use libtest_mimic::{Failed, Trial};
use pinstream::dlpack::abi::{
    DLDataType, DLDevice, DLManagedTensor, DLManagedTensorVersioned, DLPackVersion, DLTensor,
    FLAG_READ_ONLY, KDL_CPU, KDL_CUDA, KDL_CUDA_HOST,
};
use pinstream::dlpack::{Element, Imported, Part, Tensor};
use pinstream::kernels::{cpu, Normalize, Spec};
use pinstream::prefetch::{HostBatch, PrefetchConfig, Prefetcher, Source};
use pinstream::{
    bf16, f16, sys, Device, DeviceBuffer, Error, ForeignBuffer, HostAlloc, PinnedBuffer, Pod,
    Stream,
};

use crate::common::trial;

/// Prefix of this module's trial names (its path in the binary).
const PREFIX: &str = "dlpack/";

pub mod hostile;
pub mod hostile30;

/// A child process of one of these trials (this executable again, with the variable set): runs
/// its part and returns true, or exits; false in the test runner.
pub fn child_mode() -> bool {
    if let Ok(which) = std::env::var(CHILD) {
        let r = match which.as_str() {
            "host_release" => child_host_release(),
            other => Err(format!("unknown child {other}").into()),
        };
        match r {
            Ok(()) => println!("CHILD-OK"),
            Err(e) => println!("CHILD-FAILED: {e:?}"),
        }
        return true;
    }
    false
}

/// The trials of this module, named `dlpack/...`.
pub fn trials() -> Vec<Trial> {
    let no_gpu = !pinstream::available();
    let cpu_trials = vec![
        trial(PREFIX, "host/import_cpu_tensor", import_cpu_tensor),
        trial(
            PREFIX,
            "host/import_refusals_call_the_deleter",
            import_refusals,
        ),
        trial(PREFIX, "host/legacy_import", legacy_import),
        trial(PREFIX, "host/empty_tensor_any_strides", empty_any_strides),
    ];
    let gpu = vec![
        trial(PREFIX, "gpu/roundtrip/f32", roundtrip::<f32>),
        trial(PREFIX, "gpu/roundtrip/f16", roundtrip::<f16>),
        trial(PREFIX, "gpu/roundtrip/bf16", roundtrip::<bf16>),
        trial(PREFIX, "gpu/roundtrip/u8", roundtrip::<u8>),
        trial(PREFIX, "gpu/roundtrip/i8", roundtrip::<i8>),
        trial(PREFIX, "gpu/roundtrip/i32", roundtrip::<i32>),
        trial(PREFIX, "gpu/roundtrip/i64", roundtrip::<i64>),
        trial(
            PREFIX,
            "gpu/pinned_host_export_is_an_upload_source",
            pinned_export,
        ),
        trial(
            PREFIX,
            "gpu/pool_block_export_download_and_return",
            pool_block_export,
        ),
        trial(PREFIX, "gpu/packed_tensors_share_the_arena", packed_export),
        trial(PREFIX, "gpu/split/disjoint_writable_parts", split_parts),
        trial(PREFIX, "gpu/split/refusals", split_refusals),
        trial(
            PREFIX,
            "gpu/consumer_waits_on_the_gpu",
            consumer_waits_on_gpu,
        ),
        trial(
            PREFIX,
            "gpu/deleter_on_another_thread_orders_the_free",
            deleter_other_thread,
        ),
        trial(
            PREFIX,
            "gpu/no_stream_release_is_deferred",
            no_stream_release_is_deferred,
        ),
        trial(
            PREFIX,
            "gpu/lent_stream_destroyed_before_release",
            lent_stream_destroyed_before_release,
        ),
        trial(
            PREFIX,
            "gpu/host_release_touches_only_used_devices",
            host_release_touches_only_used_devices,
        ),
        trial(PREFIX, "gpu/destination_checks", destination_checks),
        trial(
            PREFIX,
            "gpu/batch/slot_held_until_release",
            batch_held_until_release,
        ),
        trial(
            PREFIX,
            "gpu/batch/never_released_is_an_error",
            batch_never_released,
        ),
        trial(
            PREFIX,
            "gpu/batch/deferred_release_is_waited_for",
            batch_deferred_release_is_waited_for,
        ),
        trial(
            PREFIX,
            "gpu/batch/record_stream_beats_the_refill",
            batch_record_stream,
        ),
        trial(PREFIX, "gpu/foreign/buffer_from_raw", foreign_from_raw),
        trial(PREFIX, "gpu/foreign/view_record_stream", view_record_stream),
    ]
    .into_iter()
    .map(|t| t.with_ignored_flag(no_gpu));
    cpu_trials.into_iter().chain(gpu).collect()
}

fn random<T: Pod>(n: usize) -> (Vec<T>, u64) {
    let (bytes, seed) = random_bytes(n * std::mem::size_of::<T>());
    (bytemuck::pod_collect_to_vec(&bytes), seed)
}

fn as_bytes<T: Pod>(v: &[T]) -> &[u8] {
    bytemuck::cast_slice(v)
}

// ---------------------------------------------------------------------------------------
// A producer written the way another library would: a C struct and a counting deleter.

static DELETED: AtomicUsize = AtomicUsize::new(0);

#[repr(C)]
struct Foreign {
    managed: DLManagedTensorVersioned,
    shape: Vec<i64>,
    strides: Option<Vec<i64>>,
    data: Vec<u8>,
    counter: Arc<AtomicUsize>,
}

unsafe extern "C" fn foreign_deleter(p: *mut DLManagedTensorVersioned) {
    // SAFETY: made by `foreign` below; called once.
    let b = unsafe { Box::from_raw(p.cast::<Foreign>()) };
    b.counter.fetch_add(1, Ordering::SeqCst);
    DELETED.fetch_add(1, Ordering::SeqCst);
}

fn foreign(
    data: Vec<u8>,
    dtype: DLDataType,
    shape: Vec<i64>,
    strides: Option<Vec<i64>>,
    flags: u64,
    major: u32,
) -> (*mut DLManagedTensorVersioned, Arc<AtomicUsize>) {
    let counter = Arc::new(AtomicUsize::new(0));
    let mut b = Box::new(Foreign {
        managed: DLManagedTensorVersioned {
            version: DLPackVersion { major, minor: 0 },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(foreign_deleter),
            flags,
            dl_tensor: DLTensor {
                data: std::ptr::null_mut(),
                device: DLDevice {
                    device_type: KDL_CPU,
                    device_id: 0,
                },
                ndim: shape.len() as i32,
                dtype,
                shape: std::ptr::null_mut(),
                strides: std::ptr::null_mut(),
                byte_offset: 0,
            },
        },
        shape,
        strides,
        data,
        counter: counter.clone(),
    });
    b.managed.dl_tensor.data = b.data.as_mut_ptr().cast();
    b.managed.dl_tensor.shape = b.shape.as_mut_ptr();
    if let Some(s) = b.strides.as_mut() {
        b.managed.dl_tensor.strides = s.as_mut_ptr();
    }
    (Box::into_raw(b).cast(), counter)
}

/// A tensor with no elements is compact whatever its strides (numpy gives `[0]` strides
/// `[0]`): an empty source, not an error.
fn empty_any_strides() -> R {
    let f32t = DLDataType {
        code: 2,
        bits: 32,
        lanes: 1,
    };
    let (raw, _) = foreign(Vec::new(), f32t, vec![0], Some(vec![0]), 0, 1);
    // SAFETY: made just above; ownership passes.
    let imp = unsafe { Imported::from_versioned(raw)? };
    ensure(imp.is_contiguous(), || format!("{imp:?}"))?;
    ensure(imp.host_bytes()?.into_slice()?.is_empty(), || {
        "bytes of nothing".into()
    })?;
    let (raw, _) = foreign(Vec::new(), f32t, vec![3, 0, 2], Some(vec![7, 9, 11]), 0, 1);
    // SAFETY: as above.
    let imp = unsafe { Imported::from_versioned(raw)? };
    ensure(imp.is_contiguous() && imp.byte_len()? == 0, || {
        format!("{imp:?}")
    })
}

/// A CPU tensor is a host source: its bytes, its shape, one deleter call on drop.
fn import_cpu_tensor() -> R {
    let (v, seed) = random::<f32>(6 * 7);
    let (p, deleted) = foreign(as_bytes(&v).to_vec(), f32::DTYPE, vec![6, 7], None, 0, 1);
    // SAFETY: a live tensor made above; ownership passes.
    let t = unsafe { Imported::from_versioned(p)? };
    ensure(
        t.shape() == [6, 7] && t.strides() == [7, 1] && t.len() == 42,
        || format!("metadata {t:?}"),
    )?;
    ensure(t.is_contiguous() && !t.is_read_only(), || format!("{t:?}"))?;
    let h = t.host::<f32>()?;
    same("host view", as_bytes(h.as_slice()?), as_bytes(&v), seed)?;
    // Wrong type: a typed error that names both.
    let e = t.host::<i32>().unwrap_err();
    ensure(e.to_string().contains("f32"), || format!("{e}"))?;
    ensure(deleted.load(Ordering::SeqCst) == 0, || {
        "deleted early".into()
    })?;
    drop(t);
    ensure(deleted.load(Ordering::SeqCst) == 1, || {
        "the deleter was not called exactly once".into()
    })
}

/// Every malformed tensor is refused with a typed error, and its deleter is called (the
/// tensor is given back, not leaked); views refuse what does not fit.
fn import_refusals() -> R {
    let d = f32::DTYPE;
    type Case = (&'static str, Vec<i64>, Option<Vec<i64>>, u32, DLDataType);
    let cases: Vec<Case> = vec![
        ("major version 2", vec![4], None, 2, d),
        ("negative size", vec![-1, 4], None, 1, d),
        ("overflowing shape", vec![i64::MAX, i64::MAX], None, 1, d),
        (
            "zero lanes",
            vec![4],
            None,
            1,
            DLDataType {
                code: 2,
                bits: 32,
                lanes: 0,
            },
        ),
    ];
    for (what, shape, strides, major, dtype) in cases {
        let (p, deleted) = foreign(vec![1u8; 16], dtype, shape, strides, 0, major);
        // SAFETY: a live tensor; ownership passes.
        let r = unsafe { Imported::from_versioned(p) };
        ensure(matches!(r, Err(Error::InvalidArgument { .. })), || {
            format!("{what}: {r:?}")
        })?;
        ensure(deleted.load(Ordering::SeqCst) == 1, || {
            format!("{what}: deleter calls {}", deleted.load(Ordering::SeqCst))
        })?;
    }
    // A transposed (non-contiguous) tensor imports, but its views are refused.
    let (p, _) = foreign(vec![3u8; 24], d, vec![2, 3], Some(vec![1, 2]), 0, 1);
    // SAFETY: as above.
    let t = unsafe { Imported::from_versioned(p)? };
    ensure(!t.is_contiguous(), || {
        "transposed reads as contiguous".into()
    })?;
    ensure(t.host::<f32>().is_err(), || "a strided host view".into())?;
    // Read-only: a source, never a destination.
    let (p, _) = foreign(vec![3u8; 16], d, vec![4], None, FLAG_READ_ONLY, 1);
    // SAFETY: as above.
    let mut t = unsafe { Imported::from_versioned(p)? };
    ensure(t.host::<f32>().is_ok(), || {
        "read-only source refused".into()
    })?;
    ensure(t.host_mut::<f32>().is_err(), || {
        "read-only destination".into()
    })?;
    // A null pointer is refused without a call.
    // SAFETY: null is checked first.
    let r = unsafe { Imported::from_versioned(std::ptr::null_mut()) };
    ensure(r.is_err(), || "null accepted".into())
}

#[repr(C)]
struct LegacyForeign {
    managed: DLManagedTensor,
    shape: [i64; 1],
    data: Vec<i32>,
}

unsafe extern "C" fn legacy_deleter(p: *mut DLManagedTensor) {
    // SAFETY: made by `legacy_import`; called once.
    drop(unsafe { Box::from_raw(p.cast::<LegacyForeign>()) });
    DELETED.fetch_add(1000, Ordering::SeqCst);
}

fn legacy_import() -> R {
    let (v, seed) = random::<i32>(10);
    let mut b = Box::new(LegacyForeign {
        managed: DLManagedTensor {
            dl_tensor: DLTensor {
                data: std::ptr::null_mut(),
                device: DLDevice {
                    device_type: KDL_CPU,
                    device_id: 0,
                },
                ndim: 1,
                dtype: i32::DTYPE,
                shape: std::ptr::null_mut(),
                strides: std::ptr::null_mut(),
                byte_offset: 0,
            },
            manager_ctx: std::ptr::null_mut(),
            deleter: Some(legacy_deleter),
        },
        shape: [10],
        data: v.clone(),
    });
    b.managed.dl_tensor.data = b.data.as_mut_ptr().cast();
    b.managed.dl_tensor.shape = b.shape.as_mut_ptr();
    let before = DELETED.load(Ordering::SeqCst);
    // SAFETY: a live legacy tensor; ownership passes.
    let t = unsafe { Imported::from_legacy(Box::into_raw(b).cast())? };
    same("legacy", t.host::<i32>()?.as_slice()?, &v, seed)?;
    drop(t);
    ensure(DELETED.load(Ordering::SeqCst) - before >= 1000, || {
        "legacy deleter not called".into()
    })
}

// ---------------------------------------------------------------------------------------
// GPU trials.

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
    // Poison: the copy must overwrite every byte.
    bytemuck::cast_slice_mut::<T, u8>(&mut out).fill(0xA5);
    s.copy_d2h(d, &mut out[..])?.wait()?;
    Ok(out)
}

/// Export → import of one dtype: 1-D, reshaped, a slice, a transposed view (refused by the
/// contiguous views, metadata intact), versioned and legacy; the memory is freed once the
/// consumer releases it.
fn roundtrip<T: Element>() -> R {
    let dev = Device::get(0)?;
    let s = dev.stream()?;
    let (rows, cols) = (37usize, 53usize);
    let (v, seed) = random::<T>(rows * cols);

    // Whole, reshaped, versioned.
    let buf = Arc::new(upload(&s, &v)?);
    let weak = Arc::downgrade(&buf);
    let t = Tensor::from_device(buf)?.reshape(&[rows, cols])?;
    ensure(
        t.shape() == [rows as i64, cols as i64] && t.strides() == [cols as i64, 1],
        || format!("{t:?}"),
    )?;
    let raw = t.into_versioned(Some(&s))?;
    // SAFETY: a tensor pinstream just handed over; ownership passes.
    let imp = unsafe { Imported::from_versioned(raw)? };
    ensure(
        imp.device().device_type == KDL_CUDA && imp.dtype() == T::DTYPE,
        || format!("{imp:?}"),
    )?;
    let got = download(&s, &imp.device_view::<T>()?, v.len())?;
    same("versioned", as_bytes(&got), as_bytes(&v), seed)?;
    ensure(weak.upgrade().is_some(), || "freed while imported".into())?;
    drop(imp);
    ensure(weak.upgrade().is_none(), || {
        "not freed at the release".into()
    })?;

    // A slice, legacy.
    let t = Tensor::from_device(upload(&s, &v)?)?.slice(cols..3 * cols)?;
    let raw = t.into_legacy(Some(&s))?;
    // SAFETY: as above.
    let imp = unsafe { Imported::from_legacy(raw)? };
    let got = download(&s, &imp.device_view::<T>()?, 2 * cols)?;
    same(
        "legacy slice",
        as_bytes(&got),
        as_bytes(&v[cols..3 * cols]),
        seed,
    )?;
    drop(imp);

    // Transposed: metadata travels; contiguous views refuse it.
    let t = Tensor::from_device(upload(&s, &v)?)?.with_strides(&[cols, rows], &[1, cols])?;
    // SAFETY: as above.
    let mut imp = unsafe { Imported::from_versioned(t.into_versioned(Some(&s))?)? };
    ensure(
        imp.shape() == [cols as i64, rows as i64] && imp.strides() == [1, cols as i64],
        || format!("{imp:?}"),
    )?;
    ensure(imp.device_mut::<T>().is_err(), || {
        "transposed destination".into()
    })?;
    drop(imp);

    // Out-of-bounds strides are refused at export.
    let t = Tensor::from_device(upload(&s, &v)?)?;
    ensure(
        t.with_strides(&[rows, cols], &[cols + 1, 1]).is_err(),
        || "strides past the end accepted".into(),
    )?;
    // Never handed over: dropping the tensor gives the buffer back.
    let buf = Arc::new(upload(&s, &v)?);
    let weak = Arc::downgrade(&buf);
    drop(Tensor::from_device(buf)?.reshape(&[cols, rows])?);
    ensure(weak.upgrade().is_none(), || {
        "an unused export kept its buffer".into()
    })
}

/// A pinned buffer exports as `kDLCUDAHost` and imports as a page-locked upload source.
fn pinned_export() -> R {
    let dev = Device::get(0)?;
    let s = dev.stream()?;
    let (v, seed) = random::<u8>(1 << 20);
    let pinned = PinnedBuffer::from_slice(&dev, &v, HostAlloc::DEFAULT)?;
    let raw = Tensor::from_pinned(pinned)?.into_versioned(Some(&s))?;
    // SAFETY: handed over just above.
    let imp = unsafe { Imported::from_versioned(raw)? };
    ensure(imp.device().device_type == KDL_CUDA_HOST, || {
        format!("{imp:?}")
    })?;
    let h = imp.host::<u8>()?;
    ensure(h.kind() == pinstream::HostKind::Pinned, || format!("{h:?}"))?;
    let mut d = DeviceBuffer::<u8>::new(&dev, v.len())?;
    s.copy_h2d(&h, &mut d)?.wait()?;
    let got = download(&s, &d, v.len())?;
    same("pinned source", &got, &v, seed)?;
    // The stager takes it as a slice.
    let stager = pinstream::Stager::new(&dev, pinstream::StagerConfig::default())?;
    let mut d2 = DeviceBuffer::<u8>::new(&dev, v.len())?;
    stager.upload(&s, h.as_slice()?, &mut d2)?;
    same("stager from import", &download(&s, &d2, v.len())?, &v, seed)
}

/// A pinned-pool block filled by a download exports as `kDLCUDAHost` (or, `host_as_cpu`,
/// `kDLCPU`), holds the downloaded bytes, is writable, and goes back to its pool (a cache hit
/// for the next request) when the consumer releases it; `host_as_cpu` refuses device tensors
/// and hands them back.
fn pool_block_export() -> R {
    let dev = Device::get(0)?;
    let s = dev.stream()?;
    let (v, seed) = random::<u8>(3 << 20);
    let d = upload(&s, &v)?;
    let pool = pinstream::PinnedPool::new(&dev, pinstream::PoolConfig::default())?;
    let mut block = pool.alloc::<u8>(v.len())?;
    s.copy_d2h(&d, &mut block)?.wait()?;
    let t = Tensor::from_pool_block(block)?;
    ensure(t.device().device_type == KDL_CUDA_HOST, || format!("{t:?}"))?;
    let t = t.host_as_cpu().map_err(|r| r.error)?;
    ensure(t.device().device_type == KDL_CPU, || format!("{t:?}"))?;
    ensure(pool.stats().in_use_bytes > 0, || "block not in use".into())?;
    let raw = t.into_versioned(None)?;
    // SAFETY: handed over just above.
    let mut imp = unsafe { Imported::from_versioned(raw)? };
    same("downloaded block", imp.host::<u8>()?.as_slice()?, &v, seed)?;
    imp.host_mut::<u8>()?; // writable: the import grants write access
    drop(imp);
    // Released by a host consumer: back after every device is idle, from the reaper thread.
    ensure(
        pinstream::dlpack::wait_for_releases(Duration::from_secs(10)),
        || "the release never finished".into(),
    )?;
    let st = pool.stats();
    ensure(st.in_use_bytes == 0 && st.cached_bytes > 0, || {
        format!("after the release: {st:?}")
    })?;
    let hits = st.hits;
    drop(pool.alloc::<u8>(v.len())?);
    ensure(pool.stats().hits == hits + 1, || {
        "the block was not reused".into()
    })?;
    // A device tensor is not host memory.
    match Tensor::from_device(d)?.host_as_cpu() {
        Ok(t) => Err(format!("host_as_cpu took a device tensor: {t:?}").into()),
        Err(r) => ensure(
            matches!(r.error, Error::InvalidArgument { .. })
                && r.tensor.device().device_type == KDL_CUDA,
            || format!("{:?}", r.error),
        ),
    }
}

/// Tensors of a packed upload share its arena: each round-trips, and the arena lives until
/// the last is released.
fn packed_export() -> R {
    let dev = Device::get(0)?;
    let s = dev.stream()?;
    let stager = pinstream::Stager::new(&dev, pinstream::StagerConfig::default())?;
    let (a, seed) = random::<f32>(1000);
    let (b, _) = random::<i64>(77);
    let (c, _) = random::<u8>(4093);
    let mut packer = pinstream::Packer::new();
    let (ha, hb, hc) = (packer.push(&a)?, packer.push(&b)?, packer.push(&c)?);
    let batch = Arc::new(stager.upload_packed(&s, &packer)?);
    let weak = Arc::downgrade(&batch);
    let ta = Tensor::from_packed(batch.clone(), ha)?.reshape(&[10, 100])?;
    let tb = Tensor::from_packed(batch.clone(), hb)?;
    let tc = Tensor::from_packed(batch, hc)?;
    // The arena is shared by the three: each is read-only, and the legacy struct refuses it.
    ensure(tc.flags() & FLAG_READ_ONLY != 0, || {
        "a shared slice is writable".into()
    })?;
    // SAFETY: each handed over just above.
    let (ia, ib, ic) = unsafe {
        (
            Imported::from_versioned(ta.into_versioned(Some(&s))?)?,
            Imported::from_versioned(tb.into_versioned(Some(&s))?)?,
            Imported::from_versioned(tc.into_versioned(None)?)?,
        )
    };
    same(
        "packed f32",
        as_bytes(&download(&s, &ia.device_view::<f32>()?, 1000)?),
        as_bytes(&a),
        seed,
    )?;
    same(
        "packed i64",
        &download(&s, &ib.device_view::<i64>()?, 77)?,
        &b,
        seed,
    )?;
    same(
        "packed u8",
        &download(&s, &ic.device_view::<u8>()?, 4093)?,
        &c,
        seed,
    )?;
    drop((ia, ib));
    ensure(weak.upgrade().is_some(), || {
        "arena freed with a tensor left".into()
    })?;
    drop(ic);
    // `ic` was handed over with no stream: its release is deferred until the device is idle.
    ensure(
        pinstream::dlpack::wait_for_releases(Duration::from_secs(60)),
        || "the deferred release never happened".into(),
    )?;
    ensure(weak.upgrade().is_none(), || {
        "arena kept after the last release".into()
    })
}

/// One uniquely owned byte buffer split into typed tensors: each is writable, has its shape
/// and its bytes; writing one leaves its neighbours alone; the buffer lives until the last
/// part is released (parts handed over, parts dropped unused, in any order).
fn split_parts() -> R {
    let dev = Device::get(0)?;
    let s = dev.stream()?;
    let (v, seed) = random::<u8>(16 << 10);
    // Unshared (no other `Arc`, not even a weak one): the parts are writable.
    let buf = upload(&s, &v)?;
    let parts = [
        Part::of::<f32>(0, &[10, 100]),
        Part::of::<i64>(4096, &[77]),
        Part::of::<u8>(4712, &[5, 7]),
        Part::of::<bf16>(4748, &[3, 2, 2]),
        Part::of::<f64>(8192, &[0]), // empty: fine anywhere
        Part::of::<u16>(9000, &[]),  // a scalar
    ];
    let mut ts = Tensor::from_device(buf)?.split(&parts)?;
    ensure(ts.len() == parts.len(), || format!("{} parts", ts.len()))?;
    for (t, p) in ts.iter().zip(&parts) {
        let want: Vec<i64> = p.shape.iter().map(|&n| n as i64).collect();
        ensure(
            t.flags() & FLAG_READ_ONLY == 0 && t.shape() == want && t.dtype() == p.dtype,
            || format!("{t:?} for {p:?}"),
        )?;
    }
    let unused = ts.pop().ok_or("no scalar")?; // dropped below, never handed over
    let mut imported = Vec::new();
    for t in ts {
        // SAFETY: handed over just above.
        imported.push(unsafe { Imported::from_versioned(t.into_versioned(Some(&s))?)? });
    }
    same(
        "f32 part",
        as_bytes(&download(&s, &imported[0].device_view::<f32>()?, 1000)?),
        &v[..4000],
        seed,
    )?;
    same(
        "i64 part",
        as_bytes(&download(&s, &imported[1].device_view::<i64>()?, 77)?),
        &v[4096..4096 + 616],
        seed,
    )?;
    same(
        "u8 part",
        &download(&s, &imported[2].device_view::<u8>()?, 35)?,
        &v[4712..4747],
        seed,
    )?;
    // Writing the u8 part changes its 35 bytes and nothing around them.
    let fresh: Vec<u8> = v[4712..4747].iter().map(|b| !b).collect();
    s.copy_h2d(&fresh[..], &mut imported[2].device_mut::<u8>()?)?
        .wait()?;
    same(
        "bf16 neighbour",
        as_bytes(&download(&s, &imported[3].device_view::<bf16>()?, 12)?),
        &v[4748..4772],
        seed,
    )?;
    same(
        "written part",
        &download(&s, &imported[2].device_view::<u8>()?, 35)?,
        &fresh,
        seed,
    )?;
    drop(unused);
    drop(imported);
    // The memory lives until the last part goes (watched through a weak reference, which
    // makes the buffer shared, so these parts are read-only).
    let buf = Arc::new(upload(&s, &v)?);
    let weak = Arc::downgrade(&buf);
    let mut ts = Tensor::from_device(buf)?.split(&parts[..3])?;
    ensure(ts[0].flags() & FLAG_READ_ONLY != 0, || {
        "a watched buffer's part is writable".into()
    })?;
    let last = ts.pop().ok_or("no part")?;
    // SAFETY: handed over just above.
    let held = unsafe { Imported::from_versioned(last.into_versioned(Some(&s))?)? };
    drop(ts);
    ensure(weak.upgrade().is_some(), || {
        "freed with a part still held".into()
    })?;
    drop(held);
    ensure(weak.upgrade().is_none(), || {
        "kept after the last part".into()
    })
}

/// Splits that would alias, reach outside, misalign or name no whole bytes are refused, and
/// the buffer goes back; a shared buffer's parts are read-only; a batch's pixels cannot be
/// split (its slot comes back once).
fn split_refusals() -> R {
    let dev = Device::get(0)?;
    let s = dev.stream()?;
    let (v, _) = random::<u8>(4096);
    let bad: [(&str, Vec<Part>); 5] = [
        (
            "overlap",
            vec![Part::of::<f32>(0, &[16]), Part::of::<u8>(63, &[2])],
        ),
        ("outside", vec![Part::of::<u8>(4000, &[97])]),
        ("overflow", vec![Part::of::<u64>(8, &[usize::MAX / 4, 3])]),
        ("misaligned", vec![Part::of::<f32>(2, &[4])]),
        (
            "nibbles",
            vec![Part {
                offset: 0,
                dtype: DLDataType {
                    code: 1,
                    bits: 4,
                    lanes: 1,
                },
                shape: vec![8],
            }],
        ),
    ];
    for (what, parts) in bad {
        let buf = Arc::new(upload(&s, &v)?);
        let weak = Arc::downgrade(&buf);
        let r = Tensor::from_device(buf)?.split(&parts);
        ensure(matches!(r, Err(Error::InvalidArgument { .. })), || {
            format!("{what}: {r:?}")
        })?;
        ensure(weak.upgrade().is_none(), || format!("{what}: buffer kept"))?;
    }
    let buf = Arc::new(upload(&s, &v)?);
    let keep = buf.clone();
    let ts = Tensor::from_device(buf)?.split(&[Part::of::<u8>(0, &[8])])?;
    ensure(ts[0].flags() & FLAG_READ_ONLY != 0, || {
        "a shared buffer's part is writable".into()
    })?;
    drop((ts, keep));
    let seed = rand::random::<u64>();
    let mut p = Prefetcher::<f32, i64>::new(&s, source(seed, 2), PrefetchConfig::default())?;
    let (px, _ex) = p.next().ok_or("no batch")??.into_dlpack()?;
    let r = px.split(&[Part::of::<f32>(0, &[4])]);
    ensure(matches!(r, Err(Error::InvalidArgument { .. })), || {
        format!("batch split: {r:?}")
    })
}

/// The consumer's stream waits for the producer's last write on the GPU: a slow fill on the
/// producer's stream, then the handover and an immediate copy on the consumer's stream, which
/// must see the fill; the host does not block for the fill.
fn consumer_waits_on_gpu() -> R {
    let dev = Device::get(0)?;
    let producer = dev.stream()?;
    let consumer = dev.stream()?;
    let n = 1 << 20;
    let (v, seed) = random::<u32>(n);
    let mut d = upload(&producer, &vec![7u32; n])?;
    // Allocations may wait for the device: make them before the spin.
    let src = PinnedBuffer::from_slice(&dev, &v, HostAlloc::DEFAULT)?;
    let mut out = DeviceBuffer::<u32>::new(&dev, n)?;
    producer.spin(Duration::from_millis(300))?;
    let pending = producer.copy_h2d(&src, &mut d)?;
    let t0 = Instant::now();
    let raw = Tensor::from_device(d)?.into_versioned(Some(&consumer))?;
    // SAFETY: handed over just above.
    let imp = unsafe { Imported::from_versioned(raw)? };
    // Ordered by the handover's wait alone: `imp`'s tracker is fresh.
    consumer.copy_d2d(&imp.device_view::<u32>()?, &mut out)?;
    // The handover ordered the consumer on the GPU: the producer's spin is still running.
    let busy = !producer.is_idle()?;
    let queued = t0.elapsed();
    let got = download(&consumer, &out, n)?;
    drop(pending);
    same("consumer copy after the handover", &got, &v, seed)?;
    ensure(busy, || {
        format!("the handover waited on the host for the producer ({queued:?})")
    })
}

/// The deleter runs on another thread while the consumer's stream still uses the memory: the
/// free (stream-ordered here, so nothing on the host waits for it) is ordered after an event
/// recorded on the consumer's stream at the release, so the consumer's slow copy reads the
/// data, not the poison written into the memory's next allocation.
fn deleter_other_thread() -> R {
    let dev = Device::get(0)?;
    let s = dev.stream()?;
    let consumer = dev.stream()?;
    let n = 1 << 22;
    let (v, seed) = random::<u8>(n);
    let mut d = DeviceBuffer::<u8>::new_async(&s, n)?;
    s.copy_h2d(&v[..], &mut d)?.wait()?;
    let raw = Tensor::from_device(d)?.into_versioned(Some(&consumer))?;
    // SAFETY: handed over just above.
    let imp = unsafe { Imported::from_versioned(raw)? };
    let ptr = imp.data_ptr() as usize;
    // Allocations may wait for the device: make them before the spin.
    let mut out = DeviceBuffer::<u8>::new(&dev, n)?;
    // The consumer queues a slow read of the memory through the raw pointer (as another
    // library would, outside pinstream's trackers), then releases the tensor at once.
    consumer.spin(Duration::from_millis(300))?;
    // SAFETY: test code standing in for a foreign library: a d2d copy from the exported
    // memory on the consumer's stream.
    let err = unsafe {
        sys::cudaMemcpyAsync(
            out.as_device_mut_ptr().cast(),
            ptr as *const c_void,
            n,
            sys::cudaMemcpyKind::cudaMemcpyDeviceToDevice,
            consumer.as_raw(),
        )
    };
    ensure(err == sys::cudaError::cudaSuccess, || format!("{err:?}"))?;
    // Drop the import (which calls the producer's deleter) on another thread.
    std::thread::spawn(move || drop(imp))
        .join()
        .map_err(|_| "deleter thread panicked")?;
    // The pool hands the freed memory out again on the same stream: poison it there.
    let mut junk = DeviceBuffer::<u8>::new_async(&s, n)?;
    s.memset(&mut junk, 0x5A)?;
    s.synchronize()?;
    let got = download(&consumer, &out, n)?;
    same("consumer read across the release", &got, &v, seed)
}

/// Queues, on `stream`, a slow read of `n` bytes at `ptr` (through the raw pointer, as another
/// library would, outside pinstream's trackers) into `out`: a spin first, then the copy.
fn slow_foreign_read(stream: &Stream, ptr: usize, out: &mut DeviceBuffer<u8>, n: usize) -> R {
    stream.spin(Duration::from_millis(300))?;
    // SAFETY: test code standing in for a foreign library: a d2d copy from the exported memory
    // (alive until the deleter runs) on a live stream.
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

/// Issue 29, finding 1. The consumer lends its own stream for the handover only (CuPy's
/// `Stream()`, torch's `ExternalStream`): it queues a slow read of the tensor there, destroys
/// the stream (CUDA lets the queued work finish), makes new streams (the driver hands the old
/// handle out again), and only then releases the tensor. The release must not record its
/// event on the handle (now a new, idle stream): the memory's next owner would overwrite it
/// before the read. Ordered after the device instead, the read sees the data.
fn lent_stream_destroyed_before_release() -> R {
    let dev = Device::get(0)?;
    let s = dev.stream()?;
    let n = 1 << 24;
    let (v, seed) = random::<u8>(n);
    let mut d = DeviceBuffer::<u8>::new_async(&s, n)?;
    s.copy_h2d(&v[..], &mut d)?.wait()?;
    let mut out = DeviceBuffer::<u8>::new(&dev, n)?;
    s.memset(&mut out, 0xA5)?;
    s.synchronize()?;
    let theirs = dev.stream()?;
    let handle = theirs.as_raw() as usize;
    let raw = {
        // SAFETY: `theirs` is a live stream of the device, alive for this block.
        let lent = unsafe { Stream::from_raw(&dev, theirs.as_raw())? };
        Tensor::from_device(d)?.into_versioned(Some(&lent))?
    };
    // SAFETY: handed over just above.
    let imp = unsafe { Imported::from_versioned(raw)? };
    slow_foreign_read(&theirs, imp.data_ptr() as usize, &mut out, n)?;
    drop(theirs); // destroyed with its read still queued
    let fresh: Vec<Stream> = (0..16).map(|_| dev.stream()).collect::<Result<_, _>>()?;
    let reused = fresh.iter().any(|f| f.as_raw() as usize == handle);
    drop(imp); // the consumer's release
               // The memory's next owner writes it at once on another stream.
    for _ in 0..4 {
        let mut junk = DeviceBuffer::<u8>::new_async(&s, n)?;
        s.memset(&mut junk, 0x5A)?;
        drop(junk);
    }
    s.synchronize()?;
    dev.synchronize()?;
    let got = download(&s, &out, n)?;
    same(
        &format!("the consumer's read across its stream's destruction (handle reused: {reused})"),
        &got,
        &v,
        seed,
    )?;
    ensure(
        pinstream::dlpack::wait_for_releases(Duration::from_secs(60)),
        || "the deferred release never happened".into(),
    )
}

/// Issue 29, finding 7: handed over with no stream (`-1`), the release neither waits for the
/// device in the deleter (it stalled behind other streams' work, and deadlocks against a
/// queued host callback that needs the caller's lock) nor gives the memory back before the
/// device has finished what was queued. A gate holds another stream while the deleter runs:
/// the deleter returns while the gate is still closed and untimed-out, and the memory comes
/// back only after the gate opens; a slow read queued before the release sees the data.
fn no_stream_release_is_deferred() -> R {
    let dev = Device::get(0)?;
    let s = dev.stream()?;
    let reader = dev.stream()?;
    let other = dev.stream()?;
    let n = 1 << 22;
    let (v, seed) = random::<u8>(n);
    let mut d = DeviceBuffer::<u8>::new_async(&s, n)?;
    s.copy_h2d(&v[..], &mut d)?.wait()?;
    let mut out = DeviceBuffer::<u8>::new(&dev, n)?;
    s.memset(&mut out, 0xA5)?;
    s.synchronize()?;
    let raw = Tensor::from_device(d)?.into_versioned(None)?;
    // SAFETY: handed over just above.
    let imp = unsafe { Imported::from_versioned(raw)? };
    slow_foreign_read(&reader, imp.data_ptr() as usize, &mut out, n)?;
    // A generous timeout: a deleter that waits for the device would wait for it.
    let gate = pinstream::timing::Gate::new(&dev, Duration::from_secs(60))?;
    gate.close(&other)?;
    // The release, on another thread with a watchdog.
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        drop(imp);
        let _ = tx.send(());
    });
    let returned = rx.recv_timeout(Duration::from_secs(30)).is_ok();
    let still_held = !other.is_idle()? && !gate.timed_out();
    let back_early = pinstream::dlpack::wait_for_releases(Duration::ZERO);
    gate.open();
    ensure(returned, || {
        "the deleter waited for the gated device".into()
    })?;
    ensure(still_held, || {
        "the gate let go before the deleter returned".into()
    })?;
    ensure(!back_early, || {
        "the memory went back while the device was still busy".into()
    })?;
    ensure(
        pinstream::dlpack::wait_for_releases(Duration::from_secs(60)),
        || "the deferred release never happened".into(),
    )?;
    // The memory's next owner writes it; the read queued before the release saw the data.
    let mut junk = DeviceBuffer::<u8>::new_async(&s, n)?;
    s.memset(&mut junk, 0x5A)?;
    s.synchronize()?;
    let got = download(&reader, &out, n)?;
    same("a read queued before a no-stream release", &got, &v, seed)
}

/// Issue 29, finding 8: a host consumer's release (page-locked memory, no stream) waits only
/// for the devices the process has a context on. Run in a child process that uses device 0
/// alone: after the release, device 1 still has no context. Needs two GPUs (ignored-equivalent
/// pass with a note otherwise).
fn host_release_touches_only_used_devices() -> R {
    if Device::count()? < 2 {
        eprintln!("(one GPU: the check needs two; nothing to check)");
        return Ok(());
    }
    let exe = std::env::current_exe()?;
    let out = std::process::Command::new(exe)
        .env(CHILD, "host_release")
        .output()?;
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    ensure(out.status.success() && text.contains("CHILD-OK"), || {
        format!("child: {:?}\n{text}", out.status)
    })
}

const CHILD: &str = "PINSTREAM_DLPACK_TEST_CHILD";

/// The child of `host_release_touches_only_used_devices`.
fn child_host_release() -> R {
    use pinstream::sys::driver::primary_context_active;
    let dev = Device::get(0)?;
    ensure(primary_context_active(1) == Some(false), || {
        "device 1 had a context before the test".into()
    })?;
    let (v, _) = random::<u8>(1 << 20);
    let buf = PinnedBuffer::from_slice(&dev, &v, HostAlloc::DEFAULT)?;
    let raw = Tensor::from_pinned(buf)?
        .host_as_cpu()
        .map_err(|r| r.error)?
        .into_versioned(None)?;
    // SAFETY: handed over just above; we stand in for the consumer and call the deleter.
    unsafe {
        let del = (*raw).deleter.ok_or("no deleter")?;
        del(raw);
    }
    ensure(
        pinstream::dlpack::wait_for_releases(Duration::from_secs(60)),
        || "the deferred release never happened".into(),
    )?;
    ensure(primary_context_active(0) == Some(true), || {
        "device 0 has no context: the check cannot see anything".into()
    })?;
    ensure(primary_context_active(1) == Some(false), || {
        "the release created a context on device 1".into()
    })?;
    ensure(pinstream::memory::leaked().allocations == 0, || {
        "the release leaked".into()
    })
}

/// Imported CUDA tensors as destinations are checked: element type, read-only, host memory.
fn destination_checks() -> R {
    let dev = Device::get(0)?;
    let s = dev.stream()?;
    let (v, _) = random::<f32>(1000);
    let raw = Tensor::from_device(upload(&s, &v)?)?.into_versioned(Some(&s))?;
    // SAFETY: handed over just above.
    let mut imp = unsafe { Imported::from_versioned(raw)? };
    ensure(imp.device_mut::<f16>().is_err(), || {
        "f16 view of f32".into()
    })?;
    ensure(imp.host::<f32>().is_err(), || {
        "host view of device memory".into()
    })?;
    // As a destination: an upload straight into it.
    let (w, seed2) = random::<f32>(1000);
    s.copy_h2d(&w[..], &mut imp.device_mut::<f32>()?)?.wait()?;
    same(
        "upload into an import",
        as_bytes(&download(&s, &imp.device_view::<f32>()?, 1000)?),
        as_bytes(&w),
        seed2,
    )?;
    drop(imp);
    // Read-only export: the import refuses to write.
    let raw = Tensor::from_device(upload(&s, &w)?)?
        .read_only()
        .into_versioned(Some(&s))?;
    // SAFETY: as above.
    let mut imp = unsafe { Imported::from_versioned(raw)? };
    ensure(imp.device_mut::<f32>().is_err(), || {
        "read-only destination".into()
    })?;
    // ... and the legacy struct cannot carry the flag.
    let t = Tensor::from_device(upload(&s, &w)?)?.read_only();
    ensure(t.into_legacy(Some(&s)).is_err(), || {
        "read-only legacy".into()
    })
}

const N: usize = 4;
const HW: usize = 24;

fn batch_bytes(seed: u64, i: u64) -> Vec<u8> {
    (0..N * 3 * HW * HW)
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

/// An exported batch keeps its slot: the prefetcher goes on through several refills (on
/// spare and remaining slots) while the exported pixels stay batch 0's; the release brings
/// the slot back.
/// Prefetched batches whose release is deferred (handed over on a lent stream, released with
/// every slot held): `next()` waits for those releases instead of saying every slot is held,
/// and the batches stay in order and intact.
fn batch_deferred_release_is_waited_for() -> R {
    within(
        "batch_deferred_release_is_waited_for",
        Duration::from_secs(120),
        || {
            let dev = Device::get(0)?;
            let s = dev.stream()?;
            let theirs = dev.stream()?;
            let seed = rand::random::<u64>();
            let config = PrefetchConfig {
                depth: 1,
                export_spares: 0,
                ..PrefetchConfig::default()
            };
            let mut p = Prefetcher::<f32, i64>::new(&s, source(seed, 8), config)?;
            for i in 0..8u64 {
                let b = p.next().ok_or("ended early")??;
                let (px, ex) = b.into_dlpack()?;
                // SAFETY: `theirs` is live for this block.
                let lent = unsafe { Stream::from_raw(&dev, theirs.as_raw())? };
                // SAFETY: handed over just above.
                let pixels = unsafe { Imported::from_versioned(px.into_versioned(Some(&lent))?)? };
                // SAFETY: as above.
                let extras = unsafe { Imported::from_versioned(ex.into_versioned(None)?)? };
                let v = download(&theirs, &pixels.device_view::<f32>()?, N * 3 * HW * HW)?;
                check_batch(&v, seed, i)?;
                // Keep the device busy so that the deferred release cannot finish at once.
                theirs.spin(Duration::from_millis(50))?;
                drop((pixels, extras));
            }
            let more = p.next().is_some();
            ensure(!more, || "more than 8 batches".into())
        },
    )
}

fn batch_held_until_release() -> R {
    within("batch_held_until_release", Duration::from_secs(60), || {
        let dev = Device::get(0)?;
        let s = dev.stream()?;
        let seed = rand::random::<u64>();
        let config = PrefetchConfig {
            depth: 2,
            export_spares: 0,
            ..PrefetchConfig::default()
        };
        let mut p = Prefetcher::<f32, i64>::new(&s, source(seed, 12), config)?;
        let b0 = p.next().ok_or("no batch 0")??;
        let (px, ex) = b0.into_dlpack()?;
        ensure(px.shape() == [N as i64, 3, HW as i64, HW as i64], || {
            format!("pixel shape {:?}", px.shape())
        })?;
        ensure(ex.shape() == [N as i64], || {
            format!("extras {:?}", ex.shape())
        })?;
        // SAFETY: handed over just above.
        let pixels = unsafe { Imported::from_versioned(px.into_versioned(Some(&s))?)? };
        // SAFETY: as above.
        let extras = unsafe { Imported::from_versioned(ex.into_versioned(Some(&s))?)? };
        // One slot left in circulation: batches 1..6 go through it.
        for i in 1..6u64 {
            let b = p.next().ok_or("ended early")??;
            let v = download(&s, &b.pixels()?, N * 3 * HW * HW)?;
            check_batch(&v, seed, i)?;
        }
        let v = download(&s, &pixels.device_view::<f32>()?, N * 3 * HW * HW)?;
        check_batch(&v, seed, 0)?;
        let e = download(&s, &extras.device_view::<i64>()?, N)?;
        ensure(e == [0, 1, 2, 3], || format!("extras {e:?}"))?;
        drop(pixels);
        drop(extras);
        // Back to two slots; the rest of the epoch is intact.
        let mut i = 6u64;
        while let Some(b) = p.next() {
            let b = b?;
            check_batch(&download(&s, &b.pixels()?, N * 3 * HW * HW)?, seed, i)?;
            i += 1;
        }
        ensure(i == 12, || format!("{i} batches of 12"))
    })
}

/// A consumer that never releases: after depth + spares batches are held, `next()` is an
/// error at once (not a hang); a release makes it go on; dropping the prefetcher with
/// tensors still held does not hang, and releasing them afterwards is fine.
fn batch_never_released() -> R {
    within("batch_never_released", Duration::from_secs(60), || {
        let dev = Device::get(0)?;
        let s = dev.stream()?;
        let seed = rand::random::<u64>();
        let config = PrefetchConfig {
            depth: 2,
            export_spares: 1,
            ..PrefetchConfig::default()
        };
        let mut p = Prefetcher::<f32, i64>::new(&s, source(seed, 40), config)?;
        let mut held = Vec::new();
        for _ in 0..3 {
            let b = p.next().ok_or("ended")??;
            let (px, ex) = b.into_dlpack()?;
            held.push((px.into_versioned(Some(&s))?, ex.into_versioned(Some(&s))?));
        }
        let t0 = Instant::now();
        match p.next() {
            Some(Err(Error::InvalidArgument { .. })) => {}
            other => {
                return Err(format!(
                    "4th next with 3 held: {:?}",
                    other.map(|r| r.map(|b| b.index()))
                )
                .into())
            }
        }
        // A watchdog, not a speed bound: the refusal must not wait for a release.
        ensure(t0.elapsed() < Duration::from_secs(60), || {
            "the refusal waited".into()
        })?;
        // Release one batch (both tensors): next() works again and in order.
        let (a, b) = held.remove(0);
        // SAFETY: handed over above; we are the consumer, calling each deleter once.
        unsafe {
            ((*a).deleter.ok_or("no deleter")?)(a);
            ((*b).deleter.ok_or("no deleter")?)(b);
        }
        let b = p.next().ok_or("ended")??;
        ensure(b.index() == 3, || {
            format!("index {} after the refusal", b.index())
        })?;
        check_batch(&download(&s, &b.pixels()?, N * 3 * HW * HW)?, seed, 3)?;
        drop(b);
        drop(p);
        // The prefetcher is gone; the held batches' deleters still work (on another thread).
        let raw: Vec<(usize, usize)> = held
            .into_iter()
            .map(|(a, b)| (a as usize, b as usize))
            .collect();
        std::thread::spawn(move || {
            for (a, b) in raw {
                for t in [a, b] {
                    let t = t as *mut DLManagedTensorVersioned;
                    // SAFETY: as above.
                    unsafe {
                        if let Some(d) = (*t).deleter {
                            d(t)
                        }
                    }
                }
            }
        })
        .join()
        .map_err(|_| "deleter thread panicked")?;
        Ok(())
    })
}

/// `record_stream` with a depth of 1 (every next() refills the one slot): a foreign stream
/// reads each batch slowly (a spin, then a copy) and the batch is dropped at once; the refill
/// must wait for the foreign read, so every copy holds its own batch.
fn batch_record_stream() -> R {
    within("batch_record_stream", Duration::from_secs(60), || {
        let dev = Device::get(0)?;
        let s = dev.stream()?;
        let foreign = dev.stream()?;
        let seed = rand::random::<u64>();
        let end = 6u64;
        let config = PrefetchConfig {
            depth: 1,
            ..PrefetchConfig::default()
        };
        let mut p = Prefetcher::<f32, i64>::new(&s, source(seed, end), config)?;
        let len = N * 3 * HW * HW;
        let mut copies = Vec::new();
        while let Some(b) = p.next() {
            let b = b?;
            b.record_stream(&foreign)?;
            foreign.spin(Duration::from_millis(40))?;
            let mut out = DeviceBuffer::<f32>::new(&dev, len)?;
            // A raw copy: outside pinstream's trackers, as another library's kernel would be.
            // SAFETY: both are live device allocations of `len` f32; the batch's memory is
            // kept by `record_stream` until the foreign stream passes this copy.
            let err = unsafe {
                sys::cudaMemcpyAsync(
                    out.as_device_mut_ptr().cast(),
                    b.pixels()?.as_device_ptr().cast(),
                    len * 4,
                    sys::cudaMemcpyKind::cudaMemcpyDeviceToDevice,
                    foreign.as_raw(),
                )
            };
            ensure(err == sys::cudaError::cudaSuccess, || format!("{err:?}"))?;
            copies.push(out);
        }
        foreign.synchronize()?;
        for (i, out) in copies.iter().enumerate() {
            check_batch(&download(&s, out, len)?, seed, i as u64)?;
        }
        ensure(copies.len() as u64 == end, || {
            format!("{} batches", copies.len())
        })
    })
}

/// `ForeignBuffer` over raw `cudaMalloc` memory: upload, normalize and download through it;
/// bad pointers are typed errors; `release_to` hands it back without a host wait.
fn foreign_from_raw() -> R {
    let dev = Device::get(0)?;
    let s = dev.stream()?;
    let n = 3 * 64 * 64;
    dev.make_current()?;
    let mut raw: *mut c_void = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    let err = unsafe { sys::cudaMalloc(&mut raw, n) };
    ensure(err == sys::cudaError::cudaSuccess, || format!("{err:?}"))?;
    let mut out_raw: *mut c_void = std::ptr::null_mut();
    // SAFETY: as above.
    let err = unsafe { sys::cudaMalloc(&mut out_raw, n * 4) };
    ensure(err == sys::cudaError::cudaSuccess, || format!("{err:?}"))?;
    let (v, seed) = random::<u8>(n);
    {
        // SAFETY: `raw` holds n bytes until the cudaFree below, after the buffers are gone.
        let mut input = unsafe { ForeignBuffer::from_raw(&dev, raw.cast::<u8>(), n)? };
        // SAFETY: as above, n f32.
        let mut output = unsafe { ForeignBuffer::from_raw(&dev, out_raw.cast::<f32>(), n)? };
        s.copy_h2d(&v[..], &mut input)?.wait()?;
        let spec = Spec::uniform(1, 3, 64, 64, Normalize::imagenet())?;
        pinstream::kernels::normalize::<f32, _, _>(&s, &input, &spec, &mut output, None)?;
        let got = download(&s, &output, n)?;
        let exact = cpu::normalize_exact(&v, &spec, None)?;
        let worst = cpu::worst_error(&got, &exact, 0.0)?;
        ensure(worst.is_none_or(|w| w.units <= 1.0), || {
            format!("normalize into foreign memory: {worst:?} (seed {seed})")
        })?;
        output.release_to(&s)?;
        drop(input);
    }
    // Refusals: host memory, misalignment, null, overflow.
    let host = [1u32; 16];
    // SAFETY: each is refused before any use (that is what is tested).
    unsafe {
        let r = ForeignBuffer::from_raw(&dev, host.as_ptr().cast_mut(), 16);
        ensure(r.is_err(), || "pageable host memory accepted".into())?;
        let r = ForeignBuffer::from_raw(&dev, raw.cast::<u8>().add(1).cast::<u32>(), 4);
        ensure(r.is_err(), || "misaligned pointer accepted".into())?;
        let r = ForeignBuffer::<u8>::from_raw(&dev, std::ptr::null_mut(), 4);
        ensure(r.is_err(), || "null accepted".into())?;
        let r = ForeignBuffer::<u64>::from_raw(&dev, raw.cast(), usize::MAX / 4);
        ensure(r.is_err(), || "overflowing length accepted".into())?;
    }
    s.synchronize()?;
    // SAFETY: the owner's frees, once, after every use.
    unsafe {
        let _ = sys::cudaFree(raw);
        let _ = sys::cudaFree(out_raw);
    }
    Ok(())
}

/// `record_stream` on a view: a foreign stream's slow read of a buffer delays the buffer's
/// next write through pinstream (on another stream) until it has passed.
fn view_record_stream() -> R {
    let dev = Device::get(0)?;
    let s = dev.stream()?;
    let foreign = dev.stream()?;
    let n = 1 << 20;
    let (v, seed) = random::<u8>(n);
    let mut d = upload(&s, &v)?;
    let mut out = DeviceBuffer::<u8>::new(&dev, n)?;
    foreign.wait(&{
        let e = pinstream::Event::new(&dev)?;
        s.record(&e)?;
        e
    })?;
    foreign.spin(Duration::from_millis(200))?;
    // SAFETY: both live device allocations of n bytes; `record_stream` below keeps `d`'s next
    // write behind this copy.
    let err = unsafe {
        sys::cudaMemcpyAsync(
            out.as_device_mut_ptr().cast(),
            d.as_device_ptr().cast(),
            n,
            sys::cudaMemcpyKind::cudaMemcpyDeviceToDevice,
            foreign.as_raw(),
        )
    };
    ensure(err == sys::cudaError::cudaSuccess, || format!("{err:?}"))?;
    d.slice(..)?.record_stream(&foreign)?;
    // Overwrite on the producer's stream: must wait for the foreign read.
    s.memset(&mut d, 0xEE)?;
    foreign.synchronize()?;
    same(
        "foreign read before the overwrite",
        &download(&s, &out, n)?,
        &v,
        seed,
    )
}
