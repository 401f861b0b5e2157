//! One context per device, made at first use and kept for the process: the device, the stream
//! pinstream's Python calls queue their work on, and the staging engine.

use std::sync::{Arc, Mutex, OnceLock};

use pinstream::{Device, PinnedPool, PoolConfig, Stager, StagerConfig, Stream};
use pyo3::prelude::*;

use crate::errors::{invalid, OrPy};

/// What the calls for one device share.
pub(crate) struct Ctx {
    pub(crate) device: Device,
    pub(crate) stream: Stream,
    pub(crate) stager: Stager,
    /// Page-locked memory for downloads (handed to numpy / torch, back when released).
    pub(crate) pinned: PinnedPool,
}

static CONTEXTS: OnceLock<Mutex<Vec<Option<Arc<Ctx>>>>> = OnceLock::new();

/// `ordinal` as a device's number, or an `InvalidArgumentError` of `op` (checked before work
/// that comes ahead of the context).
pub(crate) fn device_ordinal(op: &'static str, ordinal: i64) -> PyResult<usize> {
    usize::try_from(ordinal)
        .map_err(|_| invalid(op, format!("device {ordinal} is not a device ordinal")))
}

/// The context of device `ordinal`, made on first use (outside the GIL: making a stager
/// allocates pinned memory).
pub(crate) fn ctx(py: Python<'_>, ordinal: i64) -> PyResult<Arc<Ctx>> {
    let ordinal = device_ordinal("pinstream", ordinal)?;
    // A forked child has the parent's contexts in its memory but cannot use them.
    crate::fork::check_cuda("pinstream")?;
    let table = CONTEXTS.get_or_init(|| Mutex::new(Vec::new()));
    if let Some(c) = lock(table).get(ordinal).and_then(Clone::clone) {
        return Ok(c);
    }
    crate::fork::note_cuda();
    let made = py
        .detach(|| -> pinstream::Result<Ctx> {
            let device = Device::get(ordinal)?;
            let stream = device.stream()?;
            let stager = Stager::new(&device, StagerConfig::from_env()?)?;
            let pinned = PinnedPool::new(&device, PoolConfig::default())?;
            Ok(Ctx {
                device,
                stream,
                stager,
                pinned,
            })
        })
        .py_err()?;
    let mut t = lock(table);
    if t.len() <= ordinal {
        t.resize(ordinal + 1, None);
    }
    // Another thread may have made one meanwhile: keep the first.
    Ok(t[ordinal].get_or_insert_with(|| Arc::new(made)).clone())
}

/// The context of device `ordinal` if it was made (in this process), else `None`.
pub(crate) fn existing_ctx(ordinal: i64) -> Option<Arc<Ctx>> {
    if crate::fork::cuda_forked() {
        return None;
    }
    let ordinal = usize::try_from(ordinal).ok()?;
    let table = CONTEXTS.get()?;
    lock(table).get(ordinal).and_then(Clone::clone)
}

/// Locks `m`, ignoring poisoning: the binding's tables and slots hold no invariant a panic
/// could break half-way.
pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Number of CUDA devices (`NoDeviceError` where there is no driver or device).
#[pyfunction]
pub(crate) fn device_count(py: Python<'_>) -> PyResult<usize> {
    py.detach(Device::count).py_err()
}

/// The device's name, e.g. `NVIDIA H100 80GB HBM3`.
#[pyfunction]
#[pyo3(signature = (device = 0))]
pub(crate) fn device_name(py: Python<'_>, device: i64) -> PyResult<String> {
    let c = ctx(py, device)?;
    py.detach(|| c.device.name()).py_err()
}

/// The raw `cudaStream_t` (as an int) of the stream pinstream's calls on `device` use: pass it
/// to `__dlpack__(stream=...)` of producers, or wrap it with `torch.cuda.ExternalStream`.
#[pyfunction]
#[pyo3(signature = (device = 0))]
pub(crate) fn stream_handle(py: Python<'_>, device: i64) -> PyResult<usize> {
    Ok(ctx(py, device)?.stream.as_raw() as usize)
}

/// Waits (GIL released) until pinstream's work queued on `device` has finished.
#[pyfunction]
#[pyo3(signature = (device = 0))]
pub(crate) fn synchronize(py: Python<'_>, device: i64) -> PyResult<()> {
    let c = ctx(py, device)?;
    py.detach(|| c.stream.synchronize()).py_err()
}

/// Gives the memory pinstream keeps for reuse back: the device memory of freed uploads and of
/// tensors their consumers released (as `torch.cuda.empty_cache()` does for PyTorch's; call it
/// where PyTorch needs the room), and the idle page-locked host memory of released downloads.
/// Memory still in use stays.
#[pyfunction]
#[pyo3(signature = (device = 0))]
pub(crate) fn empty_cache(py: Python<'_>, device: i64) -> PyResult<()> {
    let c = ctx(py, device)?;
    py.detach(|| {
        c.stream.synchronize()?;
        pinstream::dlpack::wait_for_releases(std::time::Duration::from_secs(10));
        c.device.empty_cache()?;
        c.pinned.trim().map(drop)
    })
    .py_err()
}
