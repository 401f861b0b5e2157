//! `CopyLoop`: one copy queued many times as a single tracked batch, for timing.

use std::os::raw::c_void;

use bytemuck::Pod;

use crate::copy::{memcpy, memcpy_peer, reads_writes};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::memory::sealed::{DeviceMem, DeviceRegion, HostMem};
use crate::memory::tracker::{self, Access, Tracker};
use crate::memory::{DeviceSlice, DeviceSliceMut, HostKind, HostSlice, HostSliceMut};
use crate::stream::Stream;
use crate::sys;

/// The first `len` elements of one buffer copied into another, queued `n` at a time on one
/// stream with [`queue`](CopyLoop::queue): the loop a bandwidth measurement times between two
/// [`TimingEvent`](crate::TimingEvent)s.
///
/// Each `queue(n)` is one tracked batch — it waits once for the earlier uses of both buffers and
/// records one event after the last copy — so that what is timed is the copies, not pinstream's
/// bookkeeping between them; with [`pieces`](CopyLoop::pieces) each copy is issued as
/// consecutive pieces of at most that many bytes. Every copy is a plain `cudaMemcpyAsync`
/// (`cudaMemcpyPeerAsync` between devices): from or to pageable memory that is the driver's own
/// staging path, not pinstream's bounce blocks, so it measures what a plain copy of pageable
/// memory costs.
///
/// The loop holds the source borrowed and the destination borrowed mutably for as long as it
/// lives, and the buffers' trackers order it like any other copy: host access, other streams
/// and freeing wait for the copies queued. Where a side is plain (pageable) memory, which no
/// tracker guards, `queue` returns only when its copies have finished.
///
/// ```no_run
/// use pinstream::timing::{gbps, CopyLoop};
/// use pinstream::{Device, DeviceBuffer, TimingEvent};
/// # fn main() -> pinstream::Result<()> {
/// let dev = Device::get(0)?;
/// let stream = dev.stream()?;
/// let d = DeviceBuffer::<f32>::new(&dev, 1 << 20)?;
/// let mut host = vec![0f32; 1 << 20];
/// let (t0, t1) = (TimingEvent::new(&dev)?, TimingEvent::new(&dev)?);
/// let down = CopyLoop::d2h(&stream, &d, &mut host[..], 1 << 20)?.pieces(1 << 20);
/// stream.record(&t0)?;
/// down.queue(10)?;                   // ten 4 MiB copies, 1 MiB pieces, pageable destination
/// stream.record(&t1)?;
/// t1.synchronize()?;
/// println!("{:.2} GB/s", gbps(10.0 * 4.0 * (1 << 20) as f64, t0.elapsed(&t1)?.as_secs_f64()));
/// # Ok(()) }
/// ```
pub struct CopyLoop<'a> {
    stream: &'a Stream,
    uses: Vec<(&'a Tracker, Access)>,
    dst: *mut c_void,
    src: *const c_void,
    bytes: usize,
    piece: usize,
    how: How,
    /// A side is pageable memory: `queue` waits for its copies before returning.
    untracked: bool,
}

#[derive(Clone, Copy, Debug)]
enum How {
    Memcpy(sys::cudaMemcpyKind, &'static str),
    Peer { dst: Device, src: Device },
}

impl std::fmt::Debug for CopyLoop<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopyLoop")
            .field("bytes", &self.bytes)
            .field("piece", &self.piece)
            .field("how", &self.how)
            .field("untracked", &self.untracked)
            .finish_non_exhaustive()
    }
}

/// `len` elements of `T` in bytes, within both sides' lengths.
fn checked_bytes<T>(op: &'static str, len: usize, src: usize, dst: usize) -> Result<usize> {
    if len > src || len > dst {
        return Err(Error::InvalidArgument {
            op,
            reason: format!(
                "{len} elements asked for, the source has {src} and the destination {dst}"
            ),
        });
    }
    crate::error::byte_len::<T>(op, len)
}

