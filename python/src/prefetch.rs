//! `pinstream.Prefetcher`: a prefetcher over any Python iterable of CPU batches. The loader
//! threads take the items in turn (holding the GIL for `next()` and for taking the arrays); by
//! default each copies its item's pixels into page-locked memory in its turn, before the
//! iterable is asked for the next one (the GIL released for the copy: an iterable may refill
//! the array it yielded once it is asked again, as the iterator convention allows). With
//! `fresh` (a DataLoader with workers, whose every batch is a new shared-memory tensor) the
//! turn only takes hold of the array, and the copy runs after it ([`Source::iter_then`]), on
//! every loader thread at once, while the next item is pulled; page-locked arrays (a
//! `pin_memory` DataLoader's) are not copied but go to the device with one DMA
//! (`ForeignBytes::page_locked`). `zero_copy=True` hands the held array to the staging engine
//! instead. The engine uploads the
//! pixels, the fused kernel normalizes and casts them, and `__next__` hands out DLPack tensors
//! whose consumer stream waits for them on the GPU. `__next__` waits in slices, checking for
//! signals between them (Ctrl-C raises `KeyboardInterrupt` and leaves the prefetcher usable).
//! With `dry_run=True` the same loaders and pipeline run without a device (the CPU reference
//! normalizes; batches are numpy arrays), for testing an iterable where there is no GPU.

use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pinstream::dlpack::{self, Element};
use pinstream::kernels::{Layout, Normalize, OutputElement, Spec};
use pinstream::prefetch::{
    DryRun, ForeignBytes, HostBatch, HostBytes, LoadError, Pixels, PrefetchConfig, Prefetcher,
    Source,
};
use pinstream::{bf16, f16, Error, HostKind, PinnedPool};
use pyo3::exceptions::{PyKeyboardInterrupt, PyStopIteration, PySystemExit, PyTypeError};
use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyDict, PyList, PyTuple};
use pyo3::PyTraverseError;

use crate::context::{ctx, device_ordinal, existing_ctx, lock};
use crate::errors::{invalid, to_py, OrPy};
use crate::source::{self, Host};
use crate::tensor::{dtype_name, Tensor};

const OP: &str = "pinstream.prefetch";

/// What a batch index left behind on the Python side: the exception its pull raised (the
/// `__cause__` of the `LoaderError`), and the items passed through as they are.
#[derive(Default)]
struct Side {
    causes: HashMap<u64, Cause>,
    rest: HashMap<u64, Rest>,
}

/// How long `__next__` waits for a batch between two checks for signals (Ctrl-C).
const SLICE: Duration = Duration::from_millis(50);

/// Items whose arrays are held (exported) by a zero-copy prefetcher now, for `memory_stats`.
static HELD: AtomicUsize = AtomicUsize::new(0);
/// Native prefetchers alive now (their threads and memory), for `memory_stats`.
static LIVE: AtomicUsize = AtomicUsize::new(0);

/// An item's pixels held (a DLPack import or a buffer) after its turn. Letting them go runs
/// Python code (a buffer's release, a DLPack deleter, the array's finalizer: a ring slot's, a
/// user's) on whatever thread drops them: a loader after its copy or at the end of the
/// iteration, the feeder, the thread that closes. That code counts as the prefetcher's
/// iterable's (`PULLING`), so that a `next()` or `close()` of the prefetcher from there is
/// refused, and its last reference dropped there ends it on a thread of its own, rather than
/// waiting for the very thread it runs on.
struct Guarded {
    host: Option<Host>,
    /// The prefetcher's `Side` address, for `PULLING`.
    id: usize,
}

impl Guarded {
    fn host(&self) -> pinstream::Result<&Host> {
        self.host
            .as_ref()
            .ok_or_else(|| Error::invalid(OP, "the held pixels are gone"))
    }
}

impl Drop for Guarded {
    fn drop(&mut self) {
        let _pulling = Pulling::enter(self.id);
        drop(self.host.take());
    }
}

/// The pixels of one item, held until the upload has read them (`zero_copy=True`, and
/// page-locked arrays), counted in `HELD`.
struct Held(Guarded);

impl Held {
    fn new(g: Guarded) -> Held {
        HELD.fetch_add(1, Ordering::Relaxed);
        Held(g)
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        HELD.fetch_sub(1, Ordering::Relaxed);
    }
}

impl HostBytes for Held {
    fn bytes(&self) -> &[u8] {
        // Checked when the item was taken; an error here reads as no bytes (the batch's
        // length check then refuses it).
        self.0.host().and_then(Host::bytes).map_or(&[], |(b, _)| b)
    }
}

