//! GPU trials of the prefetcher: every batch that comes out equals the CPU reference of the batch
//! that went in, in order, for 1..4 loader threads and depths 1..4, with fast and slow consumers
//! (a slow consumer's delayed reads catch a slot refilled before its release); variable sizes
//! with crops and mirrors; loader errors, panics and bad batches at batch k; a leaked batch
//! guard; dropping mid-epoch; sharding; a long run with memory checked. The same for pixels in
//! page-locked memory (`HostBatch::pinned`), in file ranges (`HostBatch::set_file`) and mixed,
//! with bad lengths and ranges at batch k; and for ranges of a resident pinned buffer
//! (`HostBatch::set_resident`), one buffer shared by two devices. Ignored without a GPU, except
//! the `host/` trials.

use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::threads::thread_cpus;
use crate::common::{ensure, R};
use libtest_mimic::{Failed, Trial};
use pinstream::kernels::{cpu, Crop, Layout, Normalize, Sample, Spec};
use pinstream::prefetch::{
    HostBatch, LoadError, LoaderStats, Pixels, PrefetchConfig, Prefetcher, Source,
};
use pinstream::{
    Device, DeviceBuffer, Error, FileSource, HostAlloc, PinnedBuffer, PinnedPool, PoolConfig,
    Stream,
};
use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};

use crate::common::trial;

/// Prefix of this module's trial names (its path in the binary).
const PREFIX: &str = "prefetcher/";

/// The trials of this module, named `prefetcher/...`.
pub fn trials() -> Vec<Trial> {
    let no_gpu = !pinstream::available();
    let two_gpus = Device::count().is_ok_and(|n| n >= 2);
    let mut trials = Vec::new();
    let mut gpu = |name: &str, f: fn() -> R| {
        trials.push(trial(PREFIX, name, f).with_ignored_flag(no_gpu));
    };
    gpu("order/threads_and_depths", order_threads_and_depths);
    gpu("order/slow_consumer_delayed_reads", slow_consumer);
    gpu("variable/sizes_crops_mirrors", variable_sizes);
    gpu("errors/loader_error_at_k", loader_error);
    gpu("errors/loader_panic_at_k", loader_panic);
    gpu("errors/bad_batch_at_k", bad_batch);
    gpu("guard/leaked_batch", leaked_guard);
    gpu("drop/mid_epoch", drop_mid_epoch);
    gpu("source/iterator", iterator_source);
    gpu("source/iter_then_pinned", iter_then_pinned);
    gpu("foreign/page_locked_one_dma", foreign_page_locked);
    gpu("loaders/window_adapts", window_adapts);
    gpu("shards/two_on_one_device", shards_one_device);
    gpu("soak/memory_flat_10000", soak);
    gpu("pinned/threads_and_depths", pinned_threads_and_depths);
    gpu("pinned/slow_consumer_delayed_reads", pinned_slow_consumer);
    gpu("pinned/blocks_of_a_user_pool", pinned_user_pool);
    gpu("pinned/soak_memory_flat_2000", pinned_soak);
    gpu("pinned/host_far_ahead_bounded", pinned_host_far_ahead);
    gpu("file/ranges", file_ranges);
    gpu("mixed/pageable_pinned_file", mixed_kinds);
    gpu("source/iterator_pinned_and_file", iterator_pinned_and_file);
    gpu("errors/bad_pinned_length_at_k", bad_pinned_length);
    gpu("errors/file_range_past_end_at_k", file_range_past_end);
    gpu("affinity/numa_local", numa_local);
    gpu("resident/ranges_threads_and_depths", resident_ranges);
    gpu("errors/resident_range_outside_at_k", resident_range_outside);
    trials.push(
        trial(
            PREFIX,
            "resident/two_devices_one_buffer",
            resident_two_devices,
        )
        .with_ignored_flag(!two_gpus),
    );
    trials.push(
        trial(
            PREFIX,
            "errors/resident_of_another_device",
            resident_other_device,
        )
        .with_ignored_flag(!two_gpus),
    );
    trials
        .push(trial(PREFIX, "shards/two_devices", shards_two_devices).with_ignored_flag(!two_gpus));
    trials.push(
        trial(
            PREFIX,
            "errors/pinned_block_of_another_device",
            pinned_other_device,
        )
        .with_ignored_flag(!two_gpus),
    );
    trials.push(trial(
        PREFIX,
        "host/pinned_without_pool",
        pinned_without_pool,
    ));
    trials.push(trial(
        PREFIX,
        "host/pixels_len_and_read",
        pixels_len_and_read,
    ));
    trials.push(trial(
        PREFIX,
        "host/dry_ready_looks_without_waiting",
        dry_ready_looks_without_waiting,
    ));
    trials.push(
        trial(
            PREFIX,
            "next/ready_looks_without_waiting",
            ready_looks_without_waiting,
        )
        .with_ignored_flag(no_gpu),
    );
    trials
}

/// `n` batches of `fill_uniform` (2 images of 16x16) whose loaders wait until the gate opens
/// (at most a minute, so that a failed trial's prefetcher still stops).
fn gated_source(n: u64) -> (Source<i64>, Arc<std::sync::atomic::AtomicBool>) {
    let gate = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let g = gate.clone();
    let source = Source::new(move |i, b: &mut HostBatch<i64>| {
        let t0 = Instant::now();
        while !g.load(Ordering::Acquire) && t0.elapsed() < Duration::from_secs(60) {
            std::thread::sleep(Duration::from_millis(1));
        }
        if i >= n {
            return Ok(false);
        }
        fill_uniform(i, b, 2, 16);
        Ok(true)
    });
    (source, gate)
}

