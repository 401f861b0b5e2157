//! `TableRing`: pinned host memory for the small per-launch tables of one stream's kernels (the
//! normalize sample table), uploaded in stream order with no host wait and no reliance on the
//! driver.
//!
//! A plain `cudaMemcpyAsync` from a pageable `Vec` is what this replaces: the driver may stage
//! such a copy only once the stream has drained (measured: a call returned after 304 ms behind
//! 300 ms of queued work), and where the GPU reads pageable memory directly (HMM / ATS, Grace
//! Hopper) nothing would keep the `Vec` alive until the copy ran.
//!
//! Instead each table is written into a free region of a pinned, mapped ring that belongs to the
//! stream; its upload into the stream's device scratch is queued on the stream (by default a
//! one-block kernel that reads the mapped region across the bus, which keeps the stream on the
//! compute engine; `PINSTREAM_TABLE_UPLOAD=dma` uses a `cudaMemcpyAsync` on a copy engine); an
//! event recorded right after the upload guards the region, which is written again only once
//! that event has passed. Uploads finish in stream order, so regions are freed oldest first
//! and the newest event stands for every upload before it.
//!
//! The host waits only when the ring, grown to [`GROW_BYTES`], has no free region left: then
//! for the oldest uploads (back-pressure, never a wait for unrelated work). Outgrown rings are
//! kept, with the event after their last upload, until the ring drops (freeing pinned memory may
//! synchronise the device, the very stall this avoids). Dropping the ring waits for those events;
//! if a wait fails, the memory is leaked, not freed.

use std::collections::VecDeque;
use std::sync::OnceLock;

use crate::device::Device;
use crate::error::{check_with, Error, Result};
use crate::event::Event;
use crate::memory::sealed::DeviceMem;
use crate::memory::{DeviceBuffer, HostAlloc, PinnedBuffer};
use crate::stream::Stream;
use crate::sys;

/// Regions start at multiples of this (16-byte words for the upload kernel; whole cache lines).
const ALIGN: usize = 256;
/// The first ring's size.
const FIRST_BYTES: usize = 64 << 10;
/// The ring doubles, rather than wait for an upload, while it is smaller than this; a table
/// larger than the ring always grows it (to at least twice the old size).
pub(crate) const GROW_BYTES: usize = 1 << 20;

/// How a table goes from the pinned ring to device memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Upload {
    /// `pinstream_copy_bytes`: a kernel reads the mapped ring (the default).
    Kernel,
    /// `cudaMemcpyAsync` host to device, on a copy engine (`PINSTREAM_TABLE_UPLOAD=dma`, or a
    /// ring that could not be mapped).
    Dma,
}

/// The upload path, read once from `PINSTREAM_TABLE_UPLOAD` (`kernel`, the default, or `dma`).
pub(crate) fn upload_mode() -> Upload {
    static MODE: OnceLock<Upload> = OnceLock::new();
    *MODE.get_or_init(
        || match std::env::var("PINSTREAM_TABLE_UPLOAD").as_deref() {
            Ok("dma") => Upload::Dma,
            _ => Upload::Kernel,
        },
    )
}

/// Offsets in a ring of `cap` bytes, handed out and given back first in, first out.
#[derive(Debug)]
struct Space {
    cap: usize,
    /// Where the newest live region ends (0 when none is live).
    head: usize,
    /// Live regions as (start, end), oldest first.
    live: VecDeque<(usize, usize)>,
}

impl Space {
    fn new(cap: usize) -> Space {
        Space {
            cap,
            head: 0,
            live: VecDeque::new(),
        }
    }

    /// Where a region of `len` (> 0) bytes would start without overlapping a live region.
    fn find(&self, len: usize) -> Option<usize> {
        let Some(&(tail, _)) = self.live.front() else {
            return (len <= self.cap).then_some(0);
        };
        if tail < self.head {
            // Live bytes are tail..head: room after head, else from the start up to tail.
            if len <= self.cap - self.head {
                Some(self.head)
            } else if len <= tail {
                Some(0)
            } else {
                None
            }
        } else {
            // Wrapped: live bytes are tail..cap and 0..head; the room is between.
            (len <= tail - self.head).then_some(self.head)
        }
    }

    /// Marks `start..start + len` (from `find`) live.
    fn push(&mut self, start: usize, len: usize) {
        self.live.push_back((start, start + len));
        self.head = start + len;
    }

    /// Frees the oldest live region.
    fn pop(&mut self) {
        self.live.pop_front();
        if self.live.is_empty() {
            self.head = 0;
        }
    }
}

