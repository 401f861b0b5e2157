//! GPU trials of the staging engine (`Stager`): round trips of fresh random data at sizes that do
//! and do not divide a slot, with 1..N threads, from several host threads on two streams, lists
//! of many tensors, packed batches, files (offsets, short, missing, O_DIRECT), errors that lose
//! nothing, and dropping the engine with DMAs in flight. Guard bytes around every device
//! destination check that nothing is written outside it. Ignored without a GPU.

use std::io::Write;
use std::time::{Duration, Instant};

use crate::common::{ensure, random_bytes, rng, same, R};
use bytemuck::{self, Pod};
use libtest_mimic::Trial;
use pinstream::{
    Device, DeviceBuffer, Downloads, Error, FileSource, PackedArena, Packer, Stager, StagerConfig,
    Stream, Uploads,
};
use rand::{Rng, RngCore};

use crate::common::trial;

/// Prefix of this module's trial names (its path in the binary).
const PREFIX: &str = "engine/";

const GUARD: usize = 4096;
const GUARD_BYTE: u8 = 0xA5;

/// The trials of this module, named `engine/...`.
pub fn trials() -> Vec<Trial> {
    let no_gpu = !pinstream::available();
    let two_gpus = Device::count().is_ok_and(|n| n >= 2);
    let mut trials = Vec::new();
    let mut gpu = |name: &str, f: fn() -> R| {
        trials.push(trial(PREFIX, name, f).with_ignored_flag(no_gpu));
    };
    gpu("roundtrip/threads_and_sizes", roundtrip_threads_and_sizes);
    gpu("roundtrip/typed", roundtrip_typed);
    gpu("roundtrip/streaming_and_ramp", roundtrip_streaming_and_ramp);
    gpu("roundtrip/default_config", roundtrip_default_config);
    gpu(
        "concurrent/threads_two_streams",
        concurrent_threads_two_streams,
    );
    gpu("many/upload_download_all", many_upload_download_all);
    gpu(
        "many/upload_download_all_no_batch",
        many_upload_download_all_no_batch,
    );
    gpu("packed/mixed_types", packed_mixed_types);
    gpu(
        "packed/foreign_handle_refused",
        packed_foreign_handle_refused,
    );
    gpu(
        "packed/arena_reuse_and_growth",
        packed_arena_reuse_and_growth,
    );
    gpu(
        "packed/arena_handles_and_errors",
        packed_arena_handles_and_errors,
    );
    gpu("file/offsets", file_offsets);
    gpu("file/short_and_missing", file_short_and_missing);
    gpu("file/truncated_after_open", file_truncated_after_open);
    gpu("file/direct", file_direct);
    gpu(
        "errors/typed_and_nothing_lost",
        errors_typed_and_nothing_lost,
    );
    gpu(
        "async/upload_returns_before_device",
        upload_returns_before_device,
    );
    gpu(
        "drop/engine_with_dma_in_flight",
        drop_engine_with_dma_in_flight,
    );
    gpu("order/upload_after_kernel_use", upload_after_kernel_use);
    gpu("pool/slots_from_a_shared_pool", slots_from_a_shared_pool);
    trials
        .push(trial(PREFIX, "wrong_device_is_refused", wrong_device).with_ignored_flag(!two_gpus));
    trials
}

fn dev0() -> Result<Device, Error> {
    Device::get(0)
}

fn config(threads: usize, slot_kib: usize, slots: usize) -> StagerConfig {
    StagerConfig {
        threads,
        slot_bytes: slot_kib << 10,
        slots,
        min_bytes: 0,
        ..StagerConfig::default()
    }
}

/// A device buffer of `n` elements of `T` between guard regions of `GUARD` bytes, all poisoned.
struct Guarded {
    buf: DeviceBuffer<u8>,
    bytes: usize,
}

impl Guarded {
    fn new(stream: &Stream, bytes: usize) -> Result<Guarded, Error> {
        let mut buf = DeviceBuffer::<u8>::new(&stream.device(), bytes + 2 * GUARD)?;
        stream.memset(&mut buf, GUARD_BYTE)?;
        Ok(Guarded { buf, bytes })
    }

    fn view_mut(&mut self) -> pinstream::DeviceViewMut<'_, u8> {
        self.buf
            .slice_mut(GUARD..GUARD + self.bytes)
            .expect("in range")
    }

    fn view(&self) -> pinstream::DeviceView<'_, u8> {
        self.buf.slice(GUARD..GUARD + self.bytes).expect("in range")
    }

    /// Reads everything back (plain copy, not the stager) and checks the guards.
    fn read(&self, stream: &Stream) -> Result<Vec<u8>, libtest_mimic::Failed> {
        let mut all = vec![0u8; self.bytes + 2 * GUARD];
        stream.copy_d2h(&self.buf, &mut all[..])?.wait()?;
        let (before, rest) = all.split_at(GUARD);
        let (mid, after) = rest.split_at(self.bytes);
        ensure(before.iter().chain(after).all(|&b| b == GUARD_BYTE), || {
            "a guard byte around the destination was overwritten".into()
        })?;
        Ok(mid.to_vec())
    }
}

