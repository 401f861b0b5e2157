//! `DeviceBuffer<T>`: device memory from `cudaMalloc` or pinstream's stream-ordered pool, and
//! borrowed views of parts of it.

use std::marker::PhantomData;
use std::ops::RangeBounds;
use std::os::raw::c_void;

use bytemuck::Pod;

use super::sealed::{DeviceMem, DeviceRegion};
use super::tracker::{self, Access, Tracker};
use super::{resolve_range, DeviceSlice, DeviceSliceMut};
use crate::device::Device;
use crate::error::{byte_len, check_alloc, check_with, Result};
use crate::stream::Stream;
use crate::sys;

/// `len` elements of `T` in device memory. Its contents start undefined (any bit pattern, which
/// every `Pod` type accepts); fill it with a copy, `Stream::memset` or a kernel.
///
/// Every operation on it is ordered after the previous one, whichever stream it ran on, and
/// dropping it waits for the last one before the memory is freed.
///
/// ```no_run
/// use pinstream::{kernels, Device, DeviceBuffer};
/// # fn main() -> pinstream::Result<()> {
/// let dev = Device::get(0)?;
/// let stream = dev.stream()?;
/// let mut d = DeviceBuffer::<u32>::new(&dev, 1000)?;
/// kernels::iota(&stream, &mut d, 0, 1)?;          // 0, 1, 2, ...
/// stream.memset(&mut d.slice_mut(500..)?, 0)?;   // a view of the upper half
/// let mut host = vec![0u32; 1000];
/// let values = stream.copy_d2h(&d, &mut host[..])?.wait()?;
/// assert_eq!((values[499], values[500]), (499, 0));
/// # Ok(()) }
/// ```
pub struct DeviceBuffer<T: Pod> {
    ptr: *mut T,
    len: usize,
    device: Device,
    tracker: Tracker,
    /// Set for stream-ordered allocations: freed with `cudaFreeAsync` on this stream.
    stream: Option<Stream>,
}

// SAFETY: the buffer owns its device memory; all GPU access is ordered through the tracker,
// which is itself thread-safe.
unsafe impl<T: Pod> Send for DeviceBuffer<T> {}
// SAFETY: as above; `&DeviceBuffer` only allows reads and tracked, ordered GPU work.
unsafe impl<T: Pod> Sync for DeviceBuffer<T> {}

impl<T: Pod> std::fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("device", &self.device)
            .field("stream_ordered", &self.stream.is_some())
            .finish()
    }
}

impl<T: Pod> DeviceBuffer<T> {
    /// Allocates `len` elements with `cudaMalloc` on `device`.
    pub fn new(device: &Device, len: usize) -> Result<Self> {
        let bytes = byte_len::<T>("DeviceBuffer::new", len)?;
        let mut ptr = std::ptr::null_mut::<c_void>();
        if bytes > 0 {
            device.make_current()?;
            let alloc = |ptr: &mut *mut c_void| {
                check_alloc(
                    // SAFETY: `ptr` is a valid out-pointer; the device is current.
                    unsafe { sys::cudaMalloc(ptr, bytes) },
                    "cudaMalloc",
                    bytes,
                )
            };
            // What pinstream's stream-ordered pool keeps may be what is missing.
            super::stream_pool::retry_after_trim(device, || alloc(&mut ptr))?;
            if let Err(e) = check_align::<T>("DeviceBuffer::new", ptr) {
                // SAFETY: allocated just above, never shared, freed once.
                unsafe {
                    let _ = sys::cudaFree(ptr);
                }
                return Err(e);
            }
        }
        super::live::device_allocated(bytes);
        Ok(DeviceBuffer {
            ptr: ptr.cast(),
            len,
            device: *device,
            tracker: Tracker::new(),
            stream: None,
        })
    }