/// Pinned, mapped staging memory for one stream's kernel tables (see the module docs).
#[derive(Debug)]
pub(crate) struct TableRing {
    device: Device,
    /// `Stream::id` of the one stream whose uploads read the ring.
    stream: u64,
    /// The current ring; `None` before the first table.
    mem: Option<PinnedBuffer<u8>>,
    /// The ring's device address (`cudaHostGetDevicePointer`); `None` if it has none.
    mapped: Option<usize>,
    space: Space,
    /// The events recorded after the uploads from `space.live`, in the same order.
    events: VecDeque<Event>,
    /// Events whose region was freed, for reuse.
    spare: Vec<Event>,
    /// Outgrown rings with the event after their last upload, freed when the ring drops.
    retired: Vec<(PinnedBuffer<u8>, Option<Event>)>,
    /// Set when an upload was queued but could be neither tracked nor waited for.
    poisoned: Option<Error>,
}

impl TableRing {
    /// An empty ring for the stream `stream` (a `Stream::id`) on `device`; nothing is
    /// allocated before the first table.
    pub(crate) fn new(device: Device, stream: u64) -> TableRing {
        TableRing {
            device,
            stream,
            mem: None,
            mapped: None,
            space: Space::new(0),
            events: VecDeque::new(),
            spare: Vec::new(),
            retired: Vec::new(),
            poisoned: None,
        }
    }

    /// Writes `table` into a free region of the ring, queues its upload into the start of `dst`
    /// on `stream` and records the region's event. Returns without waiting for the GPU unless
    /// the ring is full at its largest size (then the oldest uploads are waited for).
    ///
    /// `dst` must be device memory that only `stream` writes and reads (the stream's scratch):
    /// the upload is not tracked on its own, so it runs after the last launch on `stream` that
    /// read `dst`, and the caller tracks the launch that reads it.
    pub(crate) fn upload(
        &mut self,
        stream: &Stream,
        table: &[u8],
        dst: &DeviceBuffer<u8>,
    ) -> Result<()> {
        const OP: &str = "kernel table upload";
        if let Some(e) = &self.poisoned {
            return Err(e.clone());
        }
        if table.is_empty() {
            return Ok(());
        }
        if stream.id() != self.stream {
            return Err(Error::invalid(OP, "the ring belongs to another stream"));
        }
        let d = dst.device_region();
        stream.same_device(OP, d.device)?;
        if d.len < table.len() {
            return Err(Error::LengthMismatch {
                op: OP,
                src: table.len(),
                dst: d.len,
            });
        }
        let (start, len, event, host) = self.write(stream, table)?;
        let queued = match (self.mapped, upload_mode()) {
            (Some(base), Upload::Kernel) => {
                let src = base.wrapping_add(start) as *const std::ffi::c_void;
                check_with(
                    // SAFETY: `src` is the mapped device address of the region just written
                    // (`table.len()` bytes inside the ring, which stays allocated until the
                    // event recorded below has passed); `dst` is at least as long (checked),
                    // on this device, and freed only after the stream's work on it. The
                    // device is current (`enter`); the launcher only reads its arguments.
                    unsafe { sys::pinstream_copy_bytes(d.ptr, src, table.len(), stream.as_raw()) },
                    "pinstream_copy_bytes",
                    || format!("{} bytes, kernel table", table.len()),
                )
            }
            _ => crate::copy::memcpy(
                stream,
                d.ptr,
                host.cast_const().cast(),
                table.len(),
                sys::cudaMemcpyKind::cudaMemcpyHostToDevice,
                "kernel table",
            ),
        };
        if let Err(e) = queued {
            // Nothing was queued: the region stays free.
            self.spare.push(event);
            return Err(e);
        }
        if let Err(e) = stream.record(&event) {
            // Queued but not tracked: wait for it here, which frees the region again. If even
            // that fails, nobody can know when the GPU is done with the ring: refuse every
            // later upload, and leak the memory at drop.
            if let Err(wait) = stream.synchronize() {
                self.poisoned = Some(wait);
            }
            return Err(e);
        }
        self.space.push(start, len);
        self.events.push_back(event);
        Ok(())
    }

    /// Writes `table` into a free region (waiting for the oldest uploads only when the ring
    /// is full at its largest size) and takes an event for it: `(start, len, event, host
    /// address)`. Nothing is queued; the caller queues the region's reader and then records the
    /// event and pushes the region, or gives the event back.
    fn write(&mut self, stream: &Stream, table: &[u8]) -> Result<(usize, usize, Event, *mut u8)> {
        const OP: &str = "kernel table upload";
        let len = table
            .len()
            .checked_next_multiple_of(ALIGN)
            .ok_or_else(|| Error::invalid(OP, "table too large"))?;
        stream.enter()?;
        self.reclaim()?;
        let start = loop {
            if let Some(s) = self.space.find(len) {
                break s;
            }
            if self.space.cap < GROW_BYTES || len > self.space.cap {
                self.grow(len)?;
                continue;
            }
            // Full at its largest size: wait for the oldest upload (one was queued, or the
            // table would have fitted the empty ring).
            let oldest = self
                .events
                .front()
                .ok_or_else(|| Error::invalid(OP, "the ring is full with nothing queued"))?;
            oldest.synchronize()?;
            self.release_oldest();
        };
        // Taken before anything is queued, so that a failure leaves nothing untracked.
        let event = match self.spare.pop() {
            Some(ev) => ev,
            None => Event::new(&self.device)?,
        };
        let mem = self
            .mem
            .as_ref()
            .ok_or_else(|| Error::invalid(OP, "the ring is missing"))?;
        let host = mem.host_ptr().wrapping_add(start);
        // SAFETY: `start + len <= cap == mem.len()` (`find`), and `table.len() <= len`, so the
        // bytes written lie inside the allocation, which `table` (a Rust slice) cannot overlap.
        // No GPU work that reads them is queued or running: every upload from this ring stays
        // in `space.live` until its event has passed (`reclaim`, or the wait above), and `find`
        // returns only a region disjoint from every live one; uploads from outgrown rings read
        // other allocations. `&mut self` (the stream's table lock) excludes other host access.
        unsafe { std::ptr::copy_nonoverlapping(table.as_ptr(), host, table.len()) };
        Ok((start, len, event, host))
    }