/// Asks `ready` until it says yes, at most 100 000 times 1 ms apart (a watchdog, not a
/// clock: a loaded machine only makes it ask more often).
fn until_ready(mut ready: impl FnMut() -> bool, what: &str) -> R {
    for _ in 0..100_000 {
        if ready() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Err(format!("{what}: never ready").into())
}

/// `Prefetcher::ready` looks without waiting: no while the loaders are held back (asked 200
/// times, each returning while they still are), yes once a batch has arrived, and `next` then
/// gives it, right and in order; no while the batch handed out last is still held by the
/// prefetcher (a leaked guard, whose give-back may wait for the device); yes at the end, where
/// `next` says `None`.
fn ready_looks_without_waiting() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let (source, gate) = gated_source(5);
    let mut p = Prefetcher::<f32, i64>::new(&stream, source, config(2, 2))?;
    for k in 0..200 {
        ensure(!p.ready(), || {
            format!("ready at ask {k}, before any batch was loaded")
        })?;
    }
    gate.store(true, Ordering::Release);
    for i in 0..5u64 {
        if i != 3 {
            until_ready(|| p.ready(), &format!("batch {i}"))?;
        }
        // (Batch 3 comes after the leaked guard of batch 2: `next` gives that back first.)
        let b = p
            .next()
            .ok_or_else(|| Failed::from(format!("batch {i}: the end after ready")))??;
        ensure(b.index() == i, || format!("batch {} for {i}", b.index()))?;
        let mut want = HostBatch::default();
        fill_uniform(i, &mut want, 2, 16);
        check(
            &stream,
            &b.pixels()?,
            &b.extras()?,
            &want,
            &format!("batch {i}"),
        )?;
        if i == 2 {
            // A leaked guard leaves the slot with the prefetcher: not ready, whatever arrived.
            std::mem::forget(b);
            for k in 0..50 {
                ensure(!p.ready(), || {
                    format!("ready at ask {k} with a batch still held")
                })?;
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
    until_ready(|| p.ready(), "the end")?;
    ensure(p.next().is_none(), || "a batch after the fifth".into())?;
    ensure(p.ready(), || "not ready once finished".into())
}

/// The same for a dry run, without a GPU: not ready while the loaders are held back, then every
/// batch in order with its extras, then the end.
fn dry_ready_looks_without_waiting() -> R {
    let (source, gate) = gated_source(4);
    let mut run = pinstream::prefetch::DryRun::<f32, i64>::new(source, config(2, 2))?;
    for k in 0..200 {
        ensure(!run.ready(), || {
            format!("ready at ask {k}, before any batch was loaded")
        })?;
    }
    gate.store(true, Ordering::Release);
    for i in 0..4u64 {
        until_ready(|| run.ready(), &format!("batch {i}"))?;
        let b = run
            .next()
            .ok_or_else(|| Failed::from(format!("batch {i}: the end after ready")))??;
        ensure(b.index() == i, || format!("batch {} for {i}", b.index()))?;
        let want: Vec<i64> = (0..2).map(|k| i as i64 * 1000 + k).collect();
        ensure(b.extras() == want.as_slice(), || {
            format!("batch {i}: {:?}", b.extras())
        })?;
    }
    until_ready(|| run.ready(), "the end")?;
    ensure(run.next().is_none(), || "a batch after the fourth".into())
}

/// A run-wide seed (printed on failure) so every run draws fresh data.
fn seed() -> u64 {
    static SEED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *SEED.get_or_init(|| rand::rng().next_u64())
}

/// Batch `i`'s pixel bytes: a pure function of (seed, i), so the consumer can rebuild them.
fn uniform_bytes(i: u64, out: &mut [u8]) {
    let mut r = SmallRng::seed_from_u64(seed() ^ i.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    r.fill_bytes(out);
}

/// Batch `i`'s spec and extras.
fn uniform_meta(i: u64, b: &mut HostBatch<i64>, n: usize, hw: usize) {
    b.spec = Spec::uniform(n, 3, hw, hw, Normalize::imagenet()).expect("a small batch");
    b.extras.clear();
    b.extras.extend((0..n as i64).map(|k| i as i64 * 1000 + k));
}

/// Batch `i`'s content in pageable memory.
fn fill_uniform(i: u64, b: &mut HostBatch<i64>, n: usize, hw: usize) {
    uniform_meta(i, b, n, hw);
    let px = b.pageable();
    px.resize(n * 3 * hw * hw, 0);
    uniform_bytes(i, px);
}

/// Batch `i`'s content (the same as `fill_uniform`) in page-locked memory of the prefetcher.
fn fill_uniform_pinned(
    i: u64,
    b: &mut HostBatch<i64>,
    n: usize,
    hw: usize,
) -> Result<(), LoadError> {
    uniform_meta(i, b, n, hw);
    uniform_bytes(i, b.pinned(n * 3 * hw * hw)?);
    Ok(())
}

/// The reference of batch `i`: pageable, as `fill_uniform` makes it.
fn uniform_want(i: u64, n: usize, hw: usize) -> HostBatch<i64> {
    let mut want = HostBatch::default();
    fill_uniform(i, &mut want, n, hw);
    want
}

fn uniform_source(end: u64, n: usize, hw: usize) -> Source<i64> {
    Source::new(move |i, b: &mut HostBatch<i64>| {
        if i >= end {
            return Ok(false);
        }
        fill_uniform(i, b, n, hw);
        Ok(true)
    })
}

/// Reads the batch's pixels and extras back and checks them against the CPU reference of the
/// host batch `want`.
fn check(
    stream: &Stream,
    got: &pinstream::DeviceView<'_, f32>,
    extras: &pinstream::DeviceView<'_, i64>,
    want: &HostBatch<i64>,
    what: &str,
) -> R {
    let mut px = vec![f32::NAN; got.len()];
    stream.copy_d2h(got, &mut px[..])?.wait()?;
    let exact = cpu::normalize_exact(&want.pixels.read()?, &want.spec, None)?;
    let worst = cpu::worst_error(&px, &exact, want.spec.norm.shift)?;
    ensure(worst.is_none_or(|w| w.units <= 1.0), || {
        format!(
            "{what}: pixels differ from the reference: {worst:?} (seed {})",
            seed()
        )
    })?;
    let mut ex = vec![-1i64; extras.len()];
    stream.copy_d2h(extras, &mut ex[..])?.wait()?;
    ensure(ex == want.extras, || {
        format!("{what}: extras differ (seed {})", seed())
    })
}

fn config(threads: usize, depth: usize) -> PrefetchConfig {
    let mut c = PrefetchConfig {
        depth,
        loader_threads: threads,
        ..PrefetchConfig::default()
    };
    c.stager.threads = 4;
    c.stager.slots = 8;
    c.stager.min_bytes = 64 << 10;
    c
}

fn order_threads_and_depths() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    for threads in [1, 2, 4] {
        for depth in [1, 2, 3, 4] {
            let end = 13;
            let mut p = Prefetcher::<f32, i64>::new(
                &stream,
                uniform_source(end, 8, 64),
                config(threads, depth),
            )?;
            let mut seen = 0u64;
            while let Some(b) = p.next() {
                let b = b?;
                ensure(b.index() == seen, || {
                    format!("batch {} came out {seen}th", b.index())
                })?;
                ensure(b.dims() == Some([8, 3, 64, 64]), || {
                    format!("dims {:?}", b.dims())
                })?;
                let mut want = HostBatch::default();
                fill_uniform(seen, &mut want, 8, 64);
                let what = format!("{threads} loaders, depth {depth}, batch {seen}");
                check(&stream, &b.pixels()?, &b.extras()?, &want, &what)?;
                seen += 1;
            }
            ensure(seen == end, || format!("{seen} batches of {end}"))?;
            ensure(p.next().is_none(), || "a batch after the end".into())?;
        }
    }
    Ok(())
}

/// The consumer queues slow work and then copies each batch on its stream without waiting;
/// everything is read back only at the end. A slot refilled before the consumer's release
/// would show up as a wrong copy.
fn slow_consumer() -> R {
    slow_consumer_with(uniform_source)
}

/// `slow_consumer` over the uniform batches of `source(end, n, hw)`.
fn slow_consumer_with(source: fn(u64, usize, usize) -> Source<i64>) -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let (n, hw, end) = (4usize, 96usize, 24u64);
    let len = n * 3 * hw * hw;
    for depth in [1, 2, 4] {
        let mut p = Prefetcher::<f32, i64>::new(&stream, source(end, n, hw), config(3, depth))?;
        let mut copies = Vec::new();
        while let Some(b) = p.next() {
            let b = b?;
            stream.spin(Duration::from_micros(1500))?;
            let mut d = DeviceBuffer::<f32>::new(&dev, len)?;
            stream.copy_d2d(&b.pixels()?, &mut d)?;
            copies.push(d);
        }
        ensure(copies.len() == end as usize, || "batches missing".into())?;
        for (i, d) in copies.iter().enumerate() {
            let mut px = vec![f32::NAN; len];
            stream.copy_d2h(d, &mut px[..])?.wait()?;
            let mut want = HostBatch::default();
            fill_uniform(i as u64, &mut want, n, hw);
            let exact = cpu::normalize_exact(&want.pixels.read()?, &want.spec, None)?;
            let worst = cpu::worst_error(&px, &exact, 0.0)?;
            ensure(worst.is_none_or(|w| w.units <= 1.0), || {
                format!("depth {depth}, batch {i}: overwritten before release? {worst:?}")
            })?;
        }
    }
    Ok(())
}

/// Batch `i` with samples of random sizes, random crops and mirrors, NHWC in, NCHW out.
fn fill_variable(i: u64, b: &mut HostBatch<i64>) {
    let mut r = SmallRng::seed_from_u64(seed() ^ 0xABCD ^ i);
    let n = r.random_range(1..6);
    let samples: Vec<Sample> = (0..n)
        .map(|_| {
            let (h, w) = (r.random_range(8..80), r.random_range(8..80));
            let (ch, cw) = (r.random_range(1..=h), r.random_range(1..=w));
            Sample {
                h,
                w,
                crop: Some(Crop {
                    x: r.random_range(0..=w - cw),
                    y: r.random_range(0..=h - ch),
                    w: cw,
                    h: ch,
                }),
                mirror: r.random_bool(0.5),
            }
        })
        .collect();
    b.spec = Spec {
        channels: 3,
        samples,
        in_layout: Layout::Nhwc,
        out_layout: Layout::Nchw,
        pad_to_4: None,
        norm: Normalize::imagenet(),
    };
    let len = b.spec.input_len().expect("small");
    let px = b.pageable();
    px.resize(len, 0);
    r.fill_bytes(px);
    b.extras.clear();
    b.extras.extend((0..n as i64).map(|k| -(i as i64) - k));
}

fn variable_sizes() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let src = Source::new(|i, b: &mut HostBatch<i64>| {
        if i >= 40 {
            return Ok(false);
        }
        fill_variable(i, b);
        Ok(true)
    });
    let mut p = Prefetcher::<f32, i64>::new(&stream, src, config(3, 2))?;
    let mut i = 0;
    while let Some(b) = p.next() {
        let b = b?;
        let mut want = HostBatch::default();
        fill_variable(i, &mut want);
        check(
            &stream,
            &b.pixels()?,
            &b.extras()?,
            &want,
            &format!("batch {i}"),
        )?;
        i += 1;
    }
    ensure(i == 40, || format!("{i} batches"))
}

/// Runs a source that misbehaves at batch `k` (by `how`) and checks batches before it are whole,
/// batch k is a `Loader` error naming it, and nothing comes after.
fn fails_at<F>(k: u64, how: F) -> R
where
    F: Fn(u64, &mut HostBatch<i64>) -> Result<bool, LoadError> + Send + Sync + 'static,
{
    fails_on(&Device::get(0)?, k, Source::new(how)).map(drop)
}

/// `fails_at` on `dev` with a ready-made source; returns the error's message.
fn fails_on(dev: &Device, k: u64, source: Source<i64>) -> Result<String, Failed> {
    let stream = dev.stream()?;
    let mut last = String::new();
    for threads in [1, 4] {
        let mut p = Prefetcher::<f32, i64>::new(&stream, source.clone(), config(threads, 2))?;
        for i in 0..k {
            let b = p
                .next()
                .ok_or_else(|| Failed::from(format!("no batch {i}")))??;
            let mut want = HostBatch::default();
            fill_uniform(i, &mut want, 4, 32);
            check(
                &stream,
                &b.pixels()?,
                &b.extras()?,
                &want,
                &format!("batch {i}"),
            )?;
        }
        match p.next() {
            Some(Err(Error::Loader { batch, message })) if batch == k => {
                ensure(!message.is_empty(), || "empty message".into())?;
                last = message;
            }
            other => {
                return Err(format!("batch {k}: {:?}", other.map(|r| r.map(|b| b.index()))).into())
            }
        }
        ensure(p.next().is_none(), || "a batch after the error".into())?;
    }
    Ok(last)
}

fn loader_error() -> R {
    fails_at(7, |i, b| {
        if i == 7 {
            return Err("disk on fire".into());
        }
        fill_uniform(i, b, 4, 32);
        Ok(true)
    })
}

fn loader_panic() -> R {
    fails_at(5, |i, b| {
        if i == 5 {
            panic!("decoder exploded at {i}");
        }
        fill_uniform(i, b, 4, 32);
        Ok(true)
    })
}

fn bad_batch() -> R {
    fails_at(3, |i, b| {
        fill_uniform(i, b, 4, 32);
        if i == 3 {
            b.pageable().pop();
        }
        Ok(true)
    })
}

fn leaked_guard() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let mut p = Prefetcher::<f32, i64>::new(&stream, uniform_source(10, 4, 32), config(2, 2))?;
    for i in 0..10u64 {
        let b = p
            .next()
            .ok_or_else(|| Failed::from(format!("no batch {i}")))??;
        let mut want = HostBatch::default();
        fill_uniform(i, &mut want, 4, 32);
        check(
            &stream,
            &b.pixels()?,
            &b.extras()?,
            &want,
            &format!("batch {i}"),
        )?;
        if i % 3 == 0 {
            std::mem::forget(b);
        }
    }
    let end = p.next().is_none();
    ensure(end, || "a batch after the end".into())
}