thread_local! {
    /// The prefetchers (the addresses of their `Side`s) whose iterable's code this thread runs
    /// now, innermost last: a loader in its turn, or Python code run where held pixels are let
    /// go (`Guarded`). More than one where they nest (one prefetcher's release running
    /// another's).
    static PULLING: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

/// Marks the current thread as running prefetcher `id`'s iterable's code while it lives.
struct Pulling(bool);

impl Pulling {
    fn enter(id: usize) -> Pulling {
        // `try_with`: not while the thread's locals are being destroyed (nothing to mark then).
        Pulling(PULLING.try_with(|p| p.borrow_mut().push(id)).is_ok())
    }
}

impl Drop for Pulling {
    fn drop(&mut self) {
        if self.0 {
            let _ = PULLING.try_with(|p| p.borrow_mut().pop());
        }
    }
}

/// Whether this thread runs prefetcher `id`'s iterable's code (one of its loaders in its turn,
/// or a release of its held pixels), at any depth: there, `__next__` and `close` would wait
/// for the loaders, this one included (a deadlock), and the last reference's drop would join
/// this thread from itself.
fn pulling(id: usize) -> bool {
    PULLING
        .try_with(|p| p.borrow().contains(&id))
        .unwrap_or(false)
}

/// The iterable, held once for the prefetcher (so that the garbage collector sees the one
/// reference, through `PyPrefetcher::__traverse__`); `None` once cleared.
type Iterable = Arc<Mutex<Option<Py<PyAny>>>>;

/// Where an item's pixels go during its turn.
enum Take {
    /// Copied into a block of the device's page-locked pool, on the pulling thread, before the
    /// iterable is asked for its next item (the default).
    Pinned(PinnedPool),
    /// Copied into ordinary memory (the dry run, which has no device).
    Host,
    /// Held, and taken after the turn ([`finish`]): copied on the loader thread while the
    /// next item is pulled (`fresh`), or read by the upload (`zero_copy`).
    Held,
}

/// How the images and labels of a mapping item (a dict, or a dict-like batch) are found.
#[derive(Clone, Debug, Default)]
pub(crate) struct Keys {
    /// `(images, labels)` as given by `keys=`; `None`: the first of [`IMAGE_KEYS`] and of
    /// [`LABEL_KEYS`] that the item has.
    given: Option<(String, Option<String>)>,
}

/// The keys tried, in order, for a mapping's images when `keys=` is not given.
const IMAGE_KEYS: [&str; 7] = [
    "image",
    "images",
    "pixel_values",
    "pixels",
    "img",
    "input",
    "x",
];
/// Likewise for its labels (none found: the batch has no labels).
const LABEL_KEYS: [&str; 5] = ["label", "labels", "target", "targets", "y"];

/// What a mapping entry becomes in the batch handed out.
enum Entry {
    Images,
    Labels,
    Value(Py<PyAny>),
}

/// The parts of an item that are passed through, to be put around the device tensors in
/// `__next__`.
enum Rest {
    /// A tuple or list item's parts after the images and labels.
    Tuple(Vec<Py<PyAny>>),
    /// A mapping item's entries in order, the images' and labels' places marked.
    Dict(Vec<(Py<PyAny>, Entry)>),
}

/// Why a batch failed, for the `LoaderError`'s `__cause__`.
enum Cause {
    /// The exception the pull raised (the iterable's, or a check's).
    Py(PyErr),
    /// The library's error while taking the pixels after the turn (converted in `__next__`).
    Lib(Error),
}

/// Counters of the loader side, for `Prefetcher.stats()`.
#[derive(Default)]
struct Stats {
    /// Items pulled.
    items: AtomicU64,
    /// Time in the turns, holding the GIL (the iterable's `__next__`, the checks, taking
    /// the arrays; with the default pull, the copy too, without the GIL), and waiting for it.
    pull_ns: AtomicU64,
    gil_wait_ns: AtomicU64,
    /// Time taking the pixels after the turns (`fresh`: the copies, on every loader at once).
    after_ns: AtomicU64,
    /// Host copies of pixels pinstream made: during the turn, after it.
    copied_in_turn: AtomicU64,
    copied_after: AtomicU64,
    /// Page-locked arrays (a `pin_memory` DataLoader's) handed to the upload for one DMA each.
    direct: AtomicU64,
    /// Arrays held for the staging engine to copy at upload (`zero_copy=True`).
    staged: AtomicU64,
}

fn add_ns(a: &AtomicU64, since: Instant) {
    let ns = u64::try_from(since.elapsed().as_nanos()).unwrap_or(u64::MAX);
    a.fetch_add(ns, Ordering::Relaxed);
}

/// An item taken in its turn: its spec and labels, and its pixels, copied already or held for
/// after the turn.
struct Pulled {
    pixels: Taken,
    spec: Spec,
    extras: Vec<i64>,
}

enum Taken {
    /// Copied during the turn.
    Copied(Pixels),
    /// The array itself, held (copied, or handed to the upload, after the turn).
    Held(Guarded),
}

/// The iterator the loader threads take turns on: each `next` attaches to Python, pulls one
/// item and takes its arrays; `finish` makes the item a batch after the turn.
struct Items {
    it: Iterable,
    /// The prefetcher's `Side` address, for `PULLING`.
    id: usize,
    index: u64,
    done: bool,
    /// Per-channel mean and std (the input's scale); `None`: a plain cast.
    norm: Option<(Vec<f32>, Vec<f32>)>,
    in_layout: Layout,
    out_layout: Layout,
    keys: Keys,
    side: Arc<Mutex<Side>>,
    stats: Arc<Stats>,
    take: Take,
}

impl Items {
    fn pull(&self, py: Python<'_>, i: u64) -> PyResult<Option<Pulled>> {
        let _pulling = Pulling::enter(self.id);
        // A reference of our own for the call (the GC sees it as one from outside, which keeps
        // the iterable alive meanwhile); the iterable is gone once the prefetcher was cleared.
        let Some(it) = lock(&self.it).as_ref().map(|it| it.clone_ref(py)) else {
            return Ok(None);
        };
        let item = match it.bind(py).call_method0("__next__") {
            Ok(x) => x,
            Err(e) if e.is_instance_of::<PyStopIteration>(py) => return Ok(None),
            Err(e) => return Err(e),
        };
        let (px, labels, rest) = self.split(py, i, &item)?;
        let host = source::host(OP, &px)?;
        if host.dtype != source::BYTE {
            return Err(invalid(
                OP,
                format!(
                    "batch {i}: the pixels are {}, the prefetcher takes uint8 images",
                    dtype_name(host.dtype)
                ),
            ));
        }
        let [n, a, b, c] = host.shape[..] else {
            return Err(invalid(
                OP,
                format!(
                    "batch {i}: the pixels have shape {:?}, not 4-D ({})",
                    host.shape,
                    match self.in_layout {
                        Layout::Nchw => "N, C, H, W",
                        Layout::Nhwc => "N, H, W, C",
                    }
                ),
            ));
        };
        let (ch, h, w) = match self.in_layout {
            Layout::Nchw => (a, b, c),
            Layout::Nhwc => (c, a, b),
        };
        // Everything sized from the shape is checked before anything is allocated from it.
        let len = host.bytes().map_err(to_py)?.0.len();
        check_shape(i, [n, ch, h, w], &host.shape, len, self.norm.as_ref())?;
        let norm = match &self.norm {
            Some((m, s)) => Normalize::new(m, s),
            None => Normalize::new(&[0.0; 4][..ch], &[1.0; 4][..ch]),
        };
        let spec = Spec::uniform(n, ch, h, w, norm)
            .map_err(to_py)?
            .layouts(self.in_layout, self.out_layout);
        let extras = match labels {
            Some(l) => labels_of(i, n, &l)?,
            None => Vec::new(),
        };
        let pixels = self.take_pixels(py, i, host)?;
        let keep = match &rest {
            Rest::Tuple(v) => !v.is_empty(),
            Rest::Dict(_) => true,
        };
        if keep {
            lock(&self.side).rest.insert(i, rest);
        }
        Ok(Some(Pulled {
            pixels,
            spec,
            extras,
        }))
    }

    /// An item's images, labels (if any) and the rest: `images`, `(images, labels, *rest)`
    /// (a tuple or a list), or a mapping (a dict, or a dict-like batch) whose images and labels
    /// are named by `keys=` or found under the usual names.
    #[allow(clippy::type_complexity)]
    fn split<'py>(
        &self,
        py: Python<'py>,
        i: u64,
        item: &Bound<'py, PyAny>,
    ) -> PyResult<(Bound<'py, PyAny>, Option<Bound<'py, PyAny>>, Rest)> {
        if item.is_instance_of::<PyTuple>() || item.is_instance_of::<PyList>() {
            let mut parts = item.try_iter()?;
            let px = parts
                .next()
                .transpose()?
                .ok_or_else(|| invalid(OP, format!("batch {i} is an empty tuple")))?;
            let labels = parts.next().transpose()?;
            let rest = parts
                .map(|p| p.map(Bound::unbind))
                .collect::<PyResult<_>>()?;
            return Ok((px, labels, Rest::Tuple(rest)));
        }
        if !is_mapping(py, item)? {
            return Ok((item.clone(), None, Rest::Tuple(Vec::new())));
        }
        let has = |k: &str| item.contains(k).unwrap_or(false);
        let (image_key, label_key) = match &self.keys.given {
            Some((im, lab)) => {
                let missing = |k: &str| {
                    invalid(
                        OP,
                        format!("batch {i}: the mapping has no key {k:?} (keys=)"),
                    )
                };
                if !has(im) {
                    return Err(missing(im));
                }
                if let Some(l) = lab.as_deref().filter(|l| !has(l)) {
                    return Err(missing(l));
                }
                (im.clone(), lab.clone())
            }
            None => {
                let Some(im) = IMAGE_KEYS.iter().find(|k| has(k)) else {
                    return Err(invalid(
                        OP,
                        format!(
                            "batch {i} is a mapping without any of the keys {IMAGE_KEYS:?} for \
                             its images: name them with keys=(images, labels)"
                        ),
                    ));
                };
                let lab = LABEL_KEYS.iter().find(|k| has(k)).map(|k| k.to_string());
                (im.to_string(), lab)
            }
        };
        let px = item.get_item(&image_key)?;
        let labels = label_key.as_deref().map(|k| item.get_item(k)).transpose()?;
        let mut entries = Vec::new();
        for k in item.try_iter()? {
            let k = k?;
            let entry = match k.extract::<String>() {
                Ok(s) if s == image_key => Entry::Images,
                Ok(s) if Some(s.as_str()) == label_key.as_deref() => Entry::Labels,
                _ => Entry::Value(item.get_item(&k)?.unbind()),
            };
            entries.push((k.unbind(), entry));
        }
        Ok((px, labels, Rest::Dict(entries)))
    }

    /// The item's pixels copied now, during the turn (the iterable may refill its array once
    /// it is asked for the next item, which happens only after this returns), or held for
    /// after it (`fresh`, `zero_copy`). The copy runs without the GIL.
    fn take_pixels(&self, py: Python<'_>, i: u64, host: Host) -> PyResult<Taken> {
        let failed = |e: String| invalid(OP, format!("batch {i}: {e}"));
        if !matches!(self.take, Take::Held) {
            self.stats.copied_in_turn.fetch_add(1, Ordering::Relaxed);
        }
        let px = match &self.take {
            Take::Held => {
                return Ok(Taken::Held(Guarded {
                    host: Some(host),
                    id: self.id,
                }))
            }
            Take::Pinned(pool) => {
                let block = py.detach(|| -> pinstream::Result<_> {
                    let src = host.bytes()?.0;
                    let mut block = pool.alloc::<u8>(src.len())?;
                    copy_pixels(block.as_mut_slice()?, src, true)?;
                    Ok(block)
                });
                // The export ends here, with the GIL held.
                drop(host);
                Pixels::Pinned(block.map_err(to_py)?)
            }
            Take::Host => {
                let v = py.detach(|| -> Result<Vec<u8>, String> {
                    let src = host.bytes().map_err(|e| e.to_string())?.0;
                    let mut v = Vec::new();
                    v.try_reserve_exact(src.len())
                        .map_err(|e| format!("cannot copy {} bytes: {e}", src.len()))?;
                    v.extend_from_slice(src);
                    Ok(v)
                });
                drop(host);
                Pixels::Pageable(v.map_err(failed)?)
            }
        };
        Ok(Taken::Copied(px))
    }
}

