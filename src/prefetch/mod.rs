//! The prefetcher: load the next batches while the GPU trains on this one.
//!
//! ```text
//!  loader threads (N)          feeder thread                       consumer (your thread)
//!  source(i, &mut batch) ──▶ in order: wait for a free slot ──▶ next(): its stream waits for
//!  (pixels, spec, extras),    on the slot's stream: wait for its      the slot's `ready` event,
//!   any order                 `release`, upload, fused normalize,     hands out a DeviceBatch;
//!                              extras, record `ready`                  its drop records `release`
//! ```
//!
//! The pixels come in three kinds ([`Pixels`]), which cost host memory bandwidth differently.
//! Pageable pixels (`batch.pageable()`, a `Vec<u8>`) are uploaded through the staging engine:
//! the loader writes them, the engine reads them and writes its pinned slots, the DMA reads the
//! slots. Pinned pixels (`batch.pinned(len)?`, page-locked memory of the prefetcher's pool) go to
//! the device in one DMA with no staging copy: the fast path for a loader that decodes. File
//! ranges (`batch.set_file(file, offset, len)`) are read by the engine with `pread` straight
//! into its slots, so the loader does not touch the bytes at all. For page-locked pixels the
//! feeder queues a copy on a slot only once the slot's previous batch is done on the GPU (the
//! staging engine's ring holds it back likewise for the other kinds), so the blocks that copies
//! still read stay few however far the consumer's host runs ahead of the GPU.
//!
//! K device slots (the depth) each own their input, output and extras buffers, a stream and two
//! events; they are made once and reused, so device memory stays flat (a buffer grows only when
//! a batch is bigger than any before it). Slots move between the feeder and the consumer by
//! value through channels, so at any time exactly one side can touch a slot. The consumer's
//! stream waits for `ready` on the GPU (the host never blocks on the GPU), and the slot is
//! refilled only after the `release` event recorded on the consumer's stream when the batch is
//! dropped — what `record_stream` does in PyTorch, without holding memory back. A batch guard
//! that is leaked with `mem::forget` is given back at the next `next()` (its release is
//! recorded then, after everything the consumer has queued so far).
//!
//! The parts, one file each: [`Source`] (`source.rs`, with the iterator's turn protocol in
//! `turns.rs`), [`HostBatch`] (`batch.rs`) and [`Pixels`] (`pixels.rs`) on the host side; the
//! loader threads and their queue (`loaders.rs`); the feeder loop and shutdown shared with the
//! CPU [`DryRun`] (`pipeline.rs`); the GPU slots and how the feeder fills them (`slot.rs`,
//! `feeder.rs`); [`PrefetchConfig`] (`config.rs`); the consumer side here.
//!
//! Host batches are recycled: the source fills a `HostBatch` handed back from an earlier batch
//! (its vectors keep their capacity, its page-locked block is reused once its copy is over), so
//! a steady run allocates nothing.

use std::marker::PhantomData;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytemuck::Pod;

mod affinity;
mod batch;
mod config;
mod dry;
mod export;
mod feeder;
mod loaders;
mod pipeline;
mod pixels;
mod slot;
mod source;
mod turns;

pub use affinity::{CpuBinding, MAX_CPUS};
pub use batch::HostBatch;
pub use config::{PrefetchConfig, MAX_EXPORT_SPARES};
pub use dry::{DryBatch, DryRun};
pub use pixels::{ForeignBytes, HostBytes, Pixels};
pub use source::{LoadError, Source};

use crate::error::{Error, Result};
use crate::kernels::{Layout, OutputElement, ResizeSpec, Spec};
use crate::memory::{DeviceView, PinnedPool, PoolStats};
use crate::staging::Stager;
use crate::stream::Stream;
use batch::PinnedSupply;
pub(crate) use export::Lease;
#[cfg(feature = "dlpack")]
pub(crate) use export::Leased;
use export::{Exports, Stand};
use feeder::Feeder;
use pipeline::{Msg, Pipeline, Plan};
use slot::Slot;

