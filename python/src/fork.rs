//! Fork safety. A process that forks after pinstream started CUDA or its threads gives the child
//! a copy of the parent's memory but none of its threads, and a CUDA context the child cannot
//! use: a prefetcher there would wait for loader threads that do not exist (or abort), a tensor
//! would free memory of a context that is not the child's. So every object records the process
//! that made it; in another process (a forked child) its calls raise `pinstream.ForkedError`,
//! and its drop leaks what it holds (the child's copy of the parent's memory; the device memory
//! stays the parent's) instead of calling CUDA or joining threads.

use std::sync::atomic::{AtomicU32, Ordering};

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;

/// The process that first used CUDA through the package (made a device context), or 0.
static CUDA_PID: AtomicU32 = AtomicU32::new(0);

/// This process's id.
pub(crate) fn pid() -> u32 {
    std::process::id()
}

/// Records that this process uses CUDA now (its first context).
pub(crate) fn note_cuda() {
    let _ = CUDA_PID.compare_exchange(0, pid(), Ordering::AcqRel, Ordering::Acquire);
}

/// Whether CUDA was started by another process than this one: this is a child forked after it.
pub(crate) fn cuda_forked() -> bool {
    let p = CUDA_PID.load(Ordering::Acquire);
    p != 0 && p != pid()
}

/// The `pinstream.ForkedError` for `what`, made in `parent` and used in this process.
pub(crate) fn forked(what: &str, parent: u32) -> PyErr {
    let message = format!(
        "{what}: this process ({}) was forked from process {parent} after pinstream started \
         CUDA or its threads there; neither carries over a fork. Use pinstream only in the \
         process that made it, start workers with the \"spawn\" or \"forkserver\" method, or \
         make pinstream's objects in the worker (see docs/python.md)",
        pid()
    );
    Python::attach(|py| {
        let made = (|| -> PyResult<PyErr> {
            let class = py.import("pinstream.errors")?.getattr("ForkedError")?;
            Ok(PyErr::from_value(class.call1((message.clone(),))?))
        })();
        made.unwrap_or_else(|_| PyRuntimeError::new_err(message))
    })
}

/// `Err(ForkedError)` if CUDA was started in another process.
pub(crate) fn check_cuda(what: &str) -> PyResult<()> {
    if cuda_forked() {
        return Err(forked(what, CUDA_PID.load(Ordering::Acquire)));
    }
    Ok(())
}