/// Whether `x` is a mapping: a dict, or an instance of `collections.abc.Mapping`.
fn is_mapping(py: Python<'_>, x: &Bound<'_, PyAny>) -> PyResult<bool> {
    if x.is_instance_of::<PyDict>() {
        return Ok(true);
    }
    // Arrays and tensors are the usual items: not asked about (no import on that path).
    if x.hasattr("__dlpack__")? || x.hasattr("__array_interface__")? {
        return Ok(false);
    }
    let abc = py.import("collections.abc")?;
    x.is_instance(&abc.getattr("Mapping")?)
}

/// Makes the item taken in turn `i` a batch, on the loader thread after the turn (the next
/// turn runs meanwhile). Held pixels are copied into the batch's page-locked block (into
/// ordinary memory in the dry run), without the GIL; held page-locked ones (a `pin_memory`
/// DataLoader's) go to the upload as they are, for one DMA.
fn finish(
    i: u64,
    item: Pulled,
    batch: &mut HostBatch<i64>,
    take: &AfterTake,
) -> Result<(), LoadError> {
    let Pulled {
        pixels,
        spec,
        extras,
    } = item;
    batch.spec = spec;
    batch.resize = None;
    batch.extras = extras;
    let host = match pixels {
        Taken::Copied(px) => {
            batch.pixels = px;
            return Ok(());
        }
        Taken::Held(host) => host,
    };
    let t0 = Instant::now();
    let result = take_after(i, host, batch, take);
    add_ns(&take.stats.after_ns, t0);
    result.map_err(|e| {
        let message = e.to_string();
        lock(&take.side).causes.insert(i, Cause::Lib(e));
        message.into()
    })
}

/// What `finish` needs of the prefetcher.
struct AfterTake {
    /// Hold pageable arrays for the staging engine (`zero_copy=True`) instead of copying them.
    zero_copy: bool,
    /// Every item's pixels are a view of a slot of `process=True`'s ring, page-locked while
    /// the view lives and written again only once it is gone: handed to the upload for one
    /// DMA (where the runtime confirms the ring is page-locked).
    ring: bool,
    /// A device to DMA page-locked arrays to (not in the dry run).
    device: bool,
    side: Arc<Mutex<Side>>,
    stats: Arc<Stats>,
}

/// Copies a batch's pixels into its block. For a block a DMA reads next (`for_dma`) with
/// streaming stores, which skip reading each destination line first (BENCHMARKS.md,
/// 2026-11-27 fifth session: 1.7–2.5 ms per DataLoader batch against 2.9), up to the staging
/// engine's `streaming_max_bytes` (the same measured limit, and the same
/// `PINSTREAM_STAGING_STREAMING_MAX`; 0 turns them off); a plain copy above it, and where the
/// CPU reads the copy next (the dry run). `Err` where the lengths differ.
fn copy_pixels(dst: &mut [u8], src: &[u8], for_dma: bool) -> pinstream::Result<()> {
    static MAX: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let max = *MAX.get_or_init(|| {
        pinstream::staging::StagerConfig::from_env()
            .unwrap_or_default()
            .streaming_max_bytes
    });
    if for_dma && src.len() <= max {
        return pinstream::staging::copy_streaming(dst, src);
    }
    if dst.len() != src.len() {
        return Err(pinstream::Error::invalid(
            OP,
            format!(
                "a batch of {} bytes does not fit its {}-byte block",
                src.len(),
                dst.len()
            ),
        ));
    }
    dst.copy_from_slice(src);
    Ok(())
}

