//! The pipeline every prefetcher runs, whatever its slots are: the loaders, one feeder thread
//! that takes their results in order and fills a free slot with each, and the two channels that
//! move slots between the feeder and the consumer by value (so at any time exactly one side
//! can touch a slot). The GPU prefetcher's slots are device buffers filled by the upload and the
//! fused normalize ([`feeder`](super::feeder)); the CPU dry run's are host vectors filled by the
//! CPU reference — the same loaders, feeder loop and shutdown either way.
//!
//! Every wait here ends: the consumer's on a message (the feeder always sends one before it
//! returns, and a feeder that dies is an error, not an end), the feeder's on the queue or on a
//! free slot (both woken by shutdown), the loaders' on the queue.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use bytemuck::Pod;

use super::batch::PinnedSupply;
use super::loaders::{Loaded, Loaders, Queue, Window};
use super::{HostBatch, LoaderStats, Source};
use crate::error::{Error, Result};
use crate::sync::{drop_quietly, lock, quietly};

/// What the feeder sends the consumer.
pub(crate) enum Msg<S> {
    Ready(S),
    End,
    Failed(Error),
}

/// How to start one pipeline (one shard).
pub(crate) struct Plan {
    pub(crate) loader_threads: usize,
    pub(crate) window: Window,
    pub(crate) shard: u64,
    pub(crate) shards: u64,
    pub(crate) pinned: Option<PinnedSupply>,
}

/// A running pipeline; dropping it stops and joins every thread (slots still in flight are
/// dropped on the way, each waiting for whatever its own `Drop` waits for).
pub(crate) struct Pipeline<E, S> {
    ready: Receiver<Msg<S>>,
    /// The way back to the feeder: shared with exported batches, which give their slot back
    /// when their consumer releases them; emptied (closing the channel) when the pipeline
    /// stops.
    free: Returner<S>,
    /// Set while the feeder holds a loaded batch and waits for a free slot.
    starved: Arc<AtomicBool>,
    feeder: Option<JoinHandle<()>>,
    loaders: Loaders<E>,
}

impl<E: Pod + Send + 'static, S: Send + 'static> Pipeline<E, S> {
    /// Starts the loaders and a feeder that fills `slots` with `fill(slot, global index,
    /// batch)`.
    pub(crate) fn start<F>(source: &Source<E>, plan: Plan, slots: Vec<S>, fill: F) -> Result<Self>
    where
        F: FnMut(&mut S, u64, &HostBatch<E>) -> Result<()> + Send + 'static,
    {
        let (free_tx, free_rx) = mpsc::channel::<S>();
        for s in slots {
            // The receiver is alive (held right here).
            let _ = free_tx.send(s);
        }
        let (ready_tx, ready_rx) = mpsc::channel();
        let loaders = Loaders::start(
            source,
            plan.loader_threads,
            plan.window,
            (plan.shard, plan.shards),
            plan.pinned,
        )?;
        let queue = loaders.queue().clone();
        let starved = Arc::new(AtomicBool::new(false));
        let feeder_starved = starved.clone();
        let mut me = Pipeline {
            ready: ready_rx,
            free: Arc::new(Mutex::new(Some(free_tx))),
            starved,
            feeder: None,
            loaders,
        };
        let h = std::thread::Builder::new()
            .name(format!("pinstream-feeder-{}", plan.shard))
            .spawn(move || {
                let ran = quietly(|| feed(&queue, &free_rx, &ready_tx, &feeder_starved, fill));
                if let Err(m) = ran {
                    let _ = ready_tx.send(Msg::Failed(Error::invalid(
                        "Prefetcher",
                        format!("the feeder thread panicked: {m}"),
                    )));
                    queue.stop();
                }
            })
            .map_err(|e| Error::invalid("Prefetcher::new", format!("spawn: {e}")))?;
        me.feeder = Some(h);
        Ok(me)
    }
}

impl<E, S> Pipeline<E, S> {
    /// The next message, waiting for it. A feeder that stopped without a word (which it never
    /// does) is an error, not an end of the data.
    pub(crate) fn recv(&self) -> Msg<S> {
        self.ready.recv().unwrap_or_else(|_| {
            Msg::Failed(Error::invalid(
                "Prefetcher",
                "the feeder thread stopped without a result",
            ))
        })
    }

    /// Whether the feeder holds a loaded batch and waits for a free slot: with every slot
    /// held elsewhere, nothing comes before a slot does.
    pub(crate) fn starved(&self) -> bool {
        self.starved.load(Ordering::Acquire)
    }