fn drop_mid_epoch() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let calls = Arc::new(AtomicU64::new(0));
    let c = calls.clone();
    let src = Source::new(move |i, b: &mut HostBatch<i64>| {
        c.fetch_add(1, Ordering::Relaxed);
        fill_uniform(i, b, 8, 64);
        Ok(true)
    });
    for depth in [1, 3] {
        let mut p = Prefetcher::<f32, i64>::new(&stream, src.clone(), config(4, depth))?;
        for _ in 0..3 {
            let b = p.next().ok_or("no batch")??;
            stream.spin(Duration::from_millis(2))?;
            drop(b);
        }
        let t = Instant::now();
        drop(p);
        // A watchdog against a drop that hangs, not a speed bound.
        ensure(t.elapsed() < Duration::from_secs(60), || {
            "drop took too long".into()
        })?;
    }
    // The source stops being called once the prefetchers are gone.
    let before = calls.load(Ordering::Relaxed);
    std::thread::sleep(Duration::from_millis(50));
    ensure(calls.load(Ordering::Relaxed) == before, || {
        "loaders still running".into()
    })?;
    stream.synchronize()?;
    Ok(())
}

/// Runs `end` small batches through a prefetcher with `config`, the loaders sleeping `load` per
/// batch and the consumer `consume` per batch on the host; checks every batch and returns the
/// loaders' statistics at the end.
fn run_paced(
    config: PrefetchConfig,
    end: u64,
    load: Duration,
    consume: Duration,
) -> Result<LoaderStats, Failed> {
    let stream = Device::get(0)?.stream()?;
    let src = Source::new(move |i, b: &mut HostBatch<i64>| {
        if i >= end {
            return Ok(false);
        }
        std::thread::sleep(load);
        fill_uniform(i, b, 4, 32);
        Ok(true)
    });
    let mut p = Prefetcher::<f32, i64>::new(&stream, src, config)?;
    let mut i = 0;
    while let Some(b) = p.next() {
        let b = b?;
        check(
            &stream,
            &b.pixels()?,
            &b.extras()?,
            &uniform_want(i, 4, 32),
            &format!("batch {i}"),
        )?;
        std::thread::sleep(consume);
        i += 1;
    }
    ensure(i == end, || format!("{i} batches of {end}"))?;
    Ok(p.loader_stats())
}

