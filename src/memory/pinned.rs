//! `PinnedBuffer<T>`: page-locked host memory from `cudaHostAlloc`, which the copy engines read
//! and write directly (no staging), so copies run at link speed and overlap with compute.

use std::ops::RangeBounds;
use std::os::raw::c_void;

use bytemuck::Pod;

use super::sealed::{HostMem, HostRegion};
use super::tracker::Tracker;
use super::{HostKind, HostSlice, HostSliceMut};
use crate::device::Device;
use crate::error::{byte_len, check_alloc, Result};
use crate::sys;

/// The alignment `cudaHostAlloc` is trusted to give without adjustment (it returns page-aligned
/// memory in practice). Larger alignments get slack in the allocation; either way the address
/// is checked before any `&[T]` is made from it.
const MIN_HOST_ALIGN: usize = 256;

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
///
/// ```no_run
/// use pinstream::{Device, DeviceBuffer, HostAlloc, PinnedBuffer};
/// # fn main() -> pinstream::Result<()> {
/// let dev = Device::get(0)?;
/// let stream = dev.stream()?;
/// let mut host = PinnedBuffer::<f32>::new(&dev, 1024, HostAlloc::DEFAULT)?;
/// host.as_mut_slice()?.fill(0.5);
/// let mut d = DeviceBuffer::<f32>::new(&dev, 1024)?;
/// stream.copy_h2d(&host, &mut d)?; // returns at once: the copy runs on the stream
/// // Host access waits for the copy to have read the buffer, so this cannot race with it:
/// host.as_mut_slice()?.fill(1.0);
/// # Ok(()) }
/// ```
pub struct PinnedBuffer<T: Pod> {
    /// What `cudaHostAlloc` returned (null for an empty buffer): what is freed.
    base: *mut c_void,
    /// The first element: `base`, moved up to `T`'s alignment if needed.
    ptr: *mut T,
    len: usize,
    flags: HostAlloc,
    device: Device,
    tracker: Tracker,
    /// Counted in `memory::live()` as a process-wide cache rather than as pinned memory.
    cache: bool,
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
    ///
    /// The memory is aligned for `T` whatever its alignment: `cudaHostAlloc` promises no more
    /// than the page size, so an over-aligned `T` gets a slightly larger allocation and an
    /// aligned start inside it.
    pub fn new(device: &Device, len: usize, flags: HostAlloc) -> Result<Self> {
        const OP: &str = "PinnedBuffer::new";
        let bytes = byte_len::<T>(OP, len)?;
        let align = std::mem::align_of::<T>();
        if bytes == 0 {
            return Ok(PinnedBuffer {
                base: std::ptr::null_mut(),
                ptr: std::ptr::NonNull::dangling().as_ptr(),
                len,
                flags,
                device: *device,
                tracker: Tracker::new(),
                cache: false,
            });
        }
        // Room to move the start up to the next multiple of `align`, if the runtime's address
        // is not one already.
        let slack = if align > MIN_HOST_ALIGN { align - 1 } else { 0 };
        let total = bytes.checked_add(slack).ok_or_else(|| {
            crate::Error::invalid(OP, format!("{bytes} bytes plus alignment overflow usize"))
        })?;
        device.make_current()?;
        let mut base = std::ptr::null_mut::<c_void>();
        check_alloc(
            // SAFETY: `base` is a valid out-pointer; the flags are valid cudaHostAlloc flags.
            unsafe { sys::cudaHostAlloc(&mut base, total, flags.bits()) },
            "cudaHostAlloc",
            total,
        )?;
        let offset = (base as usize).wrapping_neg() % align;
        if offset > slack {
            // Only possible if the runtime broke its own page-alignment promise.
            // SAFETY: allocated just above, never shared, freed once.
            unsafe {
                let _ = sys::cudaFreeHost(base);
            }
            return Err(crate::Error::invalid(
                OP,
                format!("cudaHostAlloc returned {base:p}, not aligned for a {align}-byte type"),
            ));
        }
        // SAFETY: `offset + bytes <= total`: the start stays inside the allocation.
        let ptr = unsafe { base.cast::<u8>().add(offset) };
        // SAFETY: `ptr..ptr + bytes` lies in the allocation, which is not yet shared with anyone;
        // zeroing makes every element initialised (all-zero is a valid `Pod` value).
        unsafe { std::ptr::write_bytes(ptr, 0, bytes) };
        super::live::pinned_allocated(total);
        Ok(PinnedBuffer {
            base,
            ptr: ptr.cast(),
            len,
            flags,
            device: *device,
            tracker: Tracker::new(),
            cache: false,
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

    /// Whether the GPU has finished every use of it so far, without blocking.
    pub(crate) fn is_idle(&self) -> bool {
        self.tracker.is_idle()
    }

    /// Waits for the GPU's last write to it (copies that only read it may go on), then gives
    /// read access.
    pub fn as_slice(&self) -> Result<&[T]> {
        self.tracker.synchronize_writes()?;
        // SAFETY: `ptr` holds `len` initialised elements (zeroed at allocation, then written
        // only through `&mut self` or by copies into it, which the wait above has seen finish).
        // No copy into it can start while this borrow lives (that needs `&mut self`); copies
        // that read it while the host does are harmless.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr, self.len) })
    }

    /// A read-only view of `range` (in elements): a copy from it reads only those elements.
    /// Copies from views (or from the whole buffer) run beside each other, on any streams and
    /// devices; a copy into the buffer or `as_mut_slice` waits for them all.
    ///
    /// Errors: `Error::InvalidArgument` for a range outside the buffer.
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<PinnedView<'_, T>> {
        let r = super::resolve_range("PinnedBuffer::slice", range, self.len)?;
        Ok(PinnedView {
            buf: self,
            start: r.start,
            len: r.len(),
        })
    }

    /// Waits for the GPU's last use, then gives write access.
    pub fn as_mut_slice(&mut self) -> Result<&mut [T]> {
        self.tracker.synchronize()?;
        // SAFETY: as in `as_slice`; `&mut self` excludes every other access for the borrow.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) })
    }
}

impl<T: Pod> PinnedBuffer<T> {
    /// Counts the buffer in `memory::live()` as part of a process-wide cache (the bounce
    /// blocks), not as pinned memory in use.
    pub(crate) fn count_as_cache(&mut self) {
        if !self.cache && !self.base.is_null() {
            super::live::pinned_to_cache(self.allocated_bytes());
            self.cache = true;
        }
    }

    /// What `new` asked `cudaHostAlloc` for (checked not to overflow there).
    fn allocated_bytes(&self) -> usize {
        let align = std::mem::align_of::<T>();
        let slack = if align > MIN_HOST_ALIGN { align - 1 } else { 0 };
        (self.len * std::mem::size_of::<T>()).saturating_add(slack)
    }
}

impl<T: Pod> Drop for PinnedBuffer<T> {
    fn drop(&mut self) {
        if self.base.is_null() {
            return;
        }
        if let Err(e) = self.tracker.synchronize() {
            // A copy may still read or write it: leak rather than free.
            super::tracker::leak(
                "pinned host memory",
                self.len * std::mem::size_of::<T>(),
                &e,
            );
            return;
        }
        // SAFETY: `base` came from cudaHostAlloc and is freed once, after the GPU's last use.
        unsafe {
            let _ = sys::cudaFreeHost(self.base);
        }
        super::live::pinned_freed(self.allocated_bytes(), self.cache);
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
    fn host_region_mut(&mut self) -> HostRegion<'_> {
        self.host_region()
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
    /// The host address of the first element, for the memory types that guard regions of a
    /// buffer with their own events (`kernels::ring::TableRing`). Writing through it is only sound
    /// where no GPU use of those bytes can be queued or running.
    pub(crate) fn host_ptr(&self) -> *mut T {
        self.ptr
    }

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
        crate::error::check(
            // SAFETY: `ptr` is a live mapped allocation; `dptr` is a valid out-pointer.
            unsafe { sys::cudaHostGetDevicePointer(&mut dptr, self.ptr.cast(), 0) },
            "cudaHostGetDevicePointer",
        )?;
        Ok(dptr.cast())
    }
}

impl PinnedBuffer<u32> {
    /// The buffer as atomics, for flags that a running kernel polls or sets through the mapped
    /// address while the host reads and writes them. Host access to such a buffer must only go
    /// through these atomics (never `as_slice`), which the one user, `timing::Gate`, keeps to.
    pub(crate) fn as_atomics(&self) -> &[std::sync::atomic::AtomicU32] {
        // SAFETY: `AtomicU32` has the size and alignment of `u32`; the `len` elements are live
        // and initialised for as long as `&self`; the GPU's accesses are outside Rust's memory
        // model, and every host access goes through atomic operations.
        unsafe { std::slice::from_raw_parts(self.ptr.cast(), self.len) }
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
    check_alloc(
        // SAFETY: valid out-pointer and flags.
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

/// A read-only range of a [`PinnedBuffer`] ([`PinnedBuffer::slice`]): a source for copies, or
/// host reads after the GPU's last write.
pub struct PinnedView<'a, T: Pod> {
    buf: &'a PinnedBuffer<T>,
    start: usize,
    len: usize,
}

impl<T: Pod> std::fmt::Debug for PinnedView<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedView")
            .field("start", &self.start)
            .field("len", &self.len)
            .field("buffer", &self.buf)
            .finish()
    }
}

impl<T: Pod> PinnedView<'_, T> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the view is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Waits for the GPU's last write to the buffer, then gives read access to the range.
    pub fn as_slice(&self) -> Result<&[T]> {
        let all = self.buf.as_slice()?;
        all.get(self.start..self.start + self.len).ok_or_else(|| {
            crate::Error::invalid("PinnedView::as_slice", "range outside the buffer")
        })
    }
}

impl<T: Pod> HostMem<T> for PinnedView<'_, T> {
    fn host_region(&self) -> HostRegion<'_> {
        HostRegion {
            // Inside the allocation (`slice` checked the range); `wrapping_add` keeps the
            // dangling pointer of an empty buffer harmless.
            ptr: self.buf.ptr.wrapping_add(self.start).cast(),
            len: self.len,
            kind: HostKind::Pinned,
            tracker: Some(&self.buf.tracker),
            read_only: false,
        }
    }
    fn host_region_mut(&mut self) -> HostRegion<'_> {
        // Not reachable: a view is never `HostSliceMut`. Read-only anyway.
        let mut r = self.host_region();
        r.read_only = true;
        r
    }
    fn host_read(&self) -> Result<&[T]> {
        self.as_slice()
    }
    fn host_write(&mut self) -> Result<&mut [T]> {
        Err(crate::Error::invalid(
            "PinnedView",
            "a view of a pinned buffer is read-only",
        ))
    }
}
impl<T: Pod> HostSlice<T> for PinnedView<'_, T> {}
