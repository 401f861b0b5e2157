//! Safe launchers for pinstream's CUDA kernels: the fused normalize / cast
//! (`normalize`, `denormalize`), the fused resized crop (`resized_crop`: crop, resize, mirror,
//! normalize, cast), their CPU references (`cpu`), and small utilities (`fill`, `iota`).

pub mod cpu;
mod element;
mod normalize;
mod resize;
mod resize_cpu;
pub(crate) mod ring;
mod spec;
mod table;

pub use cpu::PerSample;
pub use element::{DenormInput, OutputElement};
pub use normalize::{denormalize, normalize, DevicePerSample};
pub use resize::{resized_crop, ResizeSample, ResizeSpec, MAX_OUT_SIDE, MAX_SIDE};
pub use spec::{Crop, CropBox, Layout, Normalize, Sample, Spec};

use bytemuck::Pod;

use crate::error::{check_with, Error, Result};
use crate::memory::tracker;
use crate::memory::DeviceSliceMut;
use crate::stream::Stream;
use crate::sys;

/// Sets every element of `dst` to `value` (any `Pod` type of 1, 2, 4 or 8 bytes).
pub fn fill<T: Pod, D: DeviceSliceMut<T> + ?Sized>(
    stream: &Stream,
    dst: &mut D,
    value: T,
) -> Result<()> {
    const OP: &str = "kernels::fill";
    let width = std::mem::size_of::<T>();
    if !matches!(width, 1 | 2 | 4 | 8) {
        return Err(Error::invalid(
            OP,
            format!("elements of {width} bytes (1, 2, 4 or 8 are supported)"),
        ));
    }
    let r = dst.device_region();
    stream.same_device(OP, r.device)?;
    if r.len == 0 {
        return Ok(());
    }
    let mut pattern = [0u8; 8];
    pattern[..width].copy_from_slice(bytemuck::bytes_of(&value));
    let pattern = u64::from_le_bytes(pattern);
    stream.enter()?;
    tracker::ordered(stream, &[r.tracker], || {
        // SAFETY: `r.ptr` addresses `r.len` elements of `width` bytes on the stream's device,
        // kept alive by the borrow and the tracker; the launcher checks the launch.
        check_with(
            unsafe { sys::pinstream_fill(r.ptr, r.len, width as i32, pattern, stream.as_raw()) },
            "pinstream_fill",
            || format!("{} elements of {width} bytes", r.len),
        )
    })
    .map(|_| ())
}

/// `dst[i] = start + i * step` (wrapping).
pub fn iota<D: DeviceSliceMut<u32> + ?Sized>(
    stream: &Stream,
    dst: &mut D,
    start: u32,
    step: u32,
) -> Result<()> {
    let r = dst.device_region();
    stream.same_device("kernels::iota", r.device)?;
    if r.len == 0 {
        return Ok(());
    }
    stream.enter()?;
    tracker::ordered(stream, &[r.tracker], || {
        // SAFETY: as in `fill`, for `r.len` u32 elements.
        check_with(
            unsafe { sys::pinstream_iota_u32(r.ptr.cast(), r.len, start, step, stream.as_raw()) },
            "pinstream_iota_u32",
            || format!("{} elements", r.len),
        )
    })
    .map(|_| ())
}

#[cfg(feature = "timing")]
/// Queues the gate kernel: it holds `stream` until the host stores a non-zero value at
/// `flag[0]` (mapped pinned memory, device address `flag`), or `timeout` passes, which sets
/// `flag[1]`. The caller keeps the flag memory alive until the stream has passed the gate.
pub(crate) fn gate(stream: &Stream, flag: *mut u32, timeout: std::time::Duration) -> Result<()> {
    stream.enter()?;
    let ns = u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX);
    // SAFETY: `flag` is the device address of two live mapped u32 words (see above).
    check_with(
        unsafe { sys::pinstream_gate(flag, ns, stream.as_raw()) },
        "pinstream_gate",
        || format!("timeout {ns} ns"),
    )
}
