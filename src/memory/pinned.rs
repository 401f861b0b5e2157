//! `PinnedBuffer<T>`: page-locked host memory from `cudaHostAlloc`, which the copy engines read
//! and write directly (no staging), so copies run at link speed and overlap with compute.

use std::os::raw::c_void;

use bytemuck::Pod;

use super::sealed::{HostMem, HostRegion};
use super::tracker::Tracker;
use super::{HostKind, HostSlice, HostSliceMut};
use crate::device::Device;
use crate::error::{byte_len, check_alloc, Result};
use crate::sys;

super::flag_set! {
    /// Flags for `cudaHostAlloc`; combine with `|`. `Default` is `DEFAULT`.
    HostAlloc {
        /// Page-locked, cacheable, usable by the device it was allocated on.
        DEFAULT = sys::cudaHostAllocDefault;
        /// Treated as pinned by every device, not only the allocating one.
        PORTABLE = sys::cudaHostAllocPortable;
        /// Also mapped into the device address space (zero-copy access from kernels).
        MAPPED = sys::cudaHostAllocMapped;
        /// Write-combined: faster for the host to write and the GPU to read over PCIe, but very
        /// slow for the host to read. For upload buffers only.
        WRITE_COMBINED = sys::cudaHostAllocWriteCombined;
    }
}

/// `len` elements of `T` in pinned host memory, zero-filled at allocation.
///
/// Every copy that touches it records an event; `as_slice`, `as_mut_slice` and `Drop` wait for
/// that event first, so the host never sees memory the GPU is still reading or writing — not
/// even when a `Pending` copy was leaked with `mem::forget`.
pub struct PinnedBuffer<T: Pod> {
    ptr: *mut T,
    len: usize,
    flags: HostAlloc,
    device: Device,
    tracker: Tracker,
}

// SAFETY: the buffer owns its memory; host access goes through `&`/`&mut` after the tracker's
// wait, and the tracker is thread-safe.
unsafe impl<T: Pod> Send for PinnedBuffer<T> {}
// SAFETY: as above.
unsafe impl<T: Pod> Sync for PinnedBuffer<T> {}

impl<T: Pod> std::fmt::Debug for PinnedBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedBuffer")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("flags", &self.flags)
            .field("device", &self.device)
            .finish()
    }
}

impl<T: Pod> PinnedBuffer<T> {
    /// Allocates `len` zeroed elements with `cudaHostAlloc(flags)`, with `device` current.
    pub fn new(device: &Device, len: usize, flags: HostAlloc) -> Result<Self> {
        let bytes = byte_len::<T>("PinnedBuffer::new", len)?;
        let mut ptr = std::ptr::null_mut::<c_void>();
        if bytes > 0 {
            device.make_current()?;
            // SAFETY: `ptr` is a valid out-pointer; the flags are valid cudaHostAlloc flags.
            check_alloc(
                unsafe { sys::cudaHostAlloc(&mut ptr, bytes, flags.bits()) },
                "cudaHostAlloc",
                bytes,
            )?;
            // SAFETY: the allocation is `bytes` long and not yet shared with anyone; zeroing
            // makes every element initialised (all-zero is a valid `Pod` value).
            unsafe { std::ptr::write_bytes(ptr.cast::<u8>(), 0, bytes) };
        }
        Ok(PinnedBuffer {
            ptr: if bytes > 0 {
                ptr.cast()
            } else {
                std::ptr::NonNull::dangling().as_ptr()
            },
            len,
            flags,
            device: *device,
            tracker: Tracker::new(),
        })
    }

