//! `pinstream._native.ImageFeed`: pinstream-vision's image feed (JPEGs decoded on the GPU's JPEG
//! engines, or on loader threads; resized crop, flip, normalize and cast in one kernel), thinly
//! bound. Each batch leaves as two DLPack tensors, pixels and int64 labels, whose consumer
//! stream waits for them on the GPU. `next()` waits in slices with the GIL released and checks
//! for signals between them (Ctrl-C raises `KeyboardInterrupt`; the feed stays usable). The
//! Python layer (`pinstream/feed.py`) adds the defaults, the distributed rank, `set_epoch` and
//! the state dict.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::Duration;

use pinstream::dlpack;
use pinstream::kernels::{Layout, Normalize};
use pinstream::{bf16, f16, Error};
use pinstream_vision::augment::RandomResizedCrop;
use pinstream_vision::dataset::ImageList;
use pinstream_vision::{Augment, BadFiles, Decoding, ImageFeed, ImageFeedConfig};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::context::{ctx, device_ordinal, lock};
use crate::errors::{invalid, to_py, OrPy};
use crate::tensor::Tensor;

const OP: &str = "pinstream.ImageFeed";

/// How long `next` waits for a batch between two checks for signals (Ctrl-C).
const SLICE: Duration = Duration::from_millis(50);

/// The feed, of the output type asked for.
enum Any {
    F32(ImageFeed<f32>),
    F16(ImageFeed<f16>),
    Bf16(ImageFeed<bf16>),
    U8(ImageFeed<u8>),
}

/// Calls `$body` with `$f` bound to the feed whatever its output type.
macro_rules! each {
    ($any:expr, $f:ident => $body:expr) => {
        match $any {
            Any::F32($f) => $body,
            Any::F16($f) => $body,
            Any::Bf16($f) => $body,
            Any::U8($f) => $body,
        }
    };
}

/// What one wait gave: a batch, the end of the epoch, or an error.
type Got = Option<pinstream::Result<(dlpack::Tensor, dlpack::Tensor)>>;

/// The native image feed: one per `(list, config)`; `pinstream.ImageFeed` builds a new one to
/// move to another position.
#[pyclass(name = "ImageFeed", module = "pinstream._native")]
pub(crate) struct PyImageFeed {
    /// `None` once closed.
    inner: Mutex<Option<Any>>,
    batches: usize,
    files: usize,
    decoding: &'static str,
    engines: u32,
    threads: usize,
    /// The process that made it: in a forked child its calls raise `ForkedError`.
    pid: u32,
}

impl PyImageFeed {
    fn check(&self, what: &str) -> PyResult<()> {
        if self.pid != crate::fork::pid() {
            return Err(crate::fork::forked(what, self.pid));
        }
        Ok(())
    }
}

impl Drop for PyImageFeed {
    fn drop(&mut self) {
        let inner = match self.inner.get_mut() {
            Ok(i) => i.take(),
            Err(p) => p.into_inner().take(),
        };
        if self.pid != crate::fork::pid() {
            // A forked child: the loader threads and the CUDA context are the parent's.
            std::mem::forget(inner);
        } else {
            drop(inner);
        }
    }
}

fn parse_pairs(items: Vec<(PathBuf, i64)>) -> PyResult<ImageList> {
    let mut pairs = Vec::new();
    pairs
        .try_reserve_exact(items.len())
        .map_err(|_| to_py(Error::invalid(OP, "too many items")))?;
    for (p, label) in items {
        let l = usize::try_from(label)
            .map_err(|_| invalid(OP, format!("{}: label {label} is negative", p.display())))?;
        pairs.push((p, l));
    }
    ImageList::from_pairs(pairs).py_err()
}