fn roundtrip_bytes(stager: &Stager, stream: &Stream, size: usize, what: &str) -> R {
    let (src, seed) = random_bytes(size);
    let mut g = Guarded::new(stream, size)?;
    stager.upload(stream, &src, &mut g.view_mut())?;
    same(
        &format!("{what}: upload of {size}"),
        &g.read(stream)?,
        &src,
        seed,
    )?;
    // Download into a poisoned destination between host guards.
    let mut host = vec![0x5Au8; size + 2 * 64];
    stager.download(stream, &g.view(), &mut host[64..64 + size])?;
    ensure(
        host[..64]
            .iter()
            .chain(&host[64 + size..])
            .all(|&b| b == 0x5A),
        || format!("{what}: download wrote outside its destination (seed {seed})"),
    )?;
    same(
        &format!("{what}: download of {size}"),
        &host[64..64 + size],
        &src,
        seed,
    )
}

fn roundtrip_threads_and_sizes() -> R {
    let dev = dev0()?;
    let stream = dev.stream()?;
    let slot = 64usize << 10;
    let sizes = [
        1,
        255,
        4097,
        slot - 1,
        slot,
        slot + 1,
        3 * slot,
        (1 << 20) + 13,
        (8 << 20) + 4095,
        33 << 20,
    ];
    for threads in [1, 2, 3, 8] {
        for slots in [1, threads, 2 * threads + 1] {
            let stager = Stager::new(&dev, config(threads, 64, slots))?;
            for &size in &sizes {
                roundtrip_bytes(
                    &stager,
                    &stream,
                    size,
                    &format!("{threads} threads, {slots} slots"),
                )?;
            }
        }
    }
    // Bigger slots than pieces of mid-sized copies.
    let stager = Stager::new(&dev, config(4, 2048, 8))?;
    for size in [(4 << 20) + 7, 64 << 20, (100 << 20) + 1] {
        roundtrip_bytes(&stager, &stream, size, "4 threads, 2 MiB slots")?;
    }
    Ok(())
}

/// Streaming stores (with unaligned host sides: offsets 1..63 into the source) and a ramp of
/// piece sizes, each alone and together.
fn roundtrip_streaming_and_ramp() -> R {
    let dev = dev0()?;
    let stream = dev.stream()?;
    for (streaming, first) in [(true, 2048usize), (false, 64), (true, 64), (true, 256)] {
        let stager = Stager::new(
            &dev,
            StagerConfig {
                streaming_max_bytes: if streaming { usize::MAX } else { 0 },
                first_piece_bytes: first << 10,
                ..config(4, 2048, 8)
            },
        )?;
        let what = format!("streaming {streaming}, first piece {first} KiB");
        for size in [4097, (1 << 20) + 13, (9 << 20) + 4095, 40 << 20] {
            roundtrip_bytes(&stager, &stream, size, &what)?;
        }
        // Unaligned host ranges on both sides.
        let (src, seed) = random_bytes((3 << 20) + 64);
        let mut g = Guarded::new(&stream, 3 << 20)?;
        for off in [1usize, 17, 63] {
            let part = &src[off..off + (3 << 20)];
            stager.upload(&stream, part, &mut g.view_mut())?;
            same(
                &format!("{what}: upload at +{off}"),
                &g.read(&stream)?,
                part,
                seed,
            )?;
            let mut host = vec![0x5Au8; (3 << 20) + 128];
            stager.download(&stream, &g.view(), &mut host[off..off + (3 << 20)])?;
            ensure(
                host[..off]
                    .iter()
                    .chain(&host[off + (3 << 20)..])
                    .all(|&b| b == 0x5A),
                || format!("{what}: download at +{off} wrote outside (seed {seed})"),
            )?;
            same(
                &format!("{what}: download at +{off}"),
                &host[off..off + (3 << 20)],
                part,
                seed,
            )?;
        }
    }
    Ok(())
}

fn roundtrip_typed_one<T: Pod + PartialEq + std::fmt::Debug>(stager: &Stager, n: usize) -> R {
    let stream = stager.device().stream()?;
    let (bytes, seed) = random_bytes(n * std::mem::size_of::<T>());
    let src: Vec<T> = bytemuck::pod_collect_to_vec(&bytes);
    let mut d = DeviceBuffer::<T>::new(&stager.device(), n)?;
    stream.memset(&mut d, 0xEE)?;
    stager.upload(&stream, &src, &mut d)?;
    let mut back = vec![T::zeroed(); n];
    bytemuck::cast_slice_mut::<T, u8>(&mut back).fill(0x11);
    stager.download(&stream, &d, &mut back)?;
    same(std::any::type_name::<T>(), &back, &src, seed)
}

