//! `load_safetensors`: a safetensors file, or a sharded checkpoint (its index or its folder), to
//! one device arena through the staging engine (the GIL released), as one DLPack tensor per
//! entry.

use std::path::PathBuf;

use pinstream::safetensors::{Checkpoint, Direct, LoadOptions};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::context::ctx;
use crate::errors::{invalid, OrPy};
use crate::tensor::Tensor;

/// Loads every tensor of a safetensors file, or of every shard of a checkpoint (an
/// `*.index.json`, or a folder: its index, else every `*.safetensors` in it), onto `device`:
/// `{name: pinstream.Tensor}`, each writable, all in one device arena freed when the last is
/// released. `direct`: `"auto"` (O_DIRECT where most of a shard is not in the page cache),
/// `"never"`, `"always"`.
#[pyfunction]
#[pyo3(signature = (path, device = 0, direct = "auto"))]
pub(crate) fn load_safetensors<'py>(
    py: Python<'py>,
    path: PathBuf,
    device: i64,
    direct: &str,
) -> PyResult<Bound<'py, PyDict>> {
    let direct = match direct {
        "auto" => Direct::Auto,
        "never" => Direct::Never,
        "always" => Direct::Always,
        other => {
            return Err(invalid(
                "pinstream.load_safetensors",
                format!("direct={other:?}: \"auto\", \"never\" or \"always\""),
            ))
        }
    };
    // The index and every header first, each file opened once and kept open for the load: a
    // bad checkpoint is a FormatError on any machine.
    let checkpoint = py.detach(|| Checkpoint::open(&path)).py_err()?;
    let c = ctx(py, device)?;
    let tensors = py
        .detach(|| {
            let w = checkpoint.load(&c.stager, &c.stream, LoadOptions::new().direct(direct))?;
            w.into_dlpack()
        })
        .py_err()?;
    let out = PyDict::new(py);
    for (name, t) in tensors {
        out.set_item(name, Bound::new(py, Tensor::new(t))?)?;
    }
    Ok(out)
}
