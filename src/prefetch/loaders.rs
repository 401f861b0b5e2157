//! The loaders: N threads that claim batch indices in order, run the [`Source`] for each and
//! file what came out, and the queue through which the feeder takes those results in order.
//!
//! The protocol, all under one lock ([`Queue`]):
//!
//! - a loader claims the next local index `i` only while `i < fed + window` (the window is
//!   [`PrefetchConfig::ahead`](super::PrefetchConfig::ahead), fixed or adaptive) and nothing
//!   at or past `end` (the first index that ended or failed);
//! - it runs the source for global index `i * shards + shard` outside the lock; the source's
//!   code — the call, its error's `Display` and `Drop`, a panic's payload — runs under
//!   `catch_unwind`, so every claim is filed: a batch, the end, or an `Error::Loader` naming it
//!   (a [`Claim`] files an error even if the thread itself were to unwind);
//! - the feeder [`take`](Queue::take)s local index `fed` and waits while it is missing;
//! - [`stop`](Queue::stop) wakes every wait (loaders and feeder) and, for an iterator source,
//!   abandons its turns so that no other prefetcher waits for this one's.
//!
//! Every wait ends on a filed result or on `stop`; the feeder stops the queue itself when it
//! meets the end or an error, and the prefetcher when it drops.

use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use bytemuck::Pod;

use super::batch::PinnedSupply;
use super::{HostBatch, LoaderStats, Source};
use crate::error::{Error, Result};
use crate::sync::{display_quietly, drop_quietly, lock, panic_message, quietly};

/// How many batches the loaders may hold ahead of the feeder ([`PrefetchConfig::ahead`]).
///
/// Adaptive: one more after every wait of the upload for a batch, one less after a run of
/// [`Window::SURPLUS`] batches each taken with two or more finished ones behind it, but not
/// within [`Window::HOLD`] batches of the last wait. Waits then come at most about once per
/// `HOLD` batches, while the window stays near the smallest that keeps the upload fed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Window {
    now: u64,
    min: u64,
    max: u64,
    /// Batches taken in a row with two or more finished ones behind them.
    surplus: u32,
    /// Batches left before the window may shrink again.
    hold: u32,
}

impl Window {
    /// The smallest adaptive window: one batch being loaded and one finished, ready for jitter.
    const MIN: u64 = 2;
    /// Batches in a row with a surplus before the window shrinks.
    const SURPLUS: u32 = 8;
    /// Batches after a wait before the window shrinks again.
    const HOLD: u32 = 64;

    pub(crate) fn fixed(n: u64) -> Self {
        Window {
            now: n,
            min: n,
            max: n,
            surplus: 0,
            hold: 0,
        }
    }

    /// Starts at `max` (nothing is known yet) and adapts within `2..=max`.
    pub(crate) fn adaptive(max: u64) -> Self {
        Window {
            min: Self::MIN.min(max),
            ..Self::fixed(max)
        }
    }

    /// The feeder took a batch: `waited` if it was not finished yet when asked for, `ready`
    /// finished batches (or ends) still waiting behind it.
    fn took(&mut self, waited: bool, ready: usize) {
        if waited {
            self.now = (self.now + 1).min(self.max);
            self.surplus = 0;
            self.hold = Self::HOLD;
            return;
        }
        self.hold = self.hold.saturating_sub(1);
        self.surplus = if ready >= 2 { self.surplus + 1 } else { 0 };
        if self.surplus >= Self::SURPLUS && self.hold == 0 {
            self.now = self.now.saturating_sub(1).max(self.min);
            self.surplus = 0;
        }
    }
}

/// A loaded batch, or why there is none.
// Only a few exist at a time (at most the window); boxing the batch would allocate per batch.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Loaded<E> {
    Batch(u64, HostBatch<E>),
    End,
    Failed(Error),
}

struct State<E> {
    /// Next local index a loader takes.
    claim: u64,
    /// Loaders claim only indices below `fed + window.now`.
    window: Window,
    /// Batches the feeder has taken for upload, and of those how many it had to wait for
    /// (after the first).
    uploads: u64,
    waits: u64,
    /// Local indices the feeder has taken.
    fed: u64,
    results: BTreeMap<u64, Loaded<E>>,
    /// First local index past the end (or failed): nothing at or after it is claimed.
    end: Option<u64>,
    spare: Vec<HostBatch<E>>,
    stop: bool,
}

/// The loaders' results and the feeder's claims on them.
pub(crate) struct Queue<E> {
    state: Mutex<State<E>>,
    cv: Condvar,
    abandon: Option<Arc<dyn Fn() + Send + Sync>>,
}