fn take_after(
    i: u64,
    host: Guarded,
    batch: &mut HostBatch<i64>,
    take: &AfterTake,
) -> pinstream::Result<()> {
    let (len, kind) = host.host()?.bytes().map(|(b, k)| (b.len(), k))?;
    if take.device && (take.ring || kind != HostKind::Pageable) {
        take.stats.direct.fetch_add(1, Ordering::Relaxed);
        // SAFETY: nothing writes the bytes while `Held` lives, and they stay allocated:
        // - a page-locked DLPack import (a buffer is always taken as pageable): one tensor, in
        //   one allocation of its producer, page-locked as the runtime said (checked again at
        //   both ends before the DMA), kept allocated by the import; the iterable yields a new
        //   array for every item (`fresh` or `zero_copy`, the caller's promise; a DataLoader's
        //   batches);
        // - the view of a ring slot (`process=True`): the ring stays mapped and registered
        //   while the view lives (its finalizer holds the registration), and the helper
        //   writes the slot again only once the view is gone, which `Held` delays until the
        //   drop has waited for the DMA.
        // Where the runtime does not confirm that both ends are page-locked, the upload
        // stages the bytes instead.
        batch.pixels = Pixels::Foreign(unsafe { ForeignBytes::page_locked(Held::new(host)) });
        return Ok(());
    }
    if take.zero_copy {
        take.stats.staged.fetch_add(1, Ordering::Relaxed);
        batch.pixels = Pixels::Foreign(ForeignBytes::new(Held::new(host)));
        return Ok(());
    }
    let dst = batch.pinned(len).map_err(|e| Error::Loader {
        batch: i,
        message: e.to_string(),
    })?;
    // The dry run's CPU reference reads the copy next; otherwise the DMA does.
    copy_pixels(dst, host.host()?.bytes()?.0, take.device)?;
    take.stats.copied_after.fetch_add(1, Ordering::Relaxed);
    // The export ends here, on this thread, without the GIL: a DLPack producer's deleter takes
    // it where it needs it, and the memory (a worker's shared memory) is unmapped here, not on
    // the thread that pulls.
    drop(host);
    Ok(())
}

/// The checks on a batch's shape that need no allocation: 1 to 4 channels (as many as the
/// mean and std give, where they are given), no empty dimension, a size the kernels take,
/// and as many bytes as the shape says. `dims` is `[n, c, h, w]`.
fn check_shape(
    i: u64,
    dims: [usize; 4],
    shape: &[usize],
    len: usize,
    norm: Option<&(Vec<f32>, Vec<f32>)>,
) -> PyResult<()> {
    let [n, ch, h, w] = dims;
    let bad = |why: String| {
        Err(invalid(
            OP,
            format!("batch {i}: the pixels have shape {shape:?}: {why}"),
        ))
    };
    if dims.contains(&0) {
        return bad("a batch needs at least one image of at least one pixel".into());
    }
    if !(1..=4).contains(&ch) {
        return bad(format!("{ch} channels (1 to 4 are supported)"));
    }
    if let Some((m, _)) = norm {
        if m.len() != ch {
            return bad(format!(
                "{ch} channels, and normalize= gave {} means",
                m.len()
            ));
        }
    }
    let limit = i32::MAX as usize;
    if n > limit || h > limit || w > limit || h.saturating_mul(w) > u32::MAX as usize {
        return bad("too large for the kernels".into());
    }
    let total = [n, ch, h, w]
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d));
    if total != Some(len) {
        return bad(format!("{len} bytes"));
    }
    Ok(())
}

/// A batch's labels: any integer array (or sequence of ints) of `n` values, as int64.
fn labels_of(i: u64, n: usize, labels: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    let seq = if labels.hasattr("tolist")? {
        labels.call_method0("tolist")?
    } else {
        labels.clone()
    };
    let wrong = |got: &dyn std::fmt::Display| {
        invalid(OP, format!("batch {i}: {got} labels for {n} images"))
    };
    let not_ints = || {
        invalid(
            OP,
            format!("batch {i}: the labels are not a flat sequence of integers"),
        )
    };
    // A length that is known and wrong is refused before anything is allocated; otherwise at
    // most `n` labels are collected (`n` is tied to the pixel bytes already checked), never as
    // many as the sequence's own `len()` claims.
    if let Ok(len) = seq.len() {
        if len != n {
            return Err(wrong(&len));
        }
    }
    let mut v: Vec<i64> = Vec::new();
    v.try_reserve_exact(n)
        .map_err(|_| invalid(OP, format!("batch {i}: no memory for {n} labels")))?;
    for (k, x) in seq.try_iter().map_err(|_| not_ints())?.enumerate() {
        if k >= n {
            return Err(wrong(&format!("more than {n}")));
        }
        v.push(x?.extract::<i64>().map_err(|_| not_ints())?);
    }
    if v.len() != n {
        return Err(wrong(&v.len()));
    }
    Ok(v)
}

impl Iterator for Items {
    type Item = Result<Pulled, LoadError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        let i = self.index;
        self.index += 1;
        let asked = Instant::now();
        Python::attach(|py| {
            add_ns(&self.stats.gil_wait_ns, asked);
            let t0 = Instant::now();
            let pulled = self.pull(py, i);
            add_ns(&self.stats.pull_ns, t0);
            match pulled {
                Ok(Some(b)) => {
                    self.stats.items.fetch_add(1, Ordering::Relaxed);
                    Some(Ok(b))
                }
                Ok(None) => {
                    self.done = true;
                    None
                }
                Err(e) => {
                    // The error's `__str__` is the iterable's code too: a `next()` or `close()`
                    // of this prefetcher from there is refused as from `__next__`, not waited for.
                    let message = {
                        let _pulling = Pulling::enter(self.id);
                        describe(py, &e)
                    };
                    lock(&self.side).causes.insert(i, Cause::Py(e));
                    self.done = true;
                    Some(Err(message.into()))
                }
            }
        })
    }
}

/// `TypeName: message` of a Python exception.
fn describe(py: Python<'_>, e: &PyErr) -> String {
    let name = e
        .get_type(py)
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "Exception".into());
    format!("{name}: {}", e.value(py))
}

