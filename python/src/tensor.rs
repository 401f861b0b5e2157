//! `pinstream.Tensor` (a DLPack producer of device memory pinstream filled) and the calls that
//! make and read them: `upload`, `upload_many`, `download`.

use std::sync::Mutex;

use pinstream::dlpack::abi::{
    DLDataType, KDL_BFLOAT, KDL_BOOL, KDL_COMPLEX, KDL_CUDA, KDL_CUDA_MANAGED, KDL_FLOAT, KDL_INT,
    KDL_UINT,
};
use pinstream::dlpack::{self, Part};
use pinstream::{DeviceBuffer, Packer, Stream};
use pyo3::exceptions::PyBufferError;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyTuple};

use crate::capsule::{self, Managed};
use crate::context::{ctx, lock, Ctx};
use crate::errors::{invalid, OrPy};
use crate::source;

/// A readable name for a DLPack type, as numpy / torch spell it.
pub(crate) fn dtype_name(d: DLDataType) -> String {
    if d.lanes == 1 {
        let name = match (d.code, d.bits) {
            (KDL_FLOAT, 16) => Some("float16"),
            (KDL_FLOAT, 32) => Some("float32"),
            (KDL_FLOAT, 64) => Some("float64"),
            (KDL_BFLOAT, 16) => Some("bfloat16"),
            (KDL_INT, 8) => Some("int8"),
            (KDL_INT, 16) => Some("int16"),
            (KDL_INT, 32) => Some("int32"),
            (KDL_INT, 64) => Some("int64"),
            (KDL_UINT, 8) => Some("uint8"),
            (KDL_UINT, 16) => Some("uint16"),
            (KDL_UINT, 32) => Some("uint32"),
            (KDL_UINT, 64) => Some("uint64"),
            (KDL_BOOL, 8) => Some("bool"),
            (KDL_COMPLEX, 64) => Some("complex64"),
            (KDL_COMPLEX, 128) => Some("complex128"),
            _ => None,
        };
        if let Some(n) = name {
            return n.to_string();
        }
    }
    format!(
        "dlpack(code={}, bits={}, lanes={})",
        d.code, d.bits, d.lanes
    )
}

/// Device memory pinstream filled, handed to a consumer through DLPack
/// (`torch.from_dlpack(t)`, `cupy.from_dlpack(t)`, `jax.dlpack.from_dlpack(t)`), zero copy.
/// The consumer's stream waits for the data on the GPU. A tensor is handed over once: it
/// moves to the consumer, and a second `__dlpack__` raises `BufferError`. Dropped unused, it
/// frees its memory.
#[pyclass(module = "pinstream", name = "Tensor", frozen)]
pub(crate) struct Tensor {
    inner: Mutex<Option<dlpack::Tensor>>,
    shape: Vec<i64>,
    dtype: DLDataType,
    /// DLPack device type: `kDLCUDA`, or `kDLCPU` for page-locked downloads.
    kind: i32,
    device: i32,
    /// The process that made it (`fork`): in a forked child it is refused and leaked.
    pid: u32,
}

impl Drop for Tensor {
    fn drop(&mut self) {
        if self.pid != crate::fork::pid() {
            // A forked child: the memory is the parent's context's; releasing it here would
            // call CUDA in a process that cannot use it.
            let t = lock(&self.inner).take();
            std::mem::forget(t);
        }
    }
}

impl Tensor {
    pub(crate) fn new(t: dlpack::Tensor) -> Tensor {
        let device = t.device().device_id;
        Tensor::on(t, device)
    }

    /// `t`, said to come from CUDA device `device` (host memory's DLPack device id is 0).
    fn on(t: dlpack::Tensor, device: i32) -> Tensor {
        Tensor {
            shape: t.shape().to_vec(),
            dtype: t.dtype(),
            kind: t.device().device_type,
            device,
            pid: crate::fork::pid(),
            inner: Mutex::new(Some(t)),
        }
    }

