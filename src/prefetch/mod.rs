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
//! Host batches are recycled: the source fills a `HostBatch` handed back from an earlier batch
//! (its vectors keep their capacity, its page-locked block is reused once its copy is over), so
//! a steady run allocates nothing.

use std::collections::BTreeMap;
use std::marker::PhantomData;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use bytemuck::Pod;

mod pixels;
pub use pixels::Pixels;

use crate::device::Device;
use crate::error::{Error, Result};
use crate::event::Event;
use crate::kernels::{self, Normalize, OutputElement, Spec};
use crate::memory::{DeviceBuffer, DeviceView, PinnedBuffer, PinnedPool, PoolConfig, PoolStats};
use crate::staging::{FileSource, Stager, StagerConfig};
use crate::stream::Stream;
use crate::sync::{lock, panic_message};

/// What a source returns when it cannot produce a batch; the prefetcher turns it into
/// [`Error::Loader`] naming the batch.
pub type LoadError = Box<dyn std::error::Error + Send + Sync>;

/// One batch on the host, as a source fills it: the pixels (u8, laid out as `spec` says; in
/// pageable memory, page-locked memory or a file, see [`Pixels`]), the normalize `spec`
/// (layouts, crops, mirrors, mean/std), and per-sample extras such as labels.
///
/// A batch handed to a source by a [`Prefetcher`] also carries the prefetcher's pinned pool, so
/// that [`pinned`](Self::pinned) can give page-locked memory on the right device; one made with
/// [`new`](Self::new) or `default()` has none.
pub struct HostBatch<E = i64> {
    /// `spec.input_len()` bytes; see [`pageable`](Self::pageable), [`pinned`](Self::pinned) and
    /// [`set_file`](Self::set_file).
    pub pixels: Pixels,
    /// How to normalize `pixels`; also the batch's shape.
    pub spec: Spec,
    /// Anything per batch that goes to the device as is (labels, boxes); may be empty.
    pub extras: Vec<E>,
    /// The prefetcher's pool (set by the loader thread before each call of the source).
    pool: Option<PinnedPool>,
    /// A pageable vector kept aside (empty, with its capacity) while the pixels are pinned or
    /// a file range, for `pageable()` to put back.
    stash: Vec<u8>,
}

impl<E> Default for HostBatch<E> {
    fn default() -> Self {
        HostBatch::new(
            Pixels::default(),
            Spec::variable(3, &[], Normalize::new(&[0.0; 3], &[1.0; 3])),
            Vec::new(),
        )
    }
}

impl<E: std::fmt::Debug> std::fmt::Debug for HostBatch<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBatch")
            .field("pixels", &self.pixels)
            .field("spec", &self.spec)
            .field("extras", &self.extras)
            .field("pool", &self.pool.as_ref().map(|p| p.device()))
            .finish()
    }
}

impl<E> HostBatch<E> {
    /// A batch of these parts, without a pinned pool (so [`pinned`](Self::pinned) refuses):
    /// for [`Source::iter`] and for tests.
    pub fn new(pixels: Pixels, spec: Spec, extras: Vec<E>) -> Self {
        HostBatch {
            pixels,
            spec,
            extras,
            pool: None,
            stash: Vec::new(),
        }
    }

    /// The pixels as a vector of ordinary memory to fill (resize it to `spec.input_len()`):
    /// the one already there, or in place of page-locked pixels or a file range, the vector
    /// that [`pinned`](Self::pinned) or [`set_file`](Self::set_file) put aside (empty, with its
    /// capacity), so a source that switches kinds does not reallocate. A page-locked block goes
    /// back to its pool.
    pub fn pageable(&mut self) -> &mut Vec<u8> {
        if !matches!(self.pixels, Pixels::Pageable(_)) {
            self.pixels = Pixels::Pageable(std::mem::take(&mut self.stash));
        }
        match &mut self.pixels {
            Pixels::Pageable(v) => v,
            // Not reached (made pageable just above); the stash is empty then anyway.
            _ => &mut self.stash,
        }
    }