/// Transfer and normalize hidden behind compute: N loader threads run a [`Source`], a feeder
/// thread uploads each batch into one of `depth` device slots (through the staging engine, or
/// with one DMA for page-locked [`Pixels`]) and runs the fused normalize there, and
/// [`next`](Prefetcher::next) hands the batches out in order, bound to the consumer's stream.
///
/// Dropping it stops the threads and frees the slots once nothing uses them; a loader that is
/// inside the source at that moment is waited for (the source's call is not interrupted).
///
/// ```no_run
/// use pinstream::prefetch::{HostBatch, PrefetchConfig, Prefetcher, Source};
/// use pinstream::kernels::{Normalize, Spec};
/// # fn main() -> pinstream::Result<()> {
/// let dev = pinstream::Device::get(0)?;
/// let stream = dev.stream()?;
/// let source = Source::new(|i, b: &mut HostBatch<i64>| {
///     if i == 100 {
///         return Ok(false); // end of the epoch
///     }
///     b.spec = Spec::uniform(32, 3, 224, 224, Normalize::imagenet())?;
///     // Page-locked memory: uploaded with one DMA, no staging copy. Write every byte.
///     let pixels = b.pinned(32 * 3 * 224 * 224)?;
///     pixels.fill((i % 251) as u8); // decode into it here
///     b.extras.clear();
///     b.extras.extend((0..32).map(|k| (i * 32 + k) as i64)); // labels
///     Ok(true)
/// });
/// let mut batches = Prefetcher::<f32, i64>::new(&stream, source, PrefetchConfig::default())?;
/// while let Some(batch) = batches.next() {
///     let batch = batch?;
///     let (x, y) = (batch.pixels()?, batch.extras()?); // device views, ready on `stream`
///     // ... queue the training step on `stream` with x.as_device_ptr(), y.as_device_ptr()
/// # let _ = (x, y);
/// }
/// # Ok(())
/// # }
/// ```
pub struct Prefetcher<O: OutputElement, E: Pod + Send + 'static = i64> {
    consumer: Stream,
    /// The slot the consumer holds (or held, if its guard was leaked).
    current: Option<Box<Slot<O, E>>>,
    pipe: Pipeline<E, Box<Slot<O, E>>>,
    pool: PinnedPool,
    device_bytes: Arc<AtomicUsize>,
    exports: Arc<Exports<Box<Slot<O, E>>>>,
    /// An error found while giving a slot back from `Drop`, reported by the next `next()`.
    pending: Option<Error>,
    /// A message [`poll`](Prefetcher::poll) received, for the next `next()`.
    early: Option<Msg<Box<Slot<O, E>>>>,
    finished: bool,
    _types: PhantomData<fn() -> O>,
}

impl<O: OutputElement, E: Pod + Send + 'static> std::fmt::Debug for Prefetcher<O, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prefetcher")
            .field("device", &self.consumer.device())
            .field("finished", &self.finished)
            .finish_non_exhaustive()
    }
}

