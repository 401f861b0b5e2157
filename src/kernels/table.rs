//! A launch's per-sample table: in the launch's own parameters when it is small (the launch
//! copies them when it is queued: nothing to upload, nothing that must outlive the call, no wait
//! for the stream), else written into a free region of the stream's pinned table ring and
//! uploaded from there into the stream's device scratch, on the stream (`kernels::ring`): the
//! call does not wait for the stream either, and no upload reads memory that is freed when the
//! call returns. The tables stay locked until the launch is queued, so no other launch on the
//! stream can overwrite the scratch in between.

use std::ffi::c_void;
use std::sync::MutexGuard;

use bytemuck::Pod;

use super::ring::{self, TableRing};
use crate::error::{Error, Result};
use crate::memory::sealed::DeviceMem;
use crate::memory::tracker::Tracker;
use crate::memory::DeviceBuffer;
use crate::stream::{Slot, Stream};

/// Memory for the small per-launch tables of one stream's kernels, reused launch after launch;
/// kept in the stream's slot ([`Stream::slot`]).
#[derive(Debug)]
struct Tables {
    /// Device memory the launch reads. Every upload into it and every launch that reads it is
    /// queued on this stream, so each upload runs after the previous launch's reads.
    scratch: DeviceBuffer<u8>,
    /// Pinned host memory the uploads read, each region guarded by the event after its upload
    /// (`kernels::ring`): no host wait, and nothing left for the driver to stage.
    ring: TableRing,
}

/// The tables a slot holds, if it holds them.
fn tables_in(slot: &mut Slot) -> Option<&mut Tables> {
    slot.as_mut().and_then(|b| b.downcast_mut::<Tables>())
}

/// The stream's tables, locked, with a device scratch buffer at least `bytes` long and a
/// pinned ring: upload into the scratch through the ring and queue the launch that reads it
/// before the guard drops. A scratch buffer too small is replaced (after a wait for the
/// launches that still read it: only while the tables grow).
fn tables(stream: &Stream, bytes: usize) -> Result<MutexGuard<'_, Slot>> {
    let mut g = stream.slot();
    let small = tables_in(&mut g).map(|t| t.scratch.len() < bytes);
    if small != Some(false) {
        // Room to grow by half again before the next replacement.
        let len = bytes.saturating_add(bytes / 2).max(4096);
        let ring = match g.take().and_then(|b| b.downcast::<Tables>().ok()) {
            Some(old) => {
                // An upload whose launch failed to queue is not tracked: wait for it too.
                if let Err(e) = stream.synchronize() {
                    *g = Some(old);
                    return Err(e);
                }
                let Tables { scratch, ring } = *old;
                drop(scratch);
                ring
            }
            None => TableRing::new(stream.device(), stream.id()),
        };
        let scratch = match DeviceBuffer::new(&stream.device(), len) {
            Ok(b) => b,
            Err(e) => {
                // The ring alone is no use without a scratch; it waits for its events when dropped.
                drop(ring);
                return Err(e);
            }
        };
        *g = Some(Box::new(Tables { scratch, ring }));
    }
    Ok(g)
}

/// Where a launch finds its table: `param` (host rows for the launch's parameters) or
/// `device` (the scratch the rows were uploaded to), the other null; both null for no table.
pub(crate) struct Placed<'s, R> {
    pub(crate) param: *const R,
    pub(crate) device: *const c_void,
    guard: Option<MutexGuard<'s, Slot>>,
}

impl<R> Placed<'_, R> {
    /// The scratch's tracker where the rows were uploaded: the launch must be ordered after
    /// that upload (a write on this stream) and the next upload after the launch.
    pub(crate) fn tracker(&self) -> Option<&Tracker> {
        let slot = self.guard.as_deref()?;
        let t = slot.as_ref()?.downcast_ref::<Tables>()?;
        Some(t.scratch.device_region().tracker)
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
    let in_params = rows.len() <= param_max && ring::upload_mode() == ring::Upload::Kernel;
    if in_params {
        return Ok(Placed {
            param: rows.as_ptr(),
            device: std::ptr::null(),
            guard: None,
        });
    }
    let table: &[u8] = bytemuck::cast_slice(rows);
    let mut guard = tables(stream, table.len())?;
    let Some(Tables { scratch: buf, ring }) = tables_in(&mut guard) else {
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
