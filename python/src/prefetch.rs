//! `pinstream.Prefetcher`: a prefetcher over any Python iterable of CPU batches. A loader
//! thread pulls the next items (holding the GIL only for `next()` and for taking the arrays
//! through DLPack, no copy), the staging engine uploads the pixels outside the GIL, the fused
//! kernel normalizes and casts them, and `__next__` hands out DLPack tensors whose consumer
//! stream waits for them on the GPU.

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use pinstream::dlpack::{self, Element};
use pinstream::kernels::{Layout, Normalize, OutputElement, Spec};
use pinstream::prefetch::{
    ForeignBytes, HostBatch, HostBytes, LoadError, Pixels, PrefetchConfig, Prefetcher, Source,
};
use pinstream::{bf16, f16, Error};
use pyo3::exceptions::{PyStopIteration, PyTypeError};
use pyo3::gc::PyVisit;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};
use pyo3::PyTraverseError;

use crate::context::{ctx, lock};
use crate::errors::{invalid, to_py, OrPy};
use crate::source::{self, Host};
use crate::tensor::{dtype_name, Tensor};

const OP: &str = "pinstream.prefetch";

/// What a batch index left behind on the Python side: the exception its pull raised (the
/// `__cause__` of the `LoaderError`), and the items passed through as they are.
#[derive(Default)]
struct Side {
    causes: HashMap<u64, PyErr>,
    rest: HashMap<u64, Vec<Py<PyAny>>>,
}

/// The pixels of one item, held (a DLPack import or a buffer) until the upload has read them.
struct Held(Host);

impl HostBytes for Held {
    fn bytes(&self) -> &[u8] {
        // Checked when the item was taken; an error here reads as no bytes (the batch's
        // length check then refuses it).
        self.0.bytes().map_or(&[], |(b, _)| b)
    }
}

thread_local! {
    /// The prefetcher (the address of its `Side`) whose next item this thread is pulling, or 0.
    static PULLING: Cell<usize> = const { Cell::new(0) };
}

/// Marks the current thread as pulling an item of prefetcher `id` while it lives.
struct Pulling(usize);

impl Pulling {
    fn enter(id: usize) -> Pulling {
        Pulling(PULLING.with(|p| p.replace(id)))
    }
}

impl Drop for Pulling {
    fn drop(&mut self) {
        PULLING.with(|p| p.set(self.0));
    }
}

/// Whether this thread is one of prefetcher `id`'s loaders, inside its iterable's code: there,
/// `__next__` and `close` would wait for the loaders, this one included (a deadlock), and the
/// last reference's drop would join this thread from itself.
fn pulling(id: usize) -> bool {
    PULLING.with(|p| p.get() == id)
}

/// The iterable, held once for the prefetcher (so that the garbage collector sees the one
/// reference, through `PyPrefetcher::__traverse__`); `None` once cleared.
type Iterable = Arc<Mutex<Option<Py<PyAny>>>>;

/// The iterator the loader threads take turns on: each `next` attaches to Python, pulls one
/// item and takes its arrays.
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
    side: Arc<Mutex<Side>>,
}

impl Items {
    fn pull(&self, py: Python<'_>, i: u64) -> PyResult<Option<HostBatch<i64>>> {
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
        let parts: Vec<Bound<'_, PyAny>> =
            if item.is_instance_of::<PyTuple>() || item.is_instance_of::<PyList>() {
                item.try_iter()?.collect::<PyResult<_>>()?
            } else {
                vec![item]
            };
        let mut parts = parts.into_iter();
        let px = parts
            .next()
            .ok_or_else(|| invalid(OP, format!("batch {i} is an empty tuple")))?;
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
        let norm = match &self.norm {
            Some((m, s)) => Normalize::new(m, s),
            None => Normalize::new(&vec![0.0; ch], &vec![1.0; ch]),
        };
        let spec = Spec::uniform(n, ch, h, w, norm)
            .map_err(to_py)?
            .layouts(self.in_layout, self.out_layout);
        let mut extras = Vec::new();
        if let Some(labels) = parts.next() {
            extras = labels_of(i, n, &labels)?;
        }
        let rest: Vec<Py<PyAny>> = parts.map(Bound::unbind).collect();
        if !rest.is_empty() {
            lock(&self.side).rest.insert(i, rest);
        }
        Ok(Some(HostBatch::new(
            Pixels::Foreign(ForeignBytes::new(Held(host))),
            spec,
            extras,
        )))
    }
}

