//! A hostile caller against `dlpack::Tensor::split`, `Part` and `Tensor::from_packed_batch`:
//! parts that overlap, reach outside, overflow, are misaligned or empty; element types of odd
//! bits and lanes; splits of splits, of slices, reshapes and strided views, of read-only
//! (shared) memory, of packed uploads and of prefetched batches (refused, and the slot must come
//! back); parts handed over as legacy and versioned tensors and released in every order, from
//! other threads, or never. A trial passes when the library resisted (a typed error, the right
//! bytes, memory that lives exactly as long as a part does, no hang) and fails when it broke.
//!
//! Every trial needs a GPU (a `Tensor` owns device or page-locked memory): they are ignored
//! where there is none. Build them for a GPU machine with
//! `cargo test --release --test interop --no-run`.

// The attacks drop and forget values on purpose and spell lengths out.
#![allow(clippy::len_zero, clippy::drop_non_drop)]

use std::sync::{Arc, Barrier};
use std::time::Duration;

use crate::common::{ensure, random_bytes, same, within, R};
use libtest_mimic::{Failed, Trial};
use pinstream::dlpack::abi::{
    DLDataType, DLManagedTensor, DLManagedTensorVersioned, FLAG_READ_ONLY, KDL_CUDA, KDL_FLOAT,
    KDL_UINT,
};
use pinstream::dlpack::{Imported, Part, Tensor};
use pinstream::kernels::{Normalize, Spec};
use pinstream::prefetch::{HostBatch, PrefetchConfig, Prefetcher, Source};
use pinstream::{
    Device, DeviceBuffer, Error, HostAlloc, Packer, PinnedBuffer, Stager, StagerConfig, Stream,
};

use crate::common::trial;

/// Prefix of this module's trial names (its path in the binary).
const PREFIX: &str = "dlpack/hostile/split/";

const BOUND: Duration = Duration::from_secs(60);

/// The trials of this module, named `dlpack/hostile/split/...`.
pub fn trials() -> Vec<Trial> {
    let no_gpu = !pinstream::available();
    let t = |name: &str, f: fn() -> R| {
        let name = format!("gpu/{name}");
        let what = name.clone();
        trial(PREFIX, name, move || within(&what, BOUND, f)).with_ignored_flag(no_gpu)
    };
    vec![
        t("held/bad_parts_are_typed_errors", bad_parts),
        t("held/odd_bits_and_lanes", odd_bits_and_lanes),
        t("held/empty_and_many_parts", empty_and_many_parts),
        t(
            "held/split_of_slices_reshapes_and_strided_views",
            split_of_views,
        ),
        t(
            "held/split_of_split_released_in_every_order",
            split_of_split_release_orders,
        ),
        t(
            "held/deleters_from_many_threads_at_once",
            deleters_from_many_threads,
        ),
        t("held/read_only_memory_splits_read_only", read_only_splits),
        t("held/pinned_memory_parts", pinned_parts),
        t("held/packed_batch_split", packed_batch_split),
        t(
            "held/prefetched_batch_split_refused_and_slot_returns",
            batch_split_refused_slot_returns,
        ),
    ]
}

// ---------------------------------------------------------------------------------------------
// Helpers.

fn upload(s: &Stream, v: &[u8]) -> Result<DeviceBuffer<u8>, Failed> {
    let mut d = DeviceBuffer::<u8>::new(&s.device(), v.len())?;
    s.copy_h2d(v, &mut d)?.wait()?;
    Ok(d)
}

/// The bytes a handed-over part shows its consumer.
fn part_bytes(s: &Stream, imported: &Imported) -> Result<Vec<u8>, Failed> {
    let n = imported.byte_len()?;
    let mut out = vec![0xA5u8; n];
    if n > 0 {
        s.copy_d2h(&imported.device_bytes()?, &mut out[..])?
            .wait()?;
    }
    Ok(out)
}

fn dtype(code: u8, bits: u8, lanes: u16) -> DLDataType {
    DLDataType { code, bits, lanes }
}

fn part(offset: usize, d: DLDataType, shape: &[usize]) -> Part {
    Part {
        offset,
        dtype: d,
        shape: shape.to_vec(),
    }
}

