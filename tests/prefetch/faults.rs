//! The prefetcher under faults: no `next()` and no drop may hang, abort or panic, whatever the
//! source does.
//!
//! - `hang/*`, `abort/*`, `grow/*`: one trial per defect of issue 19, each written to fail (a
//!   watchdog turns a hang into a failure) on the code before the fix. `dry/` trials run the
//!   loaders and feeder without a device ([`DryRun`]), `gpu/` ones the real [`Prefetcher`].
//! - `random/*`: random schedules — closure and iterator sources, loader counts, depths, windows,
//!   shards, and at a random batch a loader error (plain, or whose `Display` or `Drop` panics), a
//!   panic (also with a payload whose `Drop` panics), or a bad batch; consumers that drop their
//!   prefetcher mid-epoch or leak a batch guard. Invariants: every schedule ends within a bound;
//!   batches come in order and equal the CPU reference; the error names the batch it stops at,
//!   and the faulty batch where that is determined; every drop returns; on the GPU, pinstream's
//!   own device and pinned memory ([`pinstream::memory::live`]) end where they began.
//!   `PINSTREAM_FAULT_SCHEDULES` sets the count (2000 on the CPU, 300 on the GPU by default),
//!   `PINSTREAM_FAULT_SEED` replays a run.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::{ensure, within, R};
use libtest_mimic::{Failed, Trial};
use pinstream::kernels::{cpu, Normalize, Spec};
use pinstream::prefetch::{DryRun, HostBatch, LoadError, PrefetchConfig, Prefetcher, Source};
use pinstream::{Device, Error, Stream};
use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};

use crate::common::trial;

/// Prefix of this module's trial names (its path in the binary).
const PREFIX: &str = "faults/";

/// The trials of this module, named `faults/...`.
pub fn trials() -> Vec<Trial> {
    // The injected panics are expected: keep them out of the output.
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let injected = info.payload().downcast_ref::<Bomb>().is_some()
            || info
                .payload()
                .downcast_ref::<&str>()
                .is_some_and(|m| m.contains("::"))
            || info
                .payload()
                .downcast_ref::<String>()
                .is_some_and(|m| m.starts_with("source panics"));
        if !injected {
            default_hook(info);
        }
    }));
    let no_gpu = !pinstream::available();
    let mut trials = vec![
        trial(PREFIX, "dry/hang/iter_shard_dropped", || {
            iter_shard_dropped(Kind::Dry)
        }),
        trial(PREFIX, "dry/hang/iter_shard_failed", || {
            iter_shard_failed(Kind::Dry)
        }),
        trial(PREFIX, "dry/hang/iter_panics", || iter_panics(Kind::Dry)),
        trial(PREFIX, "dry/hang/user_code_panics", || {
            user_code_panics(Kind::Dry)
        }),
        trial(PREFIX, "dry/hang/iter_reused", || iter_reused(Kind::Dry)),
        trial(PREFIX, "dry/random/schedules", || {
            random_schedules(Kind::Dry, 2000)
        }),
    ];
    let mut gpu = |name: &str, f: fn() -> R| {
        trials.push(trial(PREFIX, name, f).with_ignored_flag(no_gpu));
    };
    gpu("gpu/hang/iter_shard_dropped", || {
        iter_shard_dropped(Kind::Gpu)
    });
    gpu("gpu/hang/iter_shard_failed", || {
        iter_shard_failed(Kind::Gpu)
    });
    gpu("gpu/hang/iter_panics", || iter_panics(Kind::Gpu));
    gpu("gpu/hang/user_code_panics", || user_code_panics(Kind::Gpu));
    gpu("gpu/hang/iter_reused", || iter_reused(Kind::Gpu));
    gpu(
        "gpu/grow/pinned_varying_lengths_flat",
        pinned_varying_lengths,
    );
    gpu("gpu/random/schedules", || random_schedules(Kind::Gpu, 300));
    trials
}

/// How long any schedule or single step may take before it counts as a hang.
const BOUND: Duration = Duration::from_secs(30);

// ---------------------------------------------------------------------------------------------
// Batches: small, random, a pure function of (run seed, schedule, index).

