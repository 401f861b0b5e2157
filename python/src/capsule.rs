//! DLPack capsules, both ways, as the Python specification of the protocol says: a producer
//! returns a `PyCapsule` named `dltensor_versioned` (DLPack 1.x) or `dltensor` (legacy); the
//! consumer renames it `used_dltensor_versioned` / `used_dltensor` when it takes ownership, and
//! the capsule's destructor calls the tensor's deleter only if nobody took it.

use std::ffi::CStr;

use pinstream::dlpack::abi::{DLManagedTensor, DLManagedTensorVersioned};
use pinstream::dlpack::Imported;
use pyo3::exceptions::{PyBufferError, PyTypeError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::errors::OrPy;

const VERSIONED: &CStr = c"dltensor_versioned";
const USED_VERSIONED: &CStr = c"used_dltensor_versioned";
const LEGACY: &CStr = c"dltensor";
const USED_LEGACY: &CStr = c"used_dltensor";

/// A tensor pinstream handed over, not yet in a capsule.
pub(crate) enum Managed {
    Versioned(*mut DLManagedTensorVersioned),
    Legacy(*mut DLManagedTensor),
}

// SAFETY: a handed-over tensor is owned by whoever holds the pointer; pinstream's tensors may
// be used and deleted from any thread (their deleters are thread-safe, `dlpack` module docs).
unsafe impl Send for Managed {}

/// Calls the deleter of a tensor nobody else owns.
///
/// # Safety
///
/// `m` is a live managed tensor owned by the caller and not used afterwards.
unsafe fn delete(m: &Managed) {
    match *m {
        Managed::Versioned(p) => {
            // SAFETY: the caller's contract: `p` is live and ours.
            if let Some(d) = unsafe { (*p).deleter } {
                // SAFETY: DLPack: the owner calls the deleter once.
                unsafe { d(p) }
            }
        }
        Managed::Legacy(p) => {
            // SAFETY: as above.
            if let Some(d) = unsafe { (*p).deleter } {
                // SAFETY: as above.
                unsafe { d(p) }
            }
        }
    }
}

/// The capsule for a handed-over tensor. If the capsule cannot be made, the tensor is deleted
/// (given back) and the Python error returned.
pub(crate) fn into_capsule(py: Python<'_>, m: Managed) -> PyResult<Bound<'_, PyAny>> {
    let (ptr, name, dtor): (*mut std::ffi::c_void, &CStr, ffi::PyCapsule_Destructor) = match m {
        Managed::Versioned(p) => (p.cast(), VERSIONED, versioned_dtor),
        Managed::Legacy(p) => (p.cast(), LEGACY, legacy_dtor),
    };
    // SAFETY: `ptr` is non-null (a live box pinstream made); `name` is a static C string, as
    // the capsule keeps the pointer; the GIL is held (`py`).
    let cap = unsafe { ffi::PyCapsule_New(ptr, name.as_ptr(), Some(dtor)) };
    if cap.is_null() {
        // SAFETY: the capsule was not made, so the tensor is still only ours.
        unsafe { delete(&m) };
        return Err(PyErr::fetch(py));
    }
    // SAFETY: `cap` is a new reference, owned from here on by the `Bound`.
    Ok(unsafe { Bound::from_owned_ptr(py, cap) })
}

/// Destructor of a `dltensor_versioned` capsule: deletes the tensor unless a consumer renamed
/// (took) it.
unsafe extern "C" fn versioned_dtor(cap: *mut ffi::PyObject) {
    // SAFETY: Python calls a capsule's destructor with the capsule, the GIL held;
    // `PyCapsule_IsValid` sets no exception.
    if unsafe { ffi::PyCapsule_IsValid(cap, VERSIONED.as_ptr()) } != 1 {
        return;
    }
    // SAFETY: valid under that name (checked): its pointer is the tensor `into_capsule` made.
    let p = unsafe { ffi::PyCapsule_GetPointer(cap, VERSIONED.as_ptr()) };
    if !p.is_null() {
        // SAFETY: never consumed (the name is unchanged), so the tensor is still ours.
        unsafe { delete(&Managed::Versioned(p.cast())) };
    }
}

/// Destructor of a legacy `dltensor` capsule, as `versioned_dtor`.
unsafe extern "C" fn legacy_dtor(cap: *mut ffi::PyObject) {
    // SAFETY: as in `versioned_dtor`.
    if unsafe { ffi::PyCapsule_IsValid(cap, LEGACY.as_ptr()) } != 1 {
        return;
    }
    // SAFETY: as in `versioned_dtor`.
    let p = unsafe { ffi::PyCapsule_GetPointer(cap, LEGACY.as_ptr()) };
    if !p.is_null() {
        // SAFETY: as in `versioned_dtor`.
        unsafe { delete(&Managed::Legacy(p.cast())) };
    }
}

/// Takes ownership of the tensor in a producer's capsule (renaming it `used_*`, as the
/// protocol says, so the producer's destructor leaves it alone).
pub(crate) fn take(cap: &Bound<'_, PyAny>) -> PyResult<Imported> {
    let raw = cap.as_ptr();
    // SAFETY: `raw` is a live object (borrowed through `cap`), the GIL held.
    if unsafe { ffi::PyCapsule_CheckExact(raw) } != 1 {
        return Err(PyTypeError::new_err(
            "__dlpack__ did not return a PyCapsule",
        ));
    }
    for (name, used, versioned) in [
        (VERSIONED, USED_VERSIONED, true),
        (LEGACY, USED_LEGACY, false),
    ] {
        // SAFETY: `raw` is a capsule; `PyCapsule_IsValid` sets no exception.
        if unsafe { ffi::PyCapsule_IsValid(raw, name.as_ptr()) } != 1 {
            continue;
        }
        // SAFETY: valid under `name` (checked).
        let p = unsafe { ffi::PyCapsule_GetPointer(raw, name.as_ptr()) };
        // SAFETY: `used` is a static C string, as the capsule keeps the name pointer.
        if p.is_null() || unsafe { ffi::PyCapsule_SetName(raw, used.as_ptr()) } != 0 {
            return Err(PyErr::fetch(cap.py()));
        }
        // SAFETY: the capsule held a live managed tensor of that kind (the protocol), and
        // renaming it passed ownership to us: nobody else calls its deleter.
        let imported = unsafe {
            if versioned {
                Imported::from_versioned(p.cast())
            } else {
                Imported::from_legacy(p.cast())
            }
        };
        return imported.py_err();
    }
    Err(PyBufferError::new_err(
        "the capsule is not an unused DLPack tensor (dltensor_versioned / dltensor)",
    ))
}

/// Calls `obj.__dlpack__(stream=..., max_version=(1, 3))` (falling back to the arguments an
/// older producer takes) and takes the tensor. `stream`: `None` for host producers, else the
/// raw handle of the stream the data will be used on. The producer refusing its own export
/// (numpy: a big-endian or read-only array, torch: a conjugate view — a `BufferError`) is a
/// bad input to `op`: `InvalidArgumentError`. A capsule that is not what the protocol says
/// stays a `BufferError`.
pub(crate) fn import_for(
    op: &'static str,
    obj: &Bound<'_, PyAny>,
    stream: Option<usize>,
) -> PyResult<Imported> {
    let cap = export(obj, stream).map_err(|e| {
        if e.is_instance_of::<pyo3::exceptions::PyBufferError>(obj.py()) {
            crate::errors::invalid(op, format!("the source refused its DLPack export: {e}"))
        } else {
            e
        }
    })?;
    take(&cap)
}

/// Calls the producer's `__dlpack__` (with `max_version`, or without it for a producer from
/// before DLPack 1.0).
fn export<'py>(obj: &Bound<'py, PyAny>, stream: Option<usize>) -> PyResult<Bound<'py, PyAny>> {
    let py = obj.py();
    let kwargs = PyDict::new(py);
    if let Some(s) = stream {
        kwargs.set_item("stream", s)?;
    }
    kwargs.set_item("max_version", PyTuple::new(py, [1u32, 3])?)?;
    let cap = match obj.call_method("__dlpack__", (), Some(&kwargs)) {
        Ok(c) => c,
        Err(e) if e.is_instance_of::<PyTypeError>(py) => {
            // A producer from before DLPack 1.0 takes no `max_version`.
            kwargs.del_item("max_version")?;
            obj.call_method("__dlpack__", (), Some(&kwargs))?
        }
        Err(e) => return Err(e),
    };
    Ok(cap)
}