    /// Takes the pixels out, leaving empty pageable ones; a pageable vector is put aside
    /// (emptied) for `pageable()`, anything else is returned to be dropped.
    fn take_pixels(&mut self) -> Pixels {
        match std::mem::take(&mut self.pixels) {
            Pixels::Pageable(mut v) => {
                v.clear();
                self.stash = v;
                Pixels::default()
            }
            other => other,
        }
    }

    /// The pixels as `len` bytes of page-locked memory from the prefetcher's pool, to fill:
    /// the feeder then uploads them with one DMA, without the staging copy. The block already
    /// there is kept if it has exactly `len` bytes, belongs to the pool's device and its last
    /// copy has finished; otherwise it goes back to its pool (which hands it out again only
    /// after that copy) and the pool gives another (a pageable vector is put aside for
    /// [`pageable`](Self::pageable)). So this does not wait for the GPU (unless the pool's
    /// cache is full and a block has to be freed), and a steady run allocates nothing.
    ///
    /// The memory holds whatever an earlier batch left there (or zeros): **write every byte**.
    ///
    /// Errors: `Error::InvalidArgument` for a batch without a pool (one made with
    /// [`new`](Self::new) or `default()` rather than handed to a source by a prefetcher); the
    /// pool's errors (`Error::OutOfMemory`, ...) when it must allocate.
    pub fn pinned(&mut self, len: usize) -> Result<&mut [u8]> {
        let pool = self.pool.clone().ok_or_else(|| {
            Error::invalid(
                "HostBatch::pinned",
                "this batch has no pinned pool: only batches a Prefetcher hands to its source \
                 have one (use `pageable()`, or put a block of your own in `pixels`)",
            )
        })?;
        let reuse = matches!(
            &self.pixels,
            Pixels::Pinned(b) if b.len() == len && b.device() == pool.device() && b.is_idle()
        );
        if !reuse {
            // The old block goes back first, so that the pool may hand it out again.
            drop(self.take_pixels());
            self.pixels = Pixels::Pinned(pool.alloc::<u8>(len)?);
        }
        match &mut self.pixels {
            Pixels::Pinned(b) => b.as_mut_slice(),
            _ => Err(Error::invalid("HostBatch::pinned", "lost the block")),
        }
    }

    /// The pixels as `len` bytes of `buf` from `offset`: a range of page-locked memory that
    /// outlives the batch (a dataset held in pinned memory), which the feeder copies to the
    /// device with one DMA; nothing is written per batch (a page-locked block already there
    /// goes back to its pool). Checked when the batch is uploaded: a range outside the buffer,
    /// or a buffer page-locked for another device and not [`HostAlloc::PORTABLE`], is an
    /// [`Error::Loader`] naming the batch.
    ///
    /// [`HostAlloc::PORTABLE`]: crate::HostAlloc::PORTABLE
    pub fn set_resident(&mut self, buf: Arc<PinnedBuffer<u8>>, offset: usize, len: usize) {
        drop(self.take_pixels());
        self.pixels = Pixels::Resident { buf, offset, len };
    }

    /// The pixels as `len` bytes of `file` from `offset`, which the staging engine reads with
    /// `pread` straight into its pinned slots (a page-locked block already there goes back to
    /// its pool). The range is checked when the batch is uploaded: one outside the file is an
    /// [`Error::Loader`] naming the batch.
    pub fn set_file(&mut self, file: Arc<FileSource>, offset: u64, len: usize) {
        drop(self.take_pixels());
        self.pixels = Pixels::File { file, offset, len };
    }
}

type SourceFn<E> =
    dyn Fn(u64, &mut HostBatch<E>) -> std::result::Result<bool, LoadError> + Send + Sync;

