//! The image feed: an [`ImageSource`] decoded on the GPU ([`crate::gpu_feed`], nvJPEG) or on
//! the loader threads behind a [`Prefetcher`], epoch after epoch, as [`FeedBatch`]es.
//!
//! ```no_run
//! use pinstream_vision::dataset::ImageList;
//! use pinstream_vision::{ImageFeed, ImageFeedConfig};
//! # fn main() -> pinstream::Result<()> {
//! let stream = pinstream::Device::get(0)?.stream()?;
//! let train = ImageList::folder("/data/imagenet/train")?;     // train/<class>/<image>.jpg
//! let mut feed = ImageFeed::<pinstream::bf16>::new(&stream, train, ImageFeedConfig::default())?;
//! for epoch in 0..90 {
//!     while let Some(batch) = feed.next() {                   // None at the end of each epoch
//!         let batch = batch?;
//!         let (x, y) = (batch.pixels()?, batch.labels()?);    // 256 x 3 x 224 x 224, labels
//!         // ... the training step on `stream`
//! #       let _ = (x, y, epoch);
//!     }
//! }
//! # Ok(()) }
//! ```

use pinstream::kernels::OutputElement;
use pinstream::prefetch::{CpuBinding, DeviceBatch, Prefetcher};
use pinstream::{Error, Result, Stream};

use crate::dataset::ImageList;
use crate::source::{Decoding, ImageFeedConfig, ImageSource, RouteCounts, Skipped};

/// An [`ImageSource`] decoded on the GPU (see [`Decoding`]) or behind a [`Prefetcher`]:
/// batches of `O` on the device with their labels, epoch after epoch, without a drain or a
/// rebuild at epoch boundaries. [`next`](Self::next) returns `None` at the end of each epoch;
/// the call after it starts the next epoch.
pub struct ImageFeed<O: OutputElement> {
    engine: Engine<O>,
    source: ImageSource,
    /// Batches taken so far.
    taken: u64,
    /// Whether `None` was returned for the current epoch's end.
    ended: bool,
    /// The error that stopped the feed: every later call reports it again.
    failed: Option<String>,
}

enum Engine<O: OutputElement> {
    Cpu(Box<Prefetcher<O, i64>>),
    #[cfg(feature = "nvjpeg")]
    Gpu(crate::gpu_feed::GpuFeed<O>),
}

impl<O: OutputElement> std::fmt::Debug for ImageFeed<O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImageFeed")
            .field("source", &self.source)
            .field("decoding", &self.decoding())
            .field("position", &self.position())
            .finish_non_exhaustive()
    }
}

/// Whether the GPU decodes, and with what: `Ok` with nvJPEG where `decoding` asks for the GPU
/// and it can, `Ok(None)` for the CPU, `Err` where the GPU was required and cannot.
#[cfg(feature = "nvjpeg")]
fn gpu_decoder(stream: &Stream, decoding: Decoding) -> Result<Option<crate::nvjpeg::Nvjpeg>> {
    use std::sync::atomic::{AtomicBool, Ordering};
    static SAID: AtomicBool = AtomicBool::new(false);
    if decoding == Decoding::Cpu {
        return Ok(None);
    }
    let why = match crate::nvjpeg::Nvjpeg::new(&stream.device()) {
        Ok(nv) if decoding == Decoding::Gpu || nv.hardware_engines() > 0 => return Ok(Some(nv)),
        Ok(nv) => nv.hardware_absent().unwrap_or("no JPEG engine").to_string(),
        Err(e) if decoding == Decoding::Gpu => return Err(e),
        Err(e) => e.to_string(),
    };
    if !SAID.swap(true, Ordering::Relaxed) {
        eprintln!("pinstream-vision: the image feed decodes on the CPU: {why}");
    }
    Ok(None)
}

#[cfg(not(feature = "nvjpeg"))]
fn gpu_decoder(_: &Stream, decoding: Decoding) -> Result<Option<std::convert::Infallible>> {
    match decoding {
        Decoding::Gpu => Err(Error::invalid(
            "ImageFeed::new",
            "GPU decoding needs pinstream-vision's `nvjpeg` feature",
        )),
        _ => Ok(None),
    }
}

impl<O: OutputElement> ImageFeed<O> {
    /// Starts the loaders on `list` for batches on `stream` (see [`ImageSource::new`] for the
    /// errors; with [`Decoding::Gpu`], also nvJPEG's).
    pub fn new(stream: &Stream, list: ImageList, config: ImageFeedConfig) -> Result<Self> {
        let source = ImageSource::new(list, &config)?;
        // With `cpus`, everything started from here on (nvJPEG's handles and their threads,
        // the loaders) starts on those CPUs; this thread gets its mask back at the end.
        let _chosen = config
            .prefetch
            .cpus
            .as_deref()
            .map(CpuBinding::bind)
            .transpose()?;
        let engine = match gpu_decoder(stream, config.decoding)? {
            #[cfg(feature = "nvjpeg")]
            Some(nv) => Engine::Gpu(crate::gpu_feed::GpuFeed::new(stream, source.clone(), nv)?),
            #[cfg(not(feature = "nvjpeg"))]
            Some(never) => match never {},
            None => Engine::Cpu(Box::new(Prefetcher::new(
                stream,
                source.source(),
                config.prefetch_config(false),
            )?)),
        };
        Ok(ImageFeed {
            engine,
            source,
            taken: 0,
            ended: false,
            failed: None,
        })
    }