    fn take(&self) -> Option<dlpack::Tensor> {
        lock(&self.inner).take()
    }

    fn put_back(&self, t: dlpack::Tensor) {
        *lock(&self.inner) = Some(t);
    }

    fn place(&self) -> String {
        if self.kind == KDL_CUDA {
            format!("cuda:{}", self.device)
        } else {
            "cpu".to_string()
        }
    }
}

/// The consumer's stream as the protocol encodes it (CUDA): `None` and 1 the legacy default
/// stream, 2 the per-thread default stream, -1 no synchronisation, other values a
/// `cudaStream_t`; 0 is refused as ambiguous.
enum ConsumerStream {
    Raw(usize),
    PerThread,
    NoSync,
}

fn consumer_stream(stream: Option<&Bound<'_, PyAny>>) -> PyResult<ConsumerStream> {
    let Some(s) = stream.filter(|s| !s.is_none()) else {
        return Ok(ConsumerStream::Raw(1));
    };
    let v: i128 = s.extract().map_err(|_| {
        invalid(
            "Tensor.__dlpack__",
            "stream must be an int (a cudaStream_t), -1, 1, 2 or None",
        )
    })?;
    match v {
        -1 => Ok(ConsumerStream::NoSync),
        0 => Err(invalid(
            "Tensor.__dlpack__",
            "stream=0 is ambiguous for CUDA (the protocol says: pass 1 for the legacy default \
             stream, 2 for the per-thread one)",
        )),
        2 => Ok(ConsumerStream::PerThread),
        v => usize::try_from(v)
            .ok()
            .filter(|&raw| raw == 1 || could_be_a_stream(raw))
            .map(ConsumerStream::Raw)
            .ok_or_else(|| {
                invalid(
                    "Tensor.__dlpack__",
                    format!("stream {v} is not a stream handle"),
                )
            }),
    }
}

/// Whether `raw` could be a `cudaStream_t` other than the special handles: a pointer to the
/// driver's stream object, so 8-byte aligned, above the first page and below the top of the
/// user address space (2^56 with 5-level paging). Anything else is refused before the runtime
/// is handed it: it would dereference it and crash the process. (A plausible address that is
/// not a live stream still crashes it: the protocol trusts the consumer with the handle.)
fn could_be_a_stream(raw: usize) -> bool {
    raw >= 4096 && raw % 8 == 0 && (raw as u64) < (1u64 << 56)
}