    /// Frees the regions whose uploads have finished (queries only, oldest first).
    fn reclaim(&mut self) -> Result<()> {
        while let Some(ev) = self.events.front() {
            if !ev.is_complete()? {
                break;
            }
            self.release_oldest();
        }
        Ok(())
    }

    /// Frees the oldest region; its upload must have finished.
    fn release_oldest(&mut self) {
        if let Some(ev) = self.events.pop_front() {
            self.space.pop();
            self.spare.push(ev);
        }
    }

    /// Replaces the ring with one of at least twice the size and at least `len` bytes; the old
    /// one is kept with the event after its last upload.
    fn grow(&mut self, len: usize) -> Result<()> {
        let cap = len.max(self.space.cap.saturating_mul(2)).max(FIRST_BYTES);
        let mem = PinnedBuffer::<u8>::new(&self.device, cap, HostAlloc::MAPPED)?;
        // Without a device address (no mapping on this system) the uploads use DMA.
        let mapped = mem.mapped_device_ptr().ok().map(|p| p as usize);
        if let Some(old) = self.mem.replace(mem) {
            // The newest event stands for every upload from the old ring (one stream, in
            // order); the older events are free to record again.
            let last = self.events.pop_back();
            self.spare.extend(self.events.drain(..));
            self.retired.push((old, last));
        }
        self.mapped = mapped;
        self.space = Space::new(cap);
        Ok(())
    }
}

impl Drop for TableRing {
    fn drop(&mut self) {
        let current = self.mem.take().map(|m| (m, self.events.pop_back()));
        for (mem, last) in self.retired.drain(..).chain(current) {
            let waited = match (&self.poisoned, &last) {
                (Some(e), _) => Err(e.clone()),
                (None, Some(ev)) => ev.synchronize(),
                (None, None) => Ok(()),
            };
            if let Err(e) = waited {
                // An upload may still read it: leak rather than free.
                crate::memory::tracker::leak("pinned kernel-table ring", mem.len(), &e);
                std::mem::forget(mem);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Replays first-in-first-out reservations against a byte map of the ring: a region handed
    /// out never overlaps a live one, and lies inside the ring.
    #[test]
    fn regions_never_overlap_live_ones() {
        let cap = 4096;
        let mut s = Space::new(cap);
        let mut owner = vec![usize::MAX; cap];
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut next = 0usize;
        let mut wrapped = 0;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let len = (1 + (x % 6) as usize) * ALIGN;
            match s.find(len) {
                Some(start) if x % 4 != 0 => {
                    assert!(start + len <= cap, "region {start}+{len} outside {cap}");
                    if start < s.head {
                        wrapped += 1;
                    }
                    for (i, b) in owner[start..start + len].iter_mut().enumerate() {
                        assert_eq!(*b, usize::MAX, "byte {} still live", start + i);
                        *b = next;
                    }
                    s.push(start, len);
                    next += 1;
                }
                _ => {
                    // Free the oldest, as an upload finishing would.
                    if let Some(&(a, b)) = s.live.front() {
                        for o in &mut owner[a..b] {
                            *o = usize::MAX;
                        }
                        s.pop();
                    }
                }
            }
        }
        assert!(wrapped > 100, "the test never wrapped ({wrapped})");
    }

    #[test]
    fn empty_ring_takes_the_start_and_full_ring_refuses() {
        let mut s = Space::new(1024);
        assert_eq!(s.find(1024), Some(0));
        assert_eq!(s.find(1025), None);
        s.push(0, 512);
        s.push(512, 512);
        assert_eq!(s.find(256), None);
        s.pop();
        // Wraps to the start, before the live region.
        assert_eq!(s.find(512), Some(0));
        s.push(0, 256);
        assert_eq!(s.find(256), Some(256));
        assert_eq!(s.find(512), None);
        s.pop();
        s.pop();
        assert!(s.live.is_empty());
        assert_eq!(s.head, 0);
    }
}