    /// Allocates `len` elements stream-ordered on `stream` (`cudaMallocFromPoolAsync`), from
    /// pinstream's pool of the device, which keeps freed memory for the next allocation
    /// (fast: no mapping; [`Device::empty_cache`] gives it back). It is freed with `cudaFreeAsync` on the same stream after
    /// its last use. Using it on another stream is safe: that stream waits for the allocation.
    pub fn new_async(stream: &Stream, len: usize) -> Result<Self> {
        let bytes = byte_len::<T>("DeviceBuffer::new_async", len)?;
        let tracker = Tracker::new();
        let mut ptr = std::ptr::null_mut::<c_void>();
        if bytes > 0 {
            stream.enter()?;
            // The allocation is an operation on the stream: track it, so that other streams
            // wait for it before they touch the memory.
            let tracked = tracker::ordered(stream, &[&tracker], || {
                let pool = super::stream_pool::get(&stream.device())?;
                let alloc = |ptr: &mut *mut c_void| {
                    check_alloc(
                        // SAFETY: `ptr` is a valid out-pointer; the pool belongs to the
                        // stream's device; the stream is live and current.
                        unsafe { sys::cudaMallocFromPoolAsync(ptr, bytes, pool, stream.as_raw()) },
                        "cudaMallocFromPoolAsync",
                        bytes,
                    )
                };
                // Memory the pool keeps but no buffer uses may be what is missing.
                super::stream_pool::retry_after_trim(&stream.device(), || alloc(&mut ptr))?;
                check_align::<T>("DeviceBuffer::new_async", ptr)
            });
            if let Err(e) = tracked {
                if !ptr.is_null() {
                    // SAFETY: allocated just above on this stream and not used since.
                    unsafe {
                        let _ = sys::cudaFreeAsync(ptr, stream.as_raw());
                    }
                }
                return Err(e);
            }
        }
        super::live::device_allocated(bytes);
        Ok(DeviceBuffer {
            ptr: ptr.cast(),
            len,
            device: stream.device(),
            tracker,
            stream: Some(stream.clone()),
        })
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size in bytes.
    pub fn byte_len(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    /// The device the memory lives on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The device address, for passing to other CUDA code. Dereferencing it on the host is
    /// invalid; work queued through it is not tracked by this buffer.
    pub fn as_device_ptr(&self) -> *const T {
        self.ptr
    }

    /// The device address, writable, with the same caveats as `as_device_ptr`.
    pub fn as_device_mut_ptr(&mut self) -> *mut T {
        self.ptr
    }

    /// Blocks until the GPU has finished every operation queued on this buffer.
    pub fn synchronize(&self) -> Result<()> {
        self.tracker.synchronize()
    }

    /// PyTorch's `record_stream`: the memory is also read by what `stream` (another library's,
    /// usually: see [`Stream::from_raw`]) has queued so far. `stream` first waits on the GPU for
    /// the buffer's last write, then the next write or free through pinstream waits for the
    /// point it has reached now. Call it after queuing the reads (they are covered up to the
    /// call); for a stream that writes the memory use
    /// [`record_stream_mut`](Self::record_stream_mut).
    pub fn record_stream(&self, stream: &Stream) -> Result<()> {
        self.tracker.record_use(stream, Access::Read)
    }

    /// As [`record_stream`](Self::record_stream) for a stream that writes the memory: it waits
    /// for every earlier use, and every later use waits for it.
    pub fn record_stream_mut(&mut self, stream: &Stream) -> Result<()> {
        self.tracker.record_use(stream, Access::Write)
    }

    /// A read-only view of `range` (in elements).
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<DeviceView<'_, T>> {
        let r = resolve_range("DeviceBuffer::slice", range, self.len)?;
        Ok(DeviceView {
            // The offset stays inside the allocation (checked above); wrapping_add keeps this safe
            // even for the null pointer of an empty buffer.
            ptr: self.ptr.wrapping_add(r.start),
            len: r.len(),
            device: self.device,
            tracker: &self.tracker,
            _marker: PhantomData,
        })
    }

    /// A writable view of `range` (in elements).
    pub fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> Result<DeviceViewMut<'_, T>> {
        let r = resolve_range("DeviceBuffer::slice_mut", range, self.len)?;
        Ok(DeviceViewMut {
            ptr: self.ptr.wrapping_add(r.start),
            len: r.len(),
            device: self.device,
            tracker: &self.tracker,
            _marker: PhantomData,
        })
    }
}