    /// Allocates and fills it with a copy of `data`.
    pub fn from_slice(device: &Device, data: &[T], flags: HostAlloc) -> Result<Self> {
        let mut buf = PinnedBuffer::new(device, data.len(), flags)?;
        buf.as_mut_slice()?.copy_from_slice(data);
        Ok(buf)
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The flags it was allocated with.
    pub fn flags(&self) -> HostAlloc {
        self.flags
    }

    /// The device that was current at allocation.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Waits for the GPU's last use, then gives read access.
    pub fn as_slice(&self) -> Result<&[T]> {
        self.tracker.synchronize()?;
        // SAFETY: `ptr` holds `len` initialised elements (zeroed at allocation, then written
        // only through `&mut self` or by copies, which the wait above has seen finish). No copy
        // can start while this borrow lives: writes need `&mut self`, and reads are harmless.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr, self.len) })
    }

    /// Waits for the GPU's last use, then gives write access.
    pub fn as_mut_slice(&mut self) -> Result<&mut [T]> {
        self.tracker.synchronize()?;
        // SAFETY: as in `as_slice`; `&mut self` excludes every other access for the borrow.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) })
    }
}

impl<T: Pod> Drop for PinnedBuffer<T> {
    fn drop(&mut self) {
        if self.len == 0 || std::mem::size_of::<T>() == 0 {
            return;
        }
        let _ = self.tracker.synchronize();
        // SAFETY: `ptr` came from cudaHostAlloc and is freed once, after the GPU's last use.
        unsafe {
            let _ = sys::cudaFreeHost(self.ptr.cast());
        }
    }
}

impl<T: Pod> HostMem<T> for PinnedBuffer<T> {
    fn host_region(&self) -> HostRegion<'_> {
        HostRegion {
            ptr: self.ptr.cast(),
            len: self.len,
            kind: HostKind::Pinned,
            tracker: Some(&self.tracker),
            read_only: false,
        }
    }
    fn host_read(&self) -> Result<&[T]> {
        self.as_slice()
    }
    fn host_write(&mut self) -> Result<&mut [T]> {
        self.as_mut_slice()
    }
}
impl<T: Pod> HostSlice<T> for PinnedBuffer<T> {}
impl<T: Pod> HostSliceMut<T> for PinnedBuffer<T> {}

impl<T: Pod> PinnedBuffer<T> {
    /// The device address of a `MAPPED` buffer (`cudaHostGetDevicePointer`).
    pub(crate) fn mapped_device_ptr(&self) -> Result<*mut T> {
        if !self.flags.contains(HostAlloc::MAPPED) || self.len == 0 {
            return Err(crate::Error::invalid(
                "PinnedBuffer::mapped_device_ptr",
                "the buffer is empty or not allocated with HostAlloc::MAPPED",
            ));
        }
        self.device.make_current()?;
        let mut dptr = std::ptr::null_mut::<c_void>();
        // SAFETY: `ptr` is a live mapped allocation; `dptr` is a valid out-pointer.
        crate::error::check(
            unsafe { sys::cudaHostGetDevicePointer(&mut dptr, self.ptr.cast(), 0) },
            "cudaHostGetDevicePointer",
        )?;
        Ok(dptr.cast())
    }

    /// Volatile store to element `i`, bypassing the tracker: for flags a running kernel polls.
    /// Out-of-range indices are ignored.
    pub(crate) fn store_volatile(&self, i: usize, value: T) {
        if i < self.len {
            // SAFETY: in bounds of a live allocation; volatile, so the write is not elided or
            // reordered away, and `T: Pod` has no drop glue. Concurrent device reads of a
            // word-sized flag are the intended use.
            unsafe { std::ptr::write_volatile(self.ptr.add(i), value) };
            std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        }
    }

    /// Volatile load of element `i` (zeroed value when out of range).
    pub(crate) fn load_volatile(&self, i: usize) -> T {
        if i < self.len {
            std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
            // SAFETY: in bounds of a live, initialised allocation.
            unsafe { std::ptr::read_volatile(self.ptr.add(i)) }
        } else {
            T::zeroed()
        }
    }
}

/// Times `cudaHostAlloc(bytes, flags)` and the matching `cudaFreeHost`, touching nothing in
/// between (the measurement behind `pinstream bandwidth`'s pinning cost).
pub(crate) fn time_alloc_free(
    device: &Device,
    bytes: usize,
    flags: HostAlloc,
) -> Result<(std::time::Duration, std::time::Duration)> {
    device.make_current()?;
    let mut ptr = std::ptr::null_mut::<c_void>();
    let t = std::time::Instant::now();
    // SAFETY: valid out-pointer and flags.
    check_alloc(
        unsafe { sys::cudaHostAlloc(&mut ptr, bytes, flags.bits()) },
        "cudaHostAlloc",
        bytes,
    )?;
    let alloc = t.elapsed();
    let t = std::time::Instant::now();
    // SAFETY: allocated just above, never shared, freed once.
    crate::error::check(unsafe { sys::cudaFreeHost(ptr) }, "cudaFreeHost")?;
    Ok((alloc, t.elapsed()))
}
