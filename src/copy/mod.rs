//! Copies on a stream: host to device, device to host, device to device, and between devices
//! (`copy_peer`).
//!
//! Device-to-host copies return a `Pending` that keeps the destination mutably borrowed until
//! `wait()` hands out the data, so reading a result before it has arrived — the PyTorch
//! `.to("cpu", non_blocking=True)` hazard — does not compile.

use std::marker::PhantomData;
use std::os::raw::c_void;
use std::sync::Arc;

use bytemuck::Pod;

use crate::device::Device;
use crate::error::{check_with, Error, Result};
use crate::event::Event;
use crate::memory::sealed::{DeviceRegion, HostMem};
use crate::memory::tracker::{self, Access, Tracker};
use crate::memory::{DeviceSlice, DeviceSliceMut, HostKind, HostSlice, HostSliceMut};
use crate::stream::Stream;
use crate::sys;

#[cfg(any(feature = "staging", feature = "timing"))]
mod batch;
pub(crate) mod bounce;
mod download;

#[cfg(feature = "timing")]
pub(crate) use batch::batch_h2d_pageable;
#[cfg(feature = "staging")]
pub(crate) use batch::{memcpy_batch, BatchSrcAccess, BATCH_COPIES};
pub use download::{Download, DownloadTarget};

/// A host-to-device copy in flight. It borrows the source, so the source can be neither
/// mutated nor dropped while this value lives (a compile error). Dropping it does not wait —
/// the source's own event still guards later host access — while `wait()` blocks until the copy
/// has finished.
#[derive(Debug)]
pub struct InFlight<'s> {
    event: Option<Arc<Event>>,
    _src: PhantomData<&'s ()>,
}

impl InFlight<'_> {
    /// Blocks until the copy has finished.
    pub fn wait(self) -> Result<()> {
        self.event.as_ref().map_or(Ok(()), |e| e.synchronize())
    }

    /// Whether the copy has finished, without blocking.
    pub fn is_complete(&self) -> Result<bool> {
        self.event.as_ref().map_or(Ok(true), |e| e.is_complete())
    }
}

/// A device-to-host copy in flight. It holds the destination mutably borrowed: the only way to
/// read the data is `wait()`, which blocks until it has arrived. Dropping it without waiting
/// waits too, so no one reads a half-written buffer.
#[must_use = "the copy is only finished after `wait()`; read the data through it"]
pub struct Pending<'d, T> {
    ptr: *mut T,
    len: usize,
    event: Option<Arc<Event>>,
    _dst: PhantomData<&'d mut [T]>,
}

// SAFETY: a `Pending` stands for the `&'d mut [T]` it holds.
unsafe impl<T: Send> Send for Pending<'_, T> {}
// SAFETY: as above; `&Pending` gives no access to the data.
unsafe impl<T: Sync> Sync for Pending<'_, T> {}

impl<T> std::fmt::Debug for Pending<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pending")
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl<'d, T> Pending<'d, T> {
    /// Blocks until the data has arrived, then gives it out.
    pub fn wait(self) -> Result<&'d [T]> {
        self.wait_mut().map(|s| &*s)
    }

    /// As `wait`, with write access.
    pub fn wait_mut(mut self) -> Result<&'d mut [T]> {
        if let Some(ev) = &self.event {
            ev.synchronize()?;
        }
        self.event = None;
        // SAFETY: the copy into `ptr[..len]` has finished (waited above); the memory is the
        // destination borrowed mutably for 'd, which the returned slice inherits.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) })
    }

    /// Whether the data has arrived, without blocking.
    pub fn is_ready(&self) -> Result<bool> {
        self.event.as_ref().map_or(Ok(true), |e| e.is_complete())
    }
}

impl<T> Drop for Pending<'_, T> {
    fn drop(&mut self) {
        if let Some(ev) = self.event.take() {
            // The destination's borrow ends here: the copy must be over first.
            let _ = ev.synchronize();
        }
    }
}

pub(crate) fn memcpy(
    stream: &Stream,
    dst: *mut c_void,
    src: *const c_void,
    bytes: usize,
    kind: sys::cudaMemcpyKind,
    what: &'static str,
) -> Result<()> {
    // SAFETY: the callers pass regions that were checked to be `bytes` long and on the right
    // sides; both stay alive for the copy through borrows and trackers.
    check_with(
        unsafe { sys::cudaMemcpyAsync(dst, src, bytes, kind, stream.as_raw()) },
        "cudaMemcpyAsync",
        || format!("{bytes} bytes, {what}"),
    )
}