fn run_seed() -> u64 {
    static SEED: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *SEED.get_or_init(|| {
        std::env::var("PINSTREAM_FAULT_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| rand::rng().next_u64())
    })
}

/// Batch `i` of data `salt`: 1..3 samples of 3 x (1..6) x (1..6), random bytes, extras
/// `[i, samples]`.
fn make_batch(salt: u64, i: u64) -> HostBatch<i64> {
    let mut r = SmallRng::seed_from_u64(run_seed() ^ salt ^ i.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let n = r.random_range(1..=3usize);
    let sizes: Vec<(usize, usize)> = (0..n)
        .map(|_| (r.random_range(1..=6), r.random_range(1..=6)))
        .collect();
    let spec = Spec::variable(3, &sizes, Normalize::imagenet());
    let len: usize = sizes.iter().map(|(h, w)| 3 * h * w).sum();
    let mut px = vec![0u8; len];
    r.fill_bytes(&mut px);
    HostBatch::new(px.into(), spec, vec![i as i64, n as i64])
}

fn fill_from(b: &mut HostBatch<i64>, want: HostBatch<i64>) {
    b.spec = want.spec;
    b.extras.clone_from(&want.extras);
    let px = b.pageable();
    px.clear();
    if let pinstream::prefetch::Pixels::Pageable(v) = &want.pixels {
        px.extend_from_slice(v);
    }
}

/// Checks a batch that came out against the reference of batch `i`.
fn check(salt: u64, i: u64, pixels: &[f32], extras: &[i64]) -> R {
    let want = make_batch(salt, i);
    let exact = cpu::normalize_exact(&want.pixels.read()?, &want.spec, None)?;
    let worst = cpu::worst_error(pixels, &exact, want.spec.norm.shift)?;
    ensure(worst.is_none_or(|w| w.units <= 1.0), || {
        format!("batch {i}: pixels differ from the reference: {worst:?}")
    })?;
    ensure(extras == want.extras.as_slice(), || {
        format!("batch {i}: extras {extras:?}, want {:?}", want.extras)
    })
}

// ---------------------------------------------------------------------------------------------
// Faults.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    Error,
    ErrorDisplayPanics,
    ErrorDropPanics,
    Panic,
    PanicPayloadDropPanics,
    BadBatch,
}

const FAULTS: [Fault; 6] = [
    Fault::Error,
    Fault::ErrorDisplayPanics,
    Fault::ErrorDropPanics,
    Fault::Panic,
    Fault::PanicPayloadDropPanics,
    Fault::BadBatch,
];

/// A loader error whose `Display` and/or `Drop` panic.
#[derive(Debug)]
struct Nasty {
    display_panics: bool,
    drop_panics: bool,
}

impl std::fmt::Display for Nasty {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.display_panics {
            panic!("Nasty::fmt panics");
        }
        f.write_str("a nasty error")
    }
}

impl std::error::Error for Nasty {}

impl Drop for Nasty {
    fn drop(&mut self) {
        if self.drop_panics {
            panic!("Nasty::drop panics");
        }
    }
}

/// A panic payload whose `Drop` panics.
struct Bomb;

impl Drop for Bomb {
    fn drop(&mut self) {
        panic!("Bomb::drop panics");
    }
}

/// Produces batch `i` of `salt` with `fault` injected: `Err` for the error kinds (the panics
/// happen right here).
fn produce(salt: u64, i: u64, fault: Option<Fault>) -> Result<HostBatch<i64>, LoadError> {
    let mut b = make_batch(salt, i);
    match fault {
        None => {}
        Some(Fault::Error) => return Err(format!("loader error at {i}").into()),
        Some(Fault::ErrorDisplayPanics) => {
            return Err(Box::new(Nasty {
                display_panics: true,
                drop_panics: false,
            }))
        }
        Some(Fault::ErrorDropPanics) => {
            return Err(Box::new(Nasty {
                display_panics: false,
                drop_panics: true,
            }))
        }
        Some(Fault::Panic) => panic!("source panics at {i}"),
        Some(Fault::PanicPayloadDropPanics) => std::panic::panic_any(Bomb),
        Some(Fault::BadBatch) => {
            if let pinstream::prefetch::Pixels::Pageable(v) = &mut b.pixels {
                v.push(7);
            }
        }
    }
    Ok(b)
}

