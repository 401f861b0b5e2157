//! Batched copies for the layers above: `memcpy_batch` (one `cudaMemcpyBatchAsync`, or one
//! `cudaMemcpyAsync` per copy before CUDA 13.0) for the staging engine, and
//! `batch_h2d_pageable`, the measured alternative to packing (`timing`).

use std::os::raw::c_void;

use super::{memcpy, same_len};
use crate::error::{check_with, Error, Result};
use crate::stream::Stream;
use crate::sys;

/// How `memcpy_batch` may read its sources (`cudaMemcpySrcAccessOrder`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BatchSrcAccess {
    /// In stream order, after everything queued on the stream before the batch (events waited
    /// on included): what `cudaMemcpyAsync` does. The one to use with trackers.
    Stream,
    /// Out of stream order; every read is done when the call returns, so the sources may be
    /// reused or freed right after it. Nothing queued earlier may still write the sources.
    DuringCall,
}

/// Whether `memcpy_batch` is one `cudaMemcpyBatchAsync` (runtime 13.0 and newer, where the
/// build script sets `cfg(pinstream_cuda_batch)`), or one `cudaMemcpyAsync` per copy.
pub(crate) const BATCH_COPIES: bool = cfg!(pinstream_cuda_batch);

#[cfg(pinstream_cuda_batch)]
impl BatchSrcAccess {
    fn raw(self) -> sys::cudaMemcpySrcAccessOrder {
        match self {
            BatchSrcAccess::Stream => sys::cudaMemcpySrcAccessOrder_cudaMemcpySrcAccessOrderStream,
            BatchSrcAccess::DuringCall => {
                sys::cudaMemcpySrcAccessOrder_cudaMemcpySrcAccessOrderDuringApiCall
            }
        }
    }
}

/// One `cudaMemcpyBatchAsync` of `count` host-to-device or device-to-host copies on `stream`.
///
/// `kind` is `cudaMemcpyHostToDevice` or `cudaMemcpyDeviceToHost` and holds for every copy of
/// the batch (it only sets the location hints; the runtime finds the direction from the
/// pointers). Copies within one batch run in no particular order, so no two may overlap where
/// one writes. The batch as a whole is ordered on the stream like one `cudaMemcpyAsync`; record
/// an event after it to know when it is done. It cannot be captured into a CUDA graph.
///
/// Built against a runtime older than 13.0 (no `cudaMemcpyBatchAsync` as called here), it is
/// `memcpy_each`: the same copies one `cudaMemcpyAsync` each, with the same guarantees.
///
/// # Safety
///
/// Every (dst, src, size) triple names live memory of the right kind, not freed or written by
/// the host until the stream passes this point (nor a destination read by it before then), and
/// no destination overlaps another copy's source or destination in the batch. With
/// `BatchSrcAccess::DuringCall` no work queued earlier (on any stream) may still write
/// a source, as those orders do not wait for it.
pub(crate) unsafe fn memcpy_batch(
    stream: &Stream,
    dsts: &[*mut c_void],
    srcs: &[*const c_void],
    sizes: &[usize],
    kind: sys::cudaMemcpyKind,
    src_access: BatchSrcAccess,
) -> Result<()> {
    const OP: &str = "memcpy_batch";
    let count = dsts.len();
    if srcs.len() != count || sizes.len() != count {
        return Err(Error::invalid(
            OP,
            format!(
                "{count} destinations, {} sources and {} sizes",
                srcs.len(),
                sizes.len()
            ),
        ));
    }
    if count == 0 {
        return Err(Error::invalid(OP, "an empty batch"));
    }
    #[cfg(not(pinstream_cuda_batch))]
    {
        let what = match kind {
            sys::cudaMemcpyKind::cudaMemcpyHostToDevice => "host to device",
            sys::cudaMemcpyKind::cudaMemcpyDeviceToHost => "device to host",
            other => {
                return Err(Error::invalid(
                    OP,
                    format!("{other:?}: only host-to-device or device-to-host batches"),
                ))
            }
        };
        memcpy_each(stream, dsts, srcs, sizes, kind, what, src_access)
    }
    #[cfg(pinstream_cuda_batch)]
    {
        // The hints only matter for memory without a fixed place (managed memory, or plain host
        // memory on a system where the GPU reads it directly, as with HMM); CUDA ignores them
        // otherwise. They say where each side lives: the host side in host memory, the device side
        // on the stream's device.
        let host = sys::cudaMemLocation {
            type_: sys::cudaMemLocationType_cudaMemLocationTypeHost,
            id: 0,
        };
        let device = sys::cudaMemLocation {
            type_: sys::cudaMemLocationType_cudaMemLocationTypeDevice,
            id: stream.device().raw(),
        };
        let (src_hint, dst_hint, what) = match kind {
            sys::cudaMemcpyKind::cudaMemcpyHostToDevice => (host, device, "host to device"),
            sys::cudaMemcpyKind::cudaMemcpyDeviceToHost => (device, host, "device to host"),
            other => {
                return Err(Error::invalid(
                    OP,
                    format!("{other:?}: only host-to-device or device-to-host batches"),
                ))
            }
        };
        // Flags: cudaMemcpyFlagPreferOverlapWithCompute rather than the default. The 13.0 header
        // calls it a hint to try to overlap the copies with compute work on the SMs, which the
        // driver may ignore depending on the platform and the copy's parameters. Overlap with the
        // kernels that consume the data is the staging engine's whole purpose, so where the driver
        // does weigh copy speed against concurrency this asks for the engine's side of it; where it
        // does not (NVIDIA's cuda.core notes the flag acts on Tegra only, so likely nothing on an
        // H100 or H200), it costs nothing. Being a hint, it never changes what is copied or when
        // the batch completes in stream order.
        let mut attrs = [sys::cudaMemcpyAttributes {
            srcAccessOrder: src_access.raw(),
            srcLocHint: src_hint,
            dstLocHint: dst_hint,
            flags: sys::cudaMemcpyFlags_cudaMemcpyFlagPreferOverlapWithCompute,
        }];
        // One attribute entry, applying from copy 0 to the end.
        let mut attr_idxs = [0usize];
        stream.enter()?;
        check_with(
            // SAFETY: the three arrays hold `count` entries each (checked above) and `attrs` /
            // `attr_idxs` one each, all alive across the call, which reads them before returning;
            // the stream is live and not the legacy default stream (pinstream streams are created
            // non-blocking). The copies themselves are the caller's contract (see # Safety).
            unsafe {
                sys::cudaMemcpyBatchAsync(
                    dsts.as_ptr(),
                    srcs.as_ptr(),
                    sizes.as_ptr(),
                    count,
                    attrs.as_mut_ptr(),
                    attr_idxs.as_mut_ptr(),
                    attrs.len(),
                    stream.as_raw(),
                )
            },
            "cudaMemcpyBatchAsync",
            || {
                let total = sizes.iter().fold(0usize, |a, &b| a.saturating_add(b));
                format!("{count} copies, {total} bytes, {what}, {src_access:?} source order")
            },
        )
    }
}