/// `cudaMemcpyPeerAsync` of `bytes` from `src` on `src_device` to `dst` on `dst_device`, queued
/// on `stream`.
pub(crate) fn memcpy_peer(
    stream: &Stream,
    dst: *mut c_void,
    dst_device: Device,
    src: *const c_void,
    src_device: Device,
    bytes: usize,
) -> Result<()> {
    check_with(
        // SAFETY: the callers pass device regions that were checked to be `bytes` long and to
        // live on the devices named; both stay alive for the copy through borrows and
        // trackers; the stream is live and on one of the two devices.
        unsafe {
            sys::cudaMemcpyPeerAsync(
                dst,
                dst_device.raw(),
                src,
                src_device.raw(),
                bytes,
                stream.as_raw(),
            )
        },
        "cudaMemcpyPeerAsync",
        || {
            format!(
                "{bytes} bytes, device {} to device {}, on a stream of device {}",
                src_device.raw(),
                dst_device.raw(),
                stream.device().raw()
            )
        },
    )
}

fn same_len(op: &'static str, src: usize, dst: usize) -> Result<()> {
    if src != dst {
        return Err(Error::LengthMismatch { op, src, dst });
    }
    Ok(())
}

/// The uses of a copy from `src` to `dst` (a side without a tracker is pageable memory, which
/// the copy is done with before it returns).
pub(crate) fn reads_writes<'a>(
    src: Option<&'a Tracker>,
    dst: Option<&'a Tracker>,
) -> Vec<(&'a Tracker, Access)> {
    let reads = src.map(|t| (t, Access::Read));
    let writes = dst.map(|t| (t, Access::Write));
    reads.into_iter().chain(writes).collect()
}

