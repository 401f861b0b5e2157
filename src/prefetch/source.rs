//! `Source`: where a prefetcher's batches come from — a function of the batch index, or an
//! iterator taken in turns (see [`turns`](super::turns)).

use std::sync::Arc;

use bytemuck::Pod;

use super::turns::{FailedItem, Turn, Turns};
use super::HostBatch;

/// What a source returns when it cannot produce a batch; the prefetcher turns it into
/// [`Error::Loader`](crate::Error::Loader) naming the batch. Its `Display` and `Drop` run under
/// `catch_unwind`: one that panics cannot take a loader thread down.
pub type LoadError = Box<dyn std::error::Error + Send + Sync>;

pub(crate) type SourceFn<E> =
    dyn Fn(u64, &mut HostBatch<E>) -> std::result::Result<bool, LoadError> + Send + Sync;

/// Where batches come from: a function of the batch index, called on the loader threads
/// (several at once, for different indices, in any order; the prefetcher restores the order).
/// It fills the `HostBatch` it is given (a recycled one: overwrite every field; its pixels may
/// be of any kind, which [`HostBatch::pageable`], [`HostBatch::pinned`] and
/// [`HostBatch::set_file`] switch) and returns `Ok(true)`, or `Ok(false)` past the end of the
/// data. Cheap to clone and shared by the prefetchers of
/// [`Prefetcher::sharded`](super::Prefetcher::sharded).
///
/// A panic in the source (or in its error's `Display` or `Drop`) is caught and comes out of
/// [`Prefetcher::next`](super::Prefetcher::next) as an `Error::Loader` naming the batch.
pub struct Source<E = i64> {
    pub(crate) f: Arc<SourceFn<E>>,
    /// For an iterator source: tells the turns that a prefetcher using it stopped.
    abandon: Option<Arc<dyn Fn() + Send + Sync>>,
}

impl<E> Clone for Source<E> {
    fn clone(&self) -> Self {
        Source {
            f: self.f.clone(),
            abandon: self.abandon.clone(),
        }
    }
}

impl<E> std::fmt::Debug for Source<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.abandon.is_some() {
            "Source::iter"
        } else {
            "Source"
        })
    }
}

impl<E> Source<E> {
    /// A prefetcher using this source stopped (dropped, or finished by an error): for an
    /// iterator source, whose turns it will no longer take, everyone waiting for a later turn
    /// is told so. Nothing for a function source.
    pub(crate) fn abandon_hook(&self) -> Option<Arc<dyn Fn() + Send + Sync>> {
        self.abandon.clone()
    }
}

impl<E: Pod + Send + 'static> Source<E> {
    /// A source from a function of the (global) batch index.
    pub fn new<F>(f: F) -> Source<E>
    where
        F: Fn(u64, &mut HostBatch<E>) -> std::result::Result<bool, LoadError>
            + Send
            + Sync
            + 'static,
    {
        Source {
            f: Arc::new(f),
            abandon: None,
        }
    }

    /// A source from an iterator of batches: the loader threads take its items in turn (item
    /// `i` is batch `i`), so only the iterator's own work is serial.
    ///
    /// An iterator serves **one pass**. Once any prefetcher using it stops before the end
    /// (dropped mid-epoch, or finished by an error — in [`Prefetcher::sharded`], one shard),
    /// nobody will take that prefetcher's turns, so the others' next batches, and any later
    /// prefetcher given a clone, get an `Error::Loader` saying so instead of waiting forever;
    /// likewise for an index the iterator has already passed. An error item, or a panic in
    /// `next`, is the error of its batch, and every later batch (of every shard) is an
    /// `Error::Loader` naming that item. The iterator is dropped as soon as it is over.
    ///
    /// The shards of [`Prefetcher::sharded`] take the items in turn, so drive them all at
    /// once (a thread each, or round-robin): draining one shard before starting another stops
    /// once the idle shard's loaders have filled their window, since the next item is theirs.
    /// The iterator's `next` runs with no lock of the prefetcher held; it must not wait for a
    /// prefetcher of its own source.
    ///
    /// [`Prefetcher::sharded`]: super::Prefetcher::sharded
    pub fn iter<I>(iter: I) -> Source<E>
    where
        I: Iterator<Item = std::result::Result<HostBatch<E>, LoadError>> + Send + 'static,
    {
        Source::iter_then(iter, |_, b, batch: &mut HostBatch<E>| {
            let pool = batch.pool.take();
            *batch = b;
            batch.pool = pool;
            Ok(())
        })
    }

    /// A source from an iterator of items of any kind, each made into its batch by `finish`
    /// **after** its turn: the loader threads take the items in turn, as with
    /// [`iter`](Self::iter), and then each runs `finish(i, item, batch)` on its own, while the
    /// next thread already takes the next turn. Only the iterator's `next` is serial; what
    /// `finish` does (copying the item's pixels into [`HostBatch::pinned`] memory, decoding)
    /// runs on every loader thread at once.
    ///
    /// Use it where an item stays valid after the iterator has moved on (each item owns its
    /// memory): an iterator that refills one buffer must copy it inside `next` instead, with
    /// [`iter`](Self::iter). `finish` is given the recycled batch with the prefetcher's pool
    /// (so [`HostBatch::pinned`] works): overwrite every field, as a function source does. Its
    /// error, or its panic, is the error of batch `i` alone; the iterator goes on (the
    /// prefetcher stops at that batch, which abandons the turns as any stop does). Everything
    /// [`iter`](Self::iter) says of one pass, shards and errors of the iterator holds here.
    pub fn iter_then<I, T, F>(iter: I, finish: F) -> Source<E>
    where
        I: Iterator<Item = std::result::Result<T, LoadError>> + Send + 'static,
        T: Send + 'static,
        F: Fn(u64, T, &mut HostBatch<E>) -> std::result::Result<(), LoadError>
            + Send
            + Sync
            + 'static,
    {
        let turns = Arc::new(Turns::new(iter));
        let take = turns.clone();
        let f = move |i: u64, batch: &mut HostBatch<E>| match take.take(i) {
            Turn::Item(item) => finish(i, item, batch).map(|()| true),
            Turn::End => Ok(false),
            Turn::Failed(FailedItem::Error(e)) => Err(e),
            Turn::Failed(FailedItem::Panic(m)) => Err(format!("the iterator panicked: {m}").into()),
            Turn::Gone(m) => Err(m.into()),
        };
        Source {
            f: Arc::new(f),
            abandon: Some(Arc::new(move || turns.abandon())),
        }
    }
}