fn roundtrip_typed() -> R {
    let dev = dev0()?;
    let stager = Stager::new(&dev, config(4, 128, 6))?;
    roundtrip_typed_one::<u16>(&stager, 1_000_003)?;
    roundtrip_typed_one::<u32>(&stager, 777_777)?;
    roundtrip_typed_one::<u64>(&stager, 300_001)?;
    roundtrip_typed_one::<[u8; 3]>(&stager, 500_000)
}

fn roundtrip_default_config() -> R {
    let dev = dev0()?;
    let stream = dev.stream()?;
    let stager = Stager::new(&dev, StagerConfig::from_env()?)?;
    // Below, at and above the small-copy threshold.
    let min = stager.config().min_bytes;
    for size in [
        1,
        min.saturating_sub(1).max(1),
        min.max(1),
        4 << 20,
        64 << 20,
    ] {
        roundtrip_bytes(&stager, &stream, size, "default config")?;
    }
    Ok(())
}

fn concurrent_threads_two_streams() -> R {
    let dev = dev0()?;
    let stager = Stager::new(&dev, config(4, 256, 6))?;
    let streams = [dev.stream()?, dev.stream()?];
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|t| {
                let (stager, stream) = (&stager, &streams[t % 2]);
                s.spawn(move || -> R {
                    let (mut rng, _) = rng();
                    for i in 0..12 {
                        let size = rng.random_range(1..6usize << 20);
                        roundtrip_bytes(stager, stream, size, &format!("thread {t}, round {i}"))?;
                    }
                    Ok(())
                })
            })
            .collect();
        handles
            .into_iter()
            .try_for_each(|h| h.join().map_err(|_| "a thread panicked")?)
    })
}

fn many_upload_download_all() -> R {
    many_lists(true)
}

fn many_upload_download_all_no_batch() -> R {
    many_lists(false)
}

fn many_lists(batch_copies: bool) -> R {
    let dev = dev0()?;
    let stream = dev.stream()?;
    let stager = Stager::new(
        &dev,
        StagerConfig {
            batch_copies,
            ..config(4, 256, 8)
        },
    )?;
    let (mut rng, seed) = rng();
    // Mixed sizes (including 0 and bigger than a slot) and two element types.
    let sizes: Vec<usize> = (0..300)
        .map(|i| match i % 7 {
            0 => 0,
            1 => rng.random_range(300_000..700_000),
            _ => rng.random_range(1..5000),
        })
        .collect();
    let srcs: Vec<Vec<u32>> = sizes
        .iter()
        .map(|&n| (0..n).map(|_| rng.next_u32() | 1).collect())
        .collect();
    let small: Vec<Vec<u8>> = (0..50)
        .map(|i| (0..i * 37 + 1).map(|_| rng.random::<u8>() | 1).collect())
        .collect();
    let mut dsts: Vec<DeviceBuffer<u32>> = sizes
        .iter()
        .map(|&n| DeviceBuffer::new(&dev, n))
        .collect::<Result<_, _>>()?;
    let mut dsts8: Vec<DeviceBuffer<u8>> = small
        .iter()
        .map(|v| DeviceBuffer::new(&dev, v.len()))
        .collect::<Result<_, _>>()?;
    for d in &mut dsts {
        stream.memset(d, 0xEE)?;
    }
    let mut list = Uploads::new();
    for (s, d) in srcs.iter().zip(&mut dsts) {
        list.push(s, d)?;
    }
    for (s, d) in small.iter().zip(&mut dsts8) {
        list.push(s, d)?;
    }
    ensure(list.len() == 350, || "list length".into())?;
    stager.upload_all(&stream, list)?;
    // Check with plain copies, then download everything back with the stager.
    for (i, (s, d)) in srcs.iter().zip(&dsts).enumerate() {
        let mut back = vec![0u32; s.len()];
        stream.copy_d2h(d, &mut back[..])?.wait()?;
        same(&format!("upload_all tensor {i}"), &back, s, seed)?;
    }
    let mut backs: Vec<Vec<u32>> = sizes.iter().map(|&n| vec![7u32; n]).collect();
    let mut backs8: Vec<Vec<u8>> = small.iter().map(|v| vec![7u8; v.len()]).collect();
    let mut list = Downloads::new();
    for (d, b) in dsts.iter().zip(&mut backs) {
        list.push(d, b)?;
    }
    for (d, b) in dsts8.iter().zip(&mut backs8) {
        list.push(d, b)?;
    }
    stager.download_all(&stream, list)?;
    for (i, (b, s)) in backs.iter().zip(&srcs).enumerate() {
        same(&format!("download_all tensor {i}"), b, s, seed)?;
    }
    for (i, (b, s)) in backs8.iter().zip(&small).enumerate() {
        same(&format!("download_all u8 tensor {i}"), b, s, seed)?;
    }
    Ok(())
}