impl Stream {
    /// Copies `src` (pinned, registered or plain host memory) into `dst` on this stream.
    ///
    /// From pinned or registered memory the call returns at once; the source's event keeps it
    /// from being changed or freed before the copy has read it. From a plain slice of at most
    /// 1 MiB it copies the data into a pinned bounce block and returns at once too; from a
    /// larger plain slice it returns when the copy has finished. Either way `src` may be reused
    /// as soon as the call returns, on every system (also where the GPU reads pageable memory
    /// directly).
    ///
    /// ```no_run
    /// use pinstream::{Device, DeviceBuffer, HostAlloc, PinnedBuffer};
    /// # fn main() -> pinstream::Result<()> {
    /// let dev = Device::get(0)?;
    /// let stream = dev.stream()?;
    /// let mut d = DeviceBuffer::<f32>::new(&dev, 256)?;
    /// let pinned = PinnedBuffer::from_slice(&dev, &[1.0f32; 256], HostAlloc::DEFAULT)?;
    /// stream.copy_h2d(&pinned, &mut d)?;             // asynchronous
    /// let plain = vec![2.0f32; 256];
    /// stream.copy_h2d(&plain[..], &mut d)?.wait()?;  // `wait` blocks until it has landed
    /// # Ok(()) }
    /// ```
    pub fn copy_h2d<'s, T, S, D>(&self, src: &'s S, dst: &mut D) -> Result<InFlight<'s>>
    where
        T: Pod,
        S: HostSlice<T> + ?Sized,
        D: DeviceSliceMut<T> + ?Sized,
    {
        const OP: &str = "Stream::copy_h2d";
        let (h, d) = (src.host_region(), dst.device_region());
        same_len(OP, h.len, d.len)?;
        self.same_device(OP, d.device)?;
        let bytes = h.len * std::mem::size_of::<T>();
        if bytes == 0 {
            return Ok(InFlight {
                event: None,
                _src: PhantomData,
            });
        }
        self.enter()?;
        if h.kind == HostKind::Pageable && bytes <= bounce::MAX_BYTES {
            // Pieces of at most `bounce::CHUNK`, each queued as soon as it is staged, so the DMA
            // of one overlaps the host copy of the next.
            let data: &[u8] = bytemuck::cast_slice(src.host_read()?);
            let mut event = None;
            for (i, piece) in data.chunks(bounce::CHUNK).enumerate() {
                let dst = d.ptr.cast::<u8>().wrapping_add(i * bounce::CHUNK).cast();
                let mut block = bounce::take(self.device(), piece.len())?;
                let mut stage = || {
                    block.as_mut_slice()?[..piece.len()].copy_from_slice(piece);
                    let staged = block.host_region();
                    tracker::ordered_rw(
                        self,
                        &reads_writes(staged.tracker, Some(d.tracker)),
                        || {
                            memcpy(
                                self,
                                dst,
                                staged.ptr,
                                piece.len(),
                                sys::cudaMemcpyKind::cudaMemcpyHostToDevice,
                                "host to device (staged)",
                            )
                        },
                    )
                };
                let queued = stage();
                bounce::give_back(block);
                event = Some(queued?.1);
            }
            return Ok(InFlight {
                event,
                _src: PhantomData,
            });
        }
        let (_, event) =
            tracker::ordered_rw(self, &reads_writes(h.tracker, Some(d.tracker)), || {
                memcpy(
                    self,
                    d.ptr,
                    h.ptr,
                    bytes,
                    sys::cudaMemcpyKind::cudaMemcpyHostToDevice,
                    "host to device",
                )
            })?;
        if h.kind == HostKind::Pageable {
            // Nothing guards a plain slice once the borrow ends: finish the copy here rather
            // than trust the driver to have staged it (it may not have, and the slice may even
            // be page-locked elsewhere, which makes the copy truly asynchronous).
            event.synchronize()?;
        }
        Ok(InFlight {
            event: Some(event),
            _src: PhantomData,
        })
    }

    /// Copies `src` into `dst` (pinned, registered or plain host memory) on this stream. Read the
    /// data through the returned `Pending`. Into plain memory the copy has finished when the
    /// call returns (CUDA's semantics for pageable memory), and `wait()` returns at once.
    ///
    /// ```no_run
    /// use pinstream::{Device, DeviceBuffer, HostAlloc, PinnedBuffer};
    /// # fn main() -> pinstream::Result<()> {
    /// let dev = Device::get(0)?;
    /// let stream = dev.stream()?;
    /// let d = DeviceBuffer::<u16>::new(&dev, 64)?;
    /// let mut host = PinnedBuffer::<u16>::new(&dev, 64, HostAlloc::DEFAULT)?;
    /// let pending = stream.copy_d2h(&d, &mut host)?;
    /// // `host` is borrowed by `pending` here: reading it would not compile.
    /// let values: &[u16] = pending.wait()?;
    /// println!("{}", values.len());
    /// # Ok(()) }
    /// ```
    pub fn copy_d2h<'d, T, S, D>(&self, src: &S, dst: &'d mut D) -> Result<Pending<'d, T>>
    where
        T: Pod,
        S: DeviceSlice<T> + ?Sized,
        D: HostSliceMut<T> + ?Sized,
    {
        const OP: &str = "Stream::copy_d2h";
        let (d, h) = (src.device_region(), dst.host_region_mut());
        same_len(OP, d.len, h.len)?;
        self.same_device(OP, d.device)?;
        if h.read_only {
            return Err(Error::invalid(
                OP,
                "the destination is registered read-only",
            ));
        }
        let mut pending = Pending {
            ptr: h.ptr.cast(),
            len: h.len,
            event: None,
            _dst: PhantomData,
        };
        let bytes = h.len * std::mem::size_of::<T>();
        if bytes == 0 {
            return Ok(pending);
        }
        self.enter()?;
        let (_, event) =
            tracker::ordered_rw(self, &reads_writes(Some(d.tracker), h.tracker), || {
                memcpy(
                    self,
                    h.ptr,
                    d.ptr,
                    bytes,
                    sys::cudaMemcpyKind::cudaMemcpyDeviceToHost,
                    "device to host",
                )
            })?;
        pending.event = Some(event);
        if h.kind == HostKind::Pageable {
            // Synchronous for pageable memory already; this also covers a plain slice that is
            // page-locked elsewhere, which no tracker guards.
            let event = pending.event.take();
            if let Some(ev) = event {
                ev.synchronize()?;
            }
        }
        Ok(pending)
    }

    /// Copies `src` into `dst`, both on this stream's device. Either may be a view.
    ///
    /// ```no_run
    /// use pinstream::{Device, DeviceBuffer};
    /// # fn main() -> pinstream::Result<()> {
    /// let dev = Device::get(0)?;
    /// let stream = dev.stream()?;
    /// let a = DeviceBuffer::<f32>::new(&dev, 1024)?;
    /// let mut b = DeviceBuffer::<f32>::new(&dev, 2048)?;
    /// stream.copy_d2d(&a, &mut b.slice_mut(1024..)?)?; // into the upper half of `b`
    /// # Ok(()) }
    /// ```
    pub fn copy_d2d<T, S, D>(&self, src: &S, dst: &mut D) -> Result<()>
    where
        T: Pod,
        S: DeviceSlice<T> + ?Sized,
        D: DeviceSliceMut<T> + ?Sized,
    {
        self.d2d::<T>("Stream::copy_d2d", src.device_region(), dst.device_region())
    }

    fn d2d<T>(&self, op: &'static str, s: DeviceRegion<'_>, d: DeviceRegion<'_>) -> Result<()> {
        same_len(op, s.len, d.len)?;
        self.same_device(op, s.device)?;
        self.same_device(op, d.device)?;
        let bytes = s.len * std::mem::size_of::<T>();
        if bytes == 0 {
            return Ok(());
        }
        self.enter()?;
        tracker::ordered_rw(
            self,
            &reads_writes(Some(s.tracker), Some(d.tracker)),
            || {
                memcpy(
                    self,
                    d.ptr,
                    s.ptr,
                    bytes,
                    sys::cudaMemcpyKind::cudaMemcpyDeviceToDevice,
                    "device to device",
                )
            },
        )
        .map(|_| ())
    }

    /// Copies `src` on one device into `dst` on another (`cudaMemcpyPeerAsync`), on this
    /// stream, which must belong to one of the two devices. Either may be a view.
    ///
    /// Like every copy it is ordered after the earlier uses of both buffers, whatever stream or
    /// device ran them, and later uses of either wait for it; the call returns at once.
    ///
    /// - **Which device does the work**: the stream's. On a stream of the source's device the
    ///   source pushes the data (nvbandwidth's `device_to_device_memcpy_write_ce`); on one of
    ///   the destination's it pulls it (`_read_ce`). `pinstream bandwidth --directions p2p`
    ///   measures both (`p2p`, `p2p-read`). Neither operand on the stream's device is
    ///   [`Error::WrongDevice`] (naming the source's device).
    /// - **Peer access** from the stream's device to the other is enabled on first use, once
    ///   per ordered pair of devices and process ([`Device::enable_peer_access`]). Where the
    ///   two devices cannot reach each other (no NVLink or PCIe peer path, see
    ///   [`Device::can_access_peer`]) the call is [`Error::NoPeerAccess`] and nothing is
    ///   queued: it never falls back silently to a copy through host memory, which would run
    ///   at a fraction of the speed asked for. Stage through pinned memory yourself
    ///   (`copy_d2h`, then `copy_h2d`) where that is what you want.
    /// - **Both on one device**: allowed, and the same as [`Stream::copy_d2d`] (the stream
    ///   must be on that device too).
    /// - **Stream-ordered buffers** ([`DeviceBuffer::new_async`](crate::DeviceBuffer::new_async))
    ///   are copied correctly too, but peer access does not cover the devices' memory pools,
    ///   so the driver may take a slower path for them; use `DeviceBuffer::new` for buffers
    ///   that cross devices often.
    /// - Different lengths are [`Error::LengthMismatch`], before anything is queued.
    ///
    /// ```no_run
    /// use pinstream::{Device, DeviceBuffer};
    /// # fn main() -> pinstream::Result<()> {
    /// let (d0, d1) = (Device::get(0)?, Device::get(1)?);
    /// let a = DeviceBuffer::<f32>::new(&d0, 1 << 20)?;
    /// let mut b = DeviceBuffer::<f32>::new(&d1, 1 << 20)?;
    /// let s0 = d0.stream()?;
    /// s0.copy_peer(&a, &mut b)?;               // device 0 pushes into device 1
    /// let s1 = d1.stream()?;
    /// s1.memset(&mut b.slice_mut(..16)?, 0)?;  // on device 1, after the copy
    /// # Ok(()) }
    /// ```
    pub fn copy_peer<T, S, D>(&self, src: &S, dst: &mut D) -> Result<()>
    where
        T: Pod,
        S: DeviceSlice<T> + ?Sized,
        D: DeviceSliceMut<T> + ?Sized,
    {
        const OP: &str = "Stream::copy_peer";
        let (s, d) = (src.device_region(), dst.device_region());
        if s.device == d.device {
            return self.d2d::<T>(OP, s, d);
        }
        same_len(OP, s.len, d.len)?;
        let here = self.device();
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
        // Before the length test below, so that whether a pair works never depends on it.
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
        let bytes = s.len * std::mem::size_of::<T>();
        if bytes == 0 {
            return Ok(());
        }
        self.enter()?;
        tracker::ordered_rw(
            self,
            &reads_writes(Some(s.tracker), Some(d.tracker)),
            || memcpy_peer(self, d.ptr, d.device, s.ptr, s.device, bytes),
        )
        .map(|_| ())
    }
}