/// A closure source of `end` batches with `fault` at batch `at`.
fn closure_source(salt: u64, end: u64, fault: Option<(u64, Fault)>) -> Source<i64> {
    Source::new(move |i, b: &mut HostBatch<i64>| {
        if i >= end {
            return Ok(false);
        }
        let f = fault.filter(|&(k, _)| k == i).map(|(_, f)| f);
        fill_from(b, produce(salt, i, f)?);
        Ok(true)
    })
}

/// An iterator source of `end` batches with `fault` at item `at`.
fn iter_source(salt: u64, end: u64, fault: Option<(u64, Fault)>) -> Source<i64> {
    Source::iter((0..end).map(move |i| {
        let f = fault.filter(|&(k, _)| k == i).map(|(_, f)| f);
        produce(salt, i, f)
    }))
}

// ---------------------------------------------------------------------------------------------
// One consumer loop over either pipeline.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Dry,
    Gpu,
}

/// A prefetcher of either kind, as one consumer drives it.
// One per trial, on the stack: the size difference does not matter.
#[allow(clippy::large_enum_variant)]
enum Pipe {
    Dry(DryRun<f32, i64>),
    Gpu(Prefetcher<f32, i64>),
}

/// What the consumer of one shard saw.
#[derive(Debug, Default)]
struct Seen {
    got: Vec<u64>,
    /// The error that ended it: its batch and message.
    error: Option<(u64, String)>,
    /// `None` came (the end of the data).
    ended: bool,
}

/// How a consumer behaves.
#[derive(Clone, Copy, Debug, Default)]
struct Consumer {
    /// Stop (dropping the prefetcher) after this many batches.
    stop_after: Option<usize>,
    /// Leak the guard of this batch (`mem::forget`).
    leak: Option<usize>,
}

fn start(
    kind: Kind,
    streams: &[Stream],
    shards: usize,
    source: Source<i64>,
    config: PrefetchConfig,
) -> Result<Vec<Pipe>, Failed> {
    Ok(match kind {
        Kind::Dry => DryRun::sharded(shards, source, config)?
            .into_iter()
            .map(Pipe::Dry)
            .collect(),
        Kind::Gpu => Prefetcher::sharded(&streams[..shards], source, config)?
            .into_iter()
            .map(Pipe::Gpu)
            .collect(),
    })
}

fn loader_error(e: Error) -> Result<(u64, String), Failed> {
    match e {
        Error::Loader { batch, message } => Ok((batch, message)),
        e => Err(format!("expected Error::Loader, got {e:?}").into()),
    }
}

/// Drives one shard: checks every batch against the reference, in order (`shard`, `shard +
/// shards`, ...), and stops as `how` says.
fn consume(mut p: Pipe, salt: u64, shard: u64, shards: u64, how: Consumer) -> Result<Seen, Failed> {
    let mut seen = Seen::default();
    loop {
        if how.stop_after == Some(seen.got.len()) {
            drop(p);
            return Ok(seen);
        }
        let want = shard + shards * seen.got.len() as u64;
        let leak = how.leak == Some(seen.got.len());
        match &mut p {
            Pipe::Dry(d) => match d.next() {
                None => {
                    seen.ended = true;
                    break;
                }
                Some(Err(e)) => {
                    seen.error = Some(loader_error(e)?);
                    break;
                }
                Some(Ok(b)) => {
                    ensure(b.index() == want, || {
                        format!("batch {} for {want}", b.index())
                    })?;
                    // A dry batch has no guard to leak: the next `next()` takes it back.
                    check(salt, want, b.pixels(), b.extras())?;
                }
            },
            Pipe::Gpu(g) => match g.next() {
                None => {
                    seen.ended = true;
                    break;
                }
                Some(Err(e)) => {
                    seen.error = Some(loader_error(e)?);
                    break;
                }
                Some(Ok(b)) => {
                    ensure(b.index() == want, || {
                        format!("batch {} for {want}", b.index())
                    })?;
                    let (px, ex) = (b.pixels()?, b.extras()?);
                    let mut hp = vec![f32::NAN; px.len()];
                    let mut he = vec![-1i64; ex.len()];
                    b.stream().copy_d2h(&px, &mut hp[..])?.wait()?;
                    b.stream().copy_d2h(&ex, &mut he[..])?.wait()?;
                    check(salt, want, &hp, &he)?;
                    if leak {
                        std::mem::forget(b);
                    }
                }
            },
        }
        seen.got.push(want);
    }
    // After the end or an error, `next` keeps answering `None` at once.
    let again = match &mut p {
        Pipe::Dry(d) => d.next().is_none(),
        Pipe::Gpu(g) => g.next().is_none(),
    };
    ensure(again, || "next() after the end gave a batch".into())?;
    drop(p);
    Ok(seen)
}

