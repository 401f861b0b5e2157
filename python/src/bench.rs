//! Hooks for `python/bench/vs_torch.py`: the Rust calls under the Python ones, timed in Rust in
//! the same process, so that the script can report what the Python layer adds per call.

use std::time::Instant;

use pinstream::{dlpack, DeviceBuffer};
use pyo3::prelude::*;

use crate::context::ctx;
use crate::errors::{invalid, OrPy};

/// Seconds per call of what `pinstream.upload(x)` does under Python, from a Rust `Vec` of
/// `nbytes` random bytes, `iters` times: a device buffer from the pool, the staged upload (its
/// source free again on return), the DLPack tensor, dropped. The GIL is released throughout.
#[pyfunction]
#[pyo3(signature = (nbytes, iters, device = 0))]
pub(crate) fn rust_upload_times(
    py: Python<'_>,
    nbytes: usize,
    iters: usize,
    device: i64,
) -> PyResult<Vec<f64>> {
    const OP: &str = "pinstream._native.rust_upload_times";
    if nbytes == 0 || iters == 0 || iters > 1_000_000 {
        return Err(invalid(OP, "nbytes > 0 and 0 < iters <= 1e6"));
    }
    let c = ctx(py, device)?;
    py.detach(|| -> pinstream::Result<Vec<f64>> {
        let mut src = Vec::new();
        src.try_reserve_exact(nbytes)
            .map_err(|e| pinstream::Error::InvalidArgument {
                op: OP,
                reason: e.to_string(),
            })?;
        // Not zeros: a xorshift stream.
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        src.extend((0..nbytes).map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s as u8
        }));
        let mut times = Vec::with_capacity(iters);
        for _ in 0..iters {
            let t0 = Instant::now();
            let mut buf = DeviceBuffer::<u8>::new_async(&c.stream, nbytes)?;
            c.stager.upload(&c.stream, &src, &mut buf)?;
            drop(dlpack::Tensor::from_device(buf)?);
            times.push(t0.elapsed().as_secs_f64());
        }
        Ok(times)
    })
    .py_err()
}
