//! `pinstream::Error` → the Python exception class of its kind, defined in
//! `pinstream/errors.py` (so that each can also derive from the builtin a Python user catches:
//! `ValueError`, `MemoryError`, `OSError`), with the library's message.

use pinstream::Error;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyString;

/// The class name in `pinstream.errors` for an error's kind.
pub(crate) fn class_name(e: &Error) -> &'static str {
    match e {
        Error::NoDevice { .. } => "NoDeviceError",
        Error::OutOfMemory { .. } => "OutOfMemoryError",
        Error::LengthMismatch { .. } => "LengthMismatchError",
        Error::WrongDevice { .. } => "WrongDeviceError",
        Error::NoPeerAccess { .. } => "NoPeerAccessError",
        Error::InvalidArgument { .. } => "InvalidArgumentError",
        Error::Io { .. } => "IoError",
        Error::Format { .. } => "FormatError",
        Error::Panicked { .. } => "PanickedError",
        Error::Loader { .. } => "LoaderError",
        Error::Cuda { .. } => "CudaError",
        _ => "PinstreamError",
    }
}

/// The Python exception for `e`: its kind's class, the library's message, and for a loader's
/// error the batch index as `.batch`.
pub(crate) fn to_py(e: Error) -> PyErr {
    Python::attach(|py| {
        let message = e.to_string();
        let made = (|| -> PyResult<PyErr> {
            let module = py.import("pinstream.errors")?;
            let class = module.getattr(class_name(&e))?;
            let value = class.call1((PyString::new(py, &message),))?;
            if let Error::Loader { batch, .. } = &e {
                value.setattr("batch", *batch)?;
            }
            if let Some(c) = e.cuda() {
                value.setattr("cuda_error", c.name())?;
            }
            Ok(PyErr::from_value(value))
        })();
        made.unwrap_or_else(|_| PyRuntimeError::new_err(message))
    })
}

/// `?` for library results inside binding functions.
pub(crate) trait OrPy<T> {
    fn py_err(self) -> PyResult<T>;
}

impl<T> OrPy<T> for pinstream::Result<T> {
    fn py_err(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}

/// An `InvalidArgumentError` raised by the binding itself (before the library is called).
pub(crate) fn invalid(op: &'static str, reason: impl Into<String>) -> PyErr {
    to_py(Error::InvalidArgument {
        op,
        reason: reason.into(),
    })
}