/// Where batches come from: a function of the batch index, called on the loader threads
/// (several at once, for different indices, in any order; the prefetcher restores the order).
/// It fills the `HostBatch` it is given (a recycled one: overwrite every field; its pixels may
/// be of any kind, which [`HostBatch::pageable`], [`HostBatch::pinned`] and
/// [`HostBatch::set_file`] switch) and returns `Ok(true)`, or `Ok(false)` past the end of the
/// data. Cheap to clone and shared by the prefetchers of [`Prefetcher::sharded`].
pub struct Source<E = i64> {
    f: Arc<SourceFn<E>>,
}

impl<E> Clone for Source<E> {
    fn clone(&self) -> Self {
        Source { f: self.f.clone() }
    }
}

impl<E> std::fmt::Debug for Source<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Source")
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
        Source { f: Arc::new(f) }
    }

    /// A source from an iterator of batches: the loader threads take its items in turn (item
    /// `i` is batch `i`), so only the iterator's own work is serial.
    pub fn iter<I>(iter: I) -> Source<E>
    where
        I: Iterator<Item = std::result::Result<HostBatch<E>, LoadError>> + Send + 'static,
    {
        struct Turn<I> {
            iter: I,
            next: u64,
            done: bool,
        }
        let state = Arc::new((
            Mutex::new(Turn {
                iter,
                next: 0,
                done: false,
            }),
            Condvar::new(),
        ));
        Source::new(move |i, batch: &mut HostBatch<E>| {
            let (lock, cv) = &*state;
            let mut t = lock.lock().unwrap_or_else(|e| e.into_inner());
            while t.next != i && !t.done {
                t = cv.wait(t).unwrap_or_else(|e| e.into_inner());
            }
            if t.done {
                return Ok(false);
            }
            let item = t.iter.next();
            t.next += 1;
            if !matches!(item, Some(Ok(_))) {
                t.done = true;
            }
            cv.notify_all();
            drop(t);
            match item {
                Some(Ok(b)) => {
                    let pool = batch.pool.take();
                    *batch = b;
                    batch.pool = pool;
                    Ok(true)
                }
                Some(Err(e)) => Err(e),
                None => Ok(false),
            }
        })
    }
}

/// How a [`Prefetcher`] is built.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrefetchConfig {
    /// Device slots: batches ready or being filled ahead of the consumer, counting the one it
    /// holds. 1..=16; 2 hides the transfer behind one step of compute.
    pub depth: usize,
    /// Threads that run the source. At least 1.
    pub loader_threads: usize,
    /// Host batches the loaders may hold (finished or being loaded) ahead of the upload. 0,
    /// the default, adapts it between 2 and `depth + loader_threads`: one more whenever the
    /// upload has to wait for a batch, one less after a run of batches with two or more
    /// finished ones waiting behind them. Loaders that keep up then hold only a few batches
    /// (host memory, and batches uploaded soon after they are written, some of them still in
    /// the CPU's cache); slow ones get the full window. A value above 0 fixes it.
    /// [`Prefetcher::loader_stats`] shows the window and the waits.
    pub ahead: usize,
    /// The staging engine that uploads the pixels.
    pub stager: StagerConfig,
    /// Runs the loader, feeder and staging threads on the CPUs next to the device (sysfs
    /// `local_cpulist`, where the OS allows them), so the page-locked memory they fill sits on
    /// the GPU's NUMA node. Nothing changes where sysfs does not say. Default: on.
    pub numa_local: bool,
}

impl Default for PrefetchConfig {
    fn default() -> Self {
        PrefetchConfig {
            depth: 2,
            loader_threads: 4,
            ahead: 0,
            stager: StagerConfig::default(),
            numa_local: true,
        }
    }
}