    /// The next batch of this epoch, `None` after its last (then the next call goes on with
    /// the next epoch). An error ends the feed, and every later call returns an error saying
    /// so (never a `None` that would look like the end of an epoch); except the CPU path's
    /// refusal while every batch slot is lent out through DLPack, after which the feed goes on
    /// once one is released.
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> Option<Result<FeedBatch<'_, O>>> {
        if let Some(m) = &self.failed {
            return Some(Err(Error::invalid(
                "ImageFeed::next",
                format!("the feed stopped at an earlier error: {m}"),
            )));
        }
        let (_, k) = self.source.position(self.taken);
        if k == 0 && self.taken > 0 && !self.ended {
            self.ended = true;
            return None;
        }
        self.ended = false;
        let got = match &mut self.engine {
            Engine::Cpu(p) => match p.next() {
                Some(r) => r.map(|b| FeedBatch(Inner_::Cpu(b))),
                None => Err(Error::invalid(
                    "ImageFeed::next",
                    "the prefetcher ended (an endless source ended)",
                )),
            },
            #[cfg(feature = "nvjpeg")]
            Engine::Gpu(g) => g.next().map(|b| FeedBatch(Inner_::Gpu(Box::new(b)))),
        };
        match got {
            Ok(b) => {
                self.taken += 1;
                Some(Ok(b))
            }
            Err(e) => {
                // Every slot lent out through DLPack is no end: the prefetcher goes on once a
                // batch is released (`PrefetchConfig::export_spares`), and so does the feed.
                let lent_out = matches!(
                    &e,
                    Error::InvalidArgument {
                        op: "Prefetcher::next",
                        ..
                    }
                );
                if !lent_out {
                    self.failed = Some(e.to_string());
                }
                Some(Err(e))
            }
        }
    }

    /// Waits up to `timeout` for [`next`](Self::next) to have something to return without
    /// waiting (a batch, the end of the epoch, an error): `true` once it has, `false` if
    /// `timeout` passed first. For callers that must stay responsive while they wait (a Python
    /// binding checking for Ctrl-C between slices); nothing is lost.
    pub fn poll(&mut self, timeout: std::time::Duration) -> bool {
        if self.failed.is_some() {
            return true;
        }
        let (_, k) = self.source.position(self.taken);
        if k == 0 && self.taken > 0 && !self.ended {
            return true;
        }
        match &mut self.engine {
            Engine::Cpu(p) => p.poll(timeout),
            #[cfg(feature = "nvjpeg")]
            Engine::Gpu(g) => g.poll(timeout),
        }
    }

    /// `(epoch, batch)` of the next batch: where to resume from (`ImageFeedConfig::start`).
    pub fn position(&self) -> (u64, usize) {
        self.source.position(self.taken)
    }

    /// Batches in one epoch.
    pub fn batches_per_epoch(&self) -> usize {
        self.source.batches_per_epoch()
    }

    /// Files skipped so far ([`BadFiles::Skip`](crate::BadFiles::Skip)).
    pub fn skipped(&self) -> Skipped {
        self.source.skipped()
    }

    /// The source (its order, positions, and [`ImageSource::load`]).
    pub fn source(&self) -> &ImageSource {
        &self.source
    }

    /// Where this feed decodes: [`Decoding::Gpu`] or [`Decoding::Cpu`] (what `Auto` chose).
    pub fn decoding(&self) -> Decoding {
        match &self.engine {
            Engine::Cpu(_) => Decoding::Cpu,
            #[cfg(feature = "nvjpeg")]
            Engine::Gpu(_) => Decoding::Gpu,
        }
    }

    /// The loader threads it runs ([`ImageFeedConfig::loader_threads`] for where it decodes).
    pub fn loader_threads(&self) -> usize {
        self.source
            .config()
            .loader_threads(self.decoding() == Decoding::Gpu)
    }

    /// Images decoded so far by the GPU's engines, nvJPEG's CUDA backend and the CPU (all on
    /// the CPU where the feed decodes there: those are not counted).
    pub fn routes(&self) -> RouteCounts {
        match &self.engine {
            #[cfg(feature = "nvjpeg")]
            Engine::Gpu(g) => g.routes(),
            Engine::Cpu(_) => RouteCounts::default(),
        }
    }

    /// What the cache of decoded images (`ImageFeedConfig::gpu_cache_bytes`) holds, and how
    /// many images it served instead of decoding them (all zero without a cache, and on the
    /// CPU path).
    pub fn gpu_cache(&self) -> crate::GpuCacheStats {
        match &self.engine {
            #[cfg(feature = "nvjpeg")]
            Engine::Gpu(g) => g.gpu_cache(),
            Engine::Cpu(_) => crate::GpuCacheStats::default(),
        }
    }

    /// The GPU's JPEG engines the feed decodes with (0 on the CPU path).
    pub fn hardware_engines(&self) -> u32 {
        match &self.engine {
            #[cfg(feature = "nvjpeg")]
            Engine::Gpu(g) => g.nvjpeg().hardware_engines(),
            Engine::Cpu(_) => 0,
        }
    }

    /// The prefetcher underneath, where the feed decodes on the CPU.
    pub fn prefetcher(&self) -> Option<&Prefetcher<O, i64>> {
        match &self.engine {
            Engine::Cpu(p) => Some(&**p),
            #[cfg(feature = "nvjpeg")]
            Engine::Gpu(_) => None,
        }
    }
}

