//! `DryRun`: the prefetcher's pipeline without a device — the same loaders, feeder loop and
//! shutdown, with the fused normalize replaced by the f64 CPU reference into host vectors — for
//! testing a source (its order, its errors, its shutdown) where there is no GPU, as CI is.

use bytemuck::Pod;

use super::pipeline::{Msg, Pipeline, Plan};
use super::{HostBatch, LoaderStats, PrefetchConfig, Source};
use crate::error::{Error, Result};
use crate::kernels::{cpu, OutputElement, ResizeSpec, Spec};

/// A slot of the dry run: the batch as the GPU prefetcher would hand it out, on the host.
struct HostSlot<O, E> {
    pixels: Vec<O>,
    extras: Vec<E>,
    spec: Spec,
    resize: Option<ResizeSpec>,
    index: u64,
}

/// Grows `v` to `len` elements without aborting on a size the machine cannot hold.
fn fit<T: Pod>(v: &mut Vec<T>, len: usize) -> Result<()> {
    v.clear();
    v.try_reserve_exact(len).map_err(|e| {
        Error::invalid(
            "DryRun",
            format!("{len} elements of {}: {e}", std::any::type_name::<T>()),
        )
    })?;
    v.resize(len, T::zeroed());
    Ok(())
}

fn fill<O: OutputElement, E: Pod>(
    slot: &mut HostSlot<O, E>,
    global: u64,
    batch: &HostBatch<E>,
) -> Result<()> {
    let (_, out_len) = batch.checked_lens(global)?;
    let pixels = batch.pixels.read().map_err(|e| Error::Loader {
        batch: global,
        message: e.to_string(),
    })?;
    fit(&mut slot.pixels, out_len)?;
    match &batch.resize {
        Some(r) => cpu::resized_crop(&pixels, r, &mut slot.pixels)?,
        None => cpu::normalize(&pixels, &batch.spec, None, &mut slot.pixels)?,
    }
    fit(&mut slot.extras, batch.extras.len())?;
    slot.extras.copy_from_slice(&batch.extras);
    slot.spec.clone_from(&batch.spec);
    slot.resize.clone_from(&batch.resize);
    slot.index = global;
    Ok(())
}

/// The [`Prefetcher`](super::Prefetcher)'s pipeline on the CPU: the same loader threads (with
/// the same window), source protocol, ordering, error reporting and shutdown, but each batch is
/// normalized by the CPU reference ([`kernels::cpu::normalize`](crate::kernels::cpu::normalize))
/// into host memory. For testing a source without a GPU; it is slow (f64 per element) and not
/// meant for training.
///
/// Differences from the GPU prefetcher: no pinned pool, so [`HostBatch::pinned`] gives
/// ordinary memory (page-locked pixels of your own, resident ranges and files all work);
/// `PrefetchConfig::stager`, `pool` and `numa_local` are not used (`cpus` is); `depth` host
/// slots stand for the device slots.
///
/// ```
/// use pinstream::kernels::{Normalize, Spec};
/// use pinstream::prefetch::{DryRun, HostBatch, PrefetchConfig, Source};
/// # fn main() -> pinstream::Result<()> {
/// let source = Source::new(|i, b: &mut HostBatch<i64>| {
///     if i == 3 {
///         return Ok(false);
///     }
///     b.spec = Spec::variable(3, &[(2, 2)], Normalize::imagenet());
///     let px = b.pageable();
///     px.clear();
///     px.extend((0..12).map(|k| (i * 12 + k) as u8));
///     b.extras.clear();
///     b.extras.push(i as i64);
///     Ok(true)
/// });
/// let mut run = DryRun::<f32, i64>::new(source, PrefetchConfig::default())?;
/// let mut seen = 0;
/// while let Some(batch) = run.next() {
///     let batch = batch?;
///     assert_eq!(batch.index(), seen);
///     assert_eq!(batch.pixels().len(), 12);
///     assert_eq!(batch.extras(), &[seen as i64]);
///     seen += 1;
/// }
/// assert_eq!(seen, 3);
/// # Ok(()) }
/// ```
pub struct DryRun<O: OutputElement, E: Pod + Send + 'static = i64> {
    current: Option<HostSlot<O, E>>,
    pipe: Pipeline<E, HostSlot<O, E>>,
    /// A message [`poll`](DryRun::poll) received, for the next `next()`.
    early: Option<Msg<HostSlot<O, E>>>,
    finished: bool,
}

impl<O: OutputElement, E: Pod + Send + 'static> std::fmt::Debug for DryRun<O, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DryRun")
            .field("finished", &self.finished)
            .finish_non_exhaustive()
    }
}