fn packed_mixed_types() -> R {
    let dev = dev0()?;
    let stream = dev.stream()?;
    let stager = Stager::new(&dev, config(4, 512, 8))?;
    let (mut rng, seed) = rng();
    let floats: Vec<Vec<f32>> = (0..1000)
        .map(|_| (0..1000).map(|_| rng.random::<f32>() + 0.5).collect())
        .collect();
    let labels: Vec<i64> = (0..1000).map(|_| rng.random_range(1..1000)).collect();
    let odd: Vec<u8> = (0..4099).map(|_| rng.random::<u8>() | 1).collect();
    let mut packer = Packer::new();
    let hf: Vec<_> = floats
        .iter()
        .map(|f| packer.push(f))
        .collect::<Result<_, _>>()?;
    let hodd = packer.push(&odd)?;
    let hl = packer.push(&labels)?;
    let empty: [u16; 0] = [];
    let he = packer.push(&empty)?;
    let batch = stager.upload_packed(&stream, &packer)?;
    for (i, (h, f)) in hf.iter().zip(&floats).enumerate() {
        let v = batch.get(*h)?;
        ensure(v.as_device_ptr() as usize % 256 == 0, || "alignment".into())?;
        let mut back = vec![0f32; f.len()];
        stream.copy_d2h(&v, &mut back[..])?.wait()?;
        same(&format!("packed tensor {i}"), &back, f, seed)?;
    }
    let mut back = vec![0u8; odd.len()];
    stream.copy_d2h(&batch.get(hodd)?, &mut back[..])?.wait()?;
    same("packed u8", &back, &odd, seed)?;
    let mut back = vec![0i64; labels.len()];
    stream.copy_d2h(&batch.get(hl)?, &mut back[..])?.wait()?;
    same("packed labels", &back, &labels, seed)?;
    ensure(batch.get(he)?.is_empty(), || "empty slice".into())
}

fn packed_foreign_handle_refused() -> R {
    let dev = dev0()?;
    let stream = dev.stream()?;
    let stager = Stager::new(&dev, config(2, 64, 2))?;
    let a = vec![1u32; 100];
    let b = vec![2u32; 10];
    let mut pa = Packer::new();
    let ha = pa.push(&a)?;
    let mut pb = Packer::new();
    pb.push(&b)?;
    let batch = stager.upload_packed(&stream, &pb)?;
    ensure(
        matches!(batch.get(ha), Err(Error::InvalidArgument { .. })),
        || "a handle from another packer must be refused".into(),
    )?;
    // A slice pushed after the upload lies beyond the arena: refused, not a view past its end.
    let late = vec![3u32; 1000];
    let hl = pb.push(&late)?;
    ensure(
        matches!(batch.get(hl), Err(Error::InvalidArgument { .. })),
        || "a handle pushed after the upload must be refused".into(),
    )
}

/// Fresh random f32 tensors of the given lengths, and i64 labels (never all zero).
fn tensors(lens: &[usize]) -> (Vec<Vec<f32>>, Vec<i64>, u64) {
    let (mut rng, seed) = rng();
    let floats = lens
        .iter()
        .map(|&n| (0..n).map(|_| rng.random::<f32>() + 0.5).collect())
        .collect();
    let labels = (0..lens.len().max(1))
        .map(|_| rng.random_range(1..i64::MAX))
        .collect();
    (floats, labels, seed)
}