impl DeviceBuffer<u8> {
    /// Checks that `len` elements of `U` fit at byte `offset` and are aligned there; returns the
    /// address.
    fn typed_at<U: Pod>(&self, op: &'static str, offset: usize, len: usize) -> Result<*mut U> {
        let bytes = byte_len::<U>(op, len)?;
        if offset.checked_add(bytes).is_none_or(|end| end > self.len) {
            return Err(crate::Error::invalid(
                op,
                format!(
                    "{bytes} bytes at offset {offset} do not fit in {} bytes",
                    self.len
                ),
            ));
        }
        let ptr = self.ptr.wrapping_add(offset);
        check_align::<U>(op, ptr.cast())?;
        Ok(ptr.cast())
    }

    /// A read-only view of `len` elements of `U` starting at byte `offset` (for arenas that hold
    /// several types).
    pub(crate) fn view_as<U: Pod>(&self, offset: usize, len: usize) -> Result<DeviceView<'_, U>> {
        let ptr = self.typed_at::<U>("DeviceBuffer::view_as", offset, len)?;
        Ok(DeviceView {
            ptr,
            len,
            device: self.device,
            tracker: &self.tracker,
            _marker: PhantomData,
        })
    }

    /// As `view_as`, writable.
    pub(crate) fn view_as_mut<U: Pod>(
        &mut self,
        offset: usize,
        len: usize,
    ) -> Result<DeviceViewMut<'_, U>> {
        let ptr = self.typed_at::<U>("DeviceBuffer::view_as_mut", offset, len)?;
        Ok(DeviceViewMut {
            ptr,
            len,
            device: self.device,
            tracker: &self.tracker,
            _marker: PhantomData,
        })
    }
}

impl<T: Pod> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        if self.ptr.is_null() {
            return;
        }
        if let Some(stream) = &self.stream {
            // Stream-ordered free after the last use, without blocking the host.
            if self.tracker.wait_on(stream).is_ok() && stream.enter().is_ok() {
                // SAFETY: `ptr` came from cudaMallocAsync and is freed once; the stream waits
                // for every use of it first.
                let err = unsafe { sys::cudaFreeAsync(self.ptr.cast(), stream.as_raw()) };
                if err == sys::cudaError::cudaSuccess {
                    super::live::device_freed(self.byte_len());
                    return;
                }
            }
        }
        // Wait for the last use, then free synchronously (cudaFree also takes memory from
        // cudaMallocAsync). If the wait fails, a kernel or copy may still use it: leak it.
        if let Err(e) = self.tracker.synchronize() {
            super::tracker::leak("device memory", self.byte_len(), &e);
            return;
        }
        let _ = self.device.make_current();
        // SAFETY: `ptr` came from cudaMalloc / cudaMallocAsync, was not freed above (that path
        // returned), and is freed once, after the GPU's last use.
        unsafe {
            let _ = sys::cudaFree(self.ptr.cast());
        }
        super::live::device_freed(self.byte_len());
    }
}

/// Refuses an address not aligned for `T` (only possible for `T` aligned beyond the 256 bytes
/// the allocators give), so that no view or kernel ever sees a misaligned `*mut T`.
fn check_align<T>(op: &'static str, ptr: *mut c_void) -> Result<()> {
    let align = std::mem::align_of::<T>();
    if (ptr as usize) % align != 0 {
        return Err(crate::Error::invalid(
            op,
            format!("the allocator returned {ptr:p}, not aligned for a {align}-byte type"),
        ));
    }
    Ok(())
}