/// Runs `shards` consumers of `source` at once, each on its own thread, all within `BOUND`.
fn run_shards(
    kind: Kind,
    what: &str,
    salt: u64,
    shards: usize,
    source: Source<i64>,
    config: PrefetchConfig,
    how: Vec<Consumer>,
) -> Result<Vec<Seen>, Failed> {
    let what = what.to_string();
    within(&what.clone(), BOUND, move || {
        let streams = match kind {
            Kind::Dry => Vec::new(),
            Kind::Gpu => {
                let dev = Device::get(0)?;
                (0..shards)
                    .map(|_| dev.stream())
                    .collect::<Result<Vec<_>, _>>()?
            }
        };
        let pipes = start(kind, &streams, shards, source, config)?;
        let n = shards as u64;
        let handles: Vec<_> = pipes
            .into_iter()
            .zip(how)
            .enumerate()
            .map(|(d, (p, c))| {
                let w = format!("{what}: shard {d}");
                std::thread::spawn(move || {
                    consume(p, salt, d as u64, n, c).map_err(|e| format!("{w}: {e:?}"))
                })
            })
            .collect();
        let mut out = Vec::new();
        for h in handles {
            out.push(h.join().map_err(|_| "a consumer panicked")??);
        }
        Ok(out)
    })
}

fn config(loaders: usize, depth: usize, ahead: usize) -> PrefetchConfig {
    let mut c = PrefetchConfig {
        depth,
        loader_threads: loaders,
        ahead,
        numa_local: false,
        ..PrefetchConfig::default()
    };
    c.stager.threads = 1;
    c.stager.slots = 2;
    c.stager.slot_bytes = 64 << 10;
    c
}

fn salt() -> u64 {
    static N: AtomicU64 = AtomicU64::new(1);
    N.fetch_add(1, Ordering::Relaxed)
        .wrapping_mul(0xD1B5_4A32_D192_ED03)
}

// ---------------------------------------------------------------------------------------------
// One trial per reproduced defect.

/// Issue 19, 1: two shards over one iterator; shard 0 is dropped after 2 batches. Shard 1 must
/// not wait forever for the turns only shard 0 would take: it ends with an error naming its
/// next batch (or, if the iterator was already done, normally).
fn iter_shard_dropped(kind: Kind) -> R {
    let s = salt();
    let seen = run_shards(
        kind,
        "iter_shard_dropped",
        s,
        2,
        iter_source(s, 200, None),
        config(2, 2, 0),
        vec![
            Consumer {
                stop_after: Some(2),
                leak: None,
            },
            Consumer::default(),
        ],
    )?;
    let other = &seen[1];
    let (batch, message) = other
        .error
        .clone()
        .ok_or("shard 1 ended without an error")?;
    ensure(batch == 1 + 2 * other.got.len() as u64, || {
        format!("shard 1's error names batch {batch} after {:?}", other.got)
    })?;
    ensure(message.contains("stopped before its end"), || {
        format!("shard 1's error: {message}")
    })
}

/// Issue 19, 1 (the other way to stop): shard 0 ends with an error (a bad batch at 4, found by
/// its feeder): shard 1 is not left waiting either.
fn iter_shard_failed(kind: Kind) -> R {
    let s = salt();
    let seen = run_shards(
        kind,
        "iter_shard_failed",
        s,
        2,
        iter_source(s, 200, Some((4, Fault::BadBatch))),
        config(2, 2, 0),
        vec![Consumer::default(); 2],
    )?;
    ensure(seen[0].error.as_ref().is_some_and(|e| e.0 == 4), || {
        format!("shard 0: {:?}", seen[0])
    })?;
    ensure(seen[1].error.is_some() && seen[1].got.len() >= 2, || {
        format!("shard 1: {:?}", seen[1])
    })
}