impl<'a> CopyLoop<'a> {
    /// Host to device: the first `len` elements of `src` (pinned, registered or plain memory)
    /// into `dst`, a buffer or view on the stream's device.
    pub fn h2d<T, S, D>(stream: &'a Stream, src: &'a S, dst: &'a mut D, len: usize) -> Result<Self>
    where
        T: Pod,
        S: HostSlice<T> + ?Sized,
        D: DeviceSliceMut<T> + ?Sized,
    {
        const OP: &str = "CopyLoop::h2d";
        let dst: &'a D = dst;
        let (h, d) = (HostMem::host_region(src), DeviceMem::device_region(dst));
        let bytes = checked_bytes::<T>(OP, len, h.len, d.len)?;
        stream.same_device(OP, d.device)?;
        Ok(CopyLoop {
            stream,
            uses: reads_writes(h.tracker, Some(d.tracker)),
            dst: d.ptr,
            src: h.ptr,
            bytes,
            piece: bytes,
            how: How::Memcpy(
                sys::cudaMemcpyKind::cudaMemcpyHostToDevice,
                "host to device (CopyLoop)",
            ),
            untracked: h.kind == HostKind::Pageable,
        })
    }

    /// Device to host: the first `len` elements of `src`, on the stream's device, into `dst`
    /// (pinned, registered or plain memory; not memory registered read-only).
    pub fn d2h<T, S, D>(stream: &'a Stream, src: &'a S, dst: &'a mut D, len: usize) -> Result<Self>
    where
        T: Pod,
        S: DeviceSlice<T> + ?Sized,
        D: HostSliceMut<T> + ?Sized,
    {
        const OP: &str = "CopyLoop::d2h";
        let (d, h) = (DeviceMem::device_region(src), HostMem::host_region_mut(dst));
        let bytes = checked_bytes::<T>(OP, len, d.len, h.len)?;
        stream.same_device(OP, d.device)?;
        if h.read_only {
            return Err(Error::InvalidArgument {
                op: OP,
                reason: "the destination is registered read-only".into(),
            });
        }
        Ok(CopyLoop {
            stream,
            uses: reads_writes(Some(d.tracker), h.tracker),
            dst: h.ptr,
            src: d.ptr,
            bytes,
            piece: bytes,
            how: How::Memcpy(
                sys::cudaMemcpyKind::cudaMemcpyDeviceToHost,
                "device to host (CopyLoop)",
            ),
            untracked: h.kind == HostKind::Pageable,
        })
    }

    /// Device to device on the stream's device: the first `len` elements of `src` into `dst`.
    pub fn d2d<T, S, D>(stream: &'a Stream, src: &'a S, dst: &'a mut D, len: usize) -> Result<Self>
    where
        T: Pod,
        S: DeviceSlice<T> + ?Sized,
        D: DeviceSliceMut<T> + ?Sized,
    {
        let dst: &'a D = dst;
        let (s, d) = (DeviceMem::device_region(src), DeviceMem::device_region(dst));
        Self::on_device::<T>("CopyLoop::d2d", stream, s, d, len)
    }

    /// Between devices (`cudaMemcpyPeerAsync`), as [`Stream::copy_peer`]: the stream belongs to
    /// the source's device (it pushes) or the destination's (it pulls); peer access is enabled
    /// here, and a pair that cannot reach each other is
    /// [`Error::NoPeerAccess`](crate::Error::NoPeerAccess). Both on one device is the same as
    /// [`d2d`](CopyLoop::d2d).
    pub fn peer<T, S, D>(stream: &'a Stream, src: &'a S, dst: &'a mut D, len: usize) -> Result<Self>
    where
        T: Pod,
        S: DeviceSlice<T> + ?Sized,
        D: DeviceSliceMut<T> + ?Sized,
    {
        const OP: &str = "CopyLoop::peer";
        let dst: &'a D = dst;
        let (s, d) = (DeviceMem::device_region(src), DeviceMem::device_region(dst));
        if s.device == d.device {
            return Self::on_device::<T>(OP, stream, s, d, len);
        }
        let bytes = checked_bytes::<T>(OP, len, s.len, d.len)?;
        let here = stream.device();
        let there = if here == s.device {
            d.device
        } else if here == d.device {
            s.device
        } else {
            return Err(Error::WrongDevice {
                op: OP,
                expected: here.raw(),
                found: s.device.raw(),
            });
        };
        here.enable_peer_access(&there).map_err(|e| match e {
            Error::NoPeerAccess {
                device, peer, cuda, ..
            } => Error::NoPeerAccess {
                op: OP,
                device,
                peer,
                cuda,
            },
            other => other,
        })?;
        Ok(CopyLoop {
            stream,
            uses: reads_writes(Some(s.tracker), Some(d.tracker)),
            dst: d.ptr,
            src: s.ptr,
            bytes,
            piece: bytes,
            how: How::Peer {
                dst: d.device,
                src: s.device,
            },
            untracked: false,
        })
    }

    /// A device-to-device loop between two regions of the stream's device.
    fn on_device<T>(
        op: &'static str,
        stream: &'a Stream,
        s: DeviceRegion<'a>,
        d: DeviceRegion<'a>,
        len: usize,
    ) -> Result<Self> {
        let bytes = checked_bytes::<T>(op, len, s.len, d.len)?;
        stream.same_device(op, s.device)?;
        stream.same_device(op, d.device)?;
        Ok(CopyLoop {
            stream,
            uses: reads_writes(Some(s.tracker), Some(d.tracker)),
            dst: d.ptr,
            src: s.ptr,
            bytes,
            piece: bytes,
            how: How::Memcpy(
                sys::cudaMemcpyKind::cudaMemcpyDeviceToDevice,
                "device to device (CopyLoop)",
            ),
            untracked: false,
        })
    }

    /// Issues each copy as consecutive pieces of at most `bytes` bytes (at least 1), the last
    /// one shorter where they do not divide the copy.
    pub fn pieces(mut self, bytes: usize) -> Self {
        self.piece = bytes.max(1);
        self
    }

    /// Bytes per copy.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The stream the copies are queued on.
    pub fn stream(&self) -> &'a Stream {
        self.stream
    }

    /// Queues `n` copies, back to back, as one tracked batch. Returns once they are queued, or
    /// where a side is pageable memory once they have finished. Nothing is queued for `n == 0`
    /// or an empty copy.
    pub fn queue(&self, n: usize) -> Result<()> {
        if n == 0 || self.bytes == 0 {
            return Ok(());
        }
        self.stream.enter()?;
        let (_, event) = tracker::ordered_rw(self.stream, &self.uses, || {
            for _ in 0..n {
                let mut off = 0;
                while off < self.bytes {
                    let len = self.piece.min(self.bytes - off);
                    let d = self.dst.cast::<u8>().wrapping_add(off).cast::<c_void>();
                    let s = self.src.cast::<u8>().wrapping_add(off).cast::<c_void>();
                    match self.how {
                        How::Memcpy(kind, what) => memcpy(self.stream, d, s, len, kind, what)?,
                        How::Peer { dst, src } => memcpy_peer(self.stream, d, dst, s, src, len)?,
                    }
                    off += len;
                }
            }
            Ok(())
        })?;
        if self.untracked {
            // Nothing guards plain memory once the borrow ends: finish here.
            event.synchronize()?;
        }
        Ok(())
    }
}