/// A batch's labels: any integer array (or sequence of ints) of `n` values, as int64.
fn labels_of(i: u64, n: usize, labels: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    let seq = if labels.hasattr("tolist")? {
        labels.call_method0("tolist")?
    } else {
        labels.clone()
    };
    let v: Vec<i64> = seq.extract().map_err(|_| {
        invalid(
            OP,
            format!("batch {i}: the labels are not a flat sequence of integers"),
        )
    })?;
    if v.len() != n {
        return Err(invalid(
            OP,
            format!("batch {i}: {} labels for {n} images", v.len()),
        ));
    }
    Ok(v)
}

impl Iterator for Items {
    type Item = Result<HostBatch<i64>, LoadError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        let i = self.index;
        self.index += 1;
        Python::attach(|py| match self.pull(py, i) {
            Ok(Some(b)) => Some(Ok(b)),
            Ok(None) => {
                self.done = true;
                None
            }
            Err(e) => {
                let message = describe(py, &e);
                lock(&self.side).causes.insert(i, e);
                self.done = true;
                Some(Err(message.into()))
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

/// One prefetcher of each output type.
enum Inner {
    F32(Prefetcher<f32, i64>),
    F16(Prefetcher<f16, i64>),
    Bf16(Prefetcher<bf16, i64>),
    U8(Prefetcher<u8, i64>),
}

type Next = Option<pinstream::Result<(u64, dlpack::Tensor, dlpack::Tensor)>>;

fn next_of<O: OutputElement + Element>(p: &mut Prefetcher<O, i64>) -> Next {
    p.next().map(|r| {
        r.and_then(|b| {
            let i = b.index();
            b.into_dlpack().map(|(px, ex)| (i, px, ex))
        })
    })
}

impl Inner {
    fn next(&mut self) -> Next {
        match self {
            Inner::F32(p) => next_of(p),
            Inner::F16(p) => next_of(p),
            Inner::Bf16(p) => next_of(p),
            Inner::U8(p) => next_of(p),
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
}

impl PyPrefetcher {
    /// The id its loaders mark themselves with while they pull (`PULLING`).
    fn id(&self) -> usize {
        Arc::as_ptr(&self.side) as usize
    }

    fn close_inner(&self, py: Python<'_>, what: &str) -> PyResult<()> {
        if pulling(self.id()) {
            return Err(reentered(what));
        }
        // The lock is taken without the GIL: a `__next__` on another thread holds it while it
        // waits for a batch, which the loader threads pull with the GIL.
        let p = py.detach(|| lock(&self.inner).take());
        // The loader threads may be waiting for the GIL: drop them without it.
        py.detach(move || drop(p));
        Ok(())
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
        let own_loader = pulling(self.id());
        let p = lock(&self.inner).take();
        retire(p, own_loader);
    }
}

#[pymethods]
impl PyPrefetcher {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        if pulling(self.id()) {
            return Err(reentered("__next__"));
        }
        let got = py.detach(|| lock(&self.inner).as_mut().and_then(Inner::next));
        let (i, px, ex) = match got {
            None => {
                self.close_inner(py, "__next__")?;
                return Err(PyStopIteration::new_err(()));
            }
            Some(Err(e)) => {
                self.close_inner(py, "__next__")?;
                let cause = match &e {
                    Error::Loader { batch, .. } => lock(&self.side).causes.remove(batch),
                    _ => None,
                };
                let err = to_py(e);
                if let Some(c) = cause {
                    err.set_cause(py, Some(c));
                }
                return Err(err);
            }
            Some(Ok(b)) => b,
        };
        let rest = lock(&self.side).rest.remove(&i).unwrap_or_default();
        let pixels = Bound::new(py, Tensor::new(px))?.into_any();
        let has_labels = *lock(&self.labels).get_or_insert(!ex.shape().contains(&0));
        if !has_labels && rest.is_empty() {
            return Ok(pixels);
        }
        let mut out = vec![pixels];
        if has_labels {
            out.push(Bound::new(py, Tensor::new(ex))?.into_any());
        }
        out.extend(rest.into_iter().map(|r| r.into_bound(py)));
        Ok(PyTuple::new(py, out)?.into_any())
    }

    /// Stops the threads and frees the slots (batches already handed out stay valid).
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        self.close_inner(py, "close")
    }

    /// The garbage collector's view: the iterable (which may refer back to the prefetcher).
    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        // Never blocks: a loader holds the lock only to take a reference of its own.
        if let Ok(it) = self.iterable.try_lock() {
            if let Some(it) = it.as_ref() {
                visit.call(it)?;
            }
        }
        Ok(())
    }

    /// Breaks a cycle through the iterable: the iterable is let go and the prefetcher closed.
    fn __clear__(&self) {
        let it = lock(&self.iterable).take();
        drop(it);
        let own_loader = pulling(self.id());
        let p = lock(&self.inner).take();
        retire(p, own_loader);
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

/// Makes a prefetcher over `iterable` (see `pinstream.prefetch`).
#[pyfunction]
#[pyo3(signature = (iterable, device = 0, depth = 2, mean = None, std = None, dtype = "float32",
                    layout_out = "nchw", layout_in = "nchw", loader_threads = 2))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn prefetch(
    py: Python<'_>,
    iterable: &Bound<'_, PyAny>,
    device: i64,
    depth: usize,
    mean: Option<Vec<f32>>,
    std: Option<Vec<f32>>,
    dtype: &str,
    layout_out: &str,
    layout_in: &str,
    loader_threads: usize,
) -> PyResult<PyPrefetcher> {
    let (in_layout, out_layout) = (
        layout(layout_in, "layout_in")?,
        layout(layout_out, "layout_out")?,
    );
    let norm = match (mean, std) {
        (Some(m), Some(s)) => Some((m, s)),
        (None, None) => None,
        _ => return Err(invalid(OP, "give both mean and std, or neither")),
    };
    if !matches!(dtype, "float32" | "float16" | "bfloat16" | "uint8") {
        return Err(invalid(
            OP,
            format!("dtype {dtype:?}: float32, float16, bfloat16 or uint8"),
        ));
    }
    let it = iterable
        .try_iter()
        .map_err(|_| PyTypeError::new_err("pinstream.prefetch: the source is not iterable"))?;
    let c = ctx(py, device)?;
    let side = Arc::new(Mutex::new(Side::default()));
    let iterable: Iterable = Arc::new(Mutex::new(Some(it.into_any().unbind())));
    let items = Items {
        it: iterable.clone(),
        id: Arc::as_ptr(&side) as usize,
        index: 0,
        done: false,
        norm,
        in_layout,
        out_layout,
        side: side.clone(),
    };
    let config = PrefetchConfig {
        depth,
        loader_threads,
        ..PrefetchConfig::default()
    };
    let source = Source::iter(items);
    let stream = c.stream.clone();
    let dtype = dtype.to_string();
    let inner = py
        .detach(move || -> pinstream::Result<Inner> {
            Ok(match dtype.as_str() {
                "float32" => Inner::F32(Prefetcher::new(&stream, source, config)?),
                "float16" => Inner::F16(Prefetcher::new(&stream, source, config)?),
                "bfloat16" => Inner::Bf16(Prefetcher::new(&stream, source, config)?),
                "uint8" => Inner::U8(Prefetcher::new(&stream, source, config)?),
                other => {
                    return Err(Error::InvalidArgument {
                        op: OP,
                        reason: format!("dtype {other:?}: float32, float16, bfloat16 or uint8"),
                    })
                }
            })
        })
        .py_err()?;
    Ok(PyPrefetcher {
        inner: Mutex::new(Some(inner)),
        side,
        labels: Mutex::new(None),
        iterable,
    })
}
