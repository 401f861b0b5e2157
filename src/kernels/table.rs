//! A launch's per-sample table: in the launch's own parameters when it is small (the launch
//! copies them when it is queued: nothing to upload, nothing that must outlive the call, no wait
//! for the stream), else written into a free region of the stream's pinned table ring and
//! uploaded from there into the stream's device scratch, on the stream (`memory::ring`): the
//! call does not wait for the stream either, and no upload reads memory that is freed when the
//! call returns. The tables stay locked until the launch is queued, so no other launch on the
//! stream can overwrite the scratch in between.

use std::ffi::c_void;
use std::sync::MutexGuard;

use bytemuck::Pod;

use crate::error::{Error, Result};
use crate::memory::sealed::DeviceMem;
use crate::memory::tracker::Tracker;
use crate::stream::{Stream, Tables};

/// Where a launch finds its table: `param` (host rows for the launch's parameters) or
/// `device` (the scratch the rows were uploaded to), the other null; both null for no table.
pub(crate) struct Placed<'s, R> {
    pub(crate) param: *const R,
    pub(crate) device: *const c_void,
    guard: Option<MutexGuard<'s, Tables>>,
}

impl<R> Placed<'_, R> {
    /// The scratch's tracker where the rows were uploaded: the launch must be ordered after
    /// that upload (a write on this stream) and the next upload after the launch.
    pub(crate) fn tracker(&self) -> Option<&Tracker> {
        self.guard
            .as_ref()
            .and_then(|g| g.scratch.as_ref())
            .map(|b| b.device_region().tracker)
    }
}

/// Places `rows` for a launch on `stream`: in its parameters when there are at most
/// `param_max` of them (and table uploads are not forced through DMA), else uploaded.
pub(crate) fn place<'s, R: Pod>(
    op: &'static str,
    stream: &'s Stream,
    rows: &'s [R],
    param_max: usize,
) -> Result<Placed<'s, R>> {
    if rows.is_empty() {
        return Ok(Placed {
            param: std::ptr::null(),
            device: std::ptr::null(),
            guard: None,
        });
    }
    let in_params = rows.len() <= param_max
        && crate::memory::ring::upload_mode() == crate::memory::ring::Upload::Kernel;
    if in_params {
        return Ok(Placed {
            param: rows.as_ptr(),
            device: std::ptr::null(),
            guard: None,
        });
    }
    let table: &[u8] = bytemuck::cast_slice(rows);
    let mut guard = stream.tables(table.len())?;
    let t = &mut *guard;
    let (Some(buf), Some(ring)) = (t.scratch.as_ref(), t.ring.as_mut()) else {
        return Err(Error::invalid(op, "the stream's table memory is missing"));
    };
    // Not tracked on its own: only this stream uses the scratch, so the upload follows the last
    // launch that read it, and the launch (tracked through `tracker`) follows the upload.
    ring.upload(stream, table, buf)?;
    let device = buf.device_region().ptr.cast_const();
    Ok(Placed {
        param: std::ptr::null(),
        device,
        guard: Some(guard),
    })
}