/// The adaptive window (`PrefetchConfig::ahead` 0): slow loaders keep it at its maximum, with
/// the upload waiting for nearly every batch; a slow consumer shrinks it to 2 with (almost) no
/// waits; a fixed window stays.
fn window_adapts() -> R {
    let (ms, end) = (Duration::from_millis, 60);
    // One loader, slower than everything else: the upload waits for (nearly) every batch.
    let slow_loaders = run_paced(config(1, 2), end, ms(4), ms(0))?;
    let slow_consumer = run_paced(config(4, 2), end, ms(0), ms(2))?;
    let fixed = run_paced(
        PrefetchConfig {
            ahead: 3,
            ..config(4, 2)
        },
        end,
        ms(0),
        ms(2),
    )?;
    ensure(slow_loaders.uploads == end, || {
        format!("{slow_loaders:?}: {end} batches")
    })?;
    ensure(fixed.ahead == 3, || format!("fixed at 3: {fixed:?}"))?;
    // Under a sanitizer the GPU side is many times slower than the 4 ms loader, so who waits
    // for whom is not what this trial sets up (the runs above still check every batch).
    if under_sanitizer() {
        return Ok(());
    }
    ensure(
        slow_loaders.ahead == 3 && slow_loaders.waits >= end - 10,
        || {
            format!(
                "slow loader: {slow_loaders:?}, want ahead 3 (depth + loaders) and most uploads \
                 waiting"
            )
        },
    )?;
    ensure(slow_consumer.ahead == 2 && slow_consumer.waits <= 3, || {
        format!("slow consumer: {slow_consumer:?}, want the window down to 2 and no waits")
    })
}

fn iterator_source() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let it = (0..9u64).map(|i| {
        let mut b = HostBatch::default();
        fill_uniform(i, &mut b, 2, 16);
        Ok(b)
    });
    let mut p = Prefetcher::<f32, i64>::new(&stream, Source::iter(it), config(3, 2))?;
    let mut i = 0;
    while let Some(b) = p.next() {
        let b = b?;
        let mut want = HostBatch::default();
        fill_uniform(i, &mut want, 2, 16);
        check(
            &stream,
            &b.pixels()?,
            &b.extras()?,
            &want,
            &format!("batch {i}"),
        )?;
        i += 1;
    }
    ensure(i == 9, || format!("{i} batches of 9"))
}

/// `Source::iter_then`: items taken in turn, their pixels written into page-locked memory
/// after the turn (`HostBatch::pinned`), on three loaders: every batch right, in order.
fn iter_then_pinned() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let source = Source::iter_then(
        (0..11u64).map(Ok),
        |i, item: u64, b: &mut HostBatch<i64>| {
            if item != i {
                return Err(format!("turn {i} got item {item}").into());
            }
            fill_uniform_pinned(i, b, 2, 16)
        },
    );
    let mut p = Prefetcher::<f32, i64>::new(&stream, source, config(3, 2))?;
    let mut i = 0;
    while let Some(b) = p.next() {
        let b = b?;
        ensure(b.index() == i, || format!("batch {} at {i}", b.index()))?;
        check(
            &stream,
            &b.pixels()?,
            &b.extras()?,
            &uniform_want(i, 2, 16),
            &format!("batch {i}"),
        )?;
        i += 1;
    }
    ensure(i == 11, || format!("{i} batches of 11"))
}

/// Pixels another owner keeps, given as page-locked (`ForeignBytes::page_locked`).
struct LockedOwner {
    bytes: Result<PinnedBuffer<u8>, Vec<u8>>,
    dropped: Arc<AtomicU64>,
}

impl pinstream::prefetch::HostBytes for LockedOwner {
    fn bytes(&self) -> &[u8] {
        match &self.bytes {
            Ok(p) => p.as_slice().unwrap_or(&[]),
            Err(v) => v,
        }
    }
}

impl Drop for LockedOwner {
    fn drop(&mut self) {
        self.dropped.fetch_add(1, Ordering::SeqCst);
    }
}

/// `ForeignBytes::page_locked`: page-locked memory of another owner goes to the device with one
/// DMA, ordinary memory given so is staged instead; every batch arrives intact and in order
/// with a slow consumer (a slot refilled early, or an owner dropped before its DMA, would show
/// as wrong pixels), and every owner is dropped by the end.
fn foreign_page_locked() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let dropped = Arc::new(AtomicU64::new(0));
    let d2 = dropped.clone();
    let dev2 = dev;
    let source = Source::iter_then((0..10u64).map(Ok), move |i, _, b: &mut HostBatch<i64>| {
        let want = uniform_want(i, 2, 16);
        let Pixels::Pageable(v) = &want.pixels else {
            return Err("not pageable".into());
        };
        let bytes = if i % 2 == 0 {
            Ok(PinnedBuffer::from_slice(&dev2, v, HostAlloc::DEFAULT)?)
        } else {
            Err(v.clone())
        };
        let owner = LockedOwner {
            bytes,
            dropped: d2.clone(),
        };
        // SAFETY: the even owners' bytes are one `PinnedBuffer` that lives, unwritten, as long
        // as the owner; the odd ones' are pageable (staged, as the contract allows).
        b.pixels =
            Pixels::Foreign(unsafe { pinstream::prefetch::ForeignBytes::page_locked(owner) });
        b.spec = want.spec.clone();
        b.resize = None;
        b.extras = want.extras.clone();
        Ok(())
    });
    let mut p = Prefetcher::<f32, i64>::new(&stream, source, config(2, 2))?;
    let mut i = 0;
    while let Some(b) = p.next() {
        let b = b?;
        std::thread::sleep(Duration::from_millis(3));
        check(
            &stream,
            &b.pixels()?,
            &b.extras()?,
            &uniform_want(i, 2, 16),
            &format!("batch {i}"),
        )?;
        i += 1;
    }
    drop(p);
    ensure(i == 10, || format!("{i} batches of 10"))?;
    ensure(dropped.load(Ordering::SeqCst) == 10, || {
        format!("{} owners dropped of 10", dropped.load(Ordering::SeqCst))
    })
}

fn run_shards(streams: Vec<Stream>) -> R {
    run_shards_of(streams, uniform_source(21, 4, 32))
}

/// Shards of `source` (21 batches of 4 x 3x32x32, `fill_uniform`'s content) over `streams`.
fn run_shards_of(streams: Vec<Stream>, source: Source<i64>) -> R {
    let n = streams.len() as u64;
    let ps = Prefetcher::<f32, i64>::sharded(&streams, source, config(2, 2))?;
    let handles: Vec<_> = ps
        .into_iter()
        .enumerate()
        .map(|(d, mut p)| {
            std::thread::spawn(move || -> Result<u64, String> {
                let mut k = 0u64;
                while let Some(b) = p.next() {
                    let b = b.map_err(|e| e.to_string())?;
                    let want_index = d as u64 + k * n;
                    if b.index() != want_index {
                        return Err(format!("shard {d}: got {} want {want_index}", b.index()));
                    }
                    let mut want = HostBatch::default();
                    fill_uniform(want_index, &mut want, 4, 32);
                    check(
                        b.stream(),
                        &b.pixels().map_err(|e| e.to_string())?,
                        &b.extras().map_err(|e| e.to_string())?,
                        &want,
                        "shard",
                    )
                    .map_err(|e| format!("{e:?}"))?;
                    k += 1;
                }
                Ok(k)
            })
        })
        .collect();
    let mut total = 0;
    for h in handles {
        total += h.join().map_err(|_| "a shard thread panicked")??;
    }
    ensure(total == 21, || format!("{total} batches of 21"))
}