impl<O: OutputElement, E: Pod + Send + 'static> Prefetcher<O, E> {
    /// Starts the loader threads and the feeder on the consumer stream's device; batches come
    /// out of [`next`](Self::next) in index order 0, 1, 2, ...
    pub fn new(consumer: &Stream, source: Source<E>, config: PrefetchConfig) -> Result<Self> {
        Self::start(consumer, &source, &config, 0, 1)
    }

    /// One prefetcher per stream (each on its own device, usually), fed from one source: the
    /// prefetcher of `consumers[d]` gets the global batches `d, d + n, d + 2n, ...` (n =
    /// `consumers.len()`). Each is `Send`: move it to the thread that drives its device, and
    /// drive them all: the loaders of one hold at most its window of batches ahead, so with an
    /// iterator source (taken in turn by all of them) a shard whose consumer stops taking
    /// batches holds the others back. A shard that stops early (dropped, or finished by an
    /// error) ends an iterator source for all of them (see [`Source::iter`]).
    pub fn sharded(
        consumers: &[Stream],
        source: Source<E>,
        config: PrefetchConfig,
    ) -> Result<Vec<Self>> {
        let n = consumers.len() as u64;
        consumers
            .iter()
            .enumerate()
            .map(|(d, s)| Self::start(s, &source, &config, d as u64, n))
            .collect()
    }

    fn start(
        consumer: &Stream,
        source: &Source<E>,
        config: &PrefetchConfig,
        shard: u64,
        shards: u64,
    ) -> Result<Self> {
        config.validate()?;
        let device = consumer.device();
        // Threads spawned from here on inherit the mask; this thread gets its own back when
        // `_chosen` / `_local` drop at the end. CPUs the caller chose replace the NUMA choice.
        let _chosen = config.cpus.as_deref().map(CpuBinding::bind).transpose()?;
        let _local = match device
            .local_cpus()
            .filter(|_| config.numa_local && config.cpus.is_none())
        {
            Some(cpus) => affinity::bind(&cpus)?,
            None => None,
        };
        let pool = PinnedPool::new(&device, config.pool)?;
        let stager = Stager::with_pool(&pool, config.stager.clone())?;
        let device_bytes = Arc::new(AtomicUsize::new(0));
        let slots = (0..config.depth)
            .map(|_| Slot::new(&device, device_bytes.clone()).map(Box::new))
            .collect::<Result<Vec<_>>>()?;
        let feeder = Feeder {
            device,
            upload: device.stream()?,
            stager,
        };
        let plan = Plan {
            loader_threads: config.loader_threads,
            window: config.window(),
            shard,
            shards,
            pinned: Some(PinnedSupply::new(pool.clone())),
        };
        let pipe = Pipeline::start(source, plan, slots, move |slot, global, batch| {
            feeder.fill(slot, global, batch)
        })?;
        Ok(Prefetcher {
            consumer: consumer.clone(),
            current: None,
            pipe,
            pool,
            device_bytes,
            exports: Arc::new(Exports::new(config.depth, config.export_spares)),
            pending: None,
            early: None,
            finished: false,
            _types: PhantomData,
        })
    }

    /// The next batch, in order, ready on the consumer's stream (which waits for it on the GPU;
    /// the host does not block on the GPU). `None` after the last batch. A loader's error or
    /// panic comes out here as [`Error::Loader`] at the batch it failed on; after any error the
    /// prefetcher is finished and returns `None`.
    ///
    /// Not an `Iterator`: the batch borrows the prefetcher, so drop it before the next call
    /// (that is what lets its slot be refilled). The batch has
    /// [`loader_stats`](DeviceBatch::loader_stats) and the other statistics too.
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> Option<Result<DeviceBatch<'_, O, E>>> {
        self.give_back();
        if let Some(e) = self.pending.take() {
            self.finished = true;
            return Some(Err(e));
        }
        if self.finished {
            return None;
        }
        let msg = if let Some(m) = self.early.take() {
            m
        } else if self.exports.circulating() == 0 {
            // Every slot is held by a DLPack consumer: no batch can come before a release.
            // The end of the epoch or an error still can (the feeder sends them without a
            // slot): wait for a message as long as the feeder is not stuck on a loaded batch.
            let mut waited_for_releases = false;
            loop {
                if let Some(m) = self.pipe.recv_timeout(std::time::Duration::ZERO) {
                    break m;
                }
                if self.pipe.starved() && self.exports.circulating() == 0 {
                    // Releases deferred to the background (a consumer stream pinstream may
                    // not touch after the handover, or none) give their slots back once the
                    // device has finished what was queued before them: wait for those once.
                    if !waited_for_releases && releases_pending() > 0 {
                        waited_for_releases = true;
                        wait_for_releases(std::time::Duration::from_secs(120));
                        continue;
                    }
                    // The one error of this op: `ImageFeed` (pinstream-vision) tells it from
                    // a failure by the op, and goes on after a release.
                    return Some(Err(Error::invalid(
                        "Prefetcher::next",
                        format!(
                            "all {} slots are held by batches handed over through DLPack \
                             whose consumers have not released them (depth {} + \
                             export_spares {}); release one and call next() again",
                            self.exports.total(),
                            self.exports.depth,
                            self.exports.limit
                        ),
                    )));
                }
                if let Some(m) = self.pipe.recv_timeout(std::time::Duration::from_millis(2)) {
                    break m;
                }
            }
        } else {
            self.pipe.recv()
        };
        match msg {
            Msg::Ready(slot) => {
                if let Err(e) = self.consumer.wait(&slot.ready) {
                    self.finished = true;
                    self.current = Some(slot);
                    return Some(Err(e));
                }
                self.current = Some(slot);
                Some(Ok(DeviceBatch { p: self }))
            }
            Msg::Failed(e) => {
                self.finished = true;
                Some(Err(e))
            }
            Msg::End => {
                self.finished = true;
                None
            }
        }
    }

    /// Waits up to `timeout` for [`next`](Self::next) to have something to return without
    /// waiting: `true` once it has (a batch, the end, or an error), `false` if `timeout`
    /// passed first. For callers that must stay responsive while they wait (a Python binding
    /// checking for Ctrl-C between slices, an event loop); a received batch is kept for
    /// `next`, nothing is lost.
    pub fn poll(&mut self, timeout: std::time::Duration) -> bool {
        self.give_back();
        if self.early.is_some() || self.pending.is_some() || self.finished {
            return true;
        }
        match self.pipe.recv_timeout(timeout) {
            Some(m) => {
                self.early = Some(m);
                true
            }
            // Every slot held by DLPack consumers and the feeder stuck on a loaded batch:
            // `next` returns its error at once.
            // (Unless deferred releases may still give slots back: keep polling.)
            None => {
                self.exports.circulating() == 0 && self.pipe.starved() && releases_pending() == 0
            }
        }
    }

    /// Whether [`next`](Self::next) would return at once with what has already arrived (a
    /// batch, the end of the data, an error), looking without waiting for anything: not for
    /// the loaders, not for the GPU, not for a lock the loaders hold. For a caller that must
    /// not block (a Python binding holding the GIL, which the loaders may be waiting for): when
    /// it says `true`, `next` does not wait either. A batch received is kept for `next`;
    /// nothing is lost. `false` while the batch handed out last is still held by this
    /// prefetcher (not exported): giving it back may wait for the device, which `next` does.
    pub fn ready(&mut self) -> bool {
        if self.current.is_some() {
            return false;
        }
        if self.early.is_some() || self.pending.is_some() || self.finished {
            return true;
        }
        match self.pipe.recv_timeout(std::time::Duration::ZERO) {
            Some(m) => {
                self.early = Some(m);
                true
            }
            None => false,
        }
    }

    /// Records the release of the slot the consumer held and sends it back to the feeder.
    fn give_back(&mut self) {
        let Some(mut slot) = self.current.take() else {
            return;
        };
        match mark_released(&self.consumer, &mut slot) {
            Ok(None) => {}
            Ok(Some(e)) => {
                self.pending.get_or_insert(e);
            }
            Err(e) => {
                // The slot's users cannot be ordered before its refill: keep it out of use.
                self.pending.get_or_insert(e);
                self.current = Some(slot);
                return;
            }
        }
        // Once the feeder has stopped the slot is dropped there, which waits for its release.
        self.pipe.give_back(slot);
    }

    /// The consumer's stream.
    pub fn stream(&self) -> &Stream {
        &self.consumer
    }

    /// Statistics of the pinned pool behind the staging slots and the page-locked pixels that
    /// [`HostBatch::pinned`] hands out (flat in a steady run).
    pub fn pinned_stats(&self) -> PoolStats {
        self.pool.stats()
    }

    /// Device bytes held by the slots' buffers (flat once the largest batch has been seen).
    pub fn device_bytes(&self) -> usize {
        self.device_bytes.load(Ordering::Relaxed)
    }

    /// How the loaders keep up: the window they load ahead in now, and how often the upload
    /// had to wait for them.
    pub fn loader_stats(&self) -> LoaderStats {
        self.pipe.loader_stats()
    }
}