impl PrefetchConfig {
    /// Checks every field; a bad value is an `Error::InvalidArgument` that names it.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| Err(Error::invalid("PrefetchConfig", reason));
        if !(1..=16).contains(&self.depth) {
            return bad(format!("depth = {} is not in 1..=16", self.depth));
        }
        if !(1..=256).contains(&self.loader_threads) {
            return bad(format!(
                "loader_threads = {} is not in 1..=256",
                self.loader_threads
            ));
        }
        if self.ahead > 4096 {
            return bad(format!("ahead = {} is more than 4096", self.ahead));
        }
        self.stager.validate()
    }

    fn window(&self) -> Window {
        match self.ahead {
            0 => Window::adaptive((self.depth + self.loader_threads) as u64),
            n => Window::fixed(n as u64),
        }
    }
}

/// How many batches the loaders may hold ahead of the feeder ([`PrefetchConfig::ahead`]).
///
/// Adaptive: one more after every wait of the upload for a batch, one less after a run of
/// [`Window::SURPLUS`] batches each taken with two or more finished ones behind it, but not
/// within [`Window::HOLD`] batches of the last wait. Waits then come at most about once per
/// `HOLD` batches, while the window stays near the smallest that keeps the upload fed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Window {
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

    fn fixed(n: u64) -> Self {
        Window {
            now: n,
            min: n,
            max: n,
            surplus: 0,
            hold: 0,
        }
    }

    /// Starts at `max` (nothing is known yet) and adapts within `2..=max`.
    fn adaptive(max: u64) -> Self {
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
enum Loaded<E> {
    Batch(u64, HostBatch<E>),
    End,
    Failed(Error),
}

struct Loads<E> {
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

struct LoadShared<E> {
    state: Mutex<Loads<E>>,
    cv: Condvar,
}

impl<E> LoadShared<E> {
    fn stop(&self) {
        lock(&self.state).stop = true;
        self.cv.notify_all();
    }
}

/// One device slot: buffers, a stream that fills them, and the two events that hand it over.
struct Slot<O: Pod, E: Pod> {
    stream: Stream,
    /// Recorded on `stream` once the batch is in `output` / `extras`.
    ready: Event,
    /// Recorded on the consumer's stream when the consumer is done with the batch.
    release: Event,
    bufs: Option<Buffers<O, E>>,
    spec: Spec,
    index: u64,
    out_len: usize,
    extras_len: usize,
    device_bytes: Arc<AtomicUsize>,
}

struct Buffers<O: Pod, E: Pod> {
    input: DeviceBuffer<u8>,
    output: DeviceBuffer<O>,
    extras: DeviceBuffer<E>,
}

impl<O: Pod, E: Pod> Buffers<O, E> {
    fn bytes(&self) -> usize {
        self.input.byte_len() + self.output.byte_len() + self.extras.byte_len()
    }
}

impl<O: Pod, E: Pod> Slot<O, E> {
    fn new(device: &Device, device_bytes: Arc<AtomicUsize>) -> Result<Self> {
        Ok(Slot {
            stream: Stream::new(device)?,
            ready: Event::new(device)?,
            release: Event::new(device)?,
            bufs: Some(Buffers {
                input: DeviceBuffer::new(device, 0)?,
                output: DeviceBuffer::new(device, 0)?,
                extras: DeviceBuffer::new(device, 0)?,
            }),
            spec: HostBatch::<E>::default().spec,
            index: 0,
            out_len: 0,
            extras_len: 0,
            device_bytes,
        })
    }

    fn bufs(&self) -> Result<&Buffers<O, E>> {
        self.bufs
            .as_ref()
            .ok_or_else(|| Error::invalid("Prefetcher", "a slot lost its buffers"))
    }

    /// Grows `buf` to at least `len` elements. The old buffer may still be read by the
    /// consumer (through raw pointers the trackers cannot see): wait for its release first.
    fn grow<T: Pod>(
        device: &Device,
        release: &Event,
        buf: &mut DeviceBuffer<T>,
        len: usize,
        bytes: &AtomicUsize,
    ) -> Result<()> {
        if buf.len() >= len {
            return Ok(());
        }
        release.synchronize()?;
        let new = DeviceBuffer::<T>::new(device, len)?;
        bytes.fetch_sub(buf.byte_len(), Ordering::Relaxed);
        bytes.fetch_add(new.byte_len(), Ordering::Relaxed);
        *buf = new;
        Ok(())
    }
}

impl<O: Pod, E: Pod> Drop for Slot<O, E> {
    fn drop(&mut self) {
        // The consumer's last use and the slot's own work must be over before the buffers go.
        let waited = self
            .release
            .synchronize()
            .and_then(|()| self.stream.synchronize());
        if let Some(b) = self.bufs.take() {
            self.device_bytes.fetch_sub(b.bytes(), Ordering::Relaxed);
            if let Err(e) = waited {
                crate::memory::tracker::leak("prefetch slot", b.bytes(), &e);
                std::mem::forget(b);
            }
        }
    }
}

enum Msg<O: Pod, E: Pod> {
    Ready(Box<Slot<O, E>>),
    End,
    Failed(Error),
}

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
    ready: Receiver<Msg<O, E>>,
    free: Option<Sender<Box<Slot<O, E>>>>,
    loads: Arc<LoadShared<E>>,
    loaders: Vec<JoinHandle<()>>,
    feeder: Option<JoinHandle<()>>,
    pool: PinnedPool,
    device_bytes: Arc<AtomicUsize>,
    /// An error found while giving a slot back from `Drop`, reported by the next `next()`.
    pending: Option<Error>,
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
        Self::start(consumer, source, config, 0, 1)
    }

    /// One prefetcher per stream (each on its own device, usually), fed from one source: the
    /// prefetcher of `consumers[d]` gets the global batches `d, d + n, d + 2n, ...` (n =
    /// `consumers.len()`). Each is `Send`: move it to the thread that drives its device.
    pub fn sharded(
        consumers: &[Stream],
        source: Source<E>,
        config: PrefetchConfig,
    ) -> Result<Vec<Self>> {
        let n = consumers.len() as u64;
        consumers
            .iter()
            .enumerate()
            .map(|(d, s)| Self::start(s, source.clone(), config.clone(), d as u64, n))
            .collect()
    }

    fn start(
        consumer: &Stream,
        source: Source<E>,
        config: PrefetchConfig,
        shard: u64,
        shards: u64,
    ) -> Result<Self> {
        config.validate()?;
        let device = consumer.device();
        // Threads spawned from here on inherit the mask; this thread gets its own back when
        // `_local` drops at the end.
        let _local = match device.local_cpus().filter(|_| config.numa_local) {
            Some(cpus) => crate::affinity::bind(&cpus)?,
            None => None,
        };
        let pool = PinnedPool::new(&device, PoolConfig::default())?;
        let stager = Stager::with_pool(&pool, config.stager.clone())?;
        let device_bytes = Arc::new(AtomicUsize::new(0));
        let (free_tx, free_rx) = mpsc::channel::<Box<Slot<O, E>>>();
        for _ in 0..config.depth {
            let slot = Slot::new(&device, device_bytes.clone())?;
            // The receiver is alive (held right here).
            let _ = free_tx.send(Box::new(slot));
        }
        let (ready_tx, ready_rx) = mpsc::channel();
        let loads = Arc::new(LoadShared {
            state: Mutex::new(Loads {
                claim: 0,
                window: config.window(),
                uploads: 0,
                waits: 0,
                fed: 0,
                results: BTreeMap::new(),
                end: None,
                spare: Vec::new(),
                stop: false,
            }),
            cv: Condvar::new(),
        });
        let mut me = Prefetcher {
            consumer: consumer.clone(),
            current: None,
            ready: ready_rx,
            free: Some(free_tx),
            loads: loads.clone(),
            loaders: Vec::new(),
            feeder: None,
            pool,
            device_bytes,
            pending: None,
            finished: false,
            _types: PhantomData,
        };
        for t in 0..config.loader_threads {
            let (loads, source, pool) = (loads.clone(), source.clone(), me.pool.clone());
            let h = std::thread::Builder::new()
                .name(format!("pinstream-loader-{shard}.{t}"))
                .spawn(move || loader(&loads, &source, &pool, shard, shards))
                .map_err(|e| Error::invalid("Prefetcher::new", format!("spawn: {e}")))?;
            me.loaders.push(h);
        }
        let feeder = Feeder {
            device,
            upload: device.stream()?,
            stager,
            loads,
            free: free_rx,
            ready: ready_tx,
        };
        let h = std::thread::Builder::new()
            .name(format!("pinstream-feeder-{shard}"))
            .spawn(move || feeder.run())
            .map_err(|e| Error::invalid("Prefetcher::new", format!("spawn: {e}")))?;
        me.feeder = Some(h);
        Ok(me)
    }

    /// The next batch, in order, ready on the consumer's stream (which waits for it on the GPU;
    /// the host does not block on the GPU). `None` after the last batch. A loader's error or
    /// panic comes out here as [`Error::Loader`] at the batch it failed on; after any error the
    /// prefetcher is finished and returns `None`.
    ///
    /// Not an `Iterator`: the batch borrows the prefetcher, so drop it before the next call
    /// (that is what lets its slot be refilled).
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
        match self.ready.recv() {
            Ok(Msg::Ready(slot)) => {
                if let Err(e) = self.consumer.wait(&slot.ready) {
                    self.finished = true;
                    self.current = Some(slot);
                    return Some(Err(e));
                }
                self.current = Some(slot);
                Some(Ok(DeviceBatch { p: self }))
            }
            Ok(Msg::Failed(e)) => {
                self.finished = true;
                Some(Err(e))
            }
            Ok(Msg::End) | Err(_) => {
                self.finished = true;
                None
            }
        }
    }

    /// Records the release of the slot the consumer held and sends it back to the feeder.
    fn give_back(&mut self) {
        let Some(slot) = self.current.take() else {
            return;
        };
        if let Err(e) = self.consumer.record(&slot.release) {
            // Without the event the feeder could refill the slot under the consumer: wait for
            // the consumer's stream instead; if even that fails, keep the slot out of use.
            if let Err(wait) = self.consumer.synchronize() {
                self.pending.get_or_insert(wait);
                self.current = Some(slot);
                return;
            }
            self.pending.get_or_insert(e);
        }
        if let Some(free) = &self.free {
            // A send fails only when the feeder has stopped; the slot is then dropped here,
            // which waits for its release.
            let _ = free.send(slot);
        }
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
        let s = lock(&self.loads.state);
        LoaderStats {
            ahead: s.window.now as usize,
            uploads: s.uploads,
            waits: s.waits,
        }
    }
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
        self.loads.stop();
        // Closing the free channel wakes a feeder that waits for a slot.
        self.free = None;
        // Drain what the feeder sent, so it never blocks (the channel is unbounded anyway);
        // each slot waits for its release and stream when dropped.
        while let Ok(m) = self.ready.try_recv() {
            drop(m);
        }
        if let Some(h) = self.feeder.take() {
            let _ = h.join();
        }
        while let Ok(m) = self.ready.try_recv() {
            drop(m);
        }
        for h in self.loaders.drain(..) {
            let _ = h.join();
        }
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

    /// `[n, c, h, w]` of the output for a batch whose samples all have the same output size,
    /// in NCHW order whatever the layout.
    pub fn dims(&self) -> Option<[usize; 4]> {
        let spec = self.spec()?;
        let first = spec.samples.first()?.out_hw();
        spec.samples
            .iter()
            .all(|s| s.out_hw() == first)
            .then(|| [spec.samples.len(), spec.out_channels(), first.0, first.1])
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
}