#[pymethods]
impl PyImageFeed {
    /// `root` (a folder of class folders) or `items` (`(path, label)` pairs); the rest as
    /// `pinstream.ImageFeed` documents it.
    #[new]
    #[pyo3(signature = (
        root, items, *, device, batch_size, train, size, resize, scale, ratio, flip,
        mean, std, dtype, layout, seed, shuffle, drop_last, decode, threads, depth,
        decodes_at_once, rank, world_size, bad_files, start_epoch, start_batch, cpus = None,
        cache_bytes = 0
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        root: Option<PathBuf>,
        items: Option<Vec<(PathBuf, i64)>>,
        device: i64,
        batch_size: usize,
        train: bool,
        size: (usize, usize),
        resize: usize,
        scale: (f64, f64),
        ratio: (f64, f64),
        flip: f64,
        mean: Vec<f32>,
        std: Vec<f32>,
        dtype: &str,
        layout: &str,
        seed: u64,
        shuffle: bool,
        drop_last: bool,
        decode: &str,
        threads: usize,
        depth: usize,
        decodes_at_once: usize,
        rank: usize,
        world_size: usize,
        bad_files: &str,
        start_epoch: u64,
        start_batch: usize,
        cpus: Option<Bound<'_, PyAny>>,
        cache_bytes: usize,
    ) -> PyResult<Self> {
        let layout = match layout {
            "NCHW" | "nchw" => Layout::Nchw,
            "NHWC" | "nhwc" => Layout::Nhwc,
            other => {
                return Err(invalid(
                    OP,
                    format!("layout {other:?}: \"NCHW\" or \"NHWC\""),
                ))
            }
        };
        let decoding = match decode {
            "auto" => Decoding::Auto,
            "gpu" => Decoding::Gpu,
            "cpu" => Decoding::Cpu,
            other => {
                return Err(invalid(
                    OP,
                    format!("decode={other:?}: \"auto\", \"gpu\" or \"cpu\""),
                ))
            }
        };
        let bad_files = match bad_files {
            "error" => BadFiles::Error,
            "skip" => BadFiles::Skip,
            other => {
                return Err(invalid(
                    OP,
                    format!("bad_files={other:?}: \"error\" or \"skip\""),
                ))
            }
        };
        let augment = if train {
            Augment::Train(RandomResizedCrop::new(scale, ratio, flip).py_err()?)
        } else {
            Augment::Val { resize }
        };
        let mut config = ImageFeedConfig {
            batch: batch_size,
            out: size,
            augment,
            norm: Normalize::new(&mean, &std),
            layout,
            seed,
            shuffle,
            rank,
            world: world_size,
            drop_last,
            bad_files,
            start: (start_epoch, start_batch),
            decoding,
            gpu_decodes_at_once: decodes_at_once,
            gpu_cache_bytes: cache_bytes,
            ..ImageFeedConfig::default()
        };
        config.prefetch.loader_threads = threads;
        config.prefetch.depth = depth;
        config.prefetch.cpus = crate::cpus::cpu_list(OP, cpus.as_ref())?;
        // Batches held by Python (a list of them) each keep a slot of the CPU path's
        // prefetcher: spares stand in for up to this many, as the GPU path makes new buffers.
        config.prefetch.export_spares = 1024;
        // Every setting is checked before the folder is walked and the device's context is
        // made (a bad one is an InvalidArgumentError on any machine, with or without a GPU),
        // `cpus` by binding this thread to them for a moment (the OS refuses a list with no
        // CPU it lets the process use).
        config.validate().py_err()?;
        if !matches!(dtype, "float32" | "float16" | "bfloat16" | "uint8") {
            return Err(invalid(
                OP,
                format!("dtype {dtype:?}: \"float32\", \"float16\", \"bfloat16\" or \"uint8\""),
            ));
        }
        device_ordinal(OP, device)?;
        if let Some(cpus) = &config.prefetch.cpus {
            drop(crate::cpus::bind(OP, cpus)?);
        }
        let list = match (root, items) {
            (Some(r), None) => py.detach(|| ImageList::folder(r)).py_err()?,
            (None, Some(items)) => parse_pairs(items)?,
            _ => {
                return Err(invalid(
                    OP,
                    "give a folder or (path, label) items, not both",
                ))
            }
        };
        let files = list.len();
        let c = ctx(py, device)?;
        let feed = py
            .detach(|| -> pinstream::Result<Any> {
                let s = &c.stream;
                Ok(match dtype {
                    "float32" => Any::F32(ImageFeed::new(s, list, config)?),
                    "float16" => Any::F16(ImageFeed::new(s, list, config)?),
                    "bfloat16" => Any::Bf16(ImageFeed::new(s, list, config)?),
                    "uint8" => Any::U8(ImageFeed::new(s, list, config)?),
                    other => {
                        return Err(Error::invalid(
                            OP,
                            format!(
                            "dtype {other:?}: \"float32\", \"float16\", \"bfloat16\" or \"uint8\""
                        ),
                        ))
                    }
                })
            })
            .py_err()?;
        let (batches, decoding, engines, threads) = each!(&feed, f => (
            f.batches_per_epoch(),
            match f.decoding() {
                Decoding::Gpu => "gpu",
                _ => "cpu",
            },
            f.hardware_engines(),
            f.loader_threads(),
        ));
        Ok(PyImageFeed {
            inner: Mutex::new(Some(feed)),
            batches,
            files,
            decoding,
            engines,
            threads,
            pid: crate::fork::pid(),
        })
    }

    /// The next batch of the epoch as `(pixels, labels)` DLPack tensors, or `None` at its end
    /// (the call after it starts the next epoch).
    fn next<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<Option<(Bound<'py, Tensor>, Bound<'py, Tensor>)>> {
        self.check("ImageFeed.next")?;
        // The lock is held for one slice at a time, so `close` from another thread gets it
        // within a slice; the GIL is released while waiting. Signals are checked once the
        // batch is ready but before it is taken: a Ctrl-C raises KeyboardInterrupt and leaves
        // the batch for the next call (only one arriving in the microseconds between taking
        // it and returning can still cost it).
        let mut wait = SLICE;
        let got: Got = loop {
            let polled = py.detach(|| -> Result<Option<Option<Got>>, Error> {
                let mut g = lock(&self.inner);
                let Some(feed) = g.as_mut() else {
                    return Err(Error::invalid(OP, "the feed was closed"));
                };
                Ok(each!(feed, f => {
                    // `wait` is zero right after a ready poll and a signal check: take it.
                    if f.poll(wait) {
                        if wait.is_zero() {
                            Some(Some(f.next().map(|r| r.and_then(|b| b.into_dlpack()))))
                        } else {
                            Some(None)
                        }
                    } else {
                        None
                    }
                }))
            });
            match polled.py_err()? {
                Some(Some(got)) => break got,
                // Ready: check for signals, then take it without waiting.
                Some(None) => {
                    py.check_signals()?;
                    wait = Duration::ZERO;
                }
                None => {
                    py.check_signals()?;
                    wait = SLICE;
                }
            }
        };
        match got {
            None => Ok(None),
            Some(Err(e)) => Err(to_py(e)),
            Some(Ok((px, lb))) => Ok(Some((
                Bound::new(py, Tensor::new(px))?,
                Bound::new(py, Tensor::new(lb))?,
            ))),
        }
    }

    /// `(epoch, batch)` of the next batch.
    fn position(&self) -> PyResult<(u64, usize)> {
        self.check("ImageFeed.position")?;
        let g = lock(&self.inner);
        let f = g
            .as_ref()
            .ok_or_else(|| invalid(OP, "the feed was closed"))?;
        Ok(each!(f, f => f.position()))
    }

    /// Batches in one epoch of this rank.
    #[getter]
    fn batches_per_epoch(&self) -> usize {
        self.batches
    }

    /// Files in the list (all ranks).
    #[getter]
    fn files(&self) -> usize {
        self.files
    }

    /// `"gpu"` (nvJPEG) or `"cpu"`.
    #[getter]
    fn decoding(&self) -> &'static str {
        self.decoding
    }

    /// The GPU's JPEG engines (0 when decoding on the CPU).
    #[getter]
    fn hardware_engines(&self) -> u32 {
        self.engines
    }

    /// The loader threads it runs (`threads=None`: 2 decoding on the GPU, 4 on the CPU).
    #[getter]
    fn threads(&self) -> usize {
        self.threads
    }

    /// Images decoded per route so far: `{"hardware", "cuda", "cpu"}`, and `skipped`: bad files
    /// left out (`bad_files="skip"`) with the first 16 `(path, why)`.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.check("ImageFeed.stats")?;
        let g = lock(&self.inner);
        let f = g
            .as_ref()
            .ok_or_else(|| invalid(OP, "the feed was closed"))?;
        let (routes, skipped, cache) = each!(f, f => (f.routes(), f.skipped(), f.gpu_cache()));
        let d = PyDict::new(py);
        d.set_item("hardware", routes.hardware)?;
        d.set_item("cuda", routes.cuda)?;
        d.set_item("cpu", routes.cpu)?;
        d.set_item("skipped", skipped.count)?;
        d.set_item("skipped_files", skipped.first)?;
        d.set_item("cache_budget", cache.budget)?;
        d.set_item("cache_used", cache.used)?;
        d.set_item("cache_images", cache.images)?;
        d.set_item("cache_hits", cache.hits)?;
        d.set_item("cache_failures", cache.failures)?;
        Ok(d)
    }

    /// Stops the loader threads (waiting for them, the GIL released); the tensors handed out
    /// stay valid. Later calls of `next` raise.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        self.check("ImageFeed.close")?;
        let taken = lock(&self.inner).take();
        py.detach(move || drop(taken));
        Ok(())
    }
}