/// Issue 19, 2: the iterator panics at item 5 with 4 loaders: the error comes out at batch 5,
/// and every loader that claimed a later item is released, so the drop returns.
fn iter_panics(kind: Kind) -> R {
    for fault in [Fault::Panic, Fault::PanicPayloadDropPanics] {
        let s = salt();
        let seen = run_shards(
            kind,
            "iter_panics",
            s,
            1,
            iter_source(s, 100, Some((5, fault))),
            config(4, 2, 0),
            vec![Consumer::default()],
        )?;
        let (batch, message) = seen[0].error.clone().ok_or("no error")?;
        ensure(batch == 5 && seen[0].got == [0, 1, 2, 3, 4], || {
            format!("{fault:?}: {:?}", seen[0])
        })?;
        ensure(message.contains("panicked"), || {
            format!("{fault:?}: {message}")
        })?;
    }
    Ok(())
}

/// Issue 19, 3: the source's error panics in `Display`, or in `Drop`; the source panics with a
/// payload whose `Drop` panics. Each comes out as the error of batch 3; nothing hangs.
fn user_code_panics(kind: Kind) -> R {
    for fault in [
        Fault::ErrorDisplayPanics,
        Fault::ErrorDropPanics,
        Fault::PanicPayloadDropPanics,
    ] {
        let s = salt();
        let seen = run_shards(
            kind,
            "user_code_panics",
            s,
            1,
            closure_source(s, 100, Some((3, fault))),
            config(3, 2, 0),
            vec![Consumer::default()],
        )?;
        let (batch, message) = seen[0].error.clone().ok_or("no error")?;
        ensure(batch == 3 && seen[0].got == [0, 1, 2], || {
            format!("{fault:?}: {:?}", seen[0])
        })?;
        if fault == Fault::ErrorDisplayPanics {
            ensure(message.contains("Display panicked"), || message.clone())?;
        }
    }
    Ok(())
}

/// Issue 19, 4: a clone of an iterator source given to a second prefetcher after the first was
/// dropped mid-epoch: the second's first `next()` is an error (an iterator serves one pass),
/// not a wait for turn 0, and its drop returns.
fn iter_reused(kind: Kind) -> R {
    let s = salt();
    let source = iter_source(s, 100, None);
    let first = run_shards(
        kind,
        "iter_reused: first",
        s,
        1,
        source.clone(),
        config(2, 2, 0),
        vec![Consumer {
            stop_after: Some(3),
            leak: None,
        }],
    )?;
    ensure(first[0].got == [0, 1, 2], || {
        format!("first: {:?}", first[0])
    })?;
    let second = run_shards(
        kind,
        "iter_reused: second",
        s,
        1,
        source,
        config(2, 2, 0),
        vec![Consumer::default()],
    )?;
    let (batch, _) = second[0]
        .error
        .clone()
        .ok_or("the second pass ended without an error")?;
    ensure(batch == 0 && second[0].got.is_empty(), || {
        format!("second: {:?}", second[0])
    })
}

