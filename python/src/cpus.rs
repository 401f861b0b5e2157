//! `cpus=`: the CPUs a prefetcher's or an image feed's threads run on
//! (`PrefetchConfig::cpus`), taken from any iterable of integers (a list, a set such as
//! `os.sched_getaffinity(0)`, a range).

use pinstream::prefetch::{CpuBinding, MAX_CPUS};
use pinstream::Error;
use pyo3::exceptions::{PyOverflowError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBool;

use crate::errors::{invalid, to_py};

/// The calling thread bound to `cpus` (see `CpuBinding::bind`), its refusal an
/// `InvalidArgumentError` of `op`.
pub(crate) fn bind(op: &'static str, cpus: &[usize]) -> PyResult<CpuBinding> {
    CpuBinding::bind(cpus).map_err(|e| match e {
        Error::InvalidArgument { reason, .. } => invalid(op, reason),
        other => to_py(other),
    })
}

/// `None` stays `None`; anything else must be an iterable of at most `MAX_CPUS` integers in
/// `0..MAX_CPUS` (bools refused), or an `InvalidArgumentError` naming `op`. Reads at most
/// `MAX_CPUS + 1` items, so an endless iterator is refused, not followed.
pub(crate) fn cpu_list(
    op: &'static str,
    x: Option<&Bound<'_, PyAny>>,
) -> PyResult<Option<Vec<usize>>> {
    let Some(x) = x.filter(|x| !x.is_none()) else {
        return Ok(None);
    };
    let bad = |why: String| invalid(op, format!("cpus: {why}"));
    let it = x.try_iter().map_err(|_| {
        bad(format!(
            "give CPU numbers (a list or set of integers), not {}",
            type_name(x)
        ))
    })?;
    let mut cpus = Vec::new();
    for item in it {
        let item = item?;
        if cpus.len() == MAX_CPUS {
            return Err(bad(format!("more than {MAX_CPUS} entries")));
        }
        let c = if item.is_instance_of::<PyBool>() {
            None
        } else {
            match item.extract::<usize>() {
                Ok(c) => Some(c),
                // Not a number, or not one that fits: refused below. Anything else the item's
                // own `__index__` raised (Ctrl-C among them) goes to the caller as it is.
                Err(e)
                    if e.is_instance_of::<PyTypeError>(x.py())
                        || e.is_instance_of::<PyOverflowError>(x.py())
                        || e.is_instance_of::<PyValueError>(x.py()) =>
                {
                    None
                }
                Err(e) => return Err(e),
            }
        };
        match c {
            Some(c) if c < MAX_CPUS => cpus.push(c),
            _ => {
                return Err(bad(format!(
                    "{} is not a CPU number (an integer in 0..{MAX_CPUS})",
                    item.repr()
                        .map(|r| r.to_string())
                        .unwrap_or_else(|_| "an item".into())
                )))
            }
        }
    }
    if cpus.is_empty() {
        return Err(bad(
            "empty (None runs the threads where the caller may run)".into(),
        ));
    }
    Ok(Some(cpus))
}

fn type_name(x: &Bound<'_, PyAny>) -> String {
    x.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "this".into())
}