/// A raw pointer handed to another thread, as a consumer would.
struct Raw<T>(*mut T);
// SAFETY: DLPack tensors may be released from any thread; each pointer moves to exactly one.
unsafe impl<T> Send for Raw<T> {}

/// Releases a versioned tensor as its consumer does.
///
/// # Safety
///
/// `p` was handed over and not released yet.
unsafe fn release_versioned(p: *mut DLManagedTensorVersioned) {
    // SAFETY: the caller's.
    unsafe {
        if let Some(d) = (*p).deleter {
            d(p)
        }
    }
}

/// Releases a legacy tensor as its consumer does.
///
/// # Safety
///
/// As `release_versioned`.
unsafe fn release_legacy(p: *mut DLManagedTensor) {
    // SAFETY: the caller's.
    unsafe {
        if let Some(d) = (*p).deleter {
            d(p)
        }
    }
}

/// Free device memory now, after the device is idle (for lifetime checks of memory whose
/// `Arc` cannot be watched without making it shared).
fn free_now(dev: &Device) -> Result<usize, Failed> {
    dev.synchronize()?;
    // Freed stream-ordered memory stays in pinstream's pool for reuse: give it back first, so
    // that what is still missing is memory still held.
    dev.empty_cache()?;
    Ok(dev.memory_info()?.free)
}

// ---------------------------------------------------------------------------------------------
// Held.

/// Parts that overlap (by one byte, fully, a zero-size part inside another is fine), reach
/// outside by one, overflow in the shape, the size or the end, are misaligned for their
/// element, or name no whole bytes: `Error::InvalidArgument`, and the memory goes back.
fn bad_parts() -> R {
    let dev = Device::get(0)?;
    let s = dev.stream()?;
    let (v, _) = random_bytes(4096);
    let f32t = dtype(KDL_FLOAT, 32, 1);
    let u8t = dtype(KDL_UINT, 8, 1);
    let bad: Vec<(&str, Vec<Part>)> = vec![
        (
            "overlap by one",
            vec![part(0, u8t, &[9]), part(8, u8t, &[4])],
        ),
        (
            "same part twice",
            vec![part(64, f32t, &[4]), part(64, f32t, &[4])],
        ),
        (
            "overlap out of order",
            vec![part(100, u8t, &[10]), part(0, u8t, &[101])],
        ),
        ("one past the end", vec![part(4000, u8t, &[97])]),
        ("empty one past the end", vec![part(4097, u8t, &[0])]),
        ("offset usize::MAX", vec![part(usize::MAX, u8t, &[0])]),
        ("end overflows", vec![part(usize::MAX - 3, u8t, &[8])]),
        ("shape overflows", vec![part(0, u8t, &[usize::MAX, 2])]),
        ("size overflows", vec![part(0, f32t, &[usize::MAX / 2])]),
        (
            "int64 overflow in an empty shape",
            vec![part(0, u8t, &[0, usize::MAX])],
        ),
        (
            "int64 overflow, zero last",
            vec![part(0, u8t, &[usize::MAX, 0])],
        ),
        ("misaligned f32", vec![part(2, f32t, &[1])]),
        (
            "misaligned f64",
            vec![part(4, dtype(KDL_FLOAT, 64, 1), &[1])],
        ),
        (
            "misaligned 16-byte",
            vec![part(8, dtype(KDL_UINT, 8, 16), &[1])],
        ),
        ("zero bits", vec![part(0, dtype(KDL_UINT, 0, 1), &[1])]),
        ("zero lanes", vec![part(0, dtype(KDL_UINT, 8, 0), &[1])]),
        ("nibbles", vec![part(0, dtype(KDL_UINT, 4, 1), &[2])]),
        ("three nibbles", vec![part(0, dtype(KDL_UINT, 4, 3), &[2])]),
        (
            "many good then one bad",
            (0..100)
                .map(|i| part(i * 8, u8t, &[8]))
                .chain([part(4092, f32t, &[2])])
                .collect(),
        ),
    ];
    let before = free_now(&dev)?;
    for (what, parts) in bad {
        let buf = Arc::new(upload(&s, &v)?);
        let weak = Arc::downgrade(&buf);
        let r = Tensor::from_device(buf)?.split(&parts);
        ensure(matches!(r, Err(Error::InvalidArgument { .. })), || {
            format!("{what}: {r:?}")
        })?;
        ensure(weak.upgrade().is_none(), || format!("{what}: memory kept"))?;
    }
    // Unique buffers (no watcher): the device memory comes back all the same.
    for _ in 0..64 {
        let buf = DeviceBuffer::<u8>::new(&dev, 1 << 20)?;
        let r = Tensor::from_device(buf)?.split(&[part(0, u8t, &[(1 << 20) + 1])]);
        ensure(r.is_err(), || "a part past the end".into())?;
    }
    let after = free_now(&dev)?;
    ensure(before <= after + (8 << 20), || {
        format!("{} MiB kept by refused splits", (before - after) >> 20)
    })?;
    // A zero-size part inside another part, at the end, at the start: fine.
    let buf = upload(&s, &v)?;
    let ts = Tensor::from_device(buf)?.split(&[
        part(0, u8t, &[4096]),
        part(100, f32t, &[0]),
        part(4096, u8t, &[0]),
        part(0, u8t, &[0, 3]),
    ])?;
    ensure(ts.len() == 4, || format!("{} parts", ts.len()))
}

