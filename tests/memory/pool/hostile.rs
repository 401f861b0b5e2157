//! A hostile caller against pinstream's stream-ordered device pool (`DeviceBuffer::new_async`,
//! `Device::empty_cache`, `Device::pool_reserved`) and against page-locked pool blocks exported
//! through DLPack (`dlpack::Tensor::from_pool_block`, `Tensor::host_as_cpu`).
//!
//! The attacks: buffers leaked with `mem::forget` (their memory must never be handed out again),
//! `empty_cache` from many threads while others allocate, write, read and free on several
//! streams, a buffer freed on one stream while another stream still writes or reads it (the pool
//! must not hand its memory to a third stream before that work is over), `cudaMalloc` after the
//! pool kept a large block, a large allocation while an equally large free is still queued,
//! out-of-memory requests, the stream a buffer was allocated on dropped first, an exported
//! tensor across `empty_cache`; pool blocks whose pool was dropped first, released from many
//! threads, never released, released on a busy consumer stream, of a read-only registered pool,
//! empty, 0-d, relabelled twice. A trial passes when the library resisted (a typed error, the
//! right bytes, memory that lives exactly as long as it is used, no hang) and fails when it
//! broke.
//!
//! Every trial needs a GPU and is ignored where there is none. The pool is one per device and
//! process, so the trials run one at a time. Build them for a GPU machine with
//! `cargo test --release --test memory --no-run`.

// The attacks drop and forget values on purpose.
#![allow(clippy::drop_non_drop)]

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use crate::common::{ensure, random_bytes, same, within, R};
use libtest_mimic::{Failed, Trial};
use pinstream::dlpack::abi::{
    DLManagedTensorVersioned, FLAG_READ_ONLY, KDL_CPU, KDL_CUDA, KDL_CUDA_HOST,
};
use pinstream::dlpack::{Imported, Part, Tensor};
use pinstream::{
    kernels, Device, DeviceBuffer, Error, HostRegister, PinnedPool, PoolBacking, PoolConfig, Stream,
};

use crate::common::trial;

/// Prefix of this module's trial names (its path in the binary).
const PREFIX: &str = "pool/hostile/";

const BOUND: Duration = Duration::from_secs(120);
const MIB: usize = 1 << 20;

/// The trials of this module, named `pool/hostile/...`.
pub fn trials() -> Vec<Trial> {
    let no_gpu = !pinstream::available();
    let t = |name: &str, f: fn() -> R| {
        let name = format!("gpu/{name}");
        let what = name.clone();
        trial(PREFIX, name, move || within(&what, BOUND, f)).with_ignored_flag(no_gpu)
    };
    vec![
        // First: before anything else made a pool.
        t(
            "pool/unused_ordinals_report_nothing_and_empty_quietly",
            unused_ordinals,
        ),
        t(
            "pool/forgotten_buffers_are_never_handed_out_again",
            forgotten_buffers,
        ),
        t(
            "pool/free_waits_for_another_streams_writes_before_reuse",
            free_waits_for_writes,
        ),
        t(
            "pool/free_waits_for_another_streams_reads_before_reuse",
            free_waits_for_reads,
        ),
        t(
            "pool/empty_cache_storm_while_many_streams_allocate",
            empty_cache_storm,
        ),
        t(
            "pool/out_of_memory_is_typed_and_leaves_no_stale_error",
            oom_is_typed,
        ),
        t(
            "pool/cuda_malloc_gets_the_memory_the_pool_kept",
            cuda_malloc_after_pool_kept,
        ),
        t(
            "pool/large_alloc_while_an_equal_free_is_queued_elsewhere",
            large_alloc_with_pending_free,
        ),
        t(
            "pool/allocation_stream_dropped_before_the_buffer",
            stream_dropped_first,
        ),
        t(
            "pool/exported_tensor_survives_empty_cache",
            exported_survives_empty_cache,
        ),
        t(
            "pool/devices_have_independent_pools_and_peer_copies_work",
            multi_device,
        ),
        t(
            "pool/live_counts_flat_and_reserved_bounded_over_cycles",
            live_counts_flat,
        ),
        t(
            "host/host_as_cpu_refusals_hand_the_tensor_back",
            host_as_cpu_refusals,
        ),
        t("host/read_only_blocks_export_read_only", read_only_blocks),
        t(
            "host/block_outlives_its_pool_and_frees_once",
            block_outlives_pool,
        ),
        t(
            "host/split_block_released_from_many_threads",
            split_block_many_threads,
        ),
        t(
            "host/never_released_block_is_never_reused",
            never_released_block,
        ),
        t(
            "host/busy_consumer_stream_keeps_the_block_out_of_the_pool",
            busy_consumer_stream,
        ),
        t("host/empty_and_0d_blocks", empty_and_0d_blocks),
    ]
}

// ---------------------------------------------------------------------------------------------
// Helpers.

fn dev0() -> Result<Device, Failed> {
    Ok(Device::get(0)?)
}

/// Reads a whole device buffer back.
fn read_back(s: &Stream, d: &DeviceBuffer<u8>) -> Result<Vec<u8>, Failed> {
    let mut out = vec![0u8; d.len()];
    if !out.is_empty() {
        s.copy_d2h(d, &mut out[..])?.wait()?;
    }
    Ok(out)
}

