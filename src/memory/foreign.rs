//! `ForeignBuffer<T>`: device memory another library owns (a cudarc `CudaSlice`, a candle or
//! PyTorch tensor, a DLPack import) used by pinstream's copies and kernels without owning it.
//!
//! The memory gets a tracker of its own, so pinstream's work on it is ordered like work on a
//! [`DeviceBuffer`](super::DeviceBuffer); dropping the `ForeignBuffer` waits for that work (or
//! [`ForeignBuffer::release_to`] hands the wait to a stream), after which the owner may free it.

use std::marker::PhantomData;
use std::ops::RangeBounds;
use std::os::raw::c_void;

use bytemuck::Pod;

use super::sealed::{DeviceMem, DeviceRegion};
use super::tracker::{Access, Tracker};
use super::{resolve_range, DeviceSlice, DeviceSliceMut, DeviceView, DeviceViewMut};
use crate::device::Device;
use crate::error::{byte_len, check, Error, Result};
use crate::stream::Stream;
use crate::sys;

/// What the runtime knows about an address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PointerKind {
    /// Device memory of the given device (`cudaMalloc`, `cudaMallocAsync`, VMM).
    Device(i32),
    /// Managed memory (`cudaMallocManaged`), preferred on the given device.
    Managed(i32),
    /// Page-locked host memory (`cudaHostAlloc`, `cudaHostRegister`).
    Pinned,
    /// Memory the runtime does not know (pageable host memory).
    Unknown,
}

/// Asks the runtime what `ptr` is (`cudaPointerGetAttributes`).
pub(crate) fn pointer_kind(ptr: *const c_void) -> Result<PointerKind> {
    // SAFETY: all-zero bytes are a valid `cudaPointerAttributes` (integers and null pointers).
    let mut attr: sys::cudaPointerAttributes = unsafe { std::mem::zeroed() };
    check(
        // SAFETY: `attr` is a valid out-pointer; the call only inspects the address.
        unsafe { sys::cudaPointerGetAttributes(&mut attr, ptr) },
        "cudaPointerGetAttributes",
    )?;
    #[allow(non_upper_case_globals)]
    Ok(match attr.type_ {
        sys::cudaMemoryType_cudaMemoryTypeDevice => PointerKind::Device(attr.device),
        sys::cudaMemoryType_cudaMemoryTypeManaged => PointerKind::Managed(attr.device),
        sys::cudaMemoryType_cudaMemoryTypeHost => PointerKind::Pinned,
        _ => PointerKind::Unknown,
    })
}

/// Checks that `ptr` may hold `len` elements of `T` on `device`: non-null when not empty,
/// aligned for `T`, and device (or managed) memory of that device as the runtime sees it.
pub(crate) fn check_device_ptr<T>(
    op: &'static str,
    device: &Device,
    ptr: *const T,
    len: usize,
) -> Result<usize> {
    let bytes = byte_len::<T>(op, len)?;
    if bytes == 0 {
        return Ok(0);
    }
    if ptr.is_null() {
        return Err(Error::invalid(op, "a null pointer for a non-empty buffer"));
    }
    if (ptr as usize) % std::mem::align_of::<T>() != 0 {
        return Err(Error::invalid(
            op,
            format!(
                "{ptr:p} is not aligned for a {}-byte type",
                std::mem::align_of::<T>()
            ),
        ));
    }
    if (ptr as usize).checked_add(bytes).is_none() {
        return Err(Error::invalid(
            op,
            "the range wraps around the address space",
        ));
    }
    device.make_current()?;
    match pointer_kind(ptr.cast())? {
        PointerKind::Device(d) | PointerKind::Managed(d)
            if usize::try_from(d).ok() == Some(device.ordinal()) =>
        {
            Ok(bytes)
        }
        PointerKind::Device(d) | PointerKind::Managed(d) => Err(Error::invalid(
            op,
            format!(
                "{ptr:p} is memory of device {d}, not of device {}",
                device.ordinal()
            ),
        )),
        other => Err(Error::invalid(
            op,
            format!("{ptr:p} is not device memory (the runtime says {other:?})"),
        )),
    }
}

/// `len` elements of `T` in device memory that another library owns, usable wherever a
/// [`DeviceBuffer`](super::DeviceBuffer) is: a source or destination of copies, `Stager`
/// uploads and the normalize kernels.
///
/// Work pinstream queues on it is tracked as on its own buffers (ordered after earlier uses,
/// whatever stream). Dropping it blocks until that work is over, so the owner may free the
/// memory afterwards; [`release_to`](Self::release_to) instead makes the owner's stream wait
/// for it on the GPU, without blocking.
///
/// ```no_run
/// # fn main() -> pinstream::Result<()> {
/// # let (dev, ptr, n): (pinstream::Device, *mut f32, usize) = todo!();
/// let stream = dev.stream()?;
/// // SAFETY: `ptr` is n f32 of another library's allocation on `dev`, alive past the drop.
/// let mut theirs = unsafe { pinstream::ForeignBuffer::from_raw(&dev, ptr, n)? };
/// let host: Vec<f32> = vec![1.0; n];
/// stream.copy_h2d(&host[..], &mut theirs)?;    // straight into their memory
/// drop(theirs);                                // waits for the copy
/// # Ok(()) }
/// ```
pub struct ForeignBuffer<T: Pod> {
    ptr: *mut T,
    len: usize,
    device: Device,
    tracker: Tracker,
    /// Set by `release_to`: a stream waits for the uses, so the drop need not.
    released: bool,
    _marker: PhantomData<T>,
}