impl<O: OutputElement, E: Pod + Send + 'static> Drop for DeviceBatch<'_, O, E> {
    fn drop(&mut self) {
        self.p.give_back();
    }
}

/// A loader thread: claims local indices in order, runs the source, files the result.
fn loader<E: Pod + Send>(
    loads: &LoadShared<E>,
    source: &Source<E>,
    pool: &PinnedPool,
    shard: u64,
    n: u64,
) {
    loop {
        let (i, mut batch) = {
            let mut s = lock(&loads.state);
            loop {
                if s.stop || s.end.is_some_and(|e| s.claim >= e) {
                    return;
                }
                if s.claim < s.fed + s.window.now {
                    break;
                }
                s = loads.cv.wait(s).unwrap_or_else(|e| e.into_inner());
            }
            let i = s.claim;
            s.claim += 1;
            (i, s.spare.pop().unwrap_or_default())
        };
        let global = i.saturating_mul(n).saturating_add(shard);
        // The source may have moved batches around: always this prefetcher's pool.
        batch.pool = Some(pool.clone());
        let outcome = catch_unwind(AssertUnwindSafe(|| (source.f)(global, &mut batch)));
        let loaded = match outcome {
            Ok(Ok(true)) => Loaded::Batch(global, batch),
            Ok(Ok(false)) => Loaded::End,
            Ok(Err(e)) => Loaded::Failed(Error::Loader {
                batch: global,
                message: e.to_string(),
            }),
            Err(p) => Loaded::Failed(Error::Loader {
                batch: global,
                message: format!("the source panicked: {}", panic_message(&*p)),
            }),
        };
        let mut s = lock(&loads.state);
        if !matches!(loaded, Loaded::Batch(..)) {
            s.end = Some(s.end.map_or(i, |e| e.min(i)));
        }
        s.results.insert(i, loaded);
        drop(s);
        loads.cv.notify_all();
    }
}