/// Records the release of the batch in `slot` on the consumer's stream and on every stream
/// named by `record_stream`; a stream whose event cannot be recorded is waited for instead.
/// `Ok(Some(e))`: an error to report, the slot may be reused; `Err`: it may not.
fn mark_released<O: Pod, E: Pod>(
    consumer: &Stream,
    slot: &mut Slot<O, E>,
) -> Result<Option<Error>> {
    let mut report = None;
    if let Err(e) = consumer.record(&slot.release) {
        consumer.synchronize()?;
        report = Some(e);
    }
    // The last batch's release events were waited for by the fill of this one: reuse them.
    let done = std::mem::take(&mut slot.also);
    slot.spare_events.extend(done);
    for s in slot.take_users() {
        let ev = Slot::<O, E>::release_event(&mut slot.spare_events, &s.device());
        match ev.and_then(|ev| s.record(&ev).map(|()| ev)) {
            Ok(ev) => slot.also.push(ev),
            Err(e) => {
                s.synchronize()?;
                report.get_or_insert(e);
            }
        }
    }
    Ok(report)
}

/// [`Prefetcher::loader_stats`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoaderStats {
    /// Batches the loaders may hold (finished or being loaded) ahead of the upload now
    /// ([`PrefetchConfig::ahead`]).
    pub ahead: usize,
    /// Batches the feeder has taken for upload.
    pub uploads: u64,
    /// Of those, how many were not finished yet when the feeder asked for them (the first
    /// batch is not counted): many waits mean the loaders are the bottleneck (add loader
    /// threads), few mean the GPU side is.
    pub waits: u64,
}