macro_rules! view_type {
    ($name:ident, $borrow:ty, $doc:literal) => {
        #[doc = $doc]
        #[derive(Debug)]
        pub struct $name<'a, T: Pod> {
            ptr: *mut T,
            len: usize,
            device: Device,
            tracker: &'a Tracker,
            _marker: PhantomData<$borrow>,
        }

        // SAFETY: a view is a borrow of a `DeviceBuffer`, which is Send and Sync.
        unsafe impl<T: Pod> Send for $name<'_, T> {}
        // SAFETY: as above.
        unsafe impl<T: Pod> Sync for $name<'_, T> {}

        impl<T: Pod> $name<'_, T> {
            /// Number of elements.
            pub fn len(&self) -> usize {
                self.len
            }
            /// Whether it holds no elements.
            pub fn is_empty(&self) -> bool {
                self.len == 0
            }
            /// The device the memory lives on.
            pub fn device(&self) -> Device {
                self.device
            }
            /// The device address (see `DeviceBuffer::as_device_ptr`).
            pub fn as_device_ptr(&self) -> *const T {
                self.ptr
            }

            /// The memory is also read by what `stream` has queued so far (see
            /// [`DeviceBuffer::record_stream`]; it covers the whole buffer the view is of).
            pub fn record_stream(&self, stream: &Stream) -> Result<()> {
                self.tracker.record_use(stream, Access::Read)
            }
        }

        impl<'a, T: Pod> $name<'a, T> {
            /// A view of `len` elements at `ptr`, tracked by `tracker`.
            ///
            /// # Safety
            ///
            /// `ptr .. ptr + len` is device memory of `device`, aligned for `T`, that stays
            /// allocated while `tracker` lives (`'a`), and `tracker` tracks every pinstream use
            /// of it. For the writable view, nothing else hands out a view of the same memory
            /// while this one lives, except through `&mut` of the owner.
            pub(crate) unsafe fn from_parts(
                ptr: *mut T,
                len: usize,
                device: Device,
                tracker: &'a Tracker,
            ) -> Self {
                $name {
                    ptr,
                    len,
                    device,
                    tracker,
                    _marker: PhantomData,
                }
            }
        }

        impl<T: Pod> DeviceMem<T> for $name<'_, T> {
            fn device_region(&self) -> DeviceRegion<'_> {
                DeviceRegion {
                    ptr: self.ptr.cast(),
                    len: self.len,
                    device: self.device,
                    tracker: self.tracker,
                }
            }
        }
        impl<T: Pod> DeviceSlice<T> for $name<'_, T> {}
    };
}

view_type!(
    DeviceView,
    &'a [T],
    "A read-only view of part of a `DeviceBuffer` (`DeviceBuffer::slice`)."
);
view_type!(
    DeviceViewMut,
    &'a mut [T],
    "A writable view of part of a `DeviceBuffer` (`DeviceBuffer::slice_mut`)."
);
impl<T: Pod> DeviceSliceMut<T> for DeviceViewMut<'_, T> {}

impl<T: Pod> DeviceViewMut<'_, T> {
    /// As [`DeviceBuffer::record_stream_mut`]: `stream` writes the memory.
    pub fn record_stream_mut(&mut self, stream: &Stream) -> Result<()> {
        self.tracker.record_use(stream, Access::Write)
    }
}

impl<T: Pod> DeviceMem<T> for DeviceBuffer<T> {
    fn device_region(&self) -> DeviceRegion<'_> {
        DeviceRegion {
            ptr: self.ptr.cast(),
            len: self.len,
            device: self.device,
            tracker: &self.tracker,
        }
    }
}
impl<T: Pod> DeviceSlice<T> for DeviceBuffer<T> {}
impl<T: Pod> DeviceSliceMut<T> for DeviceBuffer<T> {}

impl Stream {
    /// Sets every byte of `dst` to `byte` (`cudaMemsetAsync`), ordered after its earlier uses.
    pub fn memset<T: Pod, D: DeviceSliceMut<T> + ?Sized>(
        &self,
        dst: &mut D,
        byte: u8,
    ) -> Result<()> {
        let r = dst.device_region();
        self.same_device("Stream::memset", r.device)?;
        let bytes = r.len * std::mem::size_of::<T>();
        if bytes == 0 {
            return Ok(());
        }
        self.enter()?;
        tracker::ordered(self, &[r.tracker], || {
            // SAFETY: `r.ptr` addresses `bytes` bytes of device memory on this stream's device,
            // kept alive by the `&mut` borrow and, after it, by the tracker.
            check_with(
                unsafe { sys::cudaMemsetAsync(r.ptr, i32::from(byte), bytes, self.as_raw()) },
                "cudaMemsetAsync",
                || format!("{bytes} bytes"),
            )
        })
        .map(|_| ())
    }
}