/// One arena filled by four calls of different sizes. Call 1's views are read by copies queued
/// on another stream behind a kernel, so they run after call 2 has returned: call 2's upload
/// must wait for them (the copies see call 1's data, not call 2's). A smaller batch reuses the
/// arena in place; a larger one grows it; every batch's data is checked.
fn packed_arena_reuse_and_growth() -> R {
    let dev = dev0()?;
    let (up, readers) = (dev.stream()?, dev.stream()?);
    let stager = Stager::new(&dev, config(4, 256, 8))?;
    let mut arena = PackedArena::new();
    ensure(arena.capacity() == 0 && arena.device().is_none(), || {
        "a new arena allocates nothing".into()
    })?;

    // Call 1: 300 tensors of 1000 floats and the labels.
    let (floats1, labels1, seed1) = tensors(&[1000; 300]);
    let mut packer = Packer::new();
    let h1: Vec<_> = floats1
        .iter()
        .map(|f| packer.push(f))
        .collect::<Result<_, _>>()?;
    let hl1 = packer.push(&labels1)?;
    // Allocated first: nothing that might wait for the device runs once the readers are queued.
    let mut copies: Vec<DeviceBuffer<f32>> = h1
        .iter()
        .map(|h| DeviceBuffer::<f32>::new(&dev, h.len()))
        .collect::<Result<_, _>>()?;
    let mut labels_copy = DeviceBuffer::<i64>::new(&dev, labels1.len())?;
    let (cap1, base1) = {
        let batch = stager.upload_packed_into(&up, &packer, &mut arena)?;
        ensure(batch.bytes() == packer.bytes(), || "batch bytes".into())?;
        // The readers start only after a kernel: their copies run after call 2 has been queued.
        readers.spin(Duration::from_millis(200))?;
        for (h, c) in h1.iter().zip(copies.iter_mut()) {
            readers.copy_d2d(&batch.get(*h)?, c)?;
        }
        readers.copy_d2d(&batch.get(hl1)?, &mut labels_copy)?;
        (batch.capacity(), batch.get(h1[0])?.as_device_ptr() as usize)
    };
    ensure(cap1 >= packer.bytes(), || "capacity below the batch".into())?;
    ensure(arena.capacity() == cap1, || "capacity".into())?;
    drop(packer);

    // Call 2: smaller (fits), different data over the same bytes.
    let (floats2, labels2, seed2) = tensors(&[700, 1, 4099, 250_000]);
    let mut packer = Packer::new();
    let h2: Vec<_> = floats2
        .iter()
        .map(|f| packer.push(f))
        .collect::<Result<_, _>>()?;
    let hl2 = packer.push(&labels2)?;
    let started = Instant::now();
    {
        let batch = stager.upload_packed_into(&up, &packer, &mut arena)?;
        // A state check, not a clock: the readers' 200 ms kernel still runs when it returns.
        let busy = !readers.is_idle()?;
        ensure(busy, || {
            format!(
                "upload_packed_into returned after {:?} with the readers idle (should only order the GPU)",
                started.elapsed()
            )
        })?;
        ensure(batch.capacity() == cap1, || "reused arena grew".into())?;
        ensure(batch.get(h2[0])?.as_device_ptr() as usize == base1, || {
            "a batch that fits was not put in the same arena".into()
        })?;
        check_arena_batch(&up, &batch, &h2, &floats2, hl2, &labels2, seed2, "call 2")?;
    }
    // Call 1's copies ran after call 2 was queued, and still saw call 1's data.
    for (i, (c, f)) in copies.iter().zip(&floats1).enumerate() {
        let mut back = vec![0f32; f.len()];
        up.copy_d2h(c, &mut back[..])?.wait()?;
        same(
            &format!("call 1 tensor {i}, read behind call 2"),
            &back,
            f,
            seed1,
        )?;
    }
    let mut back = vec![0i64; labels1.len()];
    up.copy_d2h(&labels_copy, &mut back[..])?.wait()?;
    same("call 1 labels, read behind call 2", &back, &labels1, seed1)?;
    drop(packer);

    // Call 3: larger than the arena: it grows (to the batch plus an eighth), data checked.
    let (floats3, labels3, seed3) = tensors(&[100_000; 5]);
    let mut packer = Packer::new();
    let h3: Vec<_> = floats3
        .iter()
        .map(|f| packer.push(f))
        .collect::<Result<_, _>>()?;
    let hl3 = packer.push(&labels3)?;
    ensure(packer.bytes() > cap1, || "call 3 must not fit".into())?;
    {
        // The previous contents are still read on `readers`: growing frees them after that.
        readers.spin(Duration::from_millis(50))?;
        let batch = stager.upload_packed_into(&readers, &packer, &mut arena)?;
        let cap = batch.capacity();
        ensure(
            cap >= packer.bytes() && cap <= packer.bytes() + packer.bytes() / 8,
            || format!("grown to {cap} for {} bytes", packer.bytes()),
        )?;
        check_arena_batch(&up, &batch, &h3, &floats3, hl3, &labels3, seed3, "call 3")?;
    }
    let cap3 = arena.capacity();
    drop(packer);

    // Call 4: small again on the grown arena, on the first stream.
    let (floats4, labels4, seed4) = tensors(&[3, 5, 8]);
    let mut packer = Packer::new();
    let h4: Vec<_> = floats4
        .iter()
        .map(|f| packer.push(f))
        .collect::<Result<_, _>>()?;
    let hl4 = packer.push(&labels4)?;
    let batch = stager.upload_packed_into(&up, &packer, &mut arena)?;
    check_arena_batch(&up, &batch, &h4, &floats4, hl4, &labels4, seed4, "call 4")?;
    ensure(batch.capacity() == cap3, || {
        "a small batch shrank or grew the arena".into()
    })
}

#[allow(clippy::too_many_arguments)]
fn check_arena_batch(
    stream: &Stream,
    batch: &pinstream::ArenaBatch<'_>,
    handles: &[pinstream::Packed<f32>],
    floats: &[Vec<f32>],
    hl: pinstream::Packed<i64>,
    labels: &[i64],
    seed: u64,
    what: &str,
) -> R {
    for (i, (h, f)) in handles.iter().zip(floats).enumerate() {
        let v = batch.get(*h)?;
        ensure(v.as_device_ptr() as usize % 256 == 0, || "alignment".into())?;
        same(&format!("{what}: tensor {i}"), &v.to_vec(stream)?, f, seed)?;
    }
    same(
        &format!("{what}: labels"),
        &batch.get(hl)?.to_vec(stream)?,
        labels,
        seed,
    )
}