impl<O: OutputElement, E: Pod + Send + 'static> Drop for Prefetcher<O, E> {
    fn drop(&mut self) {
        self.give_back();
        // `pipe` drops next: stops the loaders and the feeder and joins them; each slot still
        // in flight waits for its release and stream when dropped.
    }
}

/// A batch on the device, lent by [`Prefetcher::next`]: ready on the consumer's stream. When it
/// drops, an event is recorded on that stream and the slot is refilled only after it.
pub struct DeviceBatch<'a, O: OutputElement, E: Pod + Send + 'static = i64> {
    p: &'a mut Prefetcher<O, E>,
}

impl<O: OutputElement, E: Pod + Send + 'static> std::fmt::Debug for DeviceBatch<'_, O, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBatch")
            .field("index", &self.index())
            .finish_non_exhaustive()
    }
}

impl<O: OutputElement, E: Pod + Send + 'static> DeviceBatch<'_, O, E> {
    fn slot(&self) -> Result<&Slot<O, E>> {
        self.p
            .current
            .as_deref()
            .ok_or_else(|| Error::invalid("DeviceBatch", "the batch was given back"))
    }

    /// The batch's global index (what the source was called with).
    pub fn index(&self) -> u64 {
        self.slot().map_or(0, |s| s.index)
    }

    /// The spec the source gave: shape, layouts, crops.
    pub fn spec(&self) -> Option<&Spec> {
        self.slot().ok().map(|s| &s.spec)
    }

    /// `[n, c, h, w]` of the output for a batch whose samples all have the same output size
    /// (every resized batch), in NCHW order whatever the layout.
    pub fn dims(&self) -> Option<[usize; 4]> {
        let s = self.slot().ok()?;
        out_shape(&s.spec, s.resize.as_ref()).map(|(d, _)| d)
    }

    /// The resize spec of a resized batch (its boxes, flips and source sizes).
    pub fn resize_spec(&self) -> Option<&ResizeSpec> {
        self.slot().ok().and_then(|s| s.resize.as_ref())
    }

    /// The normalized pixels (`spec.output_len()` elements).
    pub fn pixels(&self) -> Result<DeviceView<'_, O>> {
        let s = self.slot()?;
        s.bufs()?.output.slice(..s.out_len)
    }

    /// The extras, as the source gave them.
    pub fn extras(&self) -> Result<DeviceView<'_, E>> {
        let s = self.slot()?;
        s.bufs()?.extras.slice(..s.extras_len)
    }

    /// The consumer's stream, on which the batch is ready.
    pub fn stream(&self) -> &Stream {
        &self.p.consumer
    }

    /// [`Prefetcher::loader_stats`], readable while the batch is held.
    pub fn loader_stats(&self) -> LoaderStats {
        self.p.loader_stats()
    }

    /// [`Prefetcher::pinned_stats`], readable while the batch is held.
    pub fn pinned_stats(&self) -> PoolStats {
        self.p.pinned_stats()
    }

    /// [`Prefetcher::device_bytes`], readable while the batch is held.
    pub fn device_bytes(&self) -> usize {
        self.p.device_bytes()
    }

    /// PyTorch's `record_stream` for the whole batch: `stream` (another library's, usually:
    /// see [`Stream::from_raw`]) uses it too. `stream` waits on the GPU for the batch now, and
    /// when the batch is dropped an event is recorded on it as on the consumer's stream: the
    /// slot is refilled only after both. Work queued on `stream` until the drop is covered.
    pub fn record_stream(&self, stream: &Stream) -> Result<()> {
        let slot = self.slot()?;
        stream.wait(&slot.ready)?;
        let mut users = crate::sync::lock(&slot.users);
        if !users.iter().any(|u| u.id() == stream.id()) {
            users.push(stream.clone());
        }
        Ok(())
    }

    /// Takes the batch out of the feeder's circle (for a DLPack export: `dlpack::batch`): its
    /// slot is the lease's until the lease drops, and a spare stands in meanwhile (up to
    /// [`PrefetchConfig::export_spares`]).
    pub(crate) fn lease(self) -> Result<BatchLease<O, E>> {
        let p = &mut *self.p;
        let Some(mut slot) = p.current.take() else {
            return Err(Error::invalid("DeviceBatch", "the batch was given back"));
        };
        match mark_released(&p.consumer, &mut slot) {
            Ok(None) => {}
            Ok(Some(e)) | Err(e) => {
                // Still the consumer's: dropping the batch gives it back the usual way.
                p.current = Some(slot);
                return Err(e);
            }
        }
        let device = p.consumer.device();
        let (shape, out_len, extras_len) = (pixel_shape(&slot), slot.out_len, slot.extras_len);
        let (output, extras) = match slot.bufs.as_ref() {
            Some(b) => (b.output.as_device_ptr(), b.extras.as_device_ptr()),
            None => {
                p.current = Some(slot);
                return Err(Error::invalid("Prefetcher", "a slot lost its buffers"));
            }
        };
        // A spare takes the slot's place in the feeder's circle while it is away.
        // (Not dropped here if the feeder has stopped: this may be a thread that holds what
        // the device's queued work waits for; see `export::drop_later`.)
        let later = |s| export::drop_later(s, device);
        match p.exports.on_export() {
            Stand::Parked(spare) => p.pipe.give_back_or(spare, later),
            Stand::New => match Slot::new(&device, p.device_bytes.clone()) {
                Ok(spare) => p.pipe.give_back_or(Box::new(spare), later),
                Err(e) => {
                    p.exports.spare_failed();
                    p.pending.get_or_insert(e);
                }
            },
            Stand::Nothing => {}
        }
        let lease = Arc::new(Lease::new(
            slot,
            device,
            p.pipe.returner(),
            p.exports.clone(),
        ));
        Ok(BatchLease {
            lease,
            device,
            shape,
            output: output.cast(),
            extras: extras.cast(),
            out_len,
            extras_len,
        })
    }
}

