//! `pinstream._native`: the Python binding of the pinstream library. Every call that moves data
//! or waits releases the GIL; every `pinstream::Error` becomes the exception class of its kind
//! (`pinstream.errors`); results are DLPack producers.
//!
//! The Python-facing layer (argument parsing, numpy / torch conversions) is
//! `python/pinstream/*.py`; this crate holds what needs the library.

mod bench;
mod capsule;
mod context;
mod cpus;
mod errors;
mod feed;
mod fork;
mod prefetch;
mod ring;
mod safetensors;
mod source;
mod tensor;
mod torch_many;

use pyo3::prelude::*;

/// The native module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(context::device_count, m)?)?;
    m.add_function(wrap_pyfunction!(context::device_name, m)?)?;
    m.add_function(wrap_pyfunction!(context::stream_handle, m)?)?;
    m.add_function(wrap_pyfunction!(context::synchronize, m)?)?;
    m.add_function(wrap_pyfunction!(context::empty_cache, m)?)?;
    m.add_function(wrap_pyfunction!(tensor::upload, m)?)?;
    m.add_function(wrap_pyfunction!(tensor::upload_many, m)?)?;
    m.add_function(wrap_pyfunction!(tensor::upload_packed, m)?)?;
    m.add_function(wrap_pyfunction!(tensor::download, m)?)?;
    m.add_function(wrap_pyfunction!(prefetch::prefetch, m)?)?;
    m.add_function(wrap_pyfunction!(prefetch::memory_stats, m)?)?;
    m.add_function(wrap_pyfunction!(safetensors::load_safetensors, m)?)?;
    m.add_function(wrap_pyfunction!(bench::rust_upload_times, m)?)?;
    m.add_function(wrap_pyfunction!(torch_many::upload_torch_packed, m)?)?;
    m.add_class::<tensor::Tensor>()?;
    m.add_class::<prefetch::PyPrefetcher>()?;
    m.add_class::<feed::PyImageFeed>()?;
    m.add_class::<ring::PyHostRegistration>()?;
    Ok(())
}
