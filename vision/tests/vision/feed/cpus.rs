//! `ImageFeedConfig::prefetch.cpus`: the feed's threads (the CPU path's loaders, feeder and
//! staging; the GPU path's nvJPEG loaders) run on exactly the CPUs given while the calling
//! thread is pinned elsewhere (a training thread on a CPU of its own), the batches come whole,
//! and the caller keeps its CPU. A bad list is refused before anything is made.

use std::time::Duration;

use crate::common::threads::{new_threads_on, pinstream_thread_names, thread_cpus};
use crate::common::{ensure, trial, within, R};
use libtest_mimic::Trial;
use pinstream::prefetch::CpuBinding;
use pinstream::{Device, Error};
use pinstream_vision::{Decoding, ImageFeed, ImageSource};

const PREFIX: &str = "feed/cpus/";
const WATCHDOG: Duration = Duration::from_secs(300);

pub fn trials() -> Vec<Trial> {
    let no_gpu = !pinstream::available();
    vec![
        trial(PREFIX, "bad_list_refused_before_anything", bad_list),
        trial(PREFIX, "gpu/threads_run_on_the_cpus_given", || {
            within("feed cpus", WATCHDOG, threads_on_given)
        })
        .with_ignored_flag(no_gpu),
    ]
}

fn bad_list() -> R {
    for cpus in [vec![], vec![pinstream::prefetch::MAX_CPUS]] {
        let mut cfg = super::config(4);
        cfg.prefetch.cpus = Some(cpus.clone());
        let v = cfg.validate();
        ensure(matches!(v, Err(Error::InvalidArgument { .. })), || {
            format!("{cpus:?}: validate gave {v:?}")
        })?;
        let s = ImageSource::new(super::list(), &cfg);
        ensure(matches!(s, Err(Error::InvalidArgument { .. })), || {
            format!("{cpus:?}: ImageSource::new gave {:?}", s.err())
        })?;
    }
    Ok(())
}

fn threads_on_given() -> R {
    let stream = Device::get(0)?.stream()?;
    let caller = thread_cpus()?;
    let first = caller[0];
    let want = vec![*caller.last().ok_or("no CPUs")?];
    let _pinned = CpuBinding::bind(&[first])?;
    for decoding in [Decoding::Auto, Decoding::Cpu] {
        let before = pinstream_thread_names()?;
        let mut cfg = super::config(4);
        cfg.decoding = decoding;
        cfg.prefetch.cpus = Some(want.clone());
        let mut feed = ImageFeed::<f32>::new(&stream, super::list(), cfg)?;
        ensure(thread_cpus()? == vec![first], || {
            format!("{decoding:?}: the caller's CPUs changed")
        })?;
        for k in 0..3 {
            let b = feed
                .next()
                .ok_or_else(|| format!("{decoding:?}: no batch {k}"))??;
            // 4 images, or 3 where the list's broken file was skipped.
            let d = b.dims();
            ensure((3..=4).contains(&d[0]) && d[1..] == [3, 32, 24], || {
                format!("{decoding:?}: batch {k}: {d:?}")
            })?;
        }
        new_threads_on(&before, &want, &format!("{decoding:?}"))?;
        drop(feed);
        ensure(thread_cpus()? == vec![first], || {
            format!("{decoding:?}: the caller's CPUs changed")
        })?;
    }
    Ok(())
}