/// One prefetcher of each output type, on the device or as a dry run.
enum Kind {
    F32(Prefetcher<f32, i64>),
    F16(Prefetcher<f16, i64>),
    Bf16(Prefetcher<bf16, i64>),
    U8(Prefetcher<u8, i64>),
    DryF32(DryRun<f32, i64>),
    DryF16(DryRun<f16, i64>),
    DryBf16(DryRun<bf16, i64>),
    DryU8(DryRun<u8, i64>),
}

/// A running prefetcher, counted in `LIVE` while it lives.
struct Inner(Kind);

impl Inner {
    fn new(k: Kind) -> Inner {
        LIVE.fetch_add(1, Ordering::Relaxed);
        Inner(k)
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        LIVE.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A batch: DLPack tensors on the device, or a dry run's host arrays.
enum Out {
    Device(dlpack::Tensor, dlpack::Tensor),
    Host {
        pixels: Vec<u8>,
        /// numpy's name of the element type (bfloat16 as its bits, `uint16`).
        dtype: &'static str,
        shape: Vec<usize>,
        extras: Vec<i64>,
    },
}

type Next = Option<pinstream::Result<(u64, Out)>>;

fn next_of<O: OutputElement + Element>(p: &mut Prefetcher<O, i64>) -> Next {
    p.next().map(|r| {
        r.and_then(|b| {
            let i = b.index();
            b.into_dlpack().map(|(px, ex)| (i, Out::Device(px, ex)))
        })
    })
}

fn dry_next_of<O: OutputElement + bytemuck::Pod>(
    p: &mut DryRun<O, i64>,
    dtype: &'static str,
) -> Next {
    p.next().map(|r| {
        r.map(|b| {
            let pixels: Vec<u8> = bytemuck::cast_slice(b.pixels()).to_vec();
            let n = b.pixels().len();
            let shape = match (b.dims(), b.spec().map(|s| s.out_layout)) {
                (Some([n, c, h, w]), Some(Layout::Nhwc)) => vec![n, h, w, c],
                (Some(d), _) => d.to_vec(),
                (None, _) => vec![n],
            };
            let shape = if shape.iter().product::<usize>() == n {
                shape
            } else {
                vec![n]
            };
            let out = Out::Host {
                pixels,
                dtype,
                shape,
                extras: b.extras().to_vec(),
            };
            (b.index(), out)
        })
    })
}

impl Inner {
    fn next(&mut self) -> Next {
        match &mut self.0 {
            Kind::F32(p) => next_of(p),
            Kind::F16(p) => next_of(p),
            Kind::Bf16(p) => next_of(p),
            Kind::U8(p) => next_of(p),
            Kind::DryF32(p) => dry_next_of(p, "float32"),
            Kind::DryF16(p) => dry_next_of(p, "float16"),
            Kind::DryBf16(p) => dry_next_of(p, "uint16"),
            Kind::DryU8(p) => dry_next_of(p, "uint8"),
        }
    }

    /// Whether `next` returns at once with what has arrived, without waiting to find out.
    fn ready(&mut self) -> bool {
        match &mut self.0 {
            Kind::F32(p) => p.ready(),
            Kind::F16(p) => p.ready(),
            Kind::Bf16(p) => p.ready(),
            Kind::U8(p) => p.ready(),
            Kind::DryF32(p) => p.ready(),
            Kind::DryF16(p) => p.ready(),
            Kind::DryBf16(p) => p.ready(),
            Kind::DryU8(p) => p.ready(),
        }
    }

    /// Waits up to `d` for `next` to have something to return at once.
    fn poll(&mut self, d: Duration) -> bool {
        match &mut self.0 {
            Kind::F32(p) => p.poll(d),
            Kind::F16(p) => p.poll(d),
            Kind::Bf16(p) => p.poll(d),
            Kind::U8(p) => p.poll(d),
            Kind::DryF32(p) => p.poll(d),
            Kind::DryF16(p) => p.poll(d),
            Kind::DryBf16(p) => p.poll(d),
            Kind::DryU8(p) => p.poll(d),
        }
    }
}

/// An iterator of prefetched batches: `(pixels, labels, *rest)` where the item had labels,
/// else `pixels`, each a `pinstream.Tensor` on the device (`rest`: the item's further parts,
/// passed through as they were). Close it (or leave a `with` block, or drop it) to stop the
/// threads early; the exception an item raised comes out as a `LoaderError` (its `batch`,
/// the original as `__cause__`), and the iteration ends there.
#[pyclass(module = "pinstream", name = "Prefetcher", weakref)]
pub(crate) struct PyPrefetcher {
    inner: Mutex<Option<Inner>>,
    side: Arc<Mutex<Side>>,
    labels: Mutex<Option<bool>>,
    iterable: Iterable,
    stats: Arc<Stats>,
    /// `fresh`, as chosen (`Prefetcher.stats()` says it).
    fresh: bool,
    /// The process that made it (`fork`): in a forked child, whose copy of it has no threads,
    /// `__next__` raises `ForkedError` and closing or dropping it leaks it.
    pid: u32,
    /// Called once (with no arguments) when it is closed, dropped or cleared, before its
    /// threads are joined: the Python side's `process=True` helper stops there, so that a
    /// loader waiting for it wakes.
    on_close: Mutex<Option<Py<PyAny>>>,
}

impl PyPrefetcher {
    /// The id its loaders mark themselves with while they pull (`PULLING`).
    fn id(&self) -> usize {
        Arc::as_ptr(&self.side) as usize
    }

    /// Whether this is a forked child's copy.
    fn forked(&self) -> bool {
        self.pid != crate::fork::pid()
    }

    /// In a forked child: forgets the parent's prefetcher without waiting for its lock, which
    /// a parent thread may have held at the fork (a `__next__` waiting in a slice) and which no
    /// thread of the child will ever unlock. If it is held, the drop forgets it (`get_mut`).
    fn forget_in_child(&self) {
        if let Ok(mut g) = self.inner.try_lock() {
            std::mem::forget(g.take());
        }
    }

    fn close_inner(&self, py: Python<'_>, what: &str) -> PyResult<()> {
        if self.forked() {
            // Its threads and CUDA work are the parent's: nothing to stop or wait for here.
            self.forget_in_child();
            return Ok(());
        }
        if pulling(self.id()) {
            return Err(reentered(what));
        }
        // A Ctrl-C during the hook is raised once the close is done.
        let interrupted = self.call_on_close(py);
        // The lock is taken without the GIL: a `__next__` on another thread holds it while it
        // waits for a batch, which the loader threads pull with the GIL.
        let p = py.detach(|| lock(&self.inner).take());
        // The loader threads may be waiting for the GIL: drop them without it.
        py.detach(move || drop(p));
        // Nothing pulls from the iterable any more: let it go now, not with the prefetcher
        // (`process=True`'s ring and pipes go with it).
        let it = lock(&self.iterable).take();
        drop(it);
        match interrupted {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl PyPrefetcher {
    /// Calls `on_close` once, from a drop or the garbage collector, where nothing can be
    /// raised: what it raises is reported as unraisable, and the close goes on; a Ctrl-C
    /// (`KeyboardInterrupt`) is returned instead, for [`interrupt_later`] once the rest of the
    /// drop has run. An exception already set (a drop while one propagates: the `for` loop's
    /// body raised) is kept aside meanwhile and set again after, as it was.
    fn run_on_close(&self, py: Python<'_>) -> Option<PyErr> {
        let pending = PyErr::take(py);
        let kept = match self.call_on_close(py) {
            Some(e) if e.is_instance_of::<PyKeyboardInterrupt>(py) => Some(e),
            Some(e) => {
                e.write_unraisable(py, None);
                None
            }
            None => None,
        };
        if let Some(e) = pending {
            e.restore(py);
        }
        kept
    }

    /// Calls `on_close` once. What it raises is reported as unraisable (the close goes on),
    /// except a `KeyboardInterrupt` or `SystemExit`, which is returned: `close()` raises it
    /// once the close is done.
    fn call_on_close(&self, py: Python<'_>) -> Option<PyErr> {
        let hook = lock(&self.on_close).take()?;
        match hook.call0(py) {
            Ok(_) => None,
            Err(e)
                if e.is_instance_of::<PyKeyboardInterrupt>(py)
                    || e.is_instance_of::<PySystemExit>(py) =>
            {
                Some(e)
            }
            Err(e) => {
                e.write_unraisable(py, Some(hook.bind(py)));
                None
            }
        }
    }
}

/// Refuses a call of a prefetcher from its own iterable (it would wait for itself).
fn reentered(what: &str) -> PyErr {
    invalid(
        OP,
        format!(
            "Prefetcher.{what} was called from the prefetcher's own iterable (on a loader \
             thread, which it would wait for): end the iterable with StopIteration instead"
        ),
    )
}

/// Whether the current thread is one of the library's (a loader or feeder, of this prefetcher or
/// another): a prefetcher dropped there may be joining the thread it runs on.
fn library_thread() -> bool {
    std::thread::current()
        .name()
        .is_some_and(|n| n.starts_with("pinstream-"))
}

/// Drops a prefetcher: without the GIL (its loader threads may wait for it), and on a thread of
/// its own when this thread is one of its loaders, or any thread of the library (whose drop
/// would join the thread it runs on). Leaked if no thread can be started there.
fn retire(p: Option<Inner>, own_loader: bool) {
    if p.is_none() {
        return;
    }
    if own_loader || library_thread() {
        let slot = Arc::new(Mutex::new(p));
        let theirs = slot.clone();
        let spawned = std::thread::Builder::new()
            .name("pinstream-close".into())
            .spawn(move || drop(lock(&theirs).take()));
        if spawned.is_err() {
            std::mem::forget(lock(&slot).take());
        }
        return;
    }
    Python::attach(|py| py.detach(move || drop(p)));
}

impl Drop for PyPrefetcher {
    fn drop(&mut self) {
        if self.forked() {
            // `&mut self`: no lock needed (one held by a vanished parent thread included).
            let inner = match self.inner.get_mut() {
                Ok(i) => i.take(),
                Err(p) => p.into_inner().take(),
            };
            std::mem::forget(inner);
            return;
        }
        let own_loader = pulling(self.id());
        let interrupt = Python::attach(|py| self.run_on_close(py));
        let p = lock(&self.inner).take();
        retire(p, own_loader);
        // The iterable goes here, before a Ctrl-C of the hook is raised again: its own
        // clean-up (a DataLoader's workers ended, a generator's `finally`) runs whole.
        let it = lock(&self.iterable).take();
        Python::attach(|py| {
            drop(it);
            interrupt_later(py, interrupt);
        });
    }
}

/// Raises a Ctrl-C that a drop's `on_close` raised (and could not raise itself) again in the
/// main thread, as the signal would (`_thread.interrupt_main`), where SIGINT has a Python
/// handler; otherwise (ignored) it is reported as unraisable. Any exception already set is
/// kept aside meanwhile.
fn interrupt_later(py: Python<'_>, interrupt: Option<PyErr>) {
    let Some(e) = interrupt else {
        return;
    };
    let pending = PyErr::take(py);
    let handled = py
        .import("signal")
        .and_then(|m| m.call_method1("getsignal", (m.getattr("SIGINT")?,)))
        .is_ok_and(|h| h.is_callable());
    let raised = handled
        && py
            .import("_thread")
            .and_then(|t| t.call_method0("interrupt_main"))
            .is_ok();
    if !raised {
        e.write_unraisable(py, None);
    }
    if let Some(p) = pending {
        p.restore(py);
    }
}

#[pymethods]
impl PyPrefetcher {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        if self.forked() {
            return Err(crate::fork::forked("Prefetcher.__next__", self.pid));
        }
        if pulling(self.id()) {
            return Err(reentered("__next__"));
        }
        // A batch that has already arrived is taken with the GIL held. Letting the GIL go
        // here would hand it to a loader thread waiting for it, and taking it back would wait
        // for that thread's turn: 0.2-0.3 ms a batch beside a training loop, at the moment
        // its GPU has the least queued (BENCHMARKS.md, 2026-11-27, eighth session). Nothing
        // here waits: `try_lock` and `ready` only look, and a slot the export hands back to a
        // feeder that has stopped is dropped by the background reaper, not here.
        // A pending signal first (a flag test; Ctrl-C reaches a consumer written in C, such as
        // `list(p)`, whose loop never runs bytecode), before anything is taken.
        py.check_signals()?;
        let fast = match self.inner.try_lock() {
            Ok(mut g) => match g.as_mut() {
                None => Some(None),
                Some(p) => p.ready().then(|| p.next()),
            },
            Err(_) => None,
        };
        // Otherwise it waits in slices, the GIL released, and checks for signals between
        // them: Ctrl-C raises KeyboardInterrupt here and the batch still on its way comes with
        // the next call. The lock is held for one slice at a time, so `close` from another
        // thread gets it within a slice.
        let got = if let Some(got) = fast {
            got
        } else {
            loop {
                let polled = py.detach(|| {
                    let mut g = lock(&self.inner);
                    match g.as_mut() {
                        None => Some(None),
                        Some(p) => p.poll(SLICE).then(|| p.next()),
                    }
                });
                if let Some(got) = polled {
                    break got;
                }
                py.check_signals()?;
            }
        };
        let (i, out) = match got {
            None => {
                self.close_inner(py, "__next__")?;
                return Err(PyStopIteration::new_err(()));
            }
            Some(Err(e)) => {
                // Every slot lent out through DLPack and none released yet is not an end: the
                // prefetcher goes on once the consumer releases a batch, as its message says
                // (and as the Rust feed does). Any other error ends the iteration.
                let lent_out = matches!(
                    &e,
                    Error::InvalidArgument {
                        op: "Prefetcher::next",
                        ..
                    }
                );
                if !lent_out {
                    self.close_inner(py, "__next__")?;
                }
                let cause = match &e {
                    Error::Loader { batch, .. } => lock(&self.side).causes.remove(batch),
                    _ => None,
                };
                let err = to_py(e);
                let cause = cause.map(|c| match c {
                    Cause::Py(e) => e,
                    Cause::Lib(e) => to_py(e),
                });
                if let Some(c) = cause {
                    err.set_cause(py, Some(c));
                }
                return Err(err);
            }
            Some(Ok(b)) => b,
        };
        let rest = lock(&self.side).rest.remove(&i);
        let (pixels, labels, labelled) = match out {
            Out::Device(px, ex) => {
                let labelled = !ex.shape().contains(&0);
                let px = Bound::new(py, Tensor::new(px))?.into_any();
                (px, Bound::new(py, Tensor::new(ex))?.into_any(), labelled)
            }
            Out::Host {
                pixels,
                dtype,
                shape,
                extras,
            } => {
                let np = py.import("numpy")?;
                let px = np
                    .call_method1("frombuffer", (PyByteArray::new(py, &pixels), dtype))?
                    .call_method1("reshape", (shape,))?;
                let bytes: Vec<u8> = bytemuck::cast_slice(&extras).to_vec();
                let ex = np.call_method1("frombuffer", (PyByteArray::new(py, &bytes), "int64"))?;
                (px, ex, !extras.is_empty())
            }
        };
        let rest = match rest {
            Some(Rest::Dict(entries)) => {
                // The mapping as it came, the images and labels on the device in their places.
                let d = PyDict::new(py);
                for (k, e) in entries {
                    match e {
                        Entry::Images => d.set_item(k, &pixels)?,
                        Entry::Labels => d.set_item(k, &labels)?,
                        Entry::Value(v) => d.set_item(k, v)?,
                    }
                }
                return Ok(d.into_any());
            }
            Some(Rest::Tuple(v)) => v,
            None => Vec::new(),
        };
        let has_labels = *lock(&self.labels).get_or_insert(labelled);
        if !has_labels && rest.is_empty() {
            return Ok(pixels);
        }
        let mut out = vec![pixels];
        if has_labels {
            out.push(labels);
        }
        out.extend(rest.into_iter().map(|r| r.into_bound(py)));
        Ok(PyTuple::new(py, out)?.into_any())
    }

    /// Stops the threads and frees the slots (batches already handed out stay valid).
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        self.close_inner(py, "close")
    }

    /// What the loader threads did so far, for finding where a source's time goes: `items`
    /// pulled; `pull_seconds` in the turns (the iterable's `__next__` and the checks, with
    /// the GIL; with `fresh=False` the copies too) and `gil_wait_seconds` waiting for the GIL
    /// to start them; `after_seconds` taking the pixels after the turns (`fresh`: the copies,
    /// on every loader thread at once); host copies of the pixels into page-locked memory
    /// `copied_in_turn` and `copied_after`; page-locked arrays handed to the upload as they
    /// are, one DMA each, `direct`; arrays the staging engine copied at upload (`zero_copy`)
    /// `staged`; and `fresh`.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        let st = &self.stats;
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let secs = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64 * 1e-9;
        d.set_item("items", n(&st.items))?;
        d.set_item("pull_seconds", secs(&st.pull_ns))?;
        d.set_item("gil_wait_seconds", secs(&st.gil_wait_ns))?;
        d.set_item("after_seconds", secs(&st.after_ns))?;
        d.set_item("copied_in_turn", n(&st.copied_in_turn))?;
        d.set_item("copied_after", n(&st.copied_after))?;
        d.set_item("direct", n(&st.direct))?;
        d.set_item("staged", n(&st.staged))?;
        d.set_item("fresh", self.fresh)?;
        Ok(d)
    }

    /// The garbage collector's view: the iterable (which may refer back to the prefetcher).
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        // Never blocks: a loader holds the lock only to take a reference of its own.
        if let Ok(it) = self.iterable.try_lock() {
            if let Some(it) = it.as_ref() {
                visit.call(it)?;
            }
        }
        if let Ok(hook) = self.on_close.try_lock() {
            if let Some(hook) = hook.as_ref() {
                visit.call(hook)?;
            }
        }
        Ok(())
    }

    /// Breaks a cycle through the iterable: the iterable is let go and the prefetcher closed.
    fn __clear__(&self) {
        let it = lock(&self.iterable).take();
        drop(it);
        if self.forked() {
            self.forget_in_child();
            return;
        }
        let own_loader = pulling(self.id());
        let interrupt = Python::attach(|py| self.run_on_close(py));
        let p = lock(&self.inner).take();
        retire(p, own_loader);
        Python::attach(|py| interrupt_later(py, interrupt));
    }

    fn __enter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _t: Option<Bound<'_, PyAny>>,
        _v: Option<Bound<'_, PyAny>>,
        _tb: Option<Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        self.close_inner(py, "__exit__")?;
        Ok(false)
    }
}