#[pymethods]
impl Tensor {
    /// The DLPack protocol: the tensor as a capsule, moved to the consumer. `stream`: the
    /// consumer's stream (it waits on the GPU for the data). The stream is used only during
    /// this call (the consumer may destroy it afterwards): on the legacy default stream (1,
    /// PyTorch's default) the memory's reuse is ordered after an event recorded at the
    /// release; otherwise it goes back once the device has finished the work queued before
    /// the release, from a background thread (the deleter never waits for the GPU).
    #[pyo3(signature = (*, stream = None, max_version = None, dl_device = None, copy = None))]
    fn __dlpack__<'py>(
        &self,
        py: Python<'py>,
        stream: Option<Bound<'py, PyAny>>,
        max_version: Option<(u32, u32)>,
        dl_device: Option<(i32, i32)>,
        copy: Option<bool>,
    ) -> PyResult<Bound<'py, PyAny>> {
        if self.pid != crate::fork::pid() {
            return Err(crate::fork::forked("Tensor.__dlpack__", self.pid));
        }
        if let Some(want) = dl_device {
            if want != self.__dlpack_device__() {
                let (kind, id) = want;
                return Err(PyBufferError::new_err(format!(
                    "the tensor is on {}; pinstream does not copy it to device ({kind}, {id})",
                    self.place()
                )));
            }
        }
        if copy == Some(true) {
            return Err(PyBufferError::new_err(
                "pinstream tensors are handed over, not copied (copy=True)",
            ));
        }
        // Host memory: no stream to order on (the protocol passes None); the handover waits
        // for pinstream's copies into it.
        let how = if self.kind == KDL_CUDA {
            consumer_stream(stream.as_ref())?
        } else {
            ConsumerStream::NoSync
        };
        // Host memory needs no device context (nor makes one on device 0).
        let c = if self.kind == KDL_CUDA {
            Some(ctx(py, i64::from(self.device))?)
        } else {
            None
        };
        let t = self.take().ok_or_else(|| {
            PyBufferError::new_err(
                "this pinstream.Tensor was already handed to a consumer (its memory moved \
                 there: use the consumer's tensor)",
            )
        })?;
        let versioned = max_version.is_some_and(|(major, _)| major >= 1);
        // A device tensor handed to a consumer's stream is only ordered on the GPU (the stream
        // waits for an event): nothing here waits, and it runs with the GIL held. Letting the
        // GIL go would hand it to a thread waiting for it (a prefetcher's loader) and taking
        // it back would wait for that thread, twice a batch in a training loop. Every other
        // handover may wait on the host (for the device, or for copies into host memory): the
        // GIL is let go there.
        let host_waits = !matches!((&how, &c), (ConsumerStream::Raw(_), Some(_)));
        let hand = || -> Result<Managed, Box<dlpack::Refused>> {
            let consumer = match (how, c.as_ref()) {
                (ConsumerStream::NoSync, _) | (_, None) => None,
                (ConsumerStream::PerThread, Some(c)) => {
                    // The per-thread stream names another stream on every thread, and the
                    // release may come from any thread: wait for the data here instead.
                    if let Err(error) = c.device.synchronize() {
                        return Err(Box::new(dlpack::Refused { error, tensor: t }));
                    }
                    None
                }
                (ConsumerStream::Raw(raw), Some(c)) => {
                    // SAFETY: the DLPack protocol: the consumer names a live stream of the
                    // tensor's device, in the primary context (PyTorch, CuPy and JAX use it),
                    // and keeps it alive while it holds the tensor.
                    match unsafe { Stream::from_raw(&c.device, raw as _) } {
                        Ok(s) => Some(s),
                        Err(error) => return Err(Box::new(dlpack::Refused { error, tensor: t })),
                    }
                }
            };
            if versioned {
                t.into_versioned(consumer.as_ref()).map(Managed::Versioned)
            } else {
                t.into_legacy(consumer.as_ref()).map(Managed::Legacy)
            }
        };
        let handed = if host_waits { py.detach(hand) } else { hand() };
        match handed {
            Ok(m) => capsule::into_capsule(py, m),
            Err(refused) => {
                let dlpack::Refused { error, tensor } = *refused;
                self.put_back(tensor);
                Err(crate::errors::to_py(error))
            }
        }
    }

    /// The DLPack protocol: `(kDLCUDA, device ordinal)`, or `(kDLCPU, 0)` for a download.
    fn __dlpack_device__(&self) -> (i32, i32) {
        if self.kind == KDL_CUDA {
            (KDL_CUDA, self.device)
        } else {
            (self.kind, 0)
        }
    }

    /// Sizes.
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, &self.shape)
    }

    /// Element type name (`float32`, `bfloat16`, `uint8`, ...).
    #[getter]
    fn dtype(&self) -> String {
        dtype_name(self.dtype)
    }

    /// The CUDA device ordinal (of the device it came from, for a download's host memory).
    #[getter]
    fn device(&self) -> i32 {
        self.device
    }

    /// Whether it was handed to a consumer.
    #[getter]
    fn handed_over(&self) -> bool {
        lock(&self.inner).is_none()
    }

    fn __repr__(&self) -> String {
        let state = if self.handed_over() {
            ", handed over"
        } else {
            ""
        };
        format!(
            "pinstream.Tensor(shape={:?}, dtype={}, device={}{state})",
            self.shape,
            dtype_name(self.dtype),
            self.place()
        )
    }
}