struct Feeder<O: Pod, E: Pod> {
    device: Device,
    stager: Stager,
    /// The one stream for the single-DMA copies (pinned and resident pixels) of every slot, so
    /// that they run one after another at the link's full speed: on the slots' own streams two
    /// or three would share the link and the host memory at once, and each batch would be
    /// ready later (measured on two H200s: 1.74x one GPU with per-slot copies).
    upload: Stream,
    loads: Arc<LoadShared<E>>,
    free: Receiver<Box<Slot<O, E>>>,
    ready: Sender<Msg<O, E>>,
}

impl<O: OutputElement, E: Pod + Send> Feeder<O, E> {
    fn run(self) {
        let mut i = 0u64;
        loop {
            let loaded = {
                let mut s = lock(&self.loads.state);
                let mut waited = false;
                loop {
                    if s.stop {
                        return;
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
                    s = self.loads.cv.wait(s).unwrap_or_else(|e| e.into_inner());
                }
            };
            self.loads.cv.notify_all();
            let (global, batch) = match loaded {
                Loaded::Batch(g, b) => (g, b),
                Loaded::End => {
                    let _ = self.ready.send(Msg::End);
                    return;
                }
                Loaded::Failed(e) => {
                    let _ = self.ready.send(Msg::Failed(e));
                    return;
                }
            };
            // A free slot (the consumer has recorded its release), or the prefetcher is gone.
            let Ok(mut slot) = self.free.recv() else {
                return;
            };
            let filled = self.fill(&mut slot, global, &batch);
            // The host no longer reads the batch (every staged upload finished its host side);
            // a page-locked block may still be read by its DMA, which its event records, so
            // `pinned()` reuses it only once that is over.
            lock(&self.loads.state).spare.push(batch);
            match filled {
                Ok(()) => {
                    if self.ready.send(Msg::Ready(slot)).is_err() {
                        return;
                    }
                }
                Err(e) => {
                    let _ = self.ready.send(Msg::Failed(e));
                    return;
                }
            }
            i += 1;
        }
    }

    fn fill(&self, slot: &mut Slot<O, E>, global: u64, batch: &HostBatch<E>) -> Result<()> {
        let bad = |message: String| Error::Loader {
            batch: global,
            message,
        };
        batch
            .spec
            .validate("Prefetcher")
            .map_err(|e| bad(e.to_string()))?;
        let (in_len, out_len) = (batch.spec.input_len()?, batch.spec.output_len()?);
        let pixels = &batch.pixels;
        if pixels.len() != in_len {
            return Err(bad(format!(
                "{} pixel bytes ({}), the spec describes {in_len}",
                pixels.len(),
                pixels.kind()
            )));
        }
        match pixels {
            Pixels::Pageable(_) => {}
            Pixels::Pinned(block) => {
                if block.device() != self.device {
                    return Err(bad(format!(
                        "the pinned pixels are page-locked for {}, the prefetcher uploads to {}",
                        block.device(),
                        self.device
                    )));
                }
                // Nothing else holds the feeder back here (the stager's ring does for the
                // other kinds): keep it at most one batch per slot ahead of the GPU, so that the
                // blocks busy with a copy, and with them the pool, stay bounded however far the
                // consumer's host runs ahead. Passed at once unless the GPU is behind.
                slot.ready.synchronize()?;
            }
            Pixels::Resident { buf, offset, len } => {
                if let Some(why) = pixels::resident_foreign(buf, self.device) {
                    return Err(bad(why));
                }
                if pixels::resident_range(buf.len(), *offset, *len).is_none() {
                    return Err(bad(pixels::resident_outside(buf, *offset, *len)));
                }
            }
            Pixels::File { file, offset, len } => file
                .check_range("Prefetcher", *offset, *len)
                .map_err(|e| bad(e.to_string()))?,
        }
        let extras_len = batch.extras.len();
        // Everything the consumer did with the slot's last batch comes first.
        slot.stream.wait(&slot.release)?;
        let b = slot
            .bufs
            .as_mut()
            .ok_or_else(|| Error::invalid("Prefetcher", "a slot lost its buffers"))?;
        let (dev, release, bytes) = (&self.device, &slot.release, &*slot.device_bytes);
        Slot::<O, E>::grow(dev, release, &mut b.input, in_len, bytes)?;
        Slot::<O, E>::grow(dev, release, &mut b.output, out_len, bytes)?;
        Slot::<O, E>::grow(dev, release, &mut b.extras, extras_len, bytes)?;
        let stream = &slot.stream;
        let input = &mut b.input.slice_mut(..in_len)?;
        match pixels {
            Pixels::Pageable(v) => self.stager.upload(stream, v, input)?,
            // One DMA on the upload stream, recorded in the block's event (the pool and
            // `pinned()` wait for it). The slot's input is never shown to the consumer, so the
            // copy needs no wait for `release`; the trackers order it after the slot's last
            // normalize and the next normalize after it.
            Pixels::Pinned(block) => drop(self.upload.copy_h2d(block, input)?),
            // The same from a range of a resident buffer (checked above); it only reads the
            // buffer, so other devices' copies from it run beside it; the buffer's drop and
            // writes wait for it.
            Pixels::Resident { buf, offset, len } => {
                let view = buf.slice(*offset..*offset + *len)?;
                drop(self.upload.copy_h2d(&view, input)?)
            }
            Pixels::File { file, offset, .. } => self
                .stager
                .upload_file(stream, file, *offset, input)
                .map_err(|e| match e {
                    Error::Io { .. } => bad(e.to_string()),
                    e => e,
                })?,
        }
        if extras_len > 0 {
            self.stager.upload(
                stream,
                &batch.extras,
                &mut b.extras.slice_mut(..extras_len)?,
            )?;
        }
        kernels::normalize::<O, _, _>(
            stream,
            &b.input.slice(..in_len)?,
            &batch.spec,
            &mut b.output.slice_mut(..out_len)?,
            None,
        )?;
        stream.record(&slot.ready)?;
        slot.spec.clone_from(&batch.spec);
        slot.index = global;
        slot.out_len = out_len;
        slot.extras_len = extras_len;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