fn layout(name: &str, what: &str) -> PyResult<Layout> {
    match name.to_ascii_lowercase().as_str() {
        "nchw" => Ok(Layout::Nchw),
        "nhwc" => Ok(Layout::Nhwc),
        other => Err(invalid(
            OP,
            format!("{what} {other:?}: \"nchw\" or \"nhwc\""),
        )),
    }
}

/// One float per channel (1 to 4 of them), read without trusting the object's `len()`.
fn per_channel(x: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<f32>> {
    let bad = || invalid(OP, format!("{what}: give 1 to 4 floats, one per channel"));
    let mut v = Vec::with_capacity(4);
    for item in x.try_iter().map_err(|_| bad())? {
        if v.len() == 4 {
            return Err(bad());
        }
        v.push(item?.extract::<f32>().map_err(|_| bad())?);
    }
    if v.is_empty() {
        return Err(bad());
    }
    Ok(v)
}

/// Whether `x` says it is iterable (`__iter__`, or the old sequence protocol's `__getitem__`);
/// what its attribute lookup raises (other than `AttributeError`) goes to the caller.
fn has_iter(x: &Bound<'_, PyAny>) -> PyResult<bool> {
    Ok(x.hasattr("__iter__")? || x.hasattr("__getitem__")?)
}

/// Makes a prefetcher over `iterable` (see `pinstream.prefetch`).
#[pyfunction]
#[pyo3(signature = (iterable, device = 0, depth = 2, mean = None, std = None, dtype = "float32",
                    layout_out = "nchw", layout_in = "nchw", loader_threads = 2,
                    zero_copy = false, dry_run = false, fresh = false, keys = None, cpus = None,
                    on_close = None, ring = false))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn prefetch(
    py: Python<'_>,
    iterable: &Bound<'_, PyAny>,
    device: i64,
    depth: usize,
    mean: Option<Bound<'_, PyAny>>,
    std: Option<Bound<'_, PyAny>>,
    dtype: &str,
    layout_out: &str,
    layout_in: &str,
    loader_threads: usize,
    zero_copy: bool,
    dry_run: bool,
    fresh: bool,
    keys: Option<(String, Option<String>)>,
    cpus: Option<Bound<'_, PyAny>>,
    on_close: Option<Py<PyAny>>,
    ring: bool,
) -> PyResult<PyPrefetcher> {
    let (in_layout, out_layout) = (
        layout(layout_in, "layout_in")?,
        layout(layout_out, "layout_out")?,
    );
    let (mean, std) = (
        mean.map(|m| per_channel(&m, "mean")).transpose()?,
        std.map(|s| per_channel(&s, "std")).transpose()?,
    );
    let norm = match (mean, std) {
        (Some(m), Some(s)) if m.len() == s.len() => Some((m, s)),
        (Some(m), Some(s)) => {
            return Err(invalid(
                OP,
                format!(
                    "{} means and {} stds: give one of each per channel",
                    m.len(),
                    s.len()
                ),
            ))
        }
        (None, None) => None,
        _ => return Err(invalid(OP, "give both mean and std, or neither")),
    };
    if !matches!(dtype, "float32" | "float16" | "bfloat16" | "uint8") {
        return Err(invalid(
            OP,
            format!("dtype {dtype:?}: float32, float16, bfloat16 or uint8"),
        ));
    }
    // Every setting is checked before `iter()` (where a DataLoader starts its workers); the
    // device's context is made after it (a machine without a GPU says so then).
    if !dry_run {
        device_ordinal(OP, device)?;
    }
    let config = PrefetchConfig {
        depth,
        loader_threads,
        cpus: crate::cpus::cpu_list(OP, cpus.as_ref())?,
        ..PrefetchConfig::default()
    };
    config.validate().py_err()?;
    let it = {
        // A DataLoader starts its worker processes (and its pin-memory thread) in `iter()`:
        // with `cpus` they start on those CPUs too, not on a pinned training thread's own.
        let _on = config
            .cpus
            .as_deref()
            .map(|c| crate::cpus::bind(OP, c))
            .transpose()?;
        // Not iterable is a TypeError of ours; whatever `__iter__` raises (Ctrl-C among it)
        // goes to the caller as it is.
        match iterable.try_iter() {
            Ok(it) => it,
            Err(e) if e.is_instance_of::<PyTypeError>(py) && !has_iter(iterable)? => {
                return Err(PyTypeError::new_err(
                    "pinstream.prefetch: the source is not iterable",
                ))
            }
            Err(e) => return Err(e),
        }
    };
    let c = if dry_run {
        None
    } else {
        Some(ctx(py, device)?)
    };
    let take = match (&c, zero_copy || fresh) {
        (_, true) => Take::Held,
        (Some(c), false) => Take::Pinned(c.pinned.clone()),
        (None, false) => Take::Host,
    };
    let side = Arc::new(Mutex::new(Side::default()));
    let stats = Arc::new(Stats::default());
    let iterable: Iterable = Arc::new(Mutex::new(Some(it.into_any().unbind())));
    let items = Items {
        it: iterable.clone(),
        id: Arc::as_ptr(&side) as usize,
        index: 0,
        done: false,
        norm,
        in_layout,
        out_layout,
        keys: Keys { given: keys },
        side: side.clone(),
        stats: stats.clone(),
        take,
    };
    let after = AfterTake {
        zero_copy,
        ring,
        device: c.is_some(),
        side: side.clone(),
        stats: stats.clone(),
    };
    let source = Source::iter_then(items, move |i, item, batch: &mut HostBatch<i64>| {
        finish(i, item, batch, &after)
    });
    let stream = c.map(|c| c.stream.clone());
    let dtype = dtype.to_string();
    let inner = py
        .detach(move || -> pinstream::Result<Kind> {
            Ok(match (dtype.as_str(), stream) {
                ("float32", Some(s)) => Kind::F32(Prefetcher::new(&s, source, config)?),
                ("float16", Some(s)) => Kind::F16(Prefetcher::new(&s, source, config)?),
                ("bfloat16", Some(s)) => Kind::Bf16(Prefetcher::new(&s, source, config)?),
                ("uint8", Some(s)) => Kind::U8(Prefetcher::new(&s, source, config)?),
                ("float32", None) => Kind::DryF32(DryRun::new(source, config)?),
                ("float16", None) => Kind::DryF16(DryRun::new(source, config)?),
                ("bfloat16", None) => Kind::DryBf16(DryRun::new(source, config)?),
                ("uint8", None) => Kind::DryU8(DryRun::new(source, config)?),
                (other, _) => {
                    return Err(Error::InvalidArgument {
                        op: OP,
                        reason: format!("dtype {other:?}: float32, float16, bfloat16 or uint8"),
                    })
                }
            })
        })
        .py_err()?;
    Ok(PyPrefetcher {
        inner: Mutex::new(Some(Inner::new(inner))),
        side,
        labels: Mutex::new(None),
        iterable,
        stats,
        fresh: fresh || zero_copy,
        pid: crate::fork::pid(),
        on_close: Mutex::new(on_close),
    })
}

/// What pinstream holds now: `prefetchers` (native prefetchers alive: their threads, slots and
/// pools), `held_arrays` (items of iterables a `zero_copy` prefetcher still holds exported),
/// and, for a device whose context exists, `pinned_in_use_bytes` and `pinned_cached_bytes`
/// (the page-locked pool behind downloads and prefetched pixels) and `device_reserved_bytes`
/// (pinstream's stream-ordered device pool: in use and cached; call `empty_cache` first to
/// see what is in use). Makes no context.
#[pyfunction]
#[pyo3(signature = (device = 0))]
pub(crate) fn memory_stats<'py>(py: Python<'py>, device: i64) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("prefetchers", LIVE.load(Ordering::Relaxed))?;
    d.set_item("held_arrays", HELD.load(Ordering::Relaxed))?;
    if let Some(c) = existing_ctx(device) {
        let p = c.pinned.stats();
        d.set_item("pinned_in_use_bytes", p.in_use_bytes)?;
        d.set_item("pinned_cached_bytes", p.cached_bytes)?;
        let reserved = py.detach(|| c.device.pool_reserved()).py_err()?;
        d.set_item("device_reserved_bytes", reserved)?;
    }
    Ok(d)
}