/// Handles of another packer, or pushed after the upload, are refused by an arena batch even
/// where the arena is long enough to hold them; an empty packer uploads nothing.
fn packed_arena_handles_and_errors() -> R {
    let dev = dev0()?;
    let stream = dev.stream()?;
    let stager = Stager::new(&dev, config(2, 64, 2))?;
    let mut arena = PackedArena::with_capacity(&stream, 1 << 20)?;
    ensure(arena.capacity() == 1 << 20, || "with_capacity".into())?;
    let (mut rng, seed) = rng();
    let a: Vec<u32> = (0..100).map(|_| rng.random::<u32>() | 1).collect();
    let b: Vec<u32> = (0..10).map(|_| rng.random::<u32>() | 1).collect();
    let mut pa = Packer::new();
    let ha = pa.push(&a)?;
    let mut pb = Packer::new();
    let hb = pb.push(&b)?;
    let batch = stager.upload_packed_into(&stream, &pb, &mut arena)?;
    ensure(
        matches!(batch.get(ha), Err(Error::InvalidArgument { .. })),
        || "a handle from another packer must be refused".into(),
    )?;
    same(
        "the batch's slice",
        &batch.get(hb)?.to_vec(&stream)?,
        &b,
        seed,
    )?;
    let late = vec![3u32; 1000];
    let hl = pb.push(&late)?;
    ensure(
        matches!(batch.get(hl), Err(Error::InvalidArgument { .. })),
        || "a handle pushed after the upload must be refused, even inside the arena".into(),
    )?;
    // The views' borrows end here: the arena can be filled again.
    let empty = Packer::new();
    let batch = stager.upload_packed_into(&stream, &empty, &mut arena)?;
    ensure(batch.bytes() == 0 && batch.as_view()?.is_empty(), || {
        "an empty batch".into()
    })?;
    ensure(arena.capacity() == 1 << 20, || {
        "an empty batch changed the arena".into()
    })
}