/// Issue 19, 7: page-locked pixels whose length varies by batch (between 60 % and all of the
/// largest): the pool's bytes stop growing once the largest length has been seen, and stay
/// within one block per host batch that can exist, each as long as the longest batch plus an
/// eighth (rounded up to the pool's class), plus the staging slots.
fn pinned_varying_lengths() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let (n, end) = (8usize, 600u64);
    let max_len = n * 3 * 32 * 32;
    let lens: Arc<Vec<usize>> = Arc::new({
        let mut r = SmallRng::seed_from_u64(run_seed());
        // The largest length comes early (batch 5), so the pool's size is known by batch 50.
        (0..end)
            .map(|i| {
                if i == 5 {
                    max_len
                } else {
                    3 * r.random_range(max_len / 5..=max_len / 3)
                }
            })
            .collect()
    });
    let l2 = lens.clone();
    let source = Source::new(move |i, b: &mut HostBatch<i64>| {
        let Some(&len) = l2.get(i as usize) else {
            return Ok(false);
        };
        b.spec = Spec::variable(3, &[(1, len / 3)], Normalize::imagenet());
        b.extras.clear();
        b.extras.push(i as i64);
        let px = b.pinned(len)?;
        for (k, v) in px.iter_mut().enumerate() {
            *v = (k as u64 ^ i) as u8;
        }
        Ok(true)
    });
    let c = config(4, 2, 0);
    let mut p = Prefetcher::<f32, i64>::new(&stream, source, c.clone())?;
    let class = |bytes: usize| {
        // The pool's class: a multiple of max(4096, 2^floor(log2 bytes) / 8).
        let step = ((1usize << (usize::BITS - 1 - bytes.leading_zeros())) / 8).max(4096);
        bytes.div_ceil(step) * step
    };
    let block = class(max_len + max_len / 8);
    let bound =
        c.stager.slots * c.stager.slot_bytes + (c.depth + c.loader_threads + 1 + c.depth) * block;
    let mut at50 = None;
    let mut worst = 0usize;
    let mut i = 0u64;
    loop {
        let Some(b) = p.next() else { break };
        let b = b?;
        ensure(b.index() == i, || format!("batch {} for {i}", b.index()))?;
        if i % 50 == 0 {
            let px = b.pixels()?;
            let mut h = vec![f32::NAN; px.len()];
            b.stream().copy_d2h(&px, &mut h[..])?.wait()?;
            ensure(h.len() == lens[i as usize], || {
                format!("batch {i}: {} elements", h.len())
            })?;
        }
        let s = b.pinned_stats();
        worst = worst.max(s.cached_bytes + s.in_use_bytes);
        drop(b);
        if i == 50 {
            stream.synchronize()?;
            let s = p.pinned_stats();
            at50 = Some(s.cached_bytes + s.in_use_bytes);
        }
        i += 1;
    }
    stream.synchronize()?;
    ensure(i == end, || format!("{i} batches"))?;
    let s = p.pinned_stats();
    let now = s.cached_bytes + s.in_use_bytes;
    // Blocks of the sizes before the largest batch may still be freed after batch 50.
    ensure(at50.is_some_and(|then| now <= then), || {
        format!("the pool grew after batch 50: {at50:?} -> {now} ({s:?})")
    })?;
    ensure(worst <= bound, || {
        format!("the pool held {worst} bytes, more than {bound} ({s:?})")
    })
}

// ---------------------------------------------------------------------------------------------
// Random schedules.

#[derive(Clone, Debug)]
struct Schedule {
    iter: bool,
    end: u64,
    fault: Option<(u64, Fault)>,
    shards: usize,
    loaders: usize,
    depth: usize,
    ahead: usize,
    consumers: Vec<Consumer>,
}

fn draw(r: &mut SmallRng) -> Schedule {
    let end = r.random_range(0..=14u64);
    let shards = r.random_range(1..=3usize);
    let fault = r.random_bool(0.7).then(|| {
        (
            r.random_range(0..=end + 1),
            FAULTS[r.random_range(0..FAULTS.len())],
        )
    });
    let consumers = (0..shards)
        .map(|_| Consumer {
            stop_after: r.random_bool(0.2).then(|| r.random_range(0..=5)),
            leak: r.random_bool(0.2).then(|| r.random_range(0..=5)),
        })
        .collect();
    Schedule {
        iter: r.random_bool(0.5),
        end,
        fault,
        shards,
        loaders: r.random_range(1..=4),
        depth: r.random_range(1..=3),
        ahead: if r.random_bool(0.5) {
            0
        } else {
            r.random_range(1..=4)
        },
        consumers,
    }
}