/// Element types of odd sizes: 3-byte lanes, 24-bit scalars, 65535 lanes, 255-byte elements,
/// 16-byte elements (aligned to 16), packed nibble pairs. Each part is handed over and read
/// back: its bytes are the source's, its dtype the one asked for.
fn odd_bits_and_lanes() -> R {
    let dev = Device::get(0)?;
    let s = dev.stream()?;
    let (v, seed) = random_bytes(1 << 20);
    let parts = vec![
        part(1, dtype(KDL_UINT, 8, 3), &[5]),     // 15 bytes, align 1
        part(17, dtype(KDL_UINT, 24, 1), &[7]),   // 21 bytes, align 1
        part(48, dtype(KDL_UINT, 4, 2), &[3, 3]), // nibble pairs: 9 bytes
        part(64, dtype(5, 64, 1), &[2, 2]),       // complex64: 32 bytes, align 8
        part(112, dtype(KDL_UINT, 8, 16), &[3]),  // 48 bytes, align 16
        part(4096, dtype(KDL_UINT, 8, 65535), &[2]),
        part(200_000, dtype(KDL_UINT, 255, 8), &[11]), // 255-byte elements, align 1
        part(300_001, dtype(KDL_UINT, 8, 1), &[]),     // a scalar at an odd address
    ];
    let buf = upload(&s, &v)?;
    let ts = Tensor::from_device(buf)?.split(&parts)?;
    ensure(ts.len() == parts.len(), || format!("{} parts", ts.len()))?;
    for (t, p) in ts.into_iter().zip(&parts) {
        ensure(
            t.dtype() == p.dtype && t.flags() & FLAG_READ_ONLY == 0,
            || format!("{t:?} for {p:?}"),
        )?;
        let want_shape: Vec<i64> = p.shape.iter().map(|&n| n as i64).collect();
        ensure(t.shape() == want_shape, || format!("{t:?} for {p:?}"))?;
        // SAFETY: handed over just above, taken once.
        let imported = unsafe { Imported::from_versioned(t.into_versioned(Some(&s))?)? };
        let bits = usize::from(p.dtype.bits) * usize::from(p.dtype.lanes);
        let n = p.shape.iter().product::<usize>() * bits / 8;
        same(
            &format!("{p:?}"),
            &part_bytes(&s, &imported)?,
            &v[p.offset..p.offset + n],
            seed,
        )?;
    }
    Ok(())
}

