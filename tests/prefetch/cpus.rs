//! `PrefetchConfig::cpus`: the prefetcher's threads (loaders, feeder, staging) run on exactly the
//! CPUs given, even when the calling thread is pinned elsewhere (a training thread on a CPU of
//! its own), and the caller's mask is its own again afterwards; bad lists are typed errors that
//! change nothing. The dry run is checked here without a GPU, the device path on one.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::threads::{new_threads_on, pinstream_thread_names, thread_cpus};
use crate::common::{ensure, trial, within, R};
use libtest_mimic::Trial;
use pinstream::kernels::{Normalize, Spec};
use pinstream::prefetch::{
    CpuBinding, DryRun, HostBatch, PrefetchConfig, Prefetcher, Source, MAX_CPUS,
};
use pinstream::{Device, Error};

const PREFIX: &str = "cpus/";
const WATCHDOG: Duration = Duration::from_secs(300);

pub fn trials() -> Vec<Trial> {
    let no_gpu = !pinstream::available();
    vec![
        trial(PREFIX, "dry_threads_run_on_the_cpus_given", || {
            within("cpus dry", WATCHDOG, || threads_on_given(false))
        }),
        trial(PREFIX, "bad_lists_are_typed_errors", || {
            within("cpus bad", WATCHDOG, bad_lists)
        }),
        trial(PREFIX, "gpu/threads_run_on_the_cpus_given", || {
            within("cpus gpu", WATCHDOG, || threads_on_given(true))
        })
        .with_ignored_flag(no_gpu),
    ]
}

fn source(seen: Arc<Mutex<Vec<Vec<usize>>>>, end: u64) -> Source<i64> {
    Source::new(move |i, b: &mut HostBatch<i64>| {
        if i >= end {
            return Ok(false);
        }
        seen.lock()
            .map_err(|_| "poisoned")?
            .push(thread_cpus().map_err(|e| format!("{e:?}"))?);
        b.spec = Spec::uniform(2, 3, 8, 8, Normalize::imagenet()).map_err(|e| e.to_string())?;
        b.extras.clear();
        b.extras.extend([i as i64 * 10, i as i64 * 10 + 1]);
        let px = b.pageable();
        px.clear();
        px.extend((0..2 * 3 * 8 * 8).map(|k| (k as u64 * 7 + i * 13) as u8));
        Ok(true)
    })
}

/// The calling thread narrowed to its first CPU (a pinned training thread); the prefetcher asked
/// for its last one: every loader, and every `pinstream…` thread it started, runs there; the
/// caller keeps its first CPU throughout and after.
fn threads_on_given(gpu: bool) -> R {
    let caller = thread_cpus()?;
    let first = caller[0];
    let want = vec![*caller.last().ok_or("no CPUs")?];
    let _pinned = CpuBinding::bind(&[first])?;
    ensure(thread_cpus()? == vec![first], || {
        "the caller was not narrowed".into()
    })?;
    let before = pinstream_thread_names()?;
    let seen = Arc::new(Mutex::new(Vec::new()));
    let config = PrefetchConfig {
        loader_threads: 3,
        depth: 2,
        cpus: Some(want.clone()),
        ..PrefetchConfig::default()
    };
    let end = 10u64;
    let mut k = 0u64;
    if gpu {
        let stream = Device::get(0)?.stream()?;
        let mut p = Prefetcher::<f32, i64>::new(&stream, source(seen.clone(), end), config)?;
        ensure(thread_cpus()? == vec![first], || {
            "the caller's CPUs changed".into()
        })?;
        new_threads_on(&before, &want, "prefetcher")?;
        while let Some(b) = p.next() {
            let b = b?;
            let mut labels = vec![-1i64; 2];
            stream.copy_d2h(&b.extras()?, &mut labels[..])?.wait()?;
            ensure(labels == vec![k as i64 * 10, k as i64 * 10 + 1], || {
                format!("batch {k}: labels {labels:?}")
            })?;
            k += 1;
        }
    } else {
        let mut p = DryRun::<f32, i64>::new(source(seen.clone(), end), config)?;
        ensure(thread_cpus()? == vec![first], || {
            "the caller's CPUs changed".into()
        })?;
        new_threads_on(&before, &want, "prefetcher")?;
        while let Some(b) = p.next() {
            let b = b?;
            ensure(b.extras() == [k as i64 * 10, k as i64 * 10 + 1], || {
                format!("batch {k}: labels {:?}", b.extras())
            })?;
            k += 1;
        }
    }
    ensure(k == end, || format!("{k} batches, not {end}"))?;
    let seen = seen.lock().map_err(|_| "poisoned")?;
    ensure(seen.len() as u64 >= end, || {
        format!("{} loads seen", seen.len())
    })?;
    for cpus in seen.iter() {
        ensure(*cpus == want, || {
            format!("a loader ran on {cpus:?}, not {want:?}")
        })?;
    }
    ensure(thread_cpus()? == vec![first], || {
        "the caller's CPUs changed".into()
    })
}

fn bad_lists() -> R {
    let caller = thread_cpus()?;
    let mut bad: Vec<(&str, Vec<usize>)> = vec![
        ("empty", vec![]),
        ("MAX_CPUS", vec![MAX_CPUS]),
        ("usize::MAX", vec![0, usize::MAX]),
        ("too long", vec![0; MAX_CPUS + 1]),
    ];
    // A CPU below MAX_CPUS that this machine does not have: the OS refuses it.
    let absent = caller.len() < MAX_CPUS - 1;
    if absent {
        bad.push(("absent", vec![MAX_CPUS - 1]));
    }
    for (what, cpus) in bad {
        let config = PrefetchConfig {
            cpus: Some(cpus.clone()),
            ..PrefetchConfig::default()
        };
        let checked = config.validate();
        ensure(checked.is_err() != (what == "absent"), || {
            format!("{what}: validate gave {checked:?}")
        })?;
        let seen = Arc::new(Mutex::new(Vec::new()));
        let r = DryRun::<f32, i64>::new(source(seen.clone(), 4), config);
        ensure(matches!(r, Err(Error::InvalidArgument { .. })), || {
            format!("{what}: DryRun::new gave {:?}", r.as_ref().err())
        })?;
        ensure(seen.lock().map_err(|_| "poisoned")?.is_empty(), || {
            format!("{what}: the source ran")
        })?;
        ensure(thread_cpus()? == caller, || {
            format!("{what}: the caller's CPUs changed")
        })?;
        let b = CpuBinding::bind(&cpus);
        ensure(matches!(b, Err(Error::InvalidArgument { .. })), || {
            format!("{what}: CpuBinding::bind gave {:?}", b.as_ref().err())
        })?;
        ensure(thread_cpus()? == caller, || {
            format!("{what}: the caller's CPUs changed")
        })?;
    }
    Ok(())
}