fn shards_one_device() -> R {
    let dev = Device::get(0)?;
    run_shards(vec![dev.stream()?, dev.stream()?])
}

fn shards_two_devices() -> R {
    run_shards(vec![Device::get(0)?.stream()?, Device::get(1)?.stream()?])
}

/// 10 000 small batches: device bytes, pinned pool bytes and the device's free memory are the
/// same after the last batch as after the tenth; every 500th batch is checked.
fn soak() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let mut p = Prefetcher::<f32, i64>::new(&stream, uniform_source(10_000, 4, 32), config(2, 2))?;
    let mut at10 = None;
    let mut i = 0u64;
    loop {
        let Some(b) = p.next() else { break };
        let b = b?;
        if i % 500 == 0 {
            let mut want = HostBatch::default();
            fill_uniform(i, &mut want, 4, 32);
            check(
                &stream,
                &b.pixels()?,
                &b.extras()?,
                &want,
                &format!("batch {i}"),
            )?;
        }
        drop(b);
        if i == 10 {
            stream.synchronize()?;
            let s = p.pinned_stats();
            at10 = Some((
                p.device_bytes(),
                s.cached_bytes + s.in_use_bytes,
                own_memory(),
                dev.memory_info()?.free,
            ));
        }
        i += 1;
    }
    stream.synchronize()?;
    ensure(i == 10_000, || format!("{i} batches"))?;
    let s = p.pinned_stats();
    let now = (
        p.device_bytes(),
        s.cached_bytes + s.in_use_bytes,
        own_memory(),
        dev.memory_info()?.free,
    );
    let then = at10.ok_or("no batch 10")?;
    // pinstream's own memory, counted by itself: exact, whoever else uses the device.
    ensure(
        now.0 == then.0 && now.1 == then.1 && now.2 == then.2,
        || {
            format!(
                "slot / pinned / pinstream's bytes grew: after 10 {then:?}, after 10000 {now:?}"
            )
        },
    )?;
    if under_sanitizer() {
        return Ok(());
    }
    // The device's free memory also moves with other users; allow 2 MiB.
    ensure(now.3.abs_diff(then.3) <= 2 << 20, || {
        format!("free device memory moved: after 10 {then:?}, after 10000 {now:?}")
    })
}

/// pinstream's device and pinned bytes (not the process-wide bounce cache, which may grow with
/// how many small uploads run at once).
fn own_memory() -> (usize, usize) {
    let l = pinstream::memory::live();
    (l.device_bytes, l.pinned_bytes)
}

/// Set `PINSTREAM_SANITIZER=1` when running under compute-sanitizer, which allocates device
/// memory of its own: the checks of the device's free memory are then left out (pinstream's
/// own counts, `pinstream::memory::live`, are still checked).
fn under_sanitizer() -> bool {
    std::env::var_os("PINSTREAM_SANITIZER").is_some_and(|v| !v.is_empty() && v != "0")
}

/// Runs `source` to its end (`end` batches) and checks every batch, in order, against
/// `want(i)`.
fn run_checked(
    stream: &Stream,
    source: Source<i64>,
    config: PrefetchConfig,
    end: u64,
    want: impl Fn(u64) -> HostBatch<i64>,
    what: &str,
) -> R {
    let mut p = Prefetcher::<f32, i64>::new(stream, source, config)?;
    let mut seen = 0u64;
    while let Some(b) = p.next() {
        let b = b?;
        ensure(b.index() == seen, || {
            format!("{what}: batch {} came out {seen}th", b.index())
        })?;
        let what = format!("{what}, batch {seen}");
        check(stream, &b.pixels()?, &b.extras()?, &want(seen), &what)?;
        seen += 1;
    }
    ensure(seen == end, || format!("{what}: {seen} batches of {end}"))?;
    let after = p.next().is_none();
    ensure(after, || format!("{what}: a batch after the end"))
}

/// The uniform batches in page-locked memory from `HostBatch::pinned`.
fn pinned_source(end: u64, n: usize, hw: usize) -> Source<i64> {
    Source::new(move |i, b: &mut HostBatch<i64>| {
        if i >= end {
            return Ok(false);
        }
        fill_uniform_pinned(i, b, n, hw)?;
        Ok(true)
    })
}

fn pinned_threads_and_depths() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    for threads in [1, 4] {
        for depth in [1, 3] {
            let end = 17;
            run_checked(
                &stream,
                pinned_source(end, 8, 64),
                config(threads, depth),
                end,
                |i| uniform_want(i, 8, 64),
                &format!("pinned, {threads} loaders, depth {depth}"),
            )?;
        }
    }
    Ok(())
}

/// The slow consumer over page-locked pixels: the loaders get their blocks back while the
/// copies out of them still wait behind the consumer's release on the GPU.
fn pinned_slow_consumer() -> R {
    slow_consumer_with(pinned_source)
}

/// Blocks of the user's own pools (one `cudaHostAlloc`, one registered) on the prefetcher's
/// device, set directly, next to `pinned()` (which may then reuse a user block).
fn pinned_user_pool() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let alloc = PinnedPool::new(&dev, PoolConfig::default())?;
    let register = PinnedPool::new(
        &dev,
        PoolConfig {
            backing: pinstream::PoolBacking::Register {
                threads: 2,
                huge_pages: false,
                flags: pinstream::HostRegister::DEFAULT,
            },
            ..PoolConfig::default()
        },
    )?;
    let (n, hw, end) = (4usize, 40usize, 24u64);
    let src = Source::new(move |i, b: &mut HostBatch<i64>| {
        if i >= end {
            return Ok(false);
        }
        if i % 3 == 2 {
            fill_uniform_pinned(i, b, n, hw)?;
            return Ok(true);
        }
        uniform_meta(i, b, n, hw);
        let pool = if i % 3 == 0 { &alloc } else { &register };
        let mut block = pool.alloc::<u8>(n * 3 * hw * hw)?;
        uniform_bytes(i, block.as_mut_slice()?);
        b.pixels = Pixels::Pinned(block);
        Ok(true)
    });
    run_checked(
        &stream,
        src,
        config(3, 2),
        end,
        |i| uniform_want(i, n, hw),
        "user pools",
    )
}

/// The most pool bytes a prefetcher of `c` over page-locked batches of `len` bytes may hold:
/// the stager's slots, plus one block per host batch (at most `ahead + 1` exist) and one per
/// copy in flight (at most `depth`: the feeder waits for a slot's previous batch before it
/// queues a copy from page-locked memory).
fn pinned_bound(c: &PrefetchConfig, len: usize) -> usize {
    let ahead = if c.ahead == 0 {
        c.depth + c.loader_threads
    } else {
        c.ahead
    };
    // `HostBatch::pinned` asks for the longest length plus an eighth; the pool rounds that up
    // to its class (a multiple of 4096 below 32 KiB).
    let block = len + len / 8;
    assert!(
        block < 32 << 10,
        "pinned_bound knows only the classes below 32 KiB"
    );
    c.stager.slots * c.stager.slot_bytes + (ahead + 1 + c.depth) * block.next_multiple_of(4096)
}

