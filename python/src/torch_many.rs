//! `pinstream.torch.upload_many`'s native half: many torch CPU tensors read by pointer (no
//! DLPack export, no numpy view per tensor) into one packed upload.

use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

use crate::context::ctx;
use crate::errors::{invalid, OrPy};
use crate::tensor::{upload_slices, Tensor};

const OP: &str = "pinstream.torch.upload_many";

/// `torch.Tensor` and `torch.nn.Parameter` (the only types read by pointer: a subclass could
/// answer `data_ptr` with anything), and `torch.strided`.
struct Torch {
    tensor: Py<PyType>,
    parameter: Py<PyType>,
    strided: Py<PyAny>,
    /// `torch._C.TensorBase`'s own methods, called with the tensor as their argument: a plain
    /// tensor may carry instance attributes named `data_ptr` or `is_contiguous` that would
    /// shadow them (the properties used here are data descriptors, which cannot be shadowed).
    methods: [Py<PyAny>; 7],
}

const DATA_PTR: usize = 0;
const IS_CONTIGUOUS: usize = 1;
const IS_NEG: usize = 2;
const IS_CONJ: usize = 3;
const RESOLVE_CONJ: usize = 4;
const RESOLVE_NEG: usize = 5;
const CONTIGUOUS: usize = 6;

static TORCH: PyOnceLock<Torch> = PyOnceLock::new();

fn torch_types(py: Python<'_>) -> PyResult<&Torch> {
    TORCH.get_or_try_init(py, || {
        let torch = py.import("torch")?;
        let tensor = torch.getattr("Tensor")?.cast_into::<PyType>()?.unbind();
        let param = torch
            .getattr("nn")?
            .getattr("Parameter")?
            .cast_into::<PyType>()?
            .unbind();
        let base = torch.getattr("_C")?.getattr("TensorBase")?;
        let m = |name: &str| base.getattr(name).map(Bound::unbind);
        Ok(Torch {
            tensor,
            parameter: param,
            strided: torch.getattr("strided")?.unbind(),
            methods: [
                m("data_ptr")?,
                m("is_contiguous")?,
                m("is_neg")?,
                m("is_conj")?,
                m("resolve_conj")?,
                m("resolve_neg")?,
                m("contiguous")?,
            ],
        })
    })
}

/// One tensor's bytes: where, how many.
struct Raw {
    ptr: usize,
    len: usize,
}

/// Checks that `x` is a plain torch CPU tensor and returns where its bytes are, and the tensor
/// that holds them: `x` itself where its memory holds its values as they read (dense,
/// row-major, no lazy negation or conjugation), else a resolved contiguous copy (made by torch).
fn read<'py>(x: Bound<'py, PyAny>, types: &Torch) -> PyResult<(Raw, Bound<'py, PyAny>)> {
    let py = x.py();
    let t = x.get_type();
    if !(t.is(types.tensor.bind(py)) || t.is(types.parameter.bind(py))) {
        return Err(invalid(
            OP,
            format!(
                "a {} is not a torch.Tensor",
                t.name().map(|n| n.to_string()).unwrap_or_default()
            ),
        ));
    }
    if !x.getattr(intern!(py, "is_cpu"))?.is_truthy()? {
        return Err(invalid(OP, "a tensor is not on the CPU"));
    }
    if !x.getattr(intern!(py, "layout"))?.is(types.strided.bind(py)) {
        return Err(invalid(OP, "a tensor is not dense (torch.strided)"));
    }
    let call = |m: usize, x: &Bound<'py, PyAny>| types.methods[m].bind(py).call1((x,));
    let flag = |m: usize, x: &Bound<'py, PyAny>| -> PyResult<bool> { call(m, x)?.is_truthy() };
    let as_read = |x: &Bound<'py, PyAny>| -> PyResult<bool> {
        Ok(flag(IS_CONTIGUOUS, x)? && !flag(IS_NEG, x)? && !flag(IS_CONJ, x)?)
    };
    let x = if as_read(&x)? {
        x
    } else {
        let y = call(CONTIGUOUS, &call(RESOLVE_NEG, &call(RESOLVE_CONJ, &x)?)?)?;
        if !y.get_type().is(types.tensor.bind(py)) || !as_read(&y)? {
            return Err(invalid(OP, "torch did not make a contiguous copy"));
        }
        y
    };
    let len: usize = x.getattr(intern!(py, "nbytes"))?.extract()?;
    let ptr: usize = if len == 0 {
        0
    } else {
        call(DATA_PTR, &x)?.extract()?
    };
    if len > 0 && ptr == 0 {
        return Err(invalid(OP, "a tensor has no memory"));
    }
    Ok((Raw { ptr, len }, x))
}

/// Uploads the torch CPU tensors `xs` as one packed batch: the device arena as one `uint8`
/// tensor, each tensor's byte offset in it, and whether they all have one dtype and shape and
/// lie back to back (then one `view(n, *shape).unbind(0)` cuts the arena on torch's side).
#[pyfunction]
#[pyo3(signature = (xs, device = 0))]
pub(crate) fn upload_torch_packed<'py>(
    py: Python<'py>,
    xs: &Bound<'py, PyAny>,
    device: i64,
) -> PyResult<(Option<Tensor>, Vec<usize>, bool)> {
    let types = torch_types(py)?;
    let c = ctx(py, device)?;
    let mut held = Vec::new();
    let mut raws = Vec::new();
    let mut uniform = true;
    let mut first: Option<(Bound<'py, PyAny>, Bound<'py, PyAny>)> = None;
    // Every item first: the iterable's own code (a generator) runs before any pointer is
    // read, so it cannot free a tensor whose pointer was taken.
    let items = xs.try_iter()?.collect::<PyResult<Vec<_>>>()?;
    for x in items {
        let (raw, holder) = read(x.clone(), types)?;
        raws.push(raw);
        if uniform {
            let dtype = x.getattr(intern!(py, "dtype"))?;
            let shape = x.getattr(intern!(py, "shape"))?;
            match &first {
                None => first = Some((dtype, shape)),
                Some((d, s)) => uniform = d.is(&dtype) && s.eq(&shape)?,
            }
        }
        held.push(holder.unbind());
    }
    let (arena, offsets) = py
        .detach(|| {
            upload_slices(
                &c,
                raws.iter().map(|r| {
                    Ok(if r.len == 0 {
                        &[][..]
                    } else {
                        // SAFETY: torch reported `len` bytes of CPU memory at `ptr` for a
                        // plain dense, contiguous tensor (checked above, on the exact torch
                        // types); `held` keeps each tensor, so its storage, alive until this
                        // call returns, and the bytes are only read. (As in torch's own
                        // copies, a concurrent `resize_` of the tensor from another thread is
                        // the caller's race.)
                        unsafe { std::slice::from_raw_parts(r.ptr as *const u8, r.len) }
                    })
                }),
            )
        })
        .py_err()?;
    drop(held);
    let packed = uniform
        && offsets
            .iter()
            .zip(&raws)
            .try_fold(0usize, |at, (&o, r)| (o == at).then(|| at + r.len))
            .is_some();
    Ok((arena.map(Tensor::new), offsets, packed))
}