impl<E> Queue<E> {
    fn new(window: Window, abandon: Option<Arc<dyn Fn() + Send + Sync>>) -> Self {
        Queue {
            state: Mutex::new(State {
                claim: 0,
                window,
                uploads: 0,
                waits: 0,
                fed: 0,
                results: BTreeMap::new(),
                end: None,
                spare: Vec::new(),
                stop: false,
            }),
            cv: Condvar::new(),
            abandon,
        }
    }

    /// Stops the loaders and wakes every wait; an iterator source's turns are abandoned (a
    /// no-op once the iterator is over). Idempotent.
    pub(crate) fn stop(&self) {
        // No loader fills a batch again: the spares go now (outside the lock), and with them
        // what they still hold (pixels another owner keeps, `Pixels::Foreign`).
        let spare = {
            let mut s = lock(&self.state);
            s.stop = true;
            std::mem::take(&mut s.spare)
        };
        self.cv.notify_all();
        if let Some(abandon) = &self.abandon {
            abandon();
        }
        drop_quietly(spare);
    }

    /// The result for local index `i` (the feeder takes them in order), waiting while it is
    /// still being loaded; `None` once the queue is stopped.
    pub(crate) fn take(&self, i: u64) -> Option<Loaded<E>> {
        let loaded = {
            let mut s = lock(&self.state);
            let mut waited = false;
            loop {
                if s.stop {
                    return None;
                }
                if let Some(l) = s.results.remove(&i) {
                    s.fed = i + 1;
                    if matches!(l, Loaded::Batch(..)) {
                        s.uploads += 1;
                        // Not counted at the start, when every loader begins at once.
                        if i > 0 {
                            let ready = s.results.len();
                            s.window.took(waited, ready);
                            s.waits += u64::from(waited);
                        }
                    }
                    break l;
                }
                waited = true;
                s = self.cv.wait(s).unwrap_or_else(|e| e.into_inner());
            }
        };
        self.cv.notify_all();
        Some(loaded)
    }

    /// A batch the feeder is done with, for a loader to fill again.
    /// Once the loaders are stopped it is dropped instead.
    pub(crate) fn recycle(&self, batch: HostBatch<E>) {
        let mut s = lock(&self.state);
        if s.stop {
            drop(s);
            drop_quietly(batch);
            return;
        }
        s.spare.push(batch);
    }

    pub(crate) fn stats(&self) -> LoaderStats {
        let s = lock(&self.state);
        LoaderStats {
            ahead: s.window.now as usize,
            uploads: s.uploads,
            waits: s.waits,
        }
    }

    /// The next local index to load and a batch to load it into; `None` once stopped or past
    /// the end.
    fn claim(&self) -> Option<(u64, HostBatch<E>)> {
        let mut s = lock(&self.state);
        loop {
            if s.stop || s.end.is_some_and(|e| s.claim >= e) {
                return None;
            }
            if s.claim < s.fed + s.window.now {
                break;
            }
            s = self.cv.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        let i = s.claim;
        s.claim += 1;
        let batch = s.spare.pop();
        drop(s);
        Some((i, batch.unwrap_or_default()))
    }

    fn file(&self, i: u64, loaded: Loaded<E>) {
        let mut s = lock(&self.state);
        if !matches!(loaded, Loaded::Batch(..)) {
            s.end = Some(s.end.map_or(i, |e| e.min(i)));
        }
        s.results.insert(i, loaded);
        drop(s);
        self.cv.notify_all();
    }
}

/// A claimed index: filed exactly once, with an error if the loader never gets to file it.
struct Claim<'a, E> {
    queue: &'a Queue<E>,
    local: u64,
    global: u64,
    filed: bool,
}

impl<E> Claim<'_, E> {
    fn file(mut self, loaded: Loaded<E>) {
        self.filed = true;
        self.queue.file(self.local, loaded);
    }
}

impl<E> Drop for Claim<'_, E> {
    fn drop(&mut self) {
        if !self.filed {
            self.queue.file(
                self.local,
                Loaded::Failed(Error::Loader {
                    batch: self.global,
                    message: "the loader thread stopped before filing the batch".into(),
                }),
            );
        }
    }
}

/// Runs the source for `global` into `batch`. Nothing the source does can unwind out of here.
pub(crate) fn load<E>(source: &Source<E>, global: u64, mut batch: HostBatch<E>) -> Loaded<E> {
    let outcome = catch_unwind(AssertUnwindSafe(|| (source.f)(global, &mut batch)));
    let failed = |message: String| {
        Loaded::Failed(Error::Loader {
            batch: global,
            message,
        })
    };
    match outcome {
        Ok(Ok(true)) => Loaded::Batch(global, batch),
        Ok(Ok(false)) => Loaded::End,
        Ok(Err(e)) => {
            let message = display_quietly(&*e);
            drop_quietly(e);
            failed(message)
        }
        Err(p) => {
            let message = panic_message(&*p);
            drop_quietly(p);
            failed(format!("the source panicked: {message}"))
        }
    }
}