/// Fails naming the first byte that is not `want`.
fn all_bytes(what: &str, got: &[u8], want: u8) -> R {
    match got.iter().position(|&b| b != want) {
        None => Ok(()),
        Some(i) => {
            let bad = got.iter().filter(|&&b| b != want).count();
            Err(format!(
                "{what}: {bad} of {} bytes are not {want:#04x}, first at {i}: {:#04x}",
                got.len(),
                got[i]
            )
            .into())
        }
    }
}

/// Whether `[a, a + n)` and `[b, b + m)` overlap.
fn overlaps(a: usize, n: usize, b: usize, m: usize) -> bool {
    a < b + m && b < a + n
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

/// The bytes a handed-over host tensor shows its consumer (its `data` pointer, read as the
/// consumer would).
///
/// # Safety
///
/// `p` was handed over, is not released yet, and is compact host memory.
unsafe fn host_bytes_of(p: *mut DLManagedTensorVersioned, n: usize) -> Vec<u8> {
    // SAFETY: the caller's.
    unsafe {
        let data = (*p).dl_tensor.data as *const u8;
        if n == 0 || data.is_null() {
            return Vec::new();
        }
        std::slice::from_raw_parts(data, n).to_vec()
    }
}

/// Gives the pool's memory back at the end of a trial that filled the device, whatever it
/// returned.
fn tidy(dev: &Device) {
    let _ = dev.synchronize();
    let _ = dev.empty_cache();
}

// ---------------------------------------------------------------------------------------------
// Device pool.

/// `pool_reserved` and `empty_cache` on every ordinal, used or not, are plain calls; an ordinal
/// past the count is refused before either could index a table. On a device whose pool was
/// never made nothing is reserved.
fn unused_ordinals() -> R {
    let n = Device::count()?;
    for i in 0..n {
        let d = Device::get(i)?;
        let before = d.pool_reserved()?;
        d.empty_cache()?;
        d.empty_cache()?;
        let after = d.pool_reserved()?;
        ensure(after <= before, || {
            format!("device {i}: reserved {before} -> {after} after empty_cache")
        })?;
        // Last ordinal of a machine with more than one: nothing in this process used it yet.
        if n > 1 && i == n - 1 {
            ensure(after == 0, || {
                format!("device {i} was never used but its pool reserves {after} bytes")
            })?;
        }
    }
    let e = Device::get(n).map(|_| ());
    ensure(matches!(e, Err(Error::InvalidArgument { .. })), || {
        format!("Device::get({n}) of {n} devices: {e:?}")
    })?;
    let e = Device::get(usize::MAX).map(|_| ());
    ensure(matches!(e, Err(Error::InvalidArgument { .. })), || {
        format!("Device::get(usize::MAX): {e:?}")
    })
}

/// Buffers leaked with `mem::forget` keep their memory for ever: `empty_cache` must not give it
/// back, and no later allocation (on any stream, before or after `empty_cache`) may overlap it.
fn forgotten_buffers() -> R {
    let dev = dev0()?;
    let (s1, s2) = (dev.stream()?, dev.stream()?);
    let n = 4 * MIB;
    let mut forgotten = Vec::new();
    for i in 0..8u8 {
        let s = if i % 2 == 0 { &s1 } else { &s2 };
        let mut b = DeviceBuffer::<u8>::new_async(s, n)?;
        s.memset(&mut b, 0x40 + i)?;
        if i % 2 == 0 {
            forgotten.push((b.as_device_ptr() as usize, 0x40 + i));
            std::mem::forget(b);
        } else {
            drop(b);
        }
    }
    dev.synchronize()?;
    dev.empty_cache()?;
    let reserved = dev.pool_reserved()?;
    ensure(reserved >= (forgotten.len() * n) as u64, || {
        format!(
            "the pool reserves {reserved} bytes after empty_cache, but {} bytes are leaked \
             buffers still allocated",
            forgotten.len() * n
        )
    })?;
    let mut live = Vec::new();
    for round in 0..2 {
        for i in 0..32usize {
            let s = if i % 2 == 0 { &s1 } else { &s2 };
            let mut b = DeviceBuffer::<u8>::new_async(s, n)?;
            let p = b.as_device_ptr() as usize;
            if let Some((q, _)) = forgotten.iter().find(|(q, _)| overlaps(p, n, *q, n)) {
                return Err(format!(
                    "round {round}: a new buffer at {p:#x} overlaps the forgotten one at {q:#x}"
                )
                .into());
            }
            s.memset(&mut b, 0xEE)?;
            live.push(b);
        }
        dev.synchronize()?;
        live.clear();
        dev.empty_cache()?;
    }
    Ok(())
}

/// Buffer A (allocated on s1) is written by a long queue of fills on s2, then dropped: its free
/// is queued on s1 after s2's fills. A buffer B allocated on s3 at once, the same size, may get
/// A's memory; its own fill on s3 must never be overwritten by A's late fills.
fn free_waits_for_writes() -> R {
    let dev = dev0()?;
    let (s1, s2, s3) = (dev.stream()?, dev.stream()?, dev.stream()?);
    let n = 64 * MIB;
    let mut reused = 0;
    for round in 0..6 {
        let mut a = DeviceBuffer::<u8>::new_async(&s1, n)?;
        let a_ptr = a.as_device_ptr() as usize;
        s2.spin(Duration::from_millis(100))?;
        for _ in 0..20 {
            kernels::fill(&s2, &mut a, 0x11u8)?;
        }
        drop(a);
        let mut b = DeviceBuffer::<u8>::new_async(&s3, n)?;
        if overlaps(a_ptr, n, b.as_device_ptr() as usize, n) {
            reused += 1;
        }
        kernels::fill(&s3, &mut b, 0x22u8)?;
        let got = read_back(&s3, &b)?;
        all_bytes(
            &format!("round {round}: B after A's queued fills"),
            &got,
            0x22,
        )?;
        drop(b);
        dev.synchronize()?;
    }
    eprintln!("free_waits_for_writes: B reused A's memory in {reused} of 6 rounds");
    Ok(())
}

/// Buffer A holds a pattern; s2 (busy first) copies it into C; A is dropped at once and B,
/// allocated on s3, is filled with garbage. C must hold the pattern: A's memory must not be
/// reused before s2's reads of it.
fn free_waits_for_reads() -> R {
    let dev = dev0()?;
    let (s1, s2, s3) = (dev.stream()?, dev.stream()?, dev.stream()?);
    let n = 32 * MIB;
    let (v, seed) = random_bytes(n);
    for round in 0..6 {
        let mut a = DeviceBuffer::<u8>::new_async(&s1, n)?;
        s1.copy_h2d(&v[..], &mut a)?.wait()?;
        let mut c = DeviceBuffer::<u8>::new(&dev, n)?;
        s2.spin(Duration::from_millis(100))?;
        s2.copy_d2d(&a, &mut c)?;
        drop(a);
        let mut b = DeviceBuffer::<u8>::new_async(&s3, n)?;
        kernels::fill(&s3, &mut b, 0xEEu8)?;
        drop(b);
        let got = read_back(&s2, &c)?;
        same(&format!("round {round}: C copied from A"), &got, &v, seed)?;
    }
    dev.synchronize()?;
    Ok(())
}

/// Four threads allocate, write, check and free buffers of varying sizes on their own streams
/// (and hand some to a second stream) while two threads call `empty_cache` and `pool_reserved`
/// in a loop. Every buffer must read back what was written; nothing may hang or error.
fn empty_cache_storm() -> R {
    let dev = dev0()?;
    let done = Arc::new(AtomicBool::new(false));
    let trims = Arc::new(AtomicUsize::new(0));
    let mut trimmers = Vec::new();
    for _ in 0..2 {
        let (done, trims) = (done.clone(), trims.clone());
        trimmers.push(std::thread::spawn(move || -> Result<(), String> {
            while !done.load(Ordering::Relaxed) {
                dev.empty_cache().map_err(|e| e.to_string())?;
                dev.pool_reserved().map_err(|e| e.to_string())?;
                trims.fetch_add(1, Ordering::Relaxed);
                std::thread::yield_now();
            }
            Ok(())
        }));
    }
    let mut workers = Vec::new();
    for w in 0..4u32 {
        workers.push(std::thread::spawn(move || -> Result<(), String> {
            let e = |e: Error| e.to_string();
            let s = dev.stream().map_err(e)?;
            let other = dev.stream().map_err(e)?;
            for i in 0..150u32 {
                let len = 1 + ((i as usize * 7919 + w as usize * 104_729) % (2 * MIB));
                let value = (w << 24) | i;
                let mut b = DeviceBuffer::<u32>::new_async(&s, len).map_err(e)?;
                // Half of them written on another stream than the one that frees them.
                let on = if i % 2 == 0 { &s } else { &other };
                kernels::fill(on, &mut b, value).map_err(e)?;
                let mut host = vec![0u32; len];
                let got = s
                    .copy_d2h(&b, &mut host[..])
                    .map_err(e)?
                    .wait()
                    .map_err(e)?;
                if let Some(j) = got.iter().position(|&x| x != value) {
                    return Err(format!(
                        "worker {w} round {i}: element {j} of {len} is {:#x}, want {value:#x}",
                        got[j]
                    ));
                }
                drop(b);
            }
            s.synchronize().map_err(e)?;
            Ok(())
        }));
    }
    let mut first: Option<String> = None;
    for h in workers {
        match h.join() {
            Ok(Ok(())) => {}
            Ok(Err(m)) => {
                first.get_or_insert(m);
            }
            Err(_) => {
                first.get_or_insert("a worker panicked".into());
            }
        }
    }
    done.store(true, Ordering::Relaxed);
    for h in trimmers {
        match h.join() {
            Ok(Ok(())) => {}
            Ok(Err(m)) => {
                first.get_or_insert(format!("empty_cache thread: {m}"));
            }
            Err(_) => {
                first.get_or_insert("an empty_cache thread panicked".into());
            }
        }
    }
    tidy(&dev);
    match first {
        Some(m) => Err(m.into()),
        None => ensure(trims.load(Ordering::Relaxed) > 0, || {
            "empty_cache never ran".into()
        }),
    }
}

/// Requests the device cannot hold are `Error::OutOfMemory` (or, past `usize`, a typed invalid
/// argument), not a panic; the failed allocation's error (and the retry after the trim) leaves
/// nothing behind for the next kernel launch's error check, and the stream and pool work on.
fn oom_is_typed() -> R {
    let dev = dev0()?;
    let s = dev.stream()?;
    let total = dev.total_memory()?;
    for _ in 0..3 {
        let e = DeviceBuffer::<u8>::new_async(&s, total.saturating_mul(2)).map(|_| ());
        ensure(matches!(e, Err(Error::OutOfMemory { .. })), || {
            format!("{} bytes on a {total}-byte device: {e:?}", total * 2)
        })?;
        // The next launch must not report the allocation's error.
        let mut small = DeviceBuffer::<u32>::new_async(&s, 1000)?;
        kernels::fill(&s, &mut small, 7u32)?;
        let mut host = vec![0u32; 1000];
        let got = s.copy_d2h(&small, &mut host[..])?.wait()?;
        ensure(got.iter().all(|&x| x == 7), || "fill after OOM".into())?;
    }
    let e = DeviceBuffer::<u64>::new_async(&s, usize::MAX / 4).map(|_| ());
    ensure(
        matches!(
            e,
            Err(Error::InvalidArgument { .. }) | Err(Error::OutOfMemory { .. })
        ),
        || format!("usize::MAX / 4 u64s: {e:?}"),
    )?;
    let e = DeviceBuffer::<u8>::new_async(&s, usize::MAX).map(|_| ());
    ensure(e.is_err(), || "usize::MAX bytes allocated".into())?;
    s.synchronize()?;
    Ok(())
}

/// The pool keeps a large freed block (release threshold: unbounded). A plain `cudaMalloc`
/// (`DeviceBuffer::new`, what the stream's scratch, the prefetcher's slots and every other
/// library use) of the same size must still succeed: "allocations trim the pool themselves
/// before they report OutOfMemory" (`Device::empty_cache`'s docs).
fn cuda_malloc_after_pool_kept() -> R {
    let dev = dev0()?;
    let s = dev.stream()?;
    tidy(&dev);
    let free = dev.memory_info()?.free;
    let kept = free / 10 * 6;
    {
        let mut b = DeviceBuffer::<u8>::new_async(&s, kept)?;
        s.memset(&mut b, 3)?;
    }
    s.synchronize()?;
    let reserved = dev.pool_reserved()?;
    let got = DeviceBuffer::<u8>::new(&dev, kept);
    let ok = got.is_ok();
    let err = got.err().map(|e| e.to_string());
    tidy(&dev);
    ensure(ok, || {
        format!(
            "DeviceBuffer::new({kept}) after a freed new_async of the same size (pool reserves \
             {reserved} bytes, {free} were free before): {err:?}"
        )
    })
}

/// A buffer of more than half the free memory is freed with its free still queued behind a long
/// kernel on s1; the same size is then asked for on s2. The pool must serve it (reusing the
/// memory after s1's free, in stream order) rather than report out of memory, and the new
/// buffer must hold what s2 writes.
fn large_alloc_with_pending_free() -> R {
    let dev = dev0()?;
    let (s1, s2) = (dev.stream()?, dev.stream()?);
    tidy(&dev);
    let free = dev.memory_info()?.free;
    let size = free / 100 * 55;
    let result = (|| -> R {
        let mut a = DeviceBuffer::<u8>::new_async(&s1, size)?;
        s1.memset(&mut a, 1)?;
        s1.spin(Duration::from_millis(500))?;
        drop(a);
        let mut b = DeviceBuffer::<u8>::new_async(&s2, size).map_err(|e| {
            format!("{size} bytes while an equal free is queued on another stream: {e}")
        })?;
        s2.memset(&mut b, 0x5A)?;
        let mut head = vec![0u8; MIB];
        s2.copy_d2h(&b.slice(..MIB)?, &mut head[..])?.wait()?;
        all_bytes("head of B", &head, 0x5A)?;
        let mut tail = vec![0u8; MIB];
        s2.copy_d2h(&b.slice(size - MIB..)?, &mut tail[..])?
            .wait()?;
        all_bytes("tail of B", &tail, 0x5A)
    })();
    tidy(&dev);
    result
}

/// The stream a buffer was allocated on (its free is queued there) is dropped by the caller
/// first; the buffer is then used on another stream, moved to another thread and dropped there.
fn stream_dropped_first() -> R {
    let dev = dev0()?;
    let other = dev.stream()?;
    let mut bufs = Vec::new();
    for i in 0..16u8 {
        let s = dev.stream()?;
        let mut b = DeviceBuffer::<u8>::new_async(&s, MIB + i as usize)?;
        s.memset(&mut b, i)?;
        drop(s);
        bufs.push(b);
    }
    for (i, b) in bufs.iter_mut().enumerate() {
        kernels::fill(&other, b, (i as u8) ^ 0xFF)?;
    }
    for (i, b) in bufs.iter().enumerate() {
        all_bytes(
            &format!("buffer {i}"),
            &read_back(&other, b)?,
            (i as u8) ^ 0xFF,
        )?;
    }
    let h = std::thread::spawn(move || drop(bufs));
    h.join().map_err(|_| "drop on another thread panicked")?;
    dev.synchronize()?;
    Ok(())
}

/// A device tensor exported (its buffer from the pool) and not yet released: `empty_cache` from
/// several threads must not take its memory, which the consumer then reads intact.
fn exported_survives_empty_cache() -> R {
    let dev = dev0()?;
    let (s1, s2) = (dev.stream()?, dev.stream()?);
    let n = 16 * MIB;
    let (v, seed) = random_bytes(n);
    let mut buf = DeviceBuffer::<u8>::new_async(&s1, n)?;
    s1.copy_h2d(&v[..], &mut buf)?.wait()?;
    let raw = Tensor::from_device(buf)?.into_versioned(Some(&s2))?;
    let raw = Raw(raw);
    let barrier = Arc::new(Barrier::new(4));
    let hs: Vec<_> = (0..4)
        .map(|_| {
            let b = barrier.clone();
            std::thread::spawn(move || {
                b.wait();
                for _ in 0..20 {
                    dev.empty_cache()?;
                }
                Ok::<_, Error>(())
            })
        })
        .collect();
    for h in hs {
        h.join().map_err(|_| "empty_cache thread panicked")??;
    }
    ensure(dev.pool_reserved()? >= n as u64, || {
        "empty_cache gave back the memory of an exported, unreleased tensor".into()
    })?;
    // SAFETY: handed over above, released once (by the import's drop).
    let imp = unsafe { Imported::from_versioned(raw.0)? };
    let mut out = vec![0u8; n];
    s2.copy_d2h(&imp.device_bytes()?, &mut out[..])?.wait()?;
    same("exported tensor after empty_cache", &out, &v, seed)?;
    drop(imp);
    tidy(&dev);
    Ok(())
}

/// With two devices or more: allocating on device 1 reserves nothing on device 0, and a peer
/// copy between two pool buffers either works (right bytes) or is a typed `NoPeerAccess`.
fn multi_device() -> R {
    if Device::count()? < 2 {
        eprintln!("multi_device: one device, nothing to attack");
        return Ok(());
    }
    let (d0, d1) = (Device::get(0)?, Device::get(1)?);
    let (s0, s1) = (d0.stream()?, d1.stream()?);
    tidy(&d0);
    tidy(&d1);
    let r0 = d0.pool_reserved()?;
    let n = 8 * MIB;
    let (v, seed) = random_bytes(n);
    let mut a = DeviceBuffer::<u8>::new_async(&s0, n)?;
    s0.copy_h2d(&v[..], &mut a)?.wait()?;
    let mut b = DeviceBuffer::<u8>::new_async(&s1, n)?;
    s1.memset(&mut b, 0)?;
    ensure(d0.pool_reserved()? <= r0 + 2 * n as u64, || {
        "device 1's allocation grew device 0's pool".into()
    })?;
    match s0.copy_peer(&a, &mut b) {
        Ok(()) => {
            let got = read_back(&s1, &b)?;
            same("peer copy between pool buffers", &got, &v, seed)?;
        }
        Err(Error::NoPeerAccess { .. }) => {}
        Err(e) => return Err(format!("peer copy between pool buffers: {e}").into()),
    }
    drop((a, b));
    tidy(&d0);
    tidy(&d1);
    Ok(())
}

/// 200 allocate / free rounds of varying sizes on two streams: pinstream's live count of device
/// memory comes back to where it was, and the pool holds at most a few buffers' worth.
fn live_counts_flat() -> R {
    let dev = dev0()?;
    let (s1, s2) = (dev.stream()?, dev.stream()?);
    tidy(&dev);
    let live0 = pinstream::memory::live().device_bytes;
    for i in 0..200usize {
        let s = if i % 3 == 0 { &s1 } else { &s2 };
        let mut b = DeviceBuffer::<u8>::new_async(s, MIB + (i * 4099) % (7 * MIB))?;
        s.memset(&mut b, i as u8)?;
    }
    dev.synchronize()?;
    let live1 = pinstream::memory::live().device_bytes;
    let reserved = dev.pool_reserved()?;
    tidy(&dev);
    ensure(live1 == live0, || {
        format!("live device bytes {live0} -> {live1} after every buffer was dropped")
    })?;
    ensure(reserved <= (64 * MIB) as u64, || {
        format!("the pool reserves {reserved} bytes after rounds of at most 8 MiB")
    })
}

// ---------------------------------------------------------------------------------------------
// Page-locked pool blocks through DLPack.

fn pool(dev: &Device) -> Result<PinnedPool, Failed> {
    Ok(PinnedPool::new(dev, PoolConfig::default())?)
}

/// `host_as_cpu` refuses a device tensor and an already relabelled one, handing each back
/// unchanged and still usable; the relabelled tensor keeps its memory and goes back to its pool
/// when dropped.
fn host_as_cpu_refusals() -> R {
    let dev = dev0()?;
    let s = dev.stream()?;
    let n = 1 << 16;
    let (v, seed) = random_bytes(n);
    // A device tensor: refused, handed back, still exportable with the right bytes.
    let mut d = DeviceBuffer::<u8>::new_async(&s, n)?;
    s.copy_h2d(&v[..], &mut d)?.wait()?;
    let back = match Tensor::from_device(d)?.host_as_cpu() {
        Ok(t) => return Err(format!("host_as_cpu took a device tensor: {t:?}").into()),
        Err(r) => {
            ensure(matches!(r.error, Error::InvalidArgument { .. }), || {
                format!("{:?}", r.error)
            })?;
            r.tensor
        }
    };
    ensure(back.device().device_type == KDL_CUDA, || {
        format!("{back:?}")
    })?;
    // SAFETY: handed over just above; released by the import's drop.
    let imp = unsafe { Imported::from_versioned(back.into_versioned(Some(&s))?)? };
    let mut out = vec![0u8; n];
    s.copy_d2h(&imp.device_bytes()?, &mut out[..])?.wait()?;
    same("device tensor handed back", &out, &v, seed)?;
    drop(imp);

    // A block: relabelled once, refused the second time, intact.
    let p = pool(&dev)?;
    let mut block = p.alloc::<u8>(n)?;
    block.as_mut_slice()?.copy_from_slice(&v);
    let addr = block.as_ptr() as usize;
    let t = Tensor::from_pool_block(block)?;
    ensure(t.device().device_type == KDL_CUDA_HOST, || format!("{t:?}"))?;
    let t = t.host_as_cpu().map_err(|r| r.error)?;
    ensure(
        t.device().device_type == KDL_CPU && t.device().device_id == 0,
        || format!("{t:?}"),
    )?;
    let t = match t.host_as_cpu() {
        Ok(t) => t, // accepting it again is harmless if nothing changed
        Err(r) => {
            ensure(matches!(r.error, Error::InvalidArgument { .. }), || {
                format!("{:?}", r.error)
            })?;
            r.tensor
        }
    };
    ensure(
        t.device().device_type == KDL_CPU && t.data_ptr() as usize == addr,
        || format!("after a second host_as_cpu: {t:?}"),
    )?;
    ensure(p.stats().in_use_bytes > 0, || "block not in use".into())?;
    let raw = t.into_versioned(None)?;
    // SAFETY: handed over, not released, compact host memory of `n` bytes.
    let got = unsafe { host_bytes_of(raw, n) };
    same("relabelled block", &got, &v, seed)?;
    // SAFETY: released once.
    unsafe { release_versioned(raw) };
    reaped()?;
    let st = p.stats();
    ensure(st.in_use_bytes == 0, || {
        format!("after the release: {st:?}")
    })?;
    // Dropped without a handover: back too.
    let t = Tensor::from_pool_block(p.alloc::<u8>(n)?)?;
    let t = t.host_as_cpu().map_err(|r| r.error)?;
    drop(t.host_as_cpu());
    let st = p.stats();
    ensure(st.in_use_bytes == 0, || {
        format!("after a refused drop: {st:?}")
    })
}

/// Blocks of a `READ_ONLY` registered pool, and blocks shared with another `Arc`, export
/// read-only, stay read-only through `host_as_cpu` and splits, are refused as legacy tensors
/// (handed back), and their importer gets no write access.
fn read_only_blocks() -> R {
    let dev = dev0()?;
    let n = 1 << 16;
    let (v, seed) = random_bytes(n);
    let ro = PinnedPool::new(
        &dev,
        PoolConfig {
            backing: PoolBacking::Register {
                threads: 2,
                huge_pages: false,
                flags: HostRegister::READ_ONLY,
            },
            ..Default::default()
        },
    )?;
    let mut blocks = Vec::new();
    match ro.alloc::<u8>(n) {
        Ok(mut b) => {
            b.as_mut_slice()?.copy_from_slice(&v);
            blocks.push(("read-only registered", Tensor::from_pool_block(b)?));
        }
        Err(e) => eprintln!("read_only_blocks: no read-only registration here ({e})"),
    }
    let p = pool(&dev)?;
    let mut b = p.alloc::<u8>(n)?;
    b.as_mut_slice()?.copy_from_slice(&v);
    let shared = Arc::new(b);
    let keep = shared.clone();
    blocks.push(("shared Arc", Tensor::from_pool_block(shared)?));
    for (what, t) in blocks {
        ensure(t.flags() & FLAG_READ_ONLY != 0, || format!("{what}: {t:?}"))?;
        let t = t.host_as_cpu().map_err(|r| r.error)?;
        ensure(t.flags() & FLAG_READ_ONLY != 0, || {
            format!("{what}: host_as_cpu dropped the read-only flag")
        })?;
        let mut parts = t.split(&[Part::of::<u8>(0, &[n / 2]), Part::of::<u8>(n / 2, &[n / 2])])?;
        let second = parts.pop().ok_or("no part")?;
        let first = parts.pop().ok_or("no part")?;
        let first = match first.into_legacy(None) {
            Ok(_) => return Err(format!("{what}: a read-only part went out as legacy").into()),
            Err(r) => r.tensor,
        };
        ensure(first.flags() & FLAG_READ_ONLY != 0, || {
            format!("{what}: refused part came back writable")
        })?;
        for (i, part) in [first, second].into_iter().enumerate() {
            // SAFETY: handed over just above; released by the import's drop.
            let mut imp = unsafe { Imported::from_versioned(part.into_versioned(None)?)? };
            ensure(imp.is_read_only(), || format!("{what}: part {i} writable"))?;
            let w = imp.host_mut::<u8>().map(|_| ());
            ensure(matches!(w, Err(Error::InvalidArgument { .. })), || {
                format!("{what}: host_mut of a read-only part: {w:?}")
            })?;
            let got = imp.host_bytes()?.into_slice()?.to_vec();
            same(
                &format!("{what}: part {i}"),
                &got,
                &v[i * n / 2..(i + 1) * n / 2],
                seed,
            )?;
        }
    }
    same("kept block", keep.as_slice()?, &v, seed)
}

/// The pool is dropped before its block is exported; the tensor is handed over, read, and
/// released from another thread. The memory must be there until the release and freed (not
/// leaked, not freed twice) after it.
fn block_outlives_pool() -> R {
    let dev = dev0()?;
    let n = 3 << 20;
    let (v, seed) = random_bytes(n);
    let pinned0 = pinstream::memory::live().pinned_bytes;
    let p = pool(&dev)?;
    let mut block = p.alloc::<u8>(n)?;
    block.as_mut_slice()?.copy_from_slice(&v);
    drop(p);
    let t = Tensor::from_pool_block(block)?
        .host_as_cpu()
        .map_err(|r| r.error)?;
    let raw = Raw(t.into_versioned(None)?);
    // SAFETY: handed over, not released, `n` bytes of host memory.
    let got = unsafe { host_bytes_of(raw.0, n) };
    same("block of a dropped pool", &got, &v, seed)?;
    let h = std::thread::spawn(move || {
        let raw = raw;
        // SAFETY: released once, here.
        unsafe { release_versioned(raw.0) };
    });
    h.join().map_err(|_| "release on another thread panicked")?;
    reaped()?;
    let pinned1 = pinstream::memory::live().pinned_bytes;
    ensure(pinned1 <= pinned0, || {
        format!(
            "page-locked bytes {pinned0} -> {pinned1}: the block of a dropped pool was not \
             freed at its release"
        )
    })
}

/// One block cut into 16 parts, each relabelled and handed over, released from 16 threads at
/// once: the block stays in use until the last release, then goes back to the pool exactly
/// once (a later request of its size is a cache hit, and the pool's counts are consistent).
fn split_block_many_threads() -> R {
    let dev = dev0()?;
    let p = pool(&dev)?;
    let n = MIB;
    let (v, seed) = random_bytes(n);
    for round in 0..5 {
        let mut block = p.alloc::<u8>(n)?;
        block.as_mut_slice()?.copy_from_slice(&v);
        let k = 16;
        let parts: Vec<Part> = (0..k)
            .map(|i| Part::of::<u32>(i * n / k, &[n / k / 4]))
            .collect();
        let ts = Tensor::from_pool_block(block)?.split(&parts)?;
        let mut raws = Vec::new();
        for (i, t) in ts.into_iter().enumerate() {
            let t = t.host_as_cpu().map_err(|r| r.error)?;
            let raw = t.into_versioned(None)?;
            // SAFETY: handed over, not released, n / k bytes of host memory.
            let got = unsafe { host_bytes_of(raw, n / k) };
            same(
                &format!("round {round} part {i}"),
                &got,
                &v[i * n / k..(i + 1) * n / k],
                seed,
            )?;
            raws.push(Raw(raw));
        }
        ensure(p.stats().in_use_bytes > 0, || "block back too early".into())?;
        let barrier = Arc::new(Barrier::new(k));
        let hs: Vec<_> = raws
            .into_iter()
            .map(|r| {
                let b = barrier.clone();
                std::thread::spawn(move || {
                    let r = r;
                    b.wait();
                    // SAFETY: each part released once, here.
                    unsafe { release_versioned(r.0) };
                })
            })
            .collect();
        for h in hs {
            h.join().map_err(|_| "a release panicked")?;
        }
        reaped()?;
        let st = p.stats();
        ensure(st.in_use_bytes == 0 && st.cached_bytes > 0, || {
            format!("round {round} after the last release: {st:?}")
        })?;
    }
    let st = p.stats();
    ensure(st.allocations == 1 && st.hits == 4, || {
        format!("five rounds of one size should be 1 allocation and 4 hits: {st:?}")
    })
}

/// A block handed over and never released (the consumer leaks it): `trim` must not free it, and
/// no later request may get its memory.
fn never_released_block() -> R {
    let dev = dev0()?;
    let p = pool(&dev)?;
    let n = 2 * MIB;
    let block = p.alloc::<u8>(n)?;
    let leaked = block.as_ptr() as usize;
    let t = Tensor::from_pool_block(block)?
        .host_as_cpu()
        .map_err(|r| r.error)?;
    let raw = t.into_versioned(None)?;
    let _ = raw; // never released
    p.trim()?;
    let mut held = Vec::new();
    for i in 0..8 {
        let b = p.alloc::<u8>(n)?;
        let q = b.as_ptr() as usize;
        ensure(!overlaps(q, n, leaked, n), || {
            format!("request {i} got the leaked block's memory at {q:#x}")
        })?;
        if i % 2 == 0 {
            held.push(b);
        }
    }
    drop(held);
    p.trim()?;
    let st = p.stats();
    ensure(st.in_use_bytes >= n, || {
        format!("the leaked block no longer counts as in use: {st:?}")
    })
}

/// A block handed over on a consumer stream that is busy for a while, then released at once:
/// the release orders the block's reuse after the consumer's queued work, so while that stream
/// is still busy the pool must not hand the block out again.
fn busy_consumer_stream() -> R {
    let dev = dev0()?;
    let s = dev.stream()?;
    let p = pool(&dev)?;
    let n = 4 * MIB;
    let mut checked = 0;
    for _ in 0..5 {
        let block = p.alloc::<u8>(n)?;
        let addr = block.as_ptr() as usize;
        let t = Tensor::from_pool_block(block)?
            .host_as_cpu()
            .map_err(|r| r.error)?;
        let raw = t.into_versioned(Some(&s))?;
        s.spin(Duration::from_millis(300))?;
        // SAFETY: released once: the consumer's work (the spin, standing for its copies) is
        // queued on `s` before the release.
        unsafe { release_versioned(raw) };
        let again = p.alloc::<u8>(n)?;
        let busy = !s.is_idle()?;
        if busy {
            checked += 1;
            let q = again.as_ptr() as usize;
            ensure(!overlaps(q, n, addr, n), || {
                "the pool handed out a block its consumer's stream may still use".into()
            })?;
        }
        drop(again);
        s.synchronize()?;
    }
    ensure(checked > 0, || {
        "the stream was never busy at the check (spin too short?)".into()
    })
}

/// An empty block exports as a tensor of shape [0] with a null data pointer, and a block cut to
/// a 0-d part (the download of a scalar) as a tensor of no dimensions: both hand over as
/// versioned and legacy tensors, import, and release.
fn empty_and_0d_blocks() -> R {
    let dev = dev0()?;
    let p = pool(&dev)?;
    let t = Tensor::from_pool_block(p.alloc::<f32>(0)?)?
        .host_as_cpu()
        .map_err(|r| r.error)?;
    ensure(t.shape() == [0], || format!("{t:?}"))?;
    let raw = t.into_versioned(None)?;
    // SAFETY: handed over; reading the struct's fields only.
    let (data, ndim) = unsafe { ((*raw).dl_tensor.data, (*raw).dl_tensor.ndim) };
    ensure(data.is_null() && ndim == 1, || {
        format!("empty block: data {data:p}, ndim {ndim}")
    })?;
    // SAFETY: released once.
    unsafe { release_versioned(raw) };
    let t = Tensor::from_pool_block(p.alloc::<u8>(0)?)?
        .host_as_cpu()
        .map_err(|r| r.error)?;
    let legacy = t.into_legacy(None)?;
    // SAFETY: handed over just above; released once.
    unsafe {
        if let Some(d) = (*legacy).deleter {
            d(legacy)
        }
    }

    let mut block = p.alloc::<u8>(8)?;
    block.as_mut_slice()?.copy_from_slice(&2.5f64.to_le_bytes());
    let t = Tensor::from_pool_block(block)?
        .split(&[Part::of::<f64>(0, &[])])?
        .pop()
        .ok_or("no part")?
        .host_as_cpu()
        .map_err(|r| r.error)?;
    ensure(t.shape().is_empty(), || format!("0-d part: {t:?}"))?;
    // SAFETY: handed over just above; released by the import's drop.
    let imp = unsafe { Imported::from_versioned(t.into_versioned(None)?)? };
    ensure(imp.shape().is_empty() && imp.len() == 1, || {
        format!("0-d import: {imp:?}")
    })?;
    let x = imp.host::<f64>()?.as_slice()?.to_vec();
    ensure(x == [2.5], || format!("0-d value: {x:?}"))?;
    drop(imp);
    reaped()?;
    let st = p.stats();
    ensure(st.in_use_bytes == 0, || {
        format!("after the releases: {st:?}")
    })?;

    // Timing sanity: none of the releases above waited for anything long.
    let t0 = Instant::now();
    let t = Tensor::from_pool_block(p.alloc::<u8>(64)?)?;
    drop(t);
    // A watchdog against a drop that waits, not a speed bound.
    ensure(t0.elapsed() < Duration::from_secs(60), || {
        "dropping an unreleased block tensor took seconds".into()
    })?;
    Ok(())
}

/// Waits for the releases host consumers made (`host_as_cpu` tensors released with no stream
/// go back from a background thread, after every device is idle).
fn reaped() -> R {
    ensure(
        pinstream::dlpack::wait_for_releases(Duration::from_secs(20)),
        || "host-consumer releases not finished after 20 s".into(),
    )
}