/// One tensor of `dtype` and `shape` over the whole of `t` (a byte tensor).
fn typed(
    t: dlpack::Tensor,
    dtype: DLDataType,
    shape: &[usize],
) -> pinstream::Result<dlpack::Tensor> {
    let part = Part {
        offset: 0,
        dtype,
        shape: shape.to_vec(),
    };
    t.split(&[part])?
        .pop()
        .ok_or_else(|| pinstream::Error::InvalidArgument {
            op: "pinstream.upload",
            reason: "no tensor".into(),
        })
}

/// Copies host data (anything with `__dlpack__` on the CPU, or the buffer protocol) to device
/// memory through the staging engine (the GIL released); the source is free again when the
/// call returns. Page-locked sources (`pin_memory()` tensors) take one direct copy.
#[pyfunction]
#[pyo3(signature = (x, device = 0))]
pub(crate) fn upload(py: Python<'_>, x: &Bound<'_, PyAny>, device: i64) -> PyResult<Tensor> {
    const OP: &str = "pinstream.upload";
    let c = ctx(py, device)?;
    let src = source::host(OP, x)?;
    let t = py
        .detach(|| -> pinstream::Result<dlpack::Tensor> {
            let bytes = src.bytes()?.0.len();
            let mut buf = DeviceBuffer::<u8>::new_async(&c.stream, bytes)?;
            src.upload(&c.stager, &c.stream, &mut buf)?;
            typed(dlpack::Tensor::from_device(buf)?, src.dtype, &src.shape)
        })
        .py_err()?;
    Ok(Tensor::new(t))
}

/// Many host arrays in one packed upload (one pinned arena, one DMA per slot, one device
/// arena): the tensors share the arena, which is freed when the last is released.
#[pyfunction]
#[pyo3(signature = (xs, device = 0))]
pub(crate) fn upload_many<'py>(
    py: Python<'py>,
    xs: &Bound<'py, PyAny>,
    device: i64,
) -> PyResult<Bound<'py, PyList>> {
    const OP: &str = "pinstream.upload_many";
    let c = ctx(py, device)?;
    let mut srcs = Vec::new();
    for x in xs.try_iter()? {
        srcs.push(source::host(OP, &x?)?);
    }
    let tensors = py
        .detach(|| -> pinstream::Result<Vec<dlpack::Tensor>> {
            let mut packer = Packer::new();
            let mut parts = Vec::with_capacity(srcs.len());
            for s in &srcs {
                let h = packer.push(s.bytes()?.0)?;
                parts.push(Part {
                    offset: h.offset(),
                    dtype: s.dtype,
                    shape: s.shape.clone(),
                });
            }
            if srcs.is_empty() {
                return Ok(Vec::new());
            }
            let batch = c.stager.upload_packed(&c.stream, &packer)?;
            dlpack::Tensor::from_packed_batch(batch)?.split(&parts)
        })
        .py_err()?;
    let out = PyList::empty(py);
    for t in tensors {
        out.append(Bound::new(py, Tensor::new(t))?)?;
    }
    Ok(out)
}

/// As `upload_many`, returning the device arena as one `uint8` tensor and each array's byte
/// offset in it, for callers that cut the arena into views themselves (`pinstream.torch`).
#[pyfunction]
#[pyo3(signature = (xs, device = 0))]
pub(crate) fn upload_packed<'py>(
    py: Python<'py>,
    xs: &Bound<'py, PyAny>,
    device: i64,
) -> PyResult<(Option<Tensor>, Vec<usize>)> {
    const OP: &str = "pinstream.upload_packed";
    let c = ctx(py, device)?;
    let mut srcs = Vec::new();
    for x in xs.try_iter()? {
        srcs.push(source::host_bytes_first(OP, &x?)?);
    }
    let (arena, offsets) = py
        .detach(|| upload_slices(&c, srcs.iter().map(|s| s.bytes().map(|b| b.0))))
        .py_err()?;
    Ok((arena.map(Tensor::new), offsets))
}