/// Checks what each shard saw against what the schedule determines.
fn verify(s: &Schedule, seen: &[Seen]) -> R {
    let n = s.shards as u64;
    let stopped_any = s.consumers.iter().any(|c| c.stop_after.is_some());
    let fault_at = s.fault.filter(|&(k, _)| k < s.end);
    for (d, (seen, c)) in seen.iter().zip(&s.consumers).enumerate() {
        let d = d as u64;
        let all: Vec<u64> = (0..)
            .map(|j| d + n * j)
            .take_while(|&g| g < s.end)
            .collect();
        // In order, from the start, nothing skipped (checked batch by batch too).
        ensure(all.starts_with(&seen.got), || {
            format!("shard {d}: {:?}", seen.got)
        })?;
        if let Some((batch, _)) = &seen.error {
            ensure(*batch == d + n * seen.got.len() as u64, || {
                format!("shard {d}: the error names {batch} after {:?}", seen.got)
            })?;
        }
        let stopped = c
            .stop_after
            .is_some_and(|m| seen.got.len() == m && !seen.ended);
        let finished = seen.ended || seen.error.is_some() || stopped;
        ensure(finished, || {
            format!("shard {d}: neither ended nor failed: {seen:?}")
        })?;
        // What is determined: a shard unaffected by another's stop.
        let own_fault = fault_at.filter(|&(k, _)| k % n == d);
        let isolated = !s.iter || !stopped_any;
        if !isolated || stopped {
            continue;
        }
        let before = |k: u64| all.iter().copied().filter(|&g| g < k).collect::<Vec<_>>();
        match (own_fault, fault_at) {
            (Some((k, _)), _) => {
                ensure(
                    seen.got == before(k) && seen.error.as_ref().is_some_and(|e| e.0 == k),
                    || format!("shard {d}: fault at {k}, saw {seen:?}"),
                )?;
            }
            (None, Some((k, f))) if s.iter => {
                // Another shard's item failed: everything before it, then an error (or, for a
                // bad batch found only at upload, possibly the whole share).
                ensure(seen.got.starts_with(&before(k)), || {
                    format!("shard {d}: item {k} failed elsewhere, saw {seen:?}")
                })?;
                if f != Fault::BadBatch {
                    ensure(seen.got == before(k) && seen.error.is_some(), || {
                        format!("shard {d}: item {k} failed elsewhere, saw {seen:?}")
                    })?;
                }
            }
            _ => {
                ensure(seen.got == all && seen.ended, || {
                    format!("shard {d}: no fault of its own, saw {seen:?} of {all:?}")
                })?;
            }
        }
    }
    Ok(())
}

fn schedule_count(default: usize) -> usize {
    std::env::var("PINSTREAM_FAULT_SCHEDULES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

fn random_schedules(kind: Kind, default: usize) -> R {
    let count = schedule_count(default);
    let mut r = SmallRng::seed_from_u64(run_seed());
    let before = pinstream::memory::live();
    let dev = match kind {
        Kind::Gpu => Some(Device::get(0)?),
        Kind::Dry => None,
    };
    let mut faults = 0usize;
    for k in 0..count {
        let s = draw(&mut r);
        let salt = salt();
        let source = if s.iter {
            iter_source(salt, s.end, s.fault)
        } else {
            closure_source(salt, s.end, s.fault)
        };
        faults += usize::from(s.fault.is_some_and(|(k, _)| k < s.end));
        let what = format!("schedule {k} (seed {}): {s:?}", run_seed());
        let seen = run_shards(
            kind,
            &what,
            salt,
            s.shards,
            source,
            config(s.loaders, s.depth, s.ahead),
            s.consumers.clone(),
        )
        .map_err(|e| format!("{what}: {e:?}"))?;
        verify(&s, &seen).map_err(|e| format!("{what}: {e:?}"))?;
        if let Some(dev) = dev {
            // Every prefetcher of the schedule is gone, and its memory with it.
            dev.synchronize()?;
            let now = pinstream::memory::live();
            // The process-wide bounce cache (`cache_bytes`) may grow with concurrency.
            let own = |l: pinstream::memory::Live| (l.device_bytes, l.pinned_bytes);
            ensure(own(now) == own(before), || {
                format!("{what}: pinstream's memory {before:?} -> {now:?}")
            })?;
        }
    }
    eprintln!(
        "{count} {kind:?} schedules ({faults} with a fault inside the data), seed {}",
        run_seed()
    );
    Ok(())
}