    /// The next message if one comes within `bound`.
    pub(crate) fn recv_timeout(&self, bound: std::time::Duration) -> Option<Msg<S>> {
        match self.ready.recv_timeout(bound) {
            Ok(m) => Some(m),
            Err(mpsc::RecvTimeoutError::Timeout) => None,
            Err(mpsc::RecvTimeoutError::Disconnected) => Some(self.recv()),
        }
    }

    /// Gives a slot back to the feeder. Once the feeder has stopped the slot is dropped here.
    pub(crate) fn give_back(&self, slot: S) {
        give_back(&self.free, slot);
    }

    /// As [`give_back`](Self::give_back), a slot refused (the feeder has stopped) going to
    /// `refused`.
    pub(crate) fn give_back_or(&self, slot: S, refused: impl FnOnce(S)) {
        give_back_or(&self.free, slot, refused);
    }

    /// The way back to the feeder, for slots that come back later from another thread.
    pub(crate) fn returner(&self) -> Returner<S> {
        self.free.clone()
    }

    pub(crate) fn loader_stats(&self) -> LoaderStats {
        self.loaders.queue().stats()
    }
}

impl<E, S> Drop for Pipeline<E, S> {
    fn drop(&mut self) {
        self.loaders.queue().stop();
        // Closing the free channel wakes a feeder that waits for a slot.
        let closed = lock(&self.free).take();
        drop(closed);
        // Drain what the feeder sent (the channel is unbounded, so it never blocks on it).
        while let Ok(m) = self.ready.try_recv() {
            drop(m);
        }
        if let Some(h) = self.feeder.take() {
            let _ = h.join();
        }
        while let Ok(m) = self.ready.try_recv() {
            drop(m);
        }
        // `loaders` drops next: stops (again) and joins its threads.
    }
}

/// The sending side of the feeder's free slots, `None` once the pipeline has stopped.
pub(crate) type Returner<S> = Arc<Mutex<Option<Sender<S>>>>;

/// Sends `slot` back to the feeder; once the pipeline has stopped, drops it here (after the
/// lock is released: a slot's `Drop` may wait for the GPU).
pub(crate) fn give_back<S>(r: &Returner<S>, slot: S) {
    give_back_or(r, slot, drop);
}

/// As [`give_back`], but a slot the feeder no longer takes (it has stopped) goes to `refused`
/// instead of being dropped here: a slot's drop waits for its last users on the device.
pub(crate) fn give_back_or<S>(r: &Returner<S>, slot: S, refused: impl FnOnce(S)) {
    let back = match lock(r).as_ref() {
        Some(free) => free.send(slot).err().map(|e| e.0),
        None => Some(slot),
    };
    if let Some(slot) = back {
        refused(slot);
    }
}

/// The feeder's loop: takes local index 0, 1, 2, ... from the queue, fills a free slot with
/// each batch and sends it on; at the end or an error it says so, stops the loaders and
/// returns.
fn feed<E, S, F>(
    queue: &Queue<E>,
    free: &Receiver<S>,
    ready: &Sender<Msg<S>>,
    starved: &AtomicBool,
    mut fill: F,
) where
    F: FnMut(&mut S, u64, &HostBatch<E>) -> Result<()>,
{
    let finish = |m: Msg<S>| {
        let _ = ready.send(m);
        queue.stop();
    };
    let mut i = 0u64;
    loop {
        // `None`: the prefetcher is being dropped.
        let Some(loaded) = queue.take(i) else { return };
        let (global, batch) = match loaded {
            Loaded::Batch(g, b) => (g, b),
            Loaded::End => return finish(Msg::End),
            Loaded::Failed(e) => return finish(Msg::Failed(e)),
        };
        // A free slot (the consumer has given it back), or the prefetcher is gone.
        starved.store(true, Ordering::Release);
        let got = free.recv();
        starved.store(false, Ordering::Release);
        let Ok(mut slot) = got else {
            drop_quietly(batch);
            return;
        };
        let filled = fill(&mut slot, global, &batch);
        // The host no longer reads the batch (every staged upload finished its host side);
        // a page-locked block may still be read by its DMA, which its event records, so
        // `pinned()` reuses it only once that is over.
        queue.recycle(batch);
        match filled {
            Ok(()) => {
                if ready.send(Msg::Ready(slot)).is_err() {
                    return;
                }
            }
            Err(e) => return finish(Msg::Failed(e)),
        }
        i += 1;
    }
}