/// One packed upload of `slices` (called outside the GIL): the device arena as one byte
/// tensor (`None` when there are no slices) and each slice's offset in it.
pub(crate) fn upload_slices<'a>(
    c: &Ctx,
    slices: impl ExactSizeIterator<Item = pinstream::Result<&'a [u8]>>,
) -> pinstream::Result<(Option<dlpack::Tensor>, Vec<usize>)> {
    let mut packer = Packer::new();
    let mut offsets = Vec::with_capacity(slices.len());
    for s in slices {
        offsets.push(packer.push(s?)?.offset());
    }
    if offsets.is_empty() {
        return Ok((None, offsets));
    }
    let batch = c.stager.upload_packed(&c.stream, &packer)?;
    Ok((Some(dlpack::Tensor::from_packed_batch(batch)?), offsets))
}

/// Copies device data (anything with `__dlpack__` in CUDA memory: torch / CuPy / JAX arrays,
/// a pinstream.Tensor, which is consumed) into page-locked host memory from pinstream's pool
/// with one DMA, returning only once the data has arrived. The producer orders pinstream's
/// stream after its own work (`__dlpack__(stream=...)`), so no host sync of the producer
/// happens. Returns `(tensor, dtype name, shape)`: a CPU `pinstream.Tensor` (numpy / torch take
/// it zero copy; its memory goes back to the pool when they release it), or `None` when empty.
/// `bf16_as_u16`: a bfloat16 result is typed uint16 (its bits), for numpy, which has no
/// bfloat16; the dtype name returned stays `bfloat16`.
#[pyfunction]
#[pyo3(signature = (x, bf16_as_u16 = false))]
pub(crate) fn download<'py>(
    py: Python<'py>,
    x: &Bound<'py, PyAny>,
    bf16_as_u16: bool,
) -> PyResult<(Option<Tensor>, String, Vec<usize>)> {
    const OP: &str = "pinstream.download";
    let (kind, id): (i32, i32) = x
        .call_method0("__dlpack_device__")
        .map_err(|_| invalid(OP, "the source has no __dlpack_device__"))?
        .extract()?;
    if !matches!(kind, KDL_CUDA | KDL_CUDA_MANAGED) {
        return Err(invalid(
            OP,
            format!("the source is not CUDA memory (DLPack device type {kind})"),
        ));
    }
    let c: std::sync::Arc<Ctx> = ctx(py, i64::from(id))?;
    let imp = capsule::import_for(OP, x, Some(c.stream.as_raw() as usize))?;
    let shape = source::shape_of(OP, &imp)?;
    let dtype = imp.dtype();
    let n = imp.byte_len().py_err()?;
    // Checked before the host memory is taken.
    imp.device_bytes().py_err()?;
    if n == 0 {
        return Ok((None, dtype_name(dtype), shape));
    }
    let t = py
        .detach(|| -> pinstream::Result<dlpack::Tensor> {
            let src = imp.device_bytes()?;
            let mut block = c.pinned.alloc::<u8>(n)?;
            c.stream.copy_d2h(&src, &mut block)?.wait()?;
            let t = dlpack::Tensor::from_pool_block(block)?;
            let as_dtype = if bf16_as_u16 && dtype.code == KDL_BFLOAT && dtype.bits == 16 {
                DLDataType {
                    code: KDL_UINT,
                    ..dtype
                }
            } else {
                dtype
            };
            let t = typed(t, as_dtype, &shape)?;
            t.host_as_cpu().map_err(|r| r.error)
        })
        .py_err()?;
    Ok((Some(Tensor::on(t, id)), dtype_name(dtype), shape))
}
