//! GPU trials of the prefetcher: every batch that comes out equals the CPU reference of the batch
//! that went in, in order, for 1..4 loader threads and depths 1..4, with fast and slow consumers
//! (a slow consumer's delayed reads catch a slot refilled before its release); variable sizes
//! with crops and mirrors; loader errors, panics and bad batches at batch k; a leaked batch
//! guard; dropping mid-epoch; sharding; a long run with memory checked. Ignored without a GPU.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{ensure, R};
use libtest_mimic::{Arguments, Failed, Trial};
use pinstream::kernels::{cpu, Crop, Layout, Normalize, Sample, Spec};
use pinstream::prefetch::{HostBatch, PrefetchConfig, Prefetcher, Source};
use pinstream::{Device, DeviceBuffer, Error, Stream};
use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};

fn main() {
    let mut args = Arguments::from_args();
    args.test_threads.get_or_insert(1);
    let no_gpu = !pinstream::available();
    let two_gpus = Device::count().is_ok_and(|n| n >= 2);
    let mut trials = Vec::new();
    let mut gpu = |name: &str, f: fn() -> R| {
        trials.push(Trial::test(name, f).with_ignored_flag(no_gpu));
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
    gpu("shards/two_on_one_device", shards_one_device);
    gpu("soak/memory_flat_10000", soak);
    trials.push(Trial::test("shards/two_devices", shards_two_devices).with_ignored_flag(!two_gpus));
    libtest_mimic::run(&args, trials).exit();
}

/// A run-wide seed (printed on failure) so every run draws fresh data.
fn seed() -> u64 {
    static SEED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *SEED.get_or_init(|| rand::rng().next_u64())
}

/// Batch `i`'s content: a pure function of (seed, i), so the consumer can rebuild it.
fn fill_uniform(i: u64, b: &mut HostBatch<i64>, n: usize, hw: usize) {
    b.spec = Spec::uniform(n, 3, hw, hw, Normalize::imagenet());
    let mut r = SmallRng::seed_from_u64(seed() ^ i.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    b.pixels.resize(n * 3 * hw * hw, 0);
    r.fill_bytes(&mut b.pixels);
    b.extras.clear();
    b.extras.extend((0..n as i64).map(|k| i as i64 * 1000 + k));
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
    let exact = cpu::normalize_exact(&want.pixels, &want.spec, None)?;
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
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let (n, hw, end) = (4usize, 96usize, 24u64);
    let len = n * 3 * hw * hw;
    for depth in [1, 2, 4] {
        let mut p =
            Prefetcher::<f32, i64>::new(&stream, uniform_source(end, n, hw), config(3, depth))?;
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
            let exact = cpu::normalize_exact(&want.pixels, &want.spec, None)?;
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
    b.pixels.resize(len, 0);
    r.fill_bytes(&mut b.pixels);
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
fn fails_at(
    k: u64,
    how: fn(u64, &mut HostBatch<i64>) -> Result<bool, pinstream::prefetch::LoadError>,
) -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    for threads in [1, 4] {
        let mut p = Prefetcher::<f32, i64>::new(&stream, Source::new(how), config(threads, 2))?;
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
                ensure(!message.is_empty(), || "empty message".into())?
            }
            other => {
                return Err(format!("batch {k}: {:?}", other.map(|r| r.map(|b| b.index()))).into())
            }
        }
        ensure(p.next().is_none(), || "a batch after the error".into())?;
    }
    Ok(())
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
            b.pixels.pop();
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
        ensure(t.elapsed() < Duration::from_secs(5), || {
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

fn run_shards(streams: Vec<Stream>) -> R {
    let n = streams.len() as u64;
    let ps = Prefetcher::<f32, i64>::sharded(&streams, uniform_source(21, 4, 32), config(2, 2))?;
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
        dev.memory_info()?.free,
    );
    let then = at10.ok_or("no batch 10")?;
    ensure(now.0 == then.0 && now.1 == then.1, || {
        format!("slot / pinned bytes grew: after 10 {then:?}, after 10000 {now:?}")
    })?;
    // Free device memory may move a little with other processes; allow 2 MiB.
    ensure(now.2.abs_diff(then.2) <= 2 << 20, || {
        format!("free device memory moved: after 10 {then:?}, after 10000 {now:?}")
    })
}