/// No parts at all (the memory goes back at once), 100 000 empty parts, 4096 one-byte parts
/// covering every byte (each reads its own byte).
fn empty_and_many_parts() -> R {
    let dev = Device::get(0)?;
    let s = dev.stream()?;
    let (v, seed) = random_bytes(4096);
    let buf = Arc::new(upload(&s, &v)?);
    let weak = Arc::downgrade(&buf);
    let ts = Tensor::from_device(buf)?.split(&[])?;
    ensure(ts.is_empty() && weak.upgrade().is_none(), || {
        format!(
            "{} parts, memory kept: {}",
            ts.len(),
            weak.upgrade().is_some()
        )
    })?;
    let u8t = dtype(KDL_UINT, 8, 1);
    let empties: Vec<Part> = (0..100_000).map(|i| part(i % 4097, u8t, &[0])).collect();
    let ts = Tensor::from_device(upload(&s, &v)?)?.split(&empties)?;
    ensure(ts.len() == 100_000, || format!("{} empty parts", ts.len()))?;
    drop(ts);
    let bytes: Vec<Part> = (0..4096).map(|i| part(i, u8t, &[1])).collect();
    let ts = Tensor::from_device(upload(&s, &v)?)?.split(&bytes)?;
    let mut got = Vec::with_capacity(4096);
    // Released in reverse, half of them without ever being handed over.
    for (i, t) in ts.into_iter().enumerate().rev() {
        if i % 2 == 0 {
            drop(t);
            got.push(v[i]);
            continue;
        }
        // SAFETY: handed over just above.
        let imp = unsafe { Imported::from_versioned(t.into_versioned(Some(&s))?)? };
        got.push(part_bytes(&s, &imp)?[0]);
    }
    got.reverse();
    same("one-byte parts", &got, &v, seed)
}

/// Parts are cut from the tensor's memory as it is after `slice` (relative to the slice's
/// start, never past its end even where the buffer goes on), whatever shape or strides a
/// `reshape` or `with_strides` gave it.
fn split_of_views() -> R {
    let dev = Device::get(0)?;
    let s = dev.stream()?;
    let (v, seed) = random_bytes(8192);
    let u8t = dtype(KDL_UINT, 8, 1);
    // Elements 1000..2000 of a byte tensor: parts are relative to byte 1000.
    let t = Tensor::from_device(upload(&s, &v)?)?.slice(1000..2000)?;
    let ts = t.split(&[part(0, u8t, &[10]), part(990, u8t, &[10])])?;
    let mut it = ts.into_iter();
    for want in [&v[1000..1010], &v[1990..2000]] {
        let t = it.next().ok_or("missing part")?;
        // SAFETY: handed over just above.
        let imp = unsafe { Imported::from_versioned(t.into_versioned(Some(&s))?)? };
        same("part of a slice", &part_bytes(&s, &imp)?, want, seed)?;
    }
    // Past the slice's end, inside the buffer: refused.
    let t = Tensor::from_device(upload(&s, &v)?)?.slice(1000..2000)?;
    let r = t.split(&[part(990, u8t, &[11])]);
    ensure(matches!(r, Err(Error::InvalidArgument { .. })), || {
        format!("past a slice's end: {r:?}")
    })?;
    // A broadcast, transposed view: its memory, not its strides, is what is split.
    let t = Tensor::from_device(upload(&s, &v)?)?
        .reshape(&[64, 128])?
        .with_strides(&[128, 64], &[1, 0])?;
    let ts = t.split(&[part(8000, u8t, &[192])])?;
    let t = ts.into_iter().next().ok_or("missing part")?;
    // SAFETY: handed over just above.
    let imp = unsafe { Imported::from_versioned(t.into_versioned(Some(&s))?)? };
    same(
        "part of a strided view",
        &part_bytes(&s, &imp)?,
        &v[8000..8192],
        seed,
    )?;
    // An empty slice: only empty parts fit.
    let t = Tensor::from_device(upload(&s, &v)?)?.slice(5..5)?;
    let r = t.split(&[part(0, u8t, &[1])]);
    ensure(r.is_err(), || "a byte of an empty slice".into())?;
    let t = Tensor::from_device(upload(&s, &v)?)?.slice(5..5)?;
    ensure(t.split(&[part(0, u8t, &[0])])?.len() == 1, || {
        "an empty part of an empty slice".into()
    })
}

