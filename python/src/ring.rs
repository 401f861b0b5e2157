//! `pinstream._native.HostRegistration`: a buffer (the ring of `prefetch(process=True)`, a
//! mapping shared with its helper process) page-locked for as long as the object lives, so
//! that the prefetcher's DMA reads the ring's slots directly, with no copy in this process.

use pinstream::memory::{HostRegister, HostRegistration};
use pyo3::buffer::PyUntypedBuffer;
use pyo3::prelude::*;

use crate::context::ctx;
use crate::errors::{invalid, OrPy};

const OP: &str = "pinstream.HostRegistration";

/// A writable, C-contiguous buffer page-locked (`cudaHostRegister`, portable) until this
/// object is gone. Private: `pinstream.prefetch(process=True)` registers its ring with it and
/// keeps it alive (in each slot view's finalizer) until every DMA from the ring is over.
#[pyclass(module = "pinstream", name = "HostRegistration", frozen)]
pub(crate) struct PyHostRegistration {
    // Unregistered first (in `drop`), while the buffer is still exported (an exporting mmap
    // can be neither closed nor resized), then the export is released.
    registration: Option<HostRegistration>,
    _buffer: PyUntypedBuffer,
}

impl Drop for PyHostRegistration {
    fn drop(&mut self) {
        // Unpinning a ring of hundreds of megabytes takes milliseconds (9 ms for the ring of a
        // DataLoader of 256 x 3x224x224 batches, BENCHMARKS.md, fourteenth session): without
        // the GIL, which the training thread needs meanwhile. The last slot view's finalizer
        // drops this object, on whatever thread lets that view go, at the end of an epoch.
        if let Some(r) = self.registration.take() {
            Python::attach(|py| py.detach(move || drop(r)));
        }
    }
}

#[pymethods]
impl PyHostRegistration {
    #[new]
    #[pyo3(signature = (buffer, device = 0))]
    fn new(py: Python<'_>, buffer: &Bound<'_, PyAny>, device: i64) -> PyResult<Self> {
        let buf = PyUntypedBuffer::get(buffer)?;
        if buf.readonly() || !buf.is_c_contiguous() || buf.len_bytes() == 0 {
            return Err(invalid(
                OP,
                "give a writable, C-contiguous, non-empty buffer (an mmap)",
            ));
        }
        let c = ctx(py, device)?;
        let (ptr, len) = (buf.buf_ptr() as usize, buf.len_bytes());
        let registration = py
            .detach(|| {
                // SAFETY: `len` bytes at `ptr` are the buffer's, exported by `_buffer` for as
                // long as the registration lives (dropped first, see the fields); the copies
                // from it are over before the drop: the prefetcher's views of the ring keep
                // this object alive until their DMA was waited for.
                unsafe {
                    HostRegistration::new(&c.device, ptr as *mut u8, len, HostRegister::PORTABLE)
                }
            })
            .py_err()?;
        Ok(PyHostRegistration {
            registration: Some(registration),
            _buffer: buf,
        })
    }

    fn __len__(&self) -> usize {
        self.registration.as_ref().map_or(0, HostRegistration::len)
    }
}