/// 2000 small batches in page-locked memory: device bytes, the pool's bytes and the device's
/// free memory are the same after the last batch as after the twentieth (the blocks are
/// reused, not allocated anew), and within `pinned_bound`; every 100th batch is checked. The
/// first 16 batches meet a slow consumer, so that the copies wait on the GPU, the loaders find
/// their blocks busy and the pool reaches its most blocks before batch 20.
fn pinned_soak() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let end = 2000u64;
    let c = config(2, 2);
    let bound = pinned_bound(&c, 4 * 3 * 32 * 32);
    let mut p = Prefetcher::<f32, i64>::new(&stream, pinned_source(end, 4, 32), c)?;
    let mut at20 = None;
    let mut i = 0u64;
    let measure = |p: &Prefetcher<f32, i64>| -> Result<_, Failed> {
        let s = p.pinned_stats();
        Ok((
            p.device_bytes(),
            s.cached_bytes + s.in_use_bytes,
            dev.memory_info()?.free,
        ))
    };
    loop {
        let Some(b) = p.next() else { break };
        let b = b?;
        if i % 100 == 0 {
            let what = format!("batch {i}");
            check(
                &stream,
                &b.pixels()?,
                &b.extras()?,
                &uniform_want(i, 4, 32),
                &what,
            )?;
        }
        if i < 16 {
            stream.spin(Duration::from_micros(500))?;
        }
        drop(b);
        if i == 20 {
            stream.synchronize()?;
            at20 = Some(measure(&p)?);
        }
        i += 1;
    }
    stream.synchronize()?;
    ensure(i == end, || format!("{i} batches"))?;
    let now = measure(&p)?;
    let then = at20.ok_or("no batch 20")?;
    ensure(now.0 == then.0 && now.1 == then.1, || {
        format!(
            "slot / pinned bytes grew: after 20 {then:?}, after {end} {now:?} ({:?})",
            p.pinned_stats()
        )
    })?;
    ensure(now.1 <= bound, || {
        format!("{} pinned bytes, more than {bound}", now.1)
    })?;
    if under_sanitizer() {
        return Ok(());
    }
    // Free device memory may move a little with other processes; allow 2 MiB.
    ensure(now.2.abs_diff(then.2) <= 2 << 20, || {
        format!("free device memory moved: after 20 {then:?}, after {end} {now:?}")
    })
}

/// A consumer whose GPU work is slow and whose host never waits runs far ahead of the GPU:
/// the page-locked blocks that copies still read stay bounded all the same (the feeder waits
/// for a slot's previous batch), checked against `pinned_bound`, and every batch is right.
fn pinned_host_far_ahead() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let (n, hw, end) = (4usize, 32usize, 300u64);
    let len = n * 3 * hw * hw;
    let c = config(4, 2);
    let bound = pinned_bound(&c, len);
    // Allocated up front: an allocation in the loop could synchronise with the device.
    let mut copies = (0..end)
        .map(|_| DeviceBuffer::<f32>::new(&dev, len))
        .collect::<Result<Vec<_>, _>>()?;
    stream.synchronize()?;
    let mut p = Prefetcher::<f32, i64>::new(&stream, pinned_source(end, n, hw), c)?;
    let mut worst = 0usize;
    let mut seen = 0usize;
    loop {
        let Some(b) = p.next() else { break };
        let b = b?;
        let d = copies
            .get_mut(seen)
            .ok_or("more batches than the source has")?;
        stream.spin(Duration::from_micros(300))?;
        stream.copy_d2d(&b.pixels()?, d)?;
        drop(b);
        seen += 1;
        let s = p.pinned_stats();
        worst = worst.max(s.cached_bytes + s.in_use_bytes);
    }
    ensure(worst <= bound, || {
        format!("{worst} pinned bytes, more than {bound}: the feeder ran ahead of the GPU")
    })?;
    ensure(seen == end as usize, || format!("{seen} batches of {end}"))?;
    for (i, d) in copies.iter().enumerate() {
        let mut px = vec![f32::NAN; len];
        stream.copy_d2h(d, &mut px[..])?.wait()?;
        let want = uniform_want(i as u64, n, hw);
        let exact = cpu::normalize_exact(&want.pixels.read()?, &want.spec, None)?;
        let w = cpu::worst_error(&px, &exact, 0.0)?;
        ensure(w.is_none_or(|w| w.units <= 1.0), || {
            format!("batch {i}: {w:?} (seed {})", seed())
        })?;
    }
    Ok(())
}

/// Batches written into a temporary file, removed on drop: batch `i` is `ranges[i]`, each
/// after `gap` bytes of junk (so the offsets are odd).
struct BatchFile {
    path: PathBuf,
    file: Arc<FileSource>,
    ranges: Vec<(u64, usize)>,
}

impl Drop for BatchFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Writes batches `0..count` of `dims(i) = (n, hw)` (`uniform_bytes`) into a new file.
fn write_batches(
    name: &str,
    count: u64,
    dims: impl Fn(u64) -> (usize, usize),
    gap: usize,
) -> Result<BatchFile, Failed> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let path = std::env::temp_dir().join(format!(
        "pinstream-test-prefetch-{name}-{}-{}.bin",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let mut f = std::fs::File::create(&path)?;
    // A guard from here on; its `file` is replaced once everything is written.
    let mut out = BatchFile {
        path: path.clone(),
        file: Arc::new(FileSource::open(&path)?),
        ranges: Vec::new(),
    };
    let mut at = 0u64;
    for i in 0..count {
        let (n, hw) = dims(i);
        let mut bytes = vec![0u8; n * 3 * hw * hw];
        uniform_bytes(i, &mut bytes);
        f.write_all(&vec![0xEE; gap])?;
        at += gap as u64;
        f.write_all(&bytes)?;
        out.ranges.push((at, bytes.len()));
        at += bytes.len() as u64;
    }
    f.write_all(&vec![0xEE; gap])?;
    f.flush()?;
    out.file = Arc::new(FileSource::open(&path)?);
    Ok(out)
}

/// Batches as ranges of a file: read back on the host, then through prefetchers of several
/// shapes, each batch against the CPU reference.
fn file_ranges() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let (n, hw, end) = (4usize, 48usize, 19u64);
    let bf = Arc::new(write_batches("ranges", end, |_| (n, hw), 13)?);
    for i in 0..end {
        let (offset, len) = bf.ranges[i as usize];
        let px = Pixels::File {
            file: bf.file.clone(),
            offset,
            len,
        };
        let want = uniform_want(i, n, hw);
        ensure(px.read()? == want.pixels.read()?, || {
            format!(
                "batch {i}: the file range reads back wrong (seed {})",
                seed()
            )
        })?;
    }
    for (threads, depth) in [(1, 1), (3, 2), (4, 3)] {
        let f = bf.clone();
        let src = Source::new(move |i, b: &mut HostBatch<i64>| {
            let Some(&(offset, len)) = f.ranges.get(i as usize) else {
                return Ok(false);
            };
            uniform_meta(i, b, n, hw);
            b.set_file(f.file.clone(), offset, len);
            Ok(true)
        });
        run_checked(
            &stream,
            src,
            config(threads, depth),
            end,
            |i| uniform_want(i, n, hw),
            &format!("file, {threads} loaders, depth {depth}"),
        )?;
    }
    Ok(())
}

/// Batch `i`'s shape in the mixed trial: sizes change, so blocks and slots are resized.
fn mixed_dims(i: u64) -> (usize, usize) {
    (1 + (i % 4) as usize, 16 + 8 * ((i / 3) % 4) as usize)
}