/// Exported batches whose release waits for the device (`deferred`): none without DLPack.
fn releases_pending() -> usize {
    #[cfg(feature = "dlpack")]
    return crate::deferred::pending_releases();
    #[cfg(not(feature = "dlpack"))]
    0
}

/// Waits (at most `timeout`) for the releases of [`releases_pending`].
fn wait_for_releases(timeout: std::time::Duration) -> bool {
    #[cfg(feature = "dlpack")]
    return crate::deferred::wait_for_releases(timeout);
    #[cfg(not(feature = "dlpack"))]
    {
        let _ = timeout;
        true
    }
}

/// A batch out of the feeder's circle ([`DeviceBatch::lease`]): where its pixels and extras
/// are, and the lease that keeps its slot.
pub(crate) struct BatchLease<O: Pod + Send, E: Pod + Send> {
    pub(crate) lease: Arc<Lease<Box<Slot<O, E>>>>,
    pub(crate) device: crate::device::Device,
    /// The pixels' shape where every sample has the same output size.
    pub(crate) shape: Option<Vec<usize>>,
    pub(crate) output: *const std::os::raw::c_void,
    pub(crate) extras: *const std::os::raw::c_void,
    pub(crate) out_len: usize,
    pub(crate) extras_len: usize,
}

/// `[n, c, h, w]` and the output layout of a batch whose samples all have the same output
/// size: every resized batch, a normalized one where its samples agree.
pub(crate) fn out_shape(spec: &Spec, resize: Option<&ResizeSpec>) -> Option<([usize; 4], Layout)> {
    if let Some(r) = resize {
        let dims = [r.samples.len(), r.out_channels(), r.out_h, r.out_w];
        return Some((dims, r.out_layout));
    }
    let first = spec.samples.first()?.out_hw();
    if !spec.samples.iter().all(|s| s.out_hw() == first) {
        return None;
    }
    let dims = [spec.samples.len(), spec.out_channels(), first.0, first.1];
    Some((dims, spec.out_layout))
}

/// The pixels' shape for a batch of equal-sized samples, in the output layout's order.
fn pixel_shape<O: Pod, E: Pod>(slot: &Slot<O, E>) -> Option<Vec<usize>> {
    let ([n, c, h, w], layout) = out_shape(&slot.spec, slot.resize.as_ref())?;
    let shape = match layout {
        Layout::Nchw => vec![n, c, h, w],
        Layout::Nhwc => vec![n, h, w, c],
    };
    (shape.iter().product::<usize>() == slot.out_len).then_some(shape)
}

impl<O: OutputElement, E: Pod + Send + 'static> Drop for DeviceBatch<'_, O, E> {
    fn drop(&mut self) {
        self.p.give_back();
    }
}