fn temp_file(bytes: &[u8]) -> std::io::Result<std::path::PathBuf> {
    let dir = std::env::temp_dir().join(format!("pinstream-staging-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join(format!("{}.bin", rand::random::<u64>()));
    std::fs::File::create(&path)?.write_all(bytes)?;
    Ok(path)
}

fn file_offsets() -> R {
    let dev = dev0()?;
    let stream = dev.stream()?;
    let stager = Stager::new(&dev, config(4, 256, 6))?;
    let (data, seed) = random_bytes((9 << 20) + 333);
    let path = temp_file(&data)?;
    let file = FileSource::open(&path)?;
    ensure(file.len() == data.len() as u64, || "length".into())?;
    for (off, len) in [
        (0usize, data.len()),
        (1, 100),
        (4096, 1 << 20),
        (12345, (5 << 20) + 1),
        (data.len() - 7, 7),
    ] {
        let mut g = Guarded::new(&stream, len)?;
        stager.upload_file(&stream, &file, off as u64, &mut g.view_mut())?;
        same(
            &format!("file at {off}, {len} bytes"),
            &g.read(&stream)?,
            &data[off..off + len],
            seed,
        )?;
    }
    let _ = std::fs::remove_file(&path);
    Ok(())
}

fn file_short_and_missing() -> R {
    let dev = dev0()?;
    let stream = dev.stream()?;
    let stager = Stager::new(&dev, config(2, 64, 2))?;
    let (data, _) = random_bytes(100_000);
    let path = temp_file(&data)?;
    let file = FileSource::open(&path)?;
    let mut d = DeviceBuffer::<u8>::new(&dev, 100_001)?;
    match stager.upload_file(&stream, &file, 0, &mut d) {
        Err(Error::Io {
            path: p,
            offset: 0,
            len: 100_001,
            ..
        }) if p == path.display().to_string() => {}
        other => return Err(format!("a range past the end gave {other:?}").into()),
    }
    let mut d = DeviceBuffer::<u8>::new(&dev, 10)?;
    ensure(
        matches!(
            stager.upload_file(&stream, &file, u64::MAX - 3, &mut d),
            Err(Error::Io { .. })
        ),
        || "an offset that overflows must be an Io error".into(),
    )?;
    let missing = path.with_extension("missing");
    match FileSource::open(&missing) {
        Err(Error::Io { path: p, .. }) if p == missing.display().to_string() => {}
        other => return Err(format!("a missing file gave {other:?}").into()),
    }
    let _ = std::fs::remove_file(&path);
    Ok(())
}

fn file_truncated_after_open() -> R {
    let dev = dev0()?;
    let stream = dev.stream()?;
    let stager = Stager::new(&dev, config(3, 64, 3))?;
    let (data, seed) = random_bytes(4 << 20);
    let path = temp_file(&data)?;
    let file = FileSource::open(&path)?;
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)?
        .set_len(1 << 20)?;
    let mut d = DeviceBuffer::<u8>::new(&dev, data.len())?;
    match stager.upload_file(&stream, &file, 0, &mut d) {
        Err(Error::Io { message, .. }) if message.contains("ends") => {}
        other => return Err(format!("a file cut short gave {other:?}").into()),
    }
    // Nothing stays claimed: every slot works again, and the buffer is usable.
    roundtrip_bytes(&stager, &stream, 3 << 20, "after a short read")?;
    let (fresh, _) = random_bytes(d.len());
    stager.upload(&stream, &fresh, &mut d)?;
    let mut back = vec![0u8; d.len()];
    stream.copy_d2h(&d, &mut back[..])?.wait()?;
    let _ = std::fs::remove_file(&path);
    same("buffer after a failed file upload", &back, &fresh, seed)
}

fn file_direct() -> R {
    let dev = dev0()?;
    let stream = dev.stream()?;
    let stager = Stager::new(&dev, config(4, 256, 4))?;
    let (data, seed) = random_bytes((3 << 20) + 5000);
    // /tmp may be tmpfs (no O_DIRECT); try the working directory's filesystem too.
    let mut tried = Vec::new();
    for dir in [std::env::current_dir()?, std::env::temp_dir()] {
        let path = dir.join(format!(".pinstream-direct-{}.bin", rand::random::<u64>()));
        std::fs::File::create(&path)?.write_all(&data)?;
        let opened = FileSource::open_direct(&path);
        let result = (|| -> R {
            let file = match opened {
                Ok(f) => f,
                Err(Error::Io { message, .. }) if message.contains("O_DIRECT") => {
                    tried.push(format!("{}: {message}", dir.display()));
                    return Ok(());
                }
                Err(e) => return Err(e.into()),
            };
            ensure(file.is_direct(), || "direct flag".into())?;
            let mut d = DeviceBuffer::<u8>::new(&dev, 4096)?;
            ensure(
                matches!(
                    stager.upload_file(&stream, &file, 100, &mut d),
                    Err(Error::InvalidArgument { .. })
                ),
                || "a misaligned O_DIRECT offset must be refused".into(),
            )?;
            // Unaligned length at the end of the file.
            for (off, len) in [(0usize, data.len()), (8192, data.len() - 8192), (4096, 777)] {
                let mut g = Guarded::new(&stream, len)?;
                stager.upload_file(&stream, &file, off as u64, &mut g.view_mut())?;
                same(
                    &format!("O_DIRECT at {off}, {len} bytes"),
                    &g.read(&stream)?,
                    &data[off..off + len],
                    seed,
                )?;
            }
            tried.push(format!("{}: ok", dir.display()));
            Ok(())
        })();
        let _ = std::fs::remove_file(&path);
        result?;
    }
    println!("O_DIRECT: {}", tried.join("; "));
    Ok(())
}

fn errors_typed_and_nothing_lost() -> R {
    let dev = dev0()?;
    let stream = dev.stream()?;
    let stager = Stager::new(&dev, config(2, 64, 2))?;
    let src = vec![1u8; 1000];
    let mut d = DeviceBuffer::<u8>::new(&dev, 999)?;
    ensure(
        matches!(
            stager.upload(&stream, &src, &mut d),
            Err(Error::LengthMismatch { .. })
        ),
        || "length mismatch".into(),
    )?;
    let mut back = vec![0u8; 1001];
    ensure(
        matches!(
            stager.download(&stream, &d, &mut back),
            Err(Error::LengthMismatch { .. })
        ),
        || "download length mismatch".into(),
    )?;
    for bad in [
        config(0, 64, 1),
        config(1, 65, 1),
        config(1, 64, 0),
        StagerConfig {
            slots: 4096,
            slot_bytes: 1 << 30,
            ..StagerConfig::default()
        },
    ] {
        ensure(
            matches!(
                Stager::new(&dev, bad.clone()),
                Err(Error::InvalidArgument { .. })
            ),
            || format!("{bad:?} must be refused"),
        )?;
    }
    let mut list = Uploads::new();
    let mut small = DeviceBuffer::<u8>::new(&dev, 10)?;
    ensure(
        matches!(
            list.push(&src, &mut small),
            Err(Error::LengthMismatch { .. })
        ),
        || "list length mismatch".into(),
    )?;
    ensure(list.is_empty(), || {
        "a refused pair must not be added".into()
    })?;
    // The stager still works after the refusals.
    roundtrip_bytes(&stager, &stream, 1 << 20, "after errors")
}

fn upload_returns_before_device() -> R {
    let dev = dev0()?;
    let stream = dev.stream()?;
    // 16 MiB of slots: an 8 MiB upload fits without waiting for any DMA.
    let stager = Stager::new(&dev, config(4, 1024, 16))?;
    let (mut src, seed) = random_bytes(8 << 20);
    let want = src.clone();
    let mut d = DeviceBuffer::<u8>::new(&dev, src.len())?;
    stream.spin(Duration::from_millis(300))?;
    let t = Instant::now();
    stager.upload(&stream, &src, &mut d)?;
    // A state check, not a clock: the 300 ms kernel still runs when the call returns.
    let busy = !stream.is_idle()?;
    let took = t.elapsed();
    // The source is ours again: scribble over it.
    src.fill(0);
    ensure(busy, || {
        format!("upload behind a 300 ms kernel returned after {took:?} with the stream idle: it waited for the device")
    })?;
    let mut back = vec![0u8; want.len()];
    stream.copy_d2h(&d, &mut back[..])?.wait()?;
    same("upload behind a busy stream", &back, &want, seed)
}

fn drop_engine_with_dma_in_flight() -> R {
    let dev = dev0()?;
    let stream = dev.stream()?;
    let (src, seed) = random_bytes(8 << 20);
    let mut d = DeviceBuffer::<u8>::new(&dev, src.len())?;
    {
        let stager = Stager::new(&dev, config(4, 1024, 16))?;
        stream.spin(Duration::from_millis(200))?;
        stager.upload(&stream, &src, &mut d)?;
        let t = Instant::now();
        drop(stager);
        // The drop waited for the DMAs reading its slots.
        ensure(stream.is_idle()?, || {
            format!(
                "the stager was freed after {:?} with its DMAs still queued",
                t.elapsed()
            )
        })?;
    }
    // Reuse the memory the slots had (a new pinned allocation may land there) while checking.
    let _other =
        pinstream::PinnedBuffer::<u8>::new(&dev, 16 << 20, pinstream::HostAlloc::PORTABLE)?;
    let mut back = vec![0u8; src.len()];
    stream.copy_d2h(&d, &mut back[..])?.wait()?;
    same("upload with the stager dropped", &back, &src, seed)
}

fn upload_after_kernel_use() -> R {
    // The destination was last written by a kernel on another stream: the upload lands after it.
    let dev = dev0()?;
    let (s1, s2) = (dev.stream()?, dev.stream()?);
    let stager = Stager::new(&dev, config(4, 256, 8))?;
    let (src, seed) = random_bytes(4 << 20);
    let mut d = DeviceBuffer::<u8>::new(&dev, src.len())?;
    s1.spin(Duration::from_millis(100))?;
    s1.memset(&mut d, 0x77)?;
    stager.upload(&s2, &src, &mut d)?;
    let mut back = vec![0u8; src.len()];
    s2.copy_d2h(&d, &mut back[..])?.wait()?;
    same(
        "upload ordered after a memset on another stream",
        &back,
        &src,
        seed,
    )
}

fn wrong_device() -> R {
    let (d0, d1) = (Device::get(0)?, Device::get(1)?);
    let stager = Stager::new(&d0, config(2, 64, 2))?;
    let s1 = d1.stream()?;
    let src = vec![1u8; 1 << 20];
    let mut d = DeviceBuffer::<u8>::new(&d0, src.len())?;
    ensure(
        matches!(
            stager.upload(&s1, &src, &mut d),
            Err(Error::WrongDevice { .. })
        ),
        || "a stream on another device must be refused".into(),
    )?;
    let s0 = d0.stream()?;
    let mut d1buf = DeviceBuffer::<u8>::new(&d1, src.len())?;
    ensure(
        matches!(
            stager.upload(&s0, &src, &mut d1buf),
            Err(Error::WrongDevice { .. })
        ),
        || "a destination on another device must be refused".into(),
    )
}

fn slots_from_a_shared_pool() -> R {
    let dev = dev0()?;
    let stream = dev.stream()?;
    let pool = pinstream::PinnedPool::new(&dev, pinstream::PoolConfig::default())?;
    {
        let stager = Stager::with_pool(&pool, config(3, 256, 5))?;
        let s = pool.stats();
        ensure(s.in_use_bytes == 5 * (256 << 10), || {
            format!("slots in use: {s:?}")
        })?;
        roundtrip_bytes(&stager, &stream, 5 << 20, "pool slots")?;
    }
    let s = pool.stats();
    ensure(
        s.in_use_bytes == 0 && s.cached_bytes == 5 * (256 << 10),
        || format!("slots must go back to the pool: {s:?}"),
    )?;
    // A second stager takes them from the cache.
    let stager = Stager::with_pool(&pool, config(3, 256, 5))?;
    let s2 = pool.stats();
    ensure(s2.hits >= s.hits + 5, || {
        format!("slots from the cache: {s2:?}")
    })?;
    roundtrip_bytes(&stager, &stream, 3 << 20, "pool slots, second stager")
}