/// Batch `i` pageable, pinned or a file range by `i % 3`, of changing sizes.
fn mixed_kinds() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let end = 48u64;
    let bf = Arc::new(write_batches("mixed", end, mixed_dims, 5)?);
    for (threads, depth) in [(1, 1), (3, 2)] {
        let f = bf.clone();
        let src = Source::new(move |i, b: &mut HostBatch<i64>| {
            if i >= end {
                return Ok(false);
            }
            let (n, hw) = mixed_dims(i);
            match i % 3 {
                0 => fill_uniform(i, b, n, hw),
                1 => fill_uniform_pinned(i, b, n, hw)?,
                _ => {
                    uniform_meta(i, b, n, hw);
                    let (offset, len) = f.ranges[i as usize];
                    b.set_file(f.file.clone(), offset, len);
                }
            }
            Ok(true)
        });
        run_checked(
            &stream,
            src,
            config(threads, depth),
            end,
            |i| {
                let (n, hw) = mixed_dims(i);
                uniform_want(i, n, hw)
            },
            &format!("mixed, {threads} loaders, depth {depth}"),
        )?;
    }
    Ok(())
}

/// `Source::iter` over batches made with `HostBatch::new`: pageable, a block of the user's pool,
/// a file range, by `i % 3`.
fn iterator_pinned_and_file() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let (n, hw, end) = (2usize, 24usize, 12u64);
    let bf = Arc::new(write_batches("iter", end, |_| (n, hw), 3)?);
    let pool = PinnedPool::new(&dev, PoolConfig::default())?;
    let f = bf.clone();
    let it = (0..end).map(move |i| -> Result<HostBatch<i64>, LoadError> {
        let mut b = HostBatch::new(
            Pixels::default(),
            Spec::uniform(0, 3, 1, 1, Normalize::imagenet()).expect("an empty batch"),
            Vec::new(),
        );
        uniform_meta(i, &mut b, n, hw);
        b.pixels = match i % 3 {
            0 => {
                let mut v = vec![0u8; n * 3 * hw * hw];
                uniform_bytes(i, &mut v);
                Pixels::Pageable(v)
            }
            1 => {
                let mut block = pool.alloc::<u8>(n * 3 * hw * hw)?;
                uniform_bytes(i, block.as_mut_slice()?);
                Pixels::Pinned(block)
            }
            _ => {
                let (offset, len) = f.ranges[i as usize];
                Pixels::File {
                    file: f.file.clone(),
                    offset,
                    len,
                }
            }
        };
        Ok(b)
    });
    run_checked(
        &stream,
        Source::iter(it),
        config(3, 2),
        end,
        |i| uniform_want(i, n, hw),
        "iterator",
    )
}

/// Pinned pixels one byte short at batch 4: a `Loader` error there, nothing after.
fn bad_pinned_length() -> R {
    fails_at(4, |i, b| {
        if i == 4 {
            uniform_meta(i, b, 4, 32);
            b.pinned(4 * 3 * 32 * 32 - 1)?.fill(7);
            return Ok(true);
        }
        fill_uniform_pinned(i, b, 4, 32)?;
        Ok(true)
    })
}

/// A file range past the end of the file at batch 3 (refused before the read), then a file
/// truncated after it was opened (the read itself fails): a `Loader` error at batch 3 naming
/// the file, nothing after.
fn file_range_past_end() -> R {
    let dev = Device::get(0)?;
    let k = 3u64;
    for truncate in [false, true] {
        let bf = Arc::new(write_batches("past-end", k + 1, |_| (4, 32), 0)?);
        let last_offset = bf.ranges[k as usize].0;
        if truncate {
            // The FileSource still believes the old length: the stager's pread hits the end.
            std::fs::OpenOptions::new()
                .write(true)
                .open(&bf.path)?
                .set_len(last_offset + 100)?;
        }
        let f = bf.clone();
        let src = Source::new(move |i, b: &mut HostBatch<i64>| {
            uniform_meta(i, b, 4, 32);
            let (offset, len) = f.ranges[i.min(k) as usize];
            // Without truncation, batch k asks for 10 bytes past the end.
            let offset = if i == k && !truncate {
                offset + 10
            } else {
                offset
            };
            b.set_file(f.file.clone(), offset, len);
            Ok(true)
        });
        let message = fails_on(&dev, k, src)?;
        let path = bf.path.display().to_string();
        ensure(message.contains(&path), || {
            format!("truncated {truncate}: {message:?} does not name {path}")
        })?;
    }
    Ok(())
}

/// A block of device 1's pool in a prefetcher of device 0 at batch 2: a `Loader` error naming
/// both devices.
fn pinned_other_device() -> R {
    let dev = Device::get(0)?;
    let other = PinnedPool::new(&Device::get(1)?, PoolConfig::default())?;
    let src = Source::new(move |i, b: &mut HostBatch<i64>| {
        if i == 2 {
            uniform_meta(i, b, 4, 32);
            let mut block = other.alloc::<u8>(4 * 3 * 32 * 32)?;
            uniform_bytes(i, block.as_mut_slice()?);
            b.pixels = Pixels::Pinned(block);
            return Ok(true);
        }
        fill_uniform_pinned(i, b, 4, 32)?;
        Ok(true)
    });
    let message = fails_on(&dev, 2, src)?;
    ensure(
        message.contains("cuda:0") && message.contains("cuda:1"),
        || format!("{message:?} does not name both devices"),
    )
}

/// Without a prefetcher there is no pool: `pinned()` gives the batch's ordinary vector, of the
/// length asked (so one source runs in a dry run too); an impossible length is refused.
fn pinned_without_pool() -> R {
    let mut b = HostBatch::<i64>::new(
        Pixels::Pageable(vec![1, 2, 3]),
        Spec::uniform(1, 3, 1, 1, Normalize::imagenet())?,
        vec![5],
    );
    b.pinned(5)?.copy_from_slice(&[9, 8, 7, 6, 5]);
    ensure(
        matches!(&b.pixels, Pixels::Pageable(v) if v == &[9, 8, 7, 6, 5]),
        || format!("pixels: {:?}", b.pixels),
    )?;
    let mut d = HostBatch::<i64>::default();
    ensure(d.pinned(0).is_ok_and(|p| p.is_empty()), || {
        "default batch".into()
    })?;
    ensure(
        matches!(d.pinned(usize::MAX), Err(Error::InvalidArgument { .. })),
        || "usize::MAX".into(),
    )
}

/// `Pixels::len` / `read` and the switches between kinds, on the host.
fn pixels_len_and_read() -> R {
    let mut b = HostBatch::<i64>::default();
    ensure(b.pixels.is_empty() && b.pixels.read()?.is_empty(), || {
        "default pixels".into()
    })?;
    b.pageable().extend_from_slice(&[9; 1000]);
    ensure(b.pixels.len() == 1000, || "pageable len".into())?;
    ensure(b.pixels.read()?.iter().all(|&x| x == 9), || "read".into())?;
    let bf = write_batches("host", 2, |_| (1, 8), 7)?;
    let (offset, len) = bf.ranges[1];
    b.set_file(bf.file.clone(), offset, len);
    ensure(b.pixels.len() == len && b.pixels.kind() == "file", || {
        "file len".into()
    })?;
    let mut want = vec![0u8; len];
    uniform_bytes(1, &mut want);
    ensure(b.pixels.read()?.as_ref() == &want[..], || {
        format!("the file range reads back wrong (seed {})", seed())
    })?;
    // Back to pageable: the vector put aside, empty, with its capacity.
    let v = b.pageable();
    ensure(v.is_empty() && v.capacity() >= 1000, || {
        format!("stash: len {}, capacity {}", v.len(), v.capacity())
    })?;
    // A range past the end reads as an error, not a panic.
    b.set_file(bf.file.clone(), bf.file.len() - 3, 4);
    ensure(matches!(b.pixels.read(), Err(Error::Io { .. })), || {
        "past the end".into()
    })
}