/// The loader threads of one prefetcher (one shard) and their queue. Dropping it stops and
/// joins them (a loader inside the source is waited for).
pub(crate) struct Loaders<E> {
    queue: Arc<Queue<E>>,
    threads: Vec<JoinHandle<()>>,
}

impl<E: Pod + Send + 'static> Loaders<E> {
    /// Starts `threads` loaders of `source` for shard `shard` of `shards`.
    pub(crate) fn start(
        source: &Source<E>,
        threads: usize,
        window: Window,
        (shard, shards): (u64, u64),
        pinned: Option<PinnedSupply>,
    ) -> Result<Self> {
        let mut me = Loaders {
            queue: Arc::new(Queue::new(window, source.abandon_hook())),
            threads: Vec::new(),
        };
        for t in 0..threads {
            let (queue, source, pinned) = (me.queue.clone(), source.clone(), pinned.clone());
            let h = std::thread::Builder::new()
                .name(format!("pinstream-loader-{shard}.{t}"))
                .spawn(move || {
                    let _ = quietly(|| run(&queue, &source, pinned.as_ref(), shard, shards));
                    // The last clone of the source may be this one: its captures' `Drop` is
                    // the user's code.
                    drop_quietly(source);
                })
                .map_err(|e| Error::invalid("Prefetcher::new", format!("spawn: {e}")))?;
            me.threads.push(h);
        }
        Ok(me)
    }
}

impl<E> Loaders<E> {
    pub(crate) fn queue(&self) -> &Arc<Queue<E>> {
        &self.queue
    }
}

impl<E> Drop for Loaders<E> {
    fn drop(&mut self) {
        self.queue.stop();
        for h in self.threads.drain(..) {
            let _ = h.join();
        }
    }
}

/// A loader thread: claims local indices in order, runs the source, files the result.
fn run<E: Pod + Send>(
    queue: &Queue<E>,
    source: &Source<E>,
    pinned: Option<&PinnedSupply>,
    shard: u64,
    shards: u64,
) {
    while let Some((local, mut batch)) = queue.claim() {
        let global = local.saturating_mul(shards).saturating_add(shard);
        let claim = Claim {
            queue,
            local,
            global,
            filed: false,
        };
        // The source may have moved batches around: always this prefetcher's pool.
        batch.pool = pinned.cloned();
        claim.file(load(source, global, batch));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prefetch::PrefetchConfig;

    #[test]
    fn fixed_window_stays() {
        let mut w = PrefetchConfig {
            ahead: 5,
            ..PrefetchConfig::default()
        }
        .window();
        for (waited, ready) in [(true, 0), (false, 4), (false, 9), (true, 1)] {
            w.took(waited, ready);
            assert_eq!(w.now, 5);
        }
    }

    #[test]
    fn adaptive_window_follows_the_upload() {
        let mut w = PrefetchConfig::default().window();
        assert_eq!((w.now, w.min, w.max), (6, 2, 6));
        let run = |w: &mut Window, n: u32, waited: bool, ready: usize| {
            for _ in 0..n {
                w.took(waited, ready);
            }
        };
        // Loaders far ahead: one less per run of surplus batches, down to 2, never below.
        for want in [5, 4, 3, 2, 2] {
            run(&mut w, Window::SURPLUS - 1, false, 3);
            assert_eq!(w.now, want + 1);
            w.took(false, 2);
            assert_eq!(w.now, want.max(2));
            if want == 2 {
                break;
            }
        }
        // A batch without a surplus breaks the run.
        run(&mut w, Window::SURPLUS - 1, false, 2);
        w.took(false, 1);
        run(&mut w, Window::SURPLUS - 1, false, 2);
        assert_eq!(w.now, 2);
        // The upload waits: one more per wait, up to the maximum.
        for want in [3, 4, 5, 6, 6] {
            w.took(true, 0);
            assert_eq!(w.now, want);
        }
        // No shrinking within HOLD batches of a wait, surplus or not.
        run(&mut w, Window::HOLD - 1, false, 5);
        assert_eq!(w.now, 6);
        run(&mut w, Window::SURPLUS, false, 5);
        assert_eq!(w.now, 5);
        // A window of at most 1 cannot go below it.
        let mut one = Window::adaptive(1);
        run(&mut one, 100, false, 5);
        assert_eq!((one.now, one.min), (1, 1));
    }
}