/// A split of a part of a split; parts handed over as legacy and versioned tensors with and
/// without a consumer stream, parts dropped unused, parts forgotten in a handed-over state and
/// released later: the bytes are right and the memory (watched through free device memory, the
/// buffer being unshared) comes back only after the last release.
fn split_of_split_release_orders() -> R {
    let dev = Device::get(0)?;
    let s = dev.stream()?;
    let consumer = dev.stream()?;
    let size = 64 << 20;
    let (v, seed) = random_bytes(size);
    let u8t = dtype(KDL_UINT, 8, 1);
    let f32t = dtype(KDL_FLOAT, 32, 1);
    for order in 0..4u32 {
        let base = free_now(&dev)?;
        let buf = upload(&s, &v)?;
        let mut ts = Tensor::from_device(buf)?.split(&[
            part(0, u8t, &[size / 4]),
            part(size / 4, u8t, &[size / 4]),
            part(size / 2, f32t, &[size / 8]),
        ])?;
        let third = ts.pop().ok_or("no part")?;
        let second = ts.pop().ok_or("no part")?;
        let first = ts.pop().ok_or("no part")?;
        // The second again, into three.
        let mut subs = second.split(&[
            part(0, u8t, &[16]),
            part(16, f32t, &[4]),
            part(4096, u8t, &[size / 4 - 4096]),
        ])?;
        let sub3 = subs.pop().ok_or("no sub")?;
        let sub2 = subs.pop().ok_or("no sub")?;
        let sub1 = subs.pop().ok_or("no sub")?;
        let held = free_now(&dev)?;
        ensure(base.saturating_sub(held) >= size / 2, || {
            "the buffer is not allocated?".into()
        })?;
        let legacy = first.into_legacy(None)?;
        let versioned = third.into_versioned(Some(&consumer))?;
        let sub_legacy = sub3.into_legacy(Some(&consumer))?;
        // SAFETY: handed over just above, taken once.
        let imp = unsafe { Imported::from_versioned(sub2.into_versioned(Some(&s))?)? };
        same(
            "sub-part",
            &part_bytes(&s, &imp)?,
            &v[size / 4 + 16..size / 4 + 32],
            seed,
        )?;
        // Release in an order of its own for each round; the memory must stay until the last.
        let mut steps: Vec<Box<dyn FnOnce()>> = vec![
            // SAFETY: each handed-over pointer is released exactly once, below.
            Box::new(move || unsafe { release_legacy(legacy) }),
            // SAFETY: as above.
            Box::new(move || unsafe { release_versioned(versioned) }),
            // SAFETY: as above.
            Box::new(move || unsafe { release_legacy(sub_legacy) }),
            Box::new(move || drop(imp)),
            Box::new(move || drop(sub1)),
        ];
        let n = steps.len();
        steps.rotate_left(order as usize % n);
        if order % 2 == 1 {
            steps.reverse();
        }
        let last = steps.pop().ok_or("no step")?;
        for step in steps {
            step();
        }
        ensure(free_now(&dev)? + size / 2 <= base, || {
            format!("order {order}: the memory went back before the last part")
        })?;
        last();
        // Parts released with no stream go back from the background, once the device is idle.
        ensure(
            pinstream::dlpack::wait_for_releases(std::time::Duration::from_secs(60)),
            || "the deferred releases never happened".into(),
        )?;
        let back = free_now(&dev)?;
        ensure(back + (4 << 20) >= base, || {
            format!(
                "order {order}: {} MiB still held after the last part",
                (base - back) >> 20
            )
        })?;
    }
    Ok(())
}

/// 256 parts handed over, then released by 8 threads at once (a barrier lines them up), half
/// naming a consumer stream, half not: no crash, the memory goes back once.
fn deleters_from_many_threads() -> R {
    let dev = Device::get(0)?;
    let s = dev.stream()?;
    let u8t = dtype(KDL_UINT, 8, 1);
    let base = free_now(&dev)?;
    let buf = DeviceBuffer::<u8>::new(&dev, 256 << 16)?;
    let parts: Vec<Part> = (0..256).map(|i| part(i << 16, u8t, &[1 << 16])).collect();
    let ts = Tensor::from_device(buf)?.split(&parts)?;
    let mut raws = Vec::new();
    for (i, t) in ts.into_iter().enumerate() {
        let consumer = (i % 2 == 0).then_some(&s);
        raws.push(Raw(t.into_versioned(consumer)?));
    }
    let barrier = Arc::new(Barrier::new(8));
    let mut handles = Vec::new();
    for k in 0..8 {
        let mine: Vec<Raw<DLManagedTensorVersioned>> = raws
            .iter()
            .enumerate()
            .filter(|(i, _)| i % 8 == k)
            .map(|(_, r)| Raw(r.0))
            .collect();
        let b = barrier.clone();
        handles.push(std::thread::spawn(move || {
            b.wait();
            for r in mine {
                // SAFETY: each pointer is released by exactly one thread, once.
                unsafe { release_versioned(r.0) };
            }
        }));
    }
    drop(raws);
    for h in handles {
        h.join().map_err(|_| "a releasing thread panicked")?;
    }
    let back = free_now(&dev)?;
    ensure(back + (4 << 20) >= base, || {
        format!("{} MiB held after every release", (base - back) >> 20)
    })
}