/// With `numa_local`, every loader runs on the CPUs next to the device (those the caller may
/// use), and the caller's own mask is the same after `Prefetcher::new` as before; without it,
/// the loaders keep the caller's mask.
fn numa_local() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let caller = thread_cpus()?;
    let local: Vec<usize> = match dev.local_cpus() {
        Some(l) => l.into_iter().filter(|c| caller.contains(c)).collect(),
        None => caller.clone(),
    };
    let want_local = if local.is_empty() {
        caller.clone()
    } else {
        local
    };
    for on in [true, false] {
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen2 = seen.clone();
        let source = Source::new(move |i, b: &mut HostBatch<i64>| {
            if i >= 12 {
                return Ok(false);
            }
            seen2
                .lock()
                .map_err(|_| "poisoned")?
                .push(thread_cpus().map_err(|e| format!("{e:?}"))?);
            fill_uniform(i, b, 2, 8);
            Ok(true)
        });
        let c = PrefetchConfig {
            numa_local: on,
            ..config(3, 2)
        };
        let mut p = Prefetcher::<f32, i64>::new(&stream, source, c)?;
        ensure(thread_cpus()? == caller, || {
            format!("numa_local {on}: the caller's CPUs changed")
        })?;
        let mut k = 0u64;
        while let Some(b) = p.next() {
            let b = b?;
            check(
                &stream,
                &b.pixels()?,
                &b.extras()?,
                &uniform_want(k, 2, 8),
                "affinity",
            )?;
            k += 1;
        }
        ensure(k == 12, || format!("{k} batches, not 12"))?;
        let want = if on { &want_local } else { &caller };
        for cpus in seen.lock().map_err(|_| "poisoned")?.iter() {
            ensure(cpus == want, || {
                format!("numa_local {on}: a loader ran on {cpus:?}, expected {want:?}")
            })?;
        }
    }
    Ok(())
}

/// `end` batches of `n x 3 x hw x hw` (batch `i` as `fill_uniform` makes it) back to back in
/// one pinned buffer allocated on `dev` with `flags`.
fn resident_batches(
    dev: &Device,
    end: u64,
    n: usize,
    hw: usize,
    flags: HostAlloc,
) -> Result<Arc<PinnedBuffer<u8>>, Failed> {
    let len = n * 3 * hw * hw;
    let mut buf = PinnedBuffer::<u8>::new(dev, len * end as usize, flags)?;
    for (i, chunk) in buf.as_mut_slice()?.chunks_mut(len).enumerate() {
        uniform_bytes(i as u64, chunk);
    }
    Ok(Arc::new(buf))
}

/// Batch `i` is the `i`-th range of `buf` (as `resident_batches` filled it).
fn resident_source(buf: Arc<PinnedBuffer<u8>>, end: u64, n: usize, hw: usize) -> Source<i64> {
    Source::new(move |i, b: &mut HostBatch<i64>| {
        if i >= end {
            return Ok(false);
        }
        uniform_meta(i, b, n, hw);
        let len = n * 3 * hw * hw;
        b.set_resident(buf.clone(), i as usize * len, len);
        Ok(true)
    })
}

fn resident_ranges() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let (n, hw, end) = (4usize, 40usize, 23u64);
    let buf = resident_batches(&dev, end, n, hw, HostAlloc::DEFAULT)?;
    let len = n * 3 * hw * hw;
    for i in 0..end {
        let px = Pixels::Resident {
            buf: buf.clone(),
            offset: i as usize * len,
            len,
        };
        ensure(px.kind() == "resident" && px.len() == len, || {
            format!("batch {i}: {} of {}", px.kind(), px.len())
        })?;
        let want = uniform_want(i, n, hw);
        ensure(px.read()? == want.pixels.read()?, || {
            format!(
                "batch {i}: the resident range reads back wrong (seed {})",
                seed()
            )
        })?;
    }
    for (threads, depth) in [(1, 1), (2, 2), (4, 3), (3, 4)] {
        run_checked(
            &stream,
            resident_source(buf.clone(), end, n, hw),
            config(threads, depth),
            end,
            |i| uniform_want(i, n, hw),
            &format!("resident, {threads} loaders, depth {depth}"),
        )?;
    }
    // With the prefetchers gone, the buffer is the caller's alone again, and writable.
    let mut buf = Arc::try_unwrap(buf).map_err(|_| "a prefetcher kept the resident buffer")?;
    buf.as_mut_slice()?.fill(1);
    ensure(buf.as_slice()?.iter().all(|&b| b == 1), || "rewrite".into())
}

fn resident_range_outside() -> R {
    let dev = Device::get(0)?;
    let k = 3u64;
    let (n, hw) = (4usize, 32usize);
    let len = n * 3 * hw * hw;
    let buf = resident_batches(&dev, k + 1, n, hw, HostAlloc::DEFAULT)?;
    // Ten bytes past the end, and an offset whose end overflows.
    for offset in [k as usize * len + 10, usize::MAX - 5] {
        let b2 = buf.clone();
        let src = Source::new(move |i, b: &mut HostBatch<i64>| {
            uniform_meta(i, b, n, hw);
            let at = if i == k { offset } else { i as usize * len };
            b.set_resident(b2.clone(), at, len);
            Ok(true)
        });
        let message = fails_on(&dev, k, src)?;
        ensure(message.contains("outside"), || {
            format!("offset {offset}: {message:?} does not say the range is outside")
        })?;
        let bad = Pixels::Resident {
            buf: buf.clone(),
            offset,
            len,
        };
        ensure(
            matches!(bad.read(), Err(Error::InvalidArgument { .. })),
            || format!("offset {offset}: Pixels::read of a range outside"),
        )?;
    }
    Ok(())
}

/// One portable buffer feeds a prefetcher on each of two devices; every batch checked.
fn resident_two_devices() -> R {
    let buf = resident_batches(&Device::get(0)?, 21, 4, 32, HostAlloc::PORTABLE)?;
    run_shards_of(
        vec![Device::get(0)?.stream()?, Device::get(1)?.stream()?],
        resident_source(buf, 21, 4, 32),
    )
}

fn resident_other_device() -> R {
    let dev = Device::get(0)?;
    let other = resident_batches(&Device::get(1)?, 4, 4, 32, HostAlloc::DEFAULT)?;
    let own = resident_batches(&dev, 4, 4, 32, HostAlloc::DEFAULT)?;
    let src = Source::new(move |i, b: &mut HostBatch<i64>| {
        uniform_meta(i, b, 4, 32);
        let len = 4 * 3 * 32 * 32;
        let buf = if i == 2 { &other } else { &own };
        b.set_resident(buf.clone(), i.min(3) as usize * len, len);
        Ok(true)
    });
    let message = fails_on(&dev, 2, src)?;
    ensure(
        message.contains("cuda:0") && message.contains("cuda:1") && message.contains("PORTABLE"),
        || format!("{message:?} does not name both devices and the way out"),
    )
}