impl<O: OutputElement, E: Pod + Send + 'static> DryRun<O, E> {
    /// Starts the loaders and the feeder; batches come out of [`next`](Self::next) in index
    /// order.
    pub fn new(source: Source<E>, config: PrefetchConfig) -> Result<Self> {
        Self::start(&source, &config, 0, 1)
    }

    /// `shards` dry runs fed from one source, as [`Prefetcher::sharded`] splits it: run `d`
    /// gets the global batches `d, d + shards, ...`.
    ///
    /// [`Prefetcher::sharded`]: super::Prefetcher::sharded
    pub fn sharded(shards: usize, source: Source<E>, config: PrefetchConfig) -> Result<Vec<Self>> {
        if shards == 0 {
            return Err(Error::invalid("DryRun::sharded", "no shards"));
        }
        let n = shards as u64;
        (0..n)
            .map(|d| Self::start(&source, &config, d, n))
            .collect()
    }

    fn start(source: &Source<E>, config: &PrefetchConfig, shard: u64, shards: u64) -> Result<Self> {
        config.validate()?;
        // As the device path: the threads started below run on the CPUs chosen.
        let _chosen = config
            .cpus
            .as_deref()
            .map(super::CpuBinding::bind)
            .transpose()?;
        let slots = (0..config.depth)
            .map(|_| HostSlot {
                pixels: Vec::new(),
                extras: Vec::new(),
                spec: HostBatch::<E>::default().spec,
                resize: None,
                index: 0,
            })
            .collect();
        let plan = Plan {
            loader_threads: config.loader_threads,
            window: config.window(),
            shard,
            shards,
            pinned: None,
        };
        Ok(DryRun {
            current: None,
            pipe: Pipeline::start(source, plan, slots, fill::<O, E>)?,
            early: None,
            finished: false,
        })
    }

    /// The next batch in order, `None` after the last; errors as
    /// [`Prefetcher::next`](super::Prefetcher::next) reports them.
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> Option<Result<DryBatch<'_, O, E>>> {
        if let Some(slot) = self.current.take() {
            self.pipe.give_back(slot);
        }
        if self.finished {
            return None;
        }
        let msg = match self.early.take() {
            Some(m) => m,
            None => self.pipe.recv(),
        };
        match msg {
            Msg::Ready(slot) => {
                self.current = Some(slot);
                Some(Ok(DryBatch { p: self }))
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

    /// As [`Prefetcher::poll`](super::Prefetcher::poll): waits up to `timeout` for
    /// [`next`](Self::next) to have something to return without waiting.
    pub fn poll(&mut self, timeout: std::time::Duration) -> bool {
        if let Some(slot) = self.current.take() {
            self.pipe.give_back(slot);
        }
        if self.early.is_some() || self.finished {
            return true;
        }
        match self.pipe.recv_timeout(timeout) {
            Some(m) => {
                self.early = Some(m);
                true
            }
            None => false,
        }
    }

    /// As [`Prefetcher::ready`](super::Prefetcher::ready): whether [`next`](Self::next) would
    /// return at once, looking without waiting (a dry run's slots are host memory: giving the
    /// last one back never waits).
    pub fn ready(&mut self) -> bool {
        if let Some(slot) = self.current.take() {
            self.pipe.give_back(slot);
        }
        if self.early.is_some() || self.finished {
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

    /// As [`Prefetcher::loader_stats`](super::Prefetcher::loader_stats).
    pub fn loader_stats(&self) -> LoaderStats {
        self.pipe.loader_stats()
    }
}

/// A batch of a [`DryRun`]: what the GPU prefetcher's [`DeviceBatch`](super::DeviceBatch)
/// would hold, on the host.
pub struct DryBatch<'a, O: OutputElement, E: Pod + Send + 'static = i64> {
    p: &'a mut DryRun<O, E>,
}

impl<O: OutputElement, E: Pod + Send + 'static> std::fmt::Debug for DryBatch<'_, O, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DryBatch")
            .field("index", &self.index())
            .finish_non_exhaustive()
    }
}

impl<O: OutputElement, E: Pod + Send + 'static> DryBatch<'_, O, E> {
    fn slot(&self) -> Option<&HostSlot<O, E>> {
        self.p.current.as_ref()
    }

    /// The batch's global index.
    pub fn index(&self) -> u64 {
        self.slot().map_or(0, |s| s.index)
    }

    /// The spec the source gave.
    pub fn spec(&self) -> Option<&Spec> {
        self.slot().map(|s| &s.spec)
    }

    /// The resize spec the source gave, for a resized batch.
    pub fn resize_spec(&self) -> Option<&ResizeSpec> {
        self.slot().and_then(|s| s.resize.as_ref())
    }

    /// `[n, c, h, w]` of the output (NCHW order whatever the layout), where every sample has
    /// the same output size.
    pub fn dims(&self) -> Option<[usize; 4]> {
        let s = self.slot()?;
        super::out_shape(&s.spec, s.resize.as_ref()).map(|(d, _)| d)
    }

    /// The normalized pixels, as the kernel would write them.
    pub fn pixels(&self) -> &[O] {
        self.slot().map_or(&[], |s| &s.pixels)
    }

    /// The extras, as the source gave them.
    pub fn extras(&self) -> &[E] {
        self.slot().map_or(&[], |s| &s.extras)
    }

    /// As [`DeviceBatch::loader_stats`](super::DeviceBatch::loader_stats).
    pub fn loader_stats(&self) -> LoaderStats {
        self.p.loader_stats()
    }
}