/// A batch of an [`ImageFeed`]: pixels (`n x 3 x h x w`, or NHWC) and labels on the device,
/// ordered on the feed's stream. Dropping it hands its memory back to the feed.
#[derive(Debug)]
pub struct FeedBatch<'a, O: OutputElement>(Inner_<'a, O>);

#[derive(Debug)]
enum Inner_<'a, O: OutputElement> {
    Cpu(DeviceBatch<'a, O, i64>),
    #[cfg(feature = "nvjpeg")]
    Gpu(Box<crate::gpu_feed::GpuBatch<'a, O>>),
}

impl<O: OutputElement> FeedBatch<'_, O> {
    /// The batch index (counted from the configuration's start).
    pub fn index(&self) -> u64 {
        match &self.0 {
            Inner_::Cpu(b) => b.index(),
            #[cfg(feature = "nvjpeg")]
            Inner_::Gpu(b) => b.index(),
        }
    }

    /// `[n, c, h, w]` (NCHW) or `[n, h, w, c]` (NHWC).
    pub fn dims(&self) -> [usize; 4] {
        match &self.0 {
            Inner_::Cpu(b) => b.dims().unwrap_or_default(),
            #[cfg(feature = "nvjpeg")]
            Inner_::Gpu(b) => b.dims(),
        }
    }

    /// The pixels.
    pub fn pixels(&self) -> Result<pinstream::DeviceView<'_, O>> {
        match &self.0 {
            Inner_::Cpu(b) => b.pixels(),
            #[cfg(feature = "nvjpeg")]
            Inner_::Gpu(b) => b.pixels(),
        }
    }

    /// The labels, one per sample.
    pub fn labels(&self) -> Result<pinstream::DeviceView<'_, i64>> {
        match &self.0 {
            Inner_::Cpu(b) => b.extras(),
            #[cfg(feature = "nvjpeg")]
            Inner_::Gpu(b) => b.labels(),
        }
    }

    /// The labels ([`labels`](Self::labels); the prefetcher's name for them).
    pub fn extras(&self) -> Result<pinstream::DeviceView<'_, i64>> {
        self.labels()
    }

    /// PyTorch's `record_stream`: `stream` also reads the batch.
    pub fn record_stream(&self, stream: &Stream) -> Result<()> {
        match &self.0 {
            Inner_::Cpu(b) => b.record_stream(stream),
            #[cfg(feature = "nvjpeg")]
            Inner_::Gpu(b) => b.record_stream(stream),
        }
    }

    /// The batch as two DLPack tensors, pixels (`[n, c, h, w]` or `[n, h, w, c]`) and labels
    /// (`[n]`, int64), owning its memory until both are released (feature `dlpack`). Hand each
    /// over with a consumer stream (`Tensor::into_versioned(Some(&stream))`): that stream waits
    /// for the batch on the GPU, and the memory is reused only after what it queued before the
    /// release. The feed goes on meanwhile with other buffers.
    #[cfg(feature = "dlpack")]
    pub fn into_dlpack(self) -> Result<(pinstream::dlpack::Tensor, pinstream::dlpack::Tensor)>
    where
        O: pinstream::dlpack::Element,
    {
        match self.0 {
            Inner_::Cpu(b) => b.into_dlpack(),
            #[cfg(feature = "nvjpeg")]
            Inner_::Gpu(b) => b.into_dlpack(),
        }
    }

    /// The prefetcher's batch, where the feed decodes on the CPU.
    pub fn as_prefetched(&self) -> Option<&DeviceBatch<'_, O, i64>> {
        match &self.0 {
            Inner_::Cpu(b) => Some(b),
            #[cfg(feature = "nvjpeg")]
            Inner_::Gpu(_) => None,
        }
    }
}