/// A shared buffer's tensor is read-only, and so is every part of it (and every part of those):
/// the legacy struct refuses them and gives the part back; the versioned one carries the flag;
/// an importer cannot write them.
fn read_only_splits() -> R {
    let dev = Device::get(0)?;
    let s = dev.stream()?;
    let (v, seed) = random_bytes(4096);
    let u8t = dtype(KDL_UINT, 8, 1);
    let buf = Arc::new(upload(&s, &v)?);
    let keep = buf.clone();
    let ts = Tensor::from_device(buf)?.split(&[part(0, u8t, &[100]), part(100, u8t, &[100])])?;
    let mut it = ts.into_iter();
    let a = it.next().ok_or("no part")?;
    let b = it.next().ok_or("no part")?;
    let sub = a.split(&[part(10, u8t, &[10])])?;
    let sub = sub.into_iter().next().ok_or("no sub")?;
    ensure(
        b.flags() & FLAG_READ_ONLY != 0 && sub.flags() & FLAG_READ_ONLY != 0,
        || "a part of shared memory is writable".into(),
    )?;
    let refused = sub
        .into_legacy(Some(&s))
        .err()
        .ok_or("read-only as legacy")?;
    let sub = refused.tensor;
    // SAFETY: handed over just above.
    let mut imp = unsafe { Imported::from_versioned(sub.into_versioned(Some(&s))?)? };
    ensure(imp.is_read_only(), || "the flag was lost".into())?;
    let w = imp.device_bytes_mut();
    ensure(matches!(w, Err(Error::InvalidArgument { .. })), || {
        format!("write view of a read-only part: {:?}", w.map(|_| ()))
    })?;
    same(
        "read-only sub-part",
        &part_bytes(&s, &imp)?,
        &v[10..20],
        seed,
    )?;
    drop((imp, b, keep));
    Ok(())
}

/// Page-locked memory split into parts (`kDLCUDAHost`): each part's address and bytes are its
/// range of the buffer; the buffer lives until the last part goes.
fn pinned_parts() -> R {
    let dev = Device::get(0)?;
    let (v, seed) = random_bytes(1 << 16);
    let mut buf = PinnedBuffer::<u8>::new(&dev, v.len(), HostAlloc::DEFAULT)?;
    buf.as_mut_slice()?.copy_from_slice(&v);
    let buf = Arc::new(buf);
    let base = buf.as_slice()?.as_ptr() as usize;
    let weak = Arc::downgrade(&buf);
    let u8t = dtype(KDL_UINT, 8, 1);
    let ts = Tensor::from_pinned(buf)?.split(&[part(3, u8t, &[5]), part(4096, u8t, &[4096])])?;
    for (t, (off, n)) in ts.into_iter().zip([(3usize, 5usize), (4096, 4096)]) {
        ensure(t.data_ptr() as usize == base + off, || format!("{t:?}"))?;
        // SAFETY: handed over just above.
        let imp = unsafe { Imported::from_versioned(t.into_versioned(None)?)? };
        let got = imp.host_bytes()?.into_slice()?.to_vec();
        same("pinned part", &got, &v[off..off + n], seed)?;
        ensure(weak.upgrade().is_some(), || "freed with a part left".into())?;
    }
    // Released with no stream: the parts go back from the background.
    ensure(
        pinstream::dlpack::wait_for_releases(std::time::Duration::from_secs(60)),
        || "the deferred releases never happened".into(),
    )?;
    ensure(weak.upgrade().is_none(), || {
        "kept after the last part".into()
    })
}