/// The stand-in for `cudaMemcpyBatchAsync` where the runtime lacks it: one `cudaMemcpyAsync`
/// per copy, in order on the stream. With `BatchSrcAccess::DuringCall` it then waits for the
/// stream, so that every source has been read when it returns, as the batch promises. If a copy
/// fails after others were queued, it waits for those before returning the error, so that (as
/// after a failed batch) none of them is still in flight.
///
/// The caller has checked that the three slices have the same length.
#[cfg_attr(pinstream_cuda_batch, allow(dead_code))]
fn memcpy_each(
    stream: &Stream,
    dsts: &[*mut c_void],
    srcs: &[*const c_void],
    sizes: &[usize],
    kind: sys::cudaMemcpyKind,
    what: &'static str,
    src_access: BatchSrcAccess,
) -> Result<()> {
    stream.enter()?;
    for (i, ((&dst, &src), &bytes)) in dsts.iter().zip(srcs).zip(sizes).enumerate() {
        if let Err(e) = memcpy(stream, dst, src, bytes, kind, what) {
            if i > 0 {
                stream.synchronize()?;
            }
            return Err(e);
        }
    }
    if src_access == BatchSrcAccess::DuringCall {
        stream.synchronize()?;
    }
    Ok(())
}

/// Copies each plain slice of `srcs` into the device buffer at the same index with one
/// `cudaMemcpyBatchAsync` that reads the sources during the call, then waits for the stream
/// (the measured alternative to packing; see `timing::batch_h2d_pageable`).
pub(crate) fn batch_h2d_pageable(
    stream: &Stream,
    srcs: &[&[u8]],
    dsts: &mut [crate::memory::DeviceBuffer<u8>],
) -> Result<()> {
    const OP: &str = "batch_h2d_pageable";
    if srcs.len() != dsts.len() {
        return Err(Error::LengthMismatch {
            op: OP,
            src: srcs.len(),
            dst: dsts.len(),
        });
    }
    let mut d = Vec::with_capacity(dsts.len());
    let mut s = Vec::with_capacity(srcs.len());
    let mut n = Vec::with_capacity(srcs.len());
    for (src, dst) in srcs.iter().zip(dsts.iter_mut()) {
        let r = crate::memory::sealed::DeviceMem::device_region(&*dst);
        same_len(OP, src.len(), r.len)?;
        stream.same_device(OP, r.device)?;
        if r.len == 0 {
            continue;
        }
        // Every destination waits for its own earlier uses on this stream first.
        r.tracker.wait_on(stream)?;
        d.push(r.ptr);
        s.push(src.as_ptr().cast::<c_void>());
        n.push(r.len);
    }
    if d.is_empty() {
        return Ok(());
    }
    // SAFETY: each source is a live borrowed slice read during the call (DuringCall), which
    // nothing on the GPU writes; each destination is a distinct device buffer borrowed mutably
    // (so no two overlap) whose earlier uses the stream waits for (above); the stream is
    // synchronised before the borrows end, so nothing is read or freed under the copies.
    unsafe {
        memcpy_batch(
            stream,
            &d,
            &s,
            &n,
            sys::cudaMemcpyKind::cudaMemcpyHostToDevice,
            BatchSrcAccess::DuringCall,
        )?
    };
    stream.synchronize()
}