// SAFETY: the memory is used only through tracked, ordered GPU work (the caller's contract
// keeps it valid); the tracker is thread-safe.
unsafe impl<T: Pod> Send for ForeignBuffer<T> {}
// SAFETY: as above; `&ForeignBuffer` allows only reads and tracked GPU work.
unsafe impl<T: Pod> Sync for ForeignBuffer<T> {}

impl<T: Pod> std::fmt::Debug for ForeignBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ForeignBuffer")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("device", &self.device)
            .finish()
    }
}

impl<T: Pod> ForeignBuffer<T> {
    /// Wraps `len` elements of `T` at device address `ptr` on `device`.
    ///
    /// Errors (`Error::InvalidArgument`): a size that overflows, a null or misaligned pointer,
    /// or an address the runtime does not know as device (or managed) memory of `device`.
    ///
    /// # Safety
    ///
    /// - `ptr .. ptr + len` lies inside one live allocation on `device`, and stays allocated
    ///   until this value is dropped (or [`release_to`](Self::release_to) has returned and the
    ///   stream it names has passed that point).
    /// - While this value lives, nobody else writes the memory unless ordered with pinstream's
    ///   work on it through stream order or events (as between any two CUDA libraries), and
    ///   nobody else reads it while pinstream may write it, likewise.
    pub unsafe fn from_raw(device: &Device, ptr: *mut T, len: usize) -> Result<Self> {
        check_device_ptr("ForeignBuffer::from_raw", device, ptr, len)?;
        Ok(ForeignBuffer {
            ptr,
            len,
            device: *device,
            tracker: Tracker::new(),
            released: false,
            _marker: PhantomData,
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

    /// The device the memory lives on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The device address it was made from.
    pub fn as_device_ptr(&self) -> *const T {
        self.ptr
    }

    /// A read-only view of `range` (in elements).
    pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<DeviceView<'_, T>> {
        let r = resolve_range("ForeignBuffer::slice", range, self.len)?;
        // SAFETY: the range is inside the memory (checked above), which the caller's contract
        // keeps alive while `self` (and so the borrow) lives; the tracker is ours.
        Ok(unsafe {
            DeviceView::from_parts(
                self.ptr.wrapping_add(r.start),
                r.len(),
                self.device,
                &self.tracker,
            )
        })
    }

    /// A writable view of `range` (in elements).
    pub fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> Result<DeviceViewMut<'_, T>> {
        let r = resolve_range("ForeignBuffer::slice_mut", range, self.len)?;
        // SAFETY: as in `slice`; `&mut self` makes the view the only access through us.
        Ok(unsafe {
            DeviceViewMut::from_parts(
                self.ptr.wrapping_add(r.start),
                r.len(),
                self.device,
                &self.tracker,
            )
        })
    }

    /// Blocks until the GPU has finished every operation pinstream queued on the memory.
    pub fn synchronize(&self) -> Result<()> {
        self.tracker.synchronize()
    }

    /// The memory is also read by what `stream` has queued so far (see
    /// [`DeviceBuffer::record_stream`](super::DeviceBuffer::record_stream)).
    pub fn record_stream(&self, stream: &Stream) -> Result<()> {
        self.tracker.record_use(stream, Access::Read)
    }

    /// Gives the memory back to its owner without blocking: `stream` (the owner's, usually)
    /// waits on the GPU for everything pinstream queued on it, so work the owner queues there
    /// afterwards — a free included — comes after.
    pub fn release_to(mut self, stream: &Stream) -> Result<()> {
        // On an error `self` drops, which waits on the host instead.
        self.tracker.wait_on(stream)?;
        self.released = true;
        Ok(())
    }
}

impl<T: Pod> Drop for ForeignBuffer<T> {
    fn drop(&mut self) {
        // Not ours to free; but the owner may free it as soon as we return.
        if self.released {
            return;
        }
        if let Err(e) = self.tracker.synchronize() {
            eprintln!(
                "pinstream: could not confirm the GPU has finished with {} bytes of foreign \
                 memory at {:p} before giving it back ({e})",
                self.len * std::mem::size_of::<T>(),
                self.ptr
            );
        }
    }
}

impl<T: Pod> DeviceMem<T> for ForeignBuffer<T> {
    fn device_region(&self) -> DeviceRegion<'_> {
        DeviceRegion {
            ptr: self.ptr.cast(),
            len: self.len,
            device: self.device,
            tracker: &self.tracker,
        }
    }
}
impl<T: Pod> DeviceSlice<T> for ForeignBuffer<T> {}
impl<T: Pod> DeviceSliceMut<T> for ForeignBuffer<T> {}