/// A packed upload's arena split at the packer's offsets: each typed part holds its array;
/// a batch shared with another `Arc` splits into read-only parts.
fn packed_batch_split() -> R {
    let dev = Device::get(0)?;
    let s = dev.stream()?;
    let stager = Stager::new(&dev, StagerConfig::default())?;
    let a: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5).collect();
    let b: Vec<u8> = (0..3).collect();
    let c: Vec<i64> = (0..77).map(|i| -i).collect();
    let e: Vec<u16> = Vec::new();
    let mut packer = Packer::new();
    let ha = packer.push(&a[..])?;
    let hb = packer.push(&b[..])?;
    let he = packer.push(&e[..])?;
    let hc = packer.push(&c[..])?;
    let parts = [
        Part::of::<f32>(ha.offset(), &[10, 100]),
        Part::of::<u8>(hb.offset(), &[3]),
        Part::of::<u16>(he.offset(), &[0]),
        Part::of::<i64>(hc.offset(), &[77]),
    ];
    let batch = stager.upload_packed(&s, &packer)?;
    let ts = Tensor::from_packed_batch(batch)?.split(&parts)?;
    let wants: [Vec<u8>; 4] = [
        bytemuck_bytes(&a),
        b.clone(),
        Vec::new(),
        bytemuck_bytes(&c),
    ];
    for (t, want) in ts.into_iter().zip(wants) {
        ensure(t.flags() & FLAG_READ_ONLY == 0, || {
            "an unshared batch's part is read-only".into()
        })?;
        // SAFETY: handed over just above.
        let imp = unsafe { Imported::from_versioned(t.into_versioned(Some(&s))?)? };
        ensure(part_bytes(&s, &imp)? == want, || format!("{imp:?}"))?;
    }
    let batch = Arc::new(stager.upload_packed(&s, &packer)?);
    let other = batch.clone();
    let ts = Tensor::from_packed_batch(batch)?.split(&parts)?;
    ensure(ts.iter().all(|t| t.flags() & FLAG_READ_ONLY != 0), || {
        "a shared batch's part is writable".into()
    })?;
    drop((ts, other));
    // Past the arena's end: refused.
    let batch = stager.upload_packed(&s, &packer)?;
    let end = batch.arena().len();
    let r = Tensor::from_packed_batch(batch)?.split(&[Part::of::<u8>(end, &[1])]);
    ensure(r.is_err(), || "a byte past the arena".into())
}

fn bytemuck_bytes<T: pinstream::Pod>(v: &[T]) -> Vec<u8> {
    bytemuck::cast_slice(v).to_vec()
}

/// A prefetched batch's pixels and extras refuse to be split (a slot comes back once); the
/// refusal gives the slot back, so with one slot and no spares every later batch still comes
/// (a slot lost to the refusal would hang `next()` or end it with "all held").
fn batch_split_refused_slot_returns() -> R {
    let dev = Device::get(0)?;
    let s = dev.stream()?;
    let source = Source::new(|i, b: &mut HostBatch<i64>| {
        if i >= 6 {
            return Ok(false);
        }
        b.spec = Spec::uniform(2, 3, 4, 4, Normalize::imagenet())?;
        let px = b.pageable();
        px.clear();
        px.extend((0..96).map(|k| (k + i as usize) as u8));
        b.extras.clear();
        b.extras.extend([i as i64, -(i as i64)]);
        Ok(true)
    });
    let config = PrefetchConfig {
        depth: 1,
        export_spares: 0,
        loader_threads: 1,
        ..PrefetchConfig::default()
    };
    let mut p = Prefetcher::<f32, i64>::new(&s, source, config)?;
    let f32t = dtype(KDL_FLOAT, 32, 1);
    let mut seen = 0;
    while let Some(b) = p.next() {
        let (px, ex) = b?.into_dlpack()?;
        ensure(px.device().device_type == KDL_CUDA, || format!("{px:?}"))?;
        let r = px.split(&[part(0, f32t, &[4])]);
        ensure(matches!(r, Err(Error::InvalidArgument { .. })), || {
            format!("pixels split: {r:?}")
        })?;
        let r = ex.split(&[]);
        ensure(matches!(r, Err(Error::InvalidArgument { .. })), || {
            format!("extras split: {r:?}")
        })?;
        seen += 1;
    }
    ensure(seen == 6, || format!("{seen} batches"))
}
