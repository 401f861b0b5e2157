//! Interop with [cudarc](https://docs.rs/cudarc) 0.19 (feature `cudarc`): one process, one
//! primary context per device, shared by pinstream's statically linked runtime and cudarc's
//! driver API — pointers, streams and events are valid in both.
//!
//! - [`Stream::from_cudarc`] wraps a cudarc `CudaStream` (safe: the `Stream` holds the
//!   `Arc<CudaStream>`); every copy, kernel, `Stager` call and prefetcher works on it.
//! - [`view`] / [`view_mut`] lend cudarc memory (`CudaSlice`, `CudaView`, `CudaViewMut`) to
//!   pinstream: [`CudarcView`] / [`CudarcViewMut`] are sources and destinations of copies, the
//!   stager and the normalize kernels, on any pinstream stream.
//! - A cudarc `CudaEvent` is an [`AnyEvent`]: `stream.wait(&ev)` and `stream.record(&ev)` order
//!   pinstream's streams and cudarc's either way.
//! - [`lend`] / [`lend_mut`] lend pinstream memory (a `DeviceBuffer`, a view, a prefetched
//!   batch's pixels) to cudarc as a `CudaView` / `CudaViewMut` for the length of a closure.
//!
//! ```no_run
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use pinstream::{cudarc::view_mut, Stream};
//! let cs = cudarc::driver::CudaContext::new(0)?.new_stream()?;
//! let stream = Stream::from_cudarc(&cs)?;
//! let mut x = cs.alloc_zeros::<f32>(1 << 20)?;
//! let host = vec![1.0f32; 1 << 20];
//! stream.copy_h2d(&host[..], &mut view_mut(&mut x, &stream)?)?; // ordered on `cs` both ways
//! # Ok(()) }
//! ```
//!
//! # Ordering, both ways, without host waits
//!
//! cudarc orders a slice's uses with two events per slice (its last read, its last write) when
//! its context manages stream synchronization (as soon as a second stream exists), and by
//! stream order otherwise. pinstream orders its own memory with its trackers. The two meet on
//! the cudarc stream the memory is lent on:
//!
//! - **cudarc memory in pinstream** ([`view`]): the cudarc stream first waits for cudarc's
//!   earlier uses (`DevicePtr::device_ptr`, `DevicePtrMut::device_ptr_mut`), and the view's
//!   tracker starts from that point of the stream, so pinstream work on any stream comes after.
//!   Every pinstream operation on the view is then followed at once: the cudarc stream waits
//!   for it and cudarc's event is recorded there again (after a wait for its previous record).
//!   cudarc's later work on the slice, on any stream, and its free wait for that event.
//! - **pinstream memory in cudarc** ([`lend`]): the cudarc stream waits for pinstream's
//!   conflicting uses and records the lent slice's write event; after the closure it waits for
//!   cudarc's read and write events, and that point joins the memory's tracker, so pinstream's
//!   later uses — a slot refill of a prefetched batch, a free — wait for cudarc's work.
//!
//! # Leaks
//!
//! A view's drop does nothing that safety rests on: each operation already brought cudarc's
//! ordering up to date, so `mem::forget` of a view leaks a little memory (its tracker and a
//! stream handle) and nothing else. [`lend`] keeps cudarc's slice inside the call, so there is
//! nothing to leak; a panic in the closure gives the memory back as a return does.
//!
//! # Limits
//!
//! - With cudarc's event tracking off (no stream but the default ones was ever created in the
//!   context, or `disable_event_tracking`), cudarc orders nothing across streams: work on lent
//!   memory must then be queued on the stream it was lent on (cudarc's own rule).
//! - Only the primary context is shared with the runtime: a stream or slice of another context
//!   is refused (`Error::InvalidArgument`), as is one of another device (`Error::WrongDevice`).
//! - Feature `cudarc` selects cudarc's `cuda-13000` bindings; where another crate of the build
//!   selects cudarc's version (candle: `cuda-version-from-build-system`), enable `cudarc-any`
//!   instead, which leaves it to that crate (cudarc takes exactly one version feature). Either
//!   way cudarc loads libcuda at run time unless another crate asks it to link
//!   (`fallback-dynamic-loading`).

use std::any::Any;
use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::ops::RangeBounds;
use std::sync::Arc;

use ::cudarc::driver::{
    sys as cu, CudaContext, CudaEvent, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr,
    DevicePtrMut, DriverError, SyncOnDrop,
};
use bytemuck::Pod;

use crate::device::Device;
use crate::error::{CudaError, Error, Result};
use crate::event::{AnyEvent, Event};
use crate::memory::sealed::{DeviceMem, DeviceRegion};
use crate::memory::tracker::{Access, Mirror, Tracker};
use crate::memory::{check_device_ptr, resolve_range};
use crate::memory::{DeviceSlice, DeviceSliceMut, DeviceView, DeviceViewMut};
use crate::stream::Stream;
use crate::sys;

impl Stream {
    /// A `Stream` for a cudarc stream: pinstream's copies, kernels, `Stager` calls, waits and
    /// records on it are queued on `stream` itself, in order with cudarc's work there. The
    /// `Stream` holds the `Arc<CudaStream>` (and so its context) until its last clone drops.
    ///
    /// Errors: `Error::InvalidArgument` if the stream's context is not its device's primary
    /// context (the one the CUDA runtime uses: `CudaContext::new` retains it;
    /// `new_non_primary` creates another), or for the per-thread default stream
    /// (`per_thread_stream`), which is another stream on every thread.
    pub fn from_cudarc(stream: &Arc<CudaStream>) -> Result<Stream> {
        const OP: &str = "Stream::from_cudarc";
        let ctx = stream.context();
        // `cudaStreamPerThread` names another stream on every thread, while a `Stream` is one
        // stream to the trackers (they skip waits for work on the same `Stream`).
        if stream.cu_stream() as usize == PER_THREAD_STREAM {
            return Err(Error::invalid(
                OP,
                "the per-thread default stream is another stream on every thread; use a stream \
                 of CudaContext::new_stream, or the default stream",
            ));
        }
        let device = Device::get(ctx.ordinal())?;
        check_primary(OP, &device, ctx)?;
        let keep: Arc<dyn Any + Send + Sync> = Arc::new(stream.clone());
        // SAFETY: the raw handle is cudarc's live stream (or the null handle, the legacy
        // default stream) of
        // `device`'s primary context (checked above: the context the runtime makes current for
        // `device` is the stream's); the `Stream` keeps the `Arc<CudaStream>` alive until its
        // last clone drops, and cudarc destroys the stream only with its last `Arc`. The two
        // bindgen handle types name the same driver object.
        unsafe { Stream::borrowed(&device, stream.cu_stream() as sys::cudaStream_t, Some(keep)) }
    }

    /// The cudarc stream this `Stream` wraps ([`Stream::from_cudarc`]), if it wraps one.
    pub fn cudarc(&self) -> Option<&Arc<CudaStream>> {
        self.keep()?.downcast_ref::<Arc<CudaStream>>()
    }
}

/// The handle of the per-thread default stream (`cudaStreamPerThread`, `CU_STREAM_PER_THREAD`).
const PER_THREAD_STREAM: usize = 0x2;

/// Checks that `ctx` is the context the runtime uses for `device`: its primary context, the one
/// the runtime makes current for it.
fn check_primary(op: &'static str, device: &Device, ctx: &CudaContext) -> Result<()> {
    let not_primary = || {
        Error::invalid(
            op,
            format!(
                "the cudarc context of device {} is not the primary context the CUDA runtime \
                 uses (CudaContext::new retains it; new_non_primary makes another)",
                ctx.ordinal()
            ),
        )
    };
    // SAFETY: a device handle of a live context; every retain is released just below.
    let primary = unsafe { ::cudarc::driver::result::primary_ctx::retain(ctx.cu_device()) }
        .map_err(|e| driver_error("cuDevicePrimaryCtxRetain", e))?;
    // SAFETY: releases the retain above (cudarc's context holds its own).
    let released = unsafe { ::cudarc::driver::result::primary_ctx::release(ctx.cu_device()) };
    released.map_err(|e| driver_error("cuDevicePrimaryCtxRelease", e))?;
    if primary != ctx.cu_ctx() {
        return Err(not_primary());
    }
    // The runtime's device of that ordinal is the driver's: its context, once the runtime has
    // made it current (cudaFree(null) initializes it if cudaSetDevice has not), is that one.
    device.make_current()?;
    // SAFETY: freeing null is a documented no-op that initializes the context.
    let err = unsafe { sys::cudaFree(std::ptr::null_mut()) };
    crate::error::check(err, "cudaFree")?;
    let current = ::cudarc::driver::result::ctx::get_current()
        .map_err(|e| driver_error("cuCtxGetCurrent", e))?;
    if current != Some(primary) {
        return Err(not_primary());
    }
    Ok(())
}

/// A cudarc driver error as a pinstream error.
fn driver_error(call: &'static str, e: DriverError) -> Error {
    let (mut name, mut message) = (std::ptr::null(), std::ptr::null());
    // SAFETY: valid out-pointers; the driver accepts any code and points them at static,
    // NUL-terminated strings (or fails, leaving them null).
    unsafe {
        let _ = cu::cuGetErrorName(e.0, &mut name);
        let _ = cu::cuGetErrorString(e.0, &mut message);
    }
    Error::Cuda {
        call,
        detail: "cudarc".into(),
        cuda: CudaError::from_driver(
            e.0 as i32,
            static_str(name).unwrap_or("CUDA_ERROR_UNKNOWN"),
            static_str(message).unwrap_or("unrecognized error code"),
        ),
    }
}

fn static_str(p: *const std::os::raw::c_char) -> Option<&'static str> {
    if p.is_null() {
        return None;
    }
    // SAFETY: non-null pointers from cuGetErrorName/String point at static NUL-terminated
    // strings of the driver, loaded for the rest of the process.
    unsafe { std::ffi::CStr::from_ptr(p) }.to_str().ok()
}

/// Refuses to go on while cudarc holds an error it has not reported yet (one a drop stored):
/// cudarc's own calls would fail with it, and the waits it queues for us would be skipped. The
/// error stays stored for the caller's next cudarc call.
fn no_stored_error(op: &'static str, ctx: &CudaContext) -> Result<()> {
    match ctx.check_err() {
        Ok(()) => Ok(()),
        Err(e) => {
            ctx.record_err::<()>(Err(e));
            Err(Error::invalid(
                op,
                format!("the cudarc context holds an unreported error ({e}); check it first"),
            ))
        }
    }
}

/// The cudarc stream of `stream`, or a typed error.
fn cudarc_of<'s>(op: &'static str, stream: &'s Stream) -> Result<&'s Arc<CudaStream>> {
    stream
        .cudarc()
        .ok_or_else(|| Error::invalid(op, "the stream was not made by Stream::from_cudarc"))
}

// A cudarc event is an event of the primary context (or of another: waits across contexts are
// allowed, and a record on a stream of another context is refused by the driver with an
// error), so `Stream::wait` and `Stream::record` take it as they take pinstream's.
impl crate::event::sealed::RawEvent for CudaEvent {
    fn raw_event(&self) -> sys::cudaEvent_t {
        self.cu_event() as sys::cudaEvent_t
    }
    fn event_device(&self) -> Device {
        Device::existing(self.context().ordinal())
    }
}
/// `stream.wait(&cudarc_event)` orders pinstream's work after cudarc's,
/// `stream.record(&cudarc_event)` lets cudarc's streams wait for pinstream's (`CudaStream::wait`).
impl AnyEvent for CudaEvent {}

mod sealed {
    pub trait Sealed {}
}

/// cudarc memory [`view`] accepts: `CudaSlice<T>`, `CudaView<T>`, `CudaViewMut<T>`. Sealed: only
/// cudarc's own types, whose pointer and length come from cudarc's allocations.
pub trait CudarcSlice<T>: DevicePtr<T> + sealed::Sealed {}
/// cudarc memory [`view_mut`] accepts: `CudaSlice<T>`, `CudaViewMut<T>`.
pub trait CudarcSliceMut<T>: DevicePtrMut<T> + sealed::Sealed {}

impl<T> sealed::Sealed for CudaSlice<T> {}
impl<T> sealed::Sealed for CudaView<'_, T> {}
impl<T> sealed::Sealed for CudaViewMut<'_, T> {}
impl<T> CudarcSlice<T> for CudaSlice<T> {}
impl<T> CudarcSlice<T> for CudaView<'_, T> {}
impl<T> CudarcSlice<T> for CudaViewMut<'_, T> {}
impl<T> CudarcSliceMut<T> for CudaSlice<T> {}
impl<T> CudarcSliceMut<T> for CudaViewMut<'_, T> {}

/// Takes the event a `SyncOnDrop` would record on drop, leaving it with nothing to do: the
/// mirror records it instead, after every use. `Sync` (never returned for device memory) keeps
/// its stream synchronization.
fn disarm<'g>(mut guard: SyncOnDrop<'g>) -> Option<&'g CudaEvent> {
    match &mut guard {
        SyncOnDrop::Record(target) => target.take().map(|(event, _)| event),
        SyncOnDrop::Sync(_) => None,
    }
}

/// Checks the slice's context against the stream's and returns both.
fn same_context<'s>(
    op: &'static str,
    stream: &'s Stream,
    slice_stream: &Arc<CudaStream>,
) -> Result<&'s Arc<CudaStream>> {
    let cs = cudarc_of(op, stream)?;
    let (mine, theirs) = (cs.context(), slice_stream.context());
    if mine.cu_ctx() != theirs.cu_ctx() {
        if mine.ordinal() != theirs.ordinal() {
            return Err(Error::WrongDevice {
                op,
                expected: stream.device().raw(),
                found: i32::try_from(theirs.ordinal()).unwrap_or(i32::MAX),
            });
        }
        return Err(Error::invalid(
            op,
            "the slice belongs to another context of the device than the stream",
        ));
    }
    no_stored_error(op, mine)?;
    Ok(cs)
}

/// The pieces of a view, once cudarc has ordered the stream after its earlier uses.
fn make_view<T: Pod>(
    op: &'static str,
    stream: &Stream,
    ctx: &CudaContext,
    ptr: cu::CUdeviceptr,
    len: usize,
    event: Option<&CudaEvent>,
) -> Result<(*mut T, Tracker)> {
    // The waits `device_ptr` queued report failures only through the context's stored error.
    if let Err(e) = ctx.check_err() {
        return Err(driver_error("cuStreamWaitEvent", e));
    }
    let device = stream.device();
    let ptr = usize::try_from(ptr).map_err(|_| Error::invalid(op, "address too wide"))? as *mut T;
    check_device_ptr(op, &device, ptr, len)?;
    let event = event.map(|e| {
        let raw = e.cu_event() as sys::cudaEvent_t;
        // SAFETY: `e` is borrowed for as long as the view lives (the view holds the reference),
        // and the tracker holding this wrapper lives in the view: it is only ever used while
        // the view lives (a leaked view's tracker is never used again). An event of the
        // device's primary context (the slice's context is the stream's, checked); the handle
        // types name the same driver object. The wrapper never destroys it.
        unsafe { Event::from_raw(&device, raw) }
    });
    let mirror = Mirror {
        stream: stream.clone(),
        event,
    };
    let tracker = Tracker::mirrored(mirror);
    // pinstream's work, on any stream, comes after this point of the cudarc stream (which
    // waited for cudarc's earlier uses).
    tracker.record_use(stream, Access::Write)?;
    Ok((ptr, tracker))
}

/// cudarc memory (`CudaSlice`, `CudaView`, `CudaViewMut`) as a pinstream source: copies, the
/// stager's downloads and the normalize kernels read it, on any stream of the device. Made by
/// [`view`].
///
/// The view is lent on the cudarc stream of `stream`: pinstream's work on it comes after
/// cudarc's earlier writes, and cudarc's later writes (and the free) come after pinstream's
/// work — the cudarc stream waits for each operation as it is queued. Dropping or leaking the
/// view changes nothing.
pub struct CudarcView<'a, T: Pod> {
    ptr: *mut T,
    len: usize,
    device: Device,
    tracker: Tracker,
    /// cudarc's event that the tracker's mirror records (through a raw handle): borrowed for as
    /// long as the view lives.
    _event: Option<&'a CudaEvent>,
    _borrow: PhantomData<&'a [T]>,
}

/// cudarc memory (`CudaSlice`, `CudaViewMut`) as a pinstream destination (and source): copies,
/// the stager's uploads and the normalize kernels write it. Made by [`view_mut`]; ordered as
/// [`CudarcView`], after cudarc's earlier reads and writes.
pub struct CudarcViewMut<'a, T: Pod> {
    ptr: *mut T,
    len: usize,
    device: Device,
    tracker: Tracker,
    /// As in [`CudarcView`].
    _event: Option<&'a CudaEvent>,
    _borrow: PhantomData<&'a mut [T]>,
}

/// Lends cudarc memory to pinstream, on the cudarc stream of `stream` (a
/// [`Stream::from_cudarc`]): see [`CudarcView`].
///
/// Errors: `Error::InvalidArgument` for a `stream` not made by `Stream::from_cudarc`, a slice
/// of another context of the device, or a cudarc context holding an error it has not reported;
/// `Error::WrongDevice` for a slice of another device.
pub fn view<'a, T: Pod, S: CudarcSlice<T> + ?Sized>(
    slice: &'a S,
    stream: &'a Stream,
) -> Result<CudarcView<'a, T>> {
    const OP: &str = "pinstream::cudarc::view";
    let cs = same_context(OP, stream, ::cudarc::driver::DeviceSlice::stream(slice))?;
    let len = ::cudarc::driver::DeviceSlice::len(slice);
    // The cudarc stream waits for cudarc's last write of the slice.
    let (ptr, guard) = slice.device_ptr(cs);
    let event = disarm(guard);
    let (ptr, tracker) = make_view::<T>(OP, stream, cs.context(), ptr, len, event)?;
    Ok(CudarcView {
        ptr,
        len,
        device: stream.device(),
        tracker,
        _event: event,
        _borrow: PhantomData,
    })
}

/// Lends cudarc memory to pinstream for writing, on the cudarc stream of `stream`: see
/// [`CudarcViewMut`]. Errors as [`view`].
pub fn view_mut<'a, T: Pod, S: CudarcSliceMut<T> + ?Sized>(
    slice: &'a mut S,
    stream: &'a Stream,
) -> Result<CudarcViewMut<'a, T>> {
    const OP: &str = "pinstream::cudarc::view_mut";
    let cs = same_context(OP, stream, ::cudarc::driver::DeviceSlice::stream(slice))?;
    let len = ::cudarc::driver::DeviceSlice::len(slice);
    // The cudarc stream waits for cudarc's last read and write of the slice.
    let (ptr, guard) = slice.device_ptr_mut(cs);
    let event = disarm(guard);
    let (ptr, tracker) = make_view::<T>(OP, stream, cs.context(), ptr, len, event)?;
    Ok(CudarcViewMut {
        ptr,
        len,
        device: stream.device(),
        tracker,
        _event: event,
        _borrow: PhantomData,
    })
}

macro_rules! view_common {
    ($name:ident) => {
        // SAFETY: the view is a borrow of cudarc memory (`CudaSlice` is Send and Sync); all
        // GPU access goes through the thread-safe tracker.
        unsafe impl<T: Pod> Send for $name<'_, T> {}
        // SAFETY: as above; `&self` allows only tracked GPU work.
        unsafe impl<T: Pod> Sync for $name<'_, T> {}

        impl<T: Pod> std::fmt::Debug for $name<'_, T> {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.debug_struct(stringify!($name))
                    .field("ptr", &self.ptr)
                    .field("len", &self.len)
                    .field("device", &self.device)
                    .finish()
            }
        }

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

            /// The device address.
            pub fn as_device_ptr(&self) -> *const T {
                self.ptr
            }

            /// Blocks until the GPU has finished pinstream's work on the memory.
            pub fn synchronize(&self) -> Result<()> {
                self.tracker.synchronize()
            }

            /// A read-only view of `range` (in elements).
            pub fn slice(&self, range: impl RangeBounds<usize>) -> Result<DeviceView<'_, T>> {
                let r = resolve_range(concat!(stringify!($name), "::slice"), range, self.len)?;
                // SAFETY: the range is inside the borrowed cudarc memory, which outlives the
                // borrow of `self`; the tracker is the view's, which every use goes through.
                Ok(unsafe {
                    DeviceView::from_parts(
                        self.ptr.wrapping_add(r.start),
                        r.len(),
                        self.device,
                        &self.tracker,
                    )
                })
            }
        }

        impl<T: Pod> DeviceMem<T> for $name<'_, T> {
            fn device_region(&self) -> DeviceRegion<'_> {
                DeviceRegion {
                    ptr: self.ptr.cast(),
                    len: self.len,
                    device: self.device,
                    tracker: &self.tracker,
                }
            }
        }
        impl<T: Pod> DeviceSlice<T> for $name<'_, T> {}
    };
}

view_common!(CudarcView);
view_common!(CudarcViewMut);
impl<T: Pod> DeviceSliceMut<T> for CudarcViewMut<'_, T> {}

impl<T: Pod> CudarcViewMut<'_, T> {
    /// A writable view of `range` (in elements).
    pub fn slice_mut(&mut self, range: impl RangeBounds<usize>) -> Result<DeviceViewMut<'_, T>> {
        let r = resolve_range("CudarcViewMut::slice_mut", range, self.len)?;
        // SAFETY: as `slice`; `&mut self` makes it the only view handed out through us.
        Ok(unsafe {
            DeviceViewMut::from_parts(
                self.ptr.wrapping_add(r.start),
                r.len(),
                self.device,
                &self.tracker,
            )
        })
    }
}

/// pinstream memory lent to cudarc as a `CudaSlice` that cudarc must never free.
struct Lent<'s, T> {
    slice: ManuallyDrop<CudaSlice<T>>,
    cs: &'s Arc<CudaStream>,
    stream: &'s Stream,
    tracker: &'s Tracker,
    access: Access,
    given_back: bool,
}

impl<T> Lent<'_, T> {
    /// Orders pinstream after cudarc's uses of the memory: the cudarc stream waits for the
    /// slice's read and write events, and that point joins the tracker. Where that cannot be
    /// done, it waits on the host instead, and where even that fails the tracker is poisoned
    /// (the owner then leaks the memory).
    fn give_back(&mut self) -> Result<()> {
        self.given_back = true;
        let ctx = self.cs.context();
        // An error stored before (by the user's cudarc calls) would make cudarc skip the waits:
        // take it out for the while, put it back after.
        let stored = ctx.check_err();
        drop(self.slice.device_ptr_mut(self.cs));
        let waited = ctx.check_err();
        if let Err(e) = stored {
            ctx.record_err::<()>(Err(e));
        }
        let mut result = Ok(());
        if let Err(e) = waited {
            result = Err(driver_error("cuStreamWaitEvent", e));
            // cudarc's uses, on whatever stream, are over once the context is idle: wait for
            // that on the host instead.
            if let Err(wait) = synchronize_context(ctx) {
                let err = driver_error("cuCtxSynchronize", wait);
                self.tracker.poison(err.clone());
                return Err(err);
            }
        }
        if let Err(e) = self.tracker.record_use(self.stream, self.access) {
            // The stream waited for cudarc's uses: once it is idle, so are they.
            if let Err(wait) = self.stream.synchronize() {
                self.tracker.poison(wait);
            }
            return Err(e);
        }
        result
    }
}

/// `cuCtxSynchronize` on `ctx`, without cudarc's check for stored errors.
fn synchronize_context(ctx: &CudaContext) -> std::result::Result<(), DriverError> {
    // SAFETY: a live context (the `CudaContext` holds it), made current on this thread.
    unsafe { ::cudarc::driver::result::ctx::set_current(ctx.cu_ctx()) }?;
    ::cudarc::driver::result::ctx::synchronize()
}

impl<T> Drop for Lent<'_, T> {
    fn drop(&mut self) {
        if !self.given_back {
            // A panic in the closure: give the memory back all the same.
            let _ = self.give_back();
        }
        // SAFETY: taken once, here, and not used after. `leak` frees nothing: the memory stays
        // pinstream's.
        let slice = unsafe { ManuallyDrop::take(&mut self.slice) };
        let _ = slice.leak();
    }
}

/// Wraps pinstream memory in a cudarc slice that is never freed, ordered after pinstream's uses
/// that `access` conflicts with.
fn lend_slice<'s, T: Pod>(
    op: &'static str,
    region: &DeviceRegion<'s>,
    stream: &'s Stream,
    access: Access,
) -> Result<Lent<'s, T>> {
    stream.same_device(op, region.device)?;
    let cs = cudarc_of(op, stream)?;
    no_stored_error(op, cs.context())?;
    // The cudarc stream waits for pinstream's last write (and, to be written, for every use).
    region.tracker.wait_for(stream, access)?;
    let upgraded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // SAFETY: `region` is `len` elements of `T` of live device memory of the stream's
        // device, kept allocated by the borrow the caller holds until `Lent` is dropped, and
        // `Lent` never lets cudarc free it (`leak`, never `drop`). The context is the device's
        // primary context, the memory's.
        unsafe { cs.upgrade_device_ptr::<T>(region.ptr as usize as cu::CUdeviceptr, region.len) }
    }));
    let slice = upgraded.map_err(|p| Error::Panicked {
        op,
        message: crate::sync::panic_message(&*p),
    })?;
    let mut lent = Lent {
        slice: ManuallyDrop::new(slice),
        cs,
        stream,
        tracker: region.tracker,
        access,
        given_back: false,
    };
    // cudarc's work on other streams waits for this point (its slice's write event).
    drop(lent.slice.device_ptr_mut(cs));
    if let Err(e) = cs.context().check_err() {
        return Err(driver_error("cuEventRecord", e));
    }
    Ok(lent)
}

/// Lends pinstream memory — a `DeviceBuffer`, a view, a [`ForeignBuffer`](crate::ForeignBuffer),
/// a prefetched batch's [`pixels`](crate::prefetch::DeviceBatch::pixels) — to cudarc as a
/// `CudaView` for the length of `f`, on the cudarc stream of `stream` (a
/// [`Stream::from_cudarc`]). Zero copy.
///
/// cudarc's work on the view, on any stream, comes after pinstream's last write of the memory;
/// pinstream's later writes (a prefetcher's refill of the batch's slot included) and the free
/// come after cudarc's work queued in `f` — no host waits. Returns `f`'s result.
///
/// ```no_run
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let (stream, batch): (pinstream::Stream, pinstream::prefetch::DeviceBatch<'_, f32>) = todo!();
/// let cs = stream.cudarc().unwrap();
/// let mut copy = cs.alloc_zeros::<f32>(batch.pixels()?.len())?;
/// pinstream::cudarc::lend(&batch.pixels()?, &stream, |px| cs.memcpy_dtod(&px, &mut copy))??;
/// # Ok(()) }
/// ```
///
/// Errors: as [`view`]; `Error::WrongDevice` for memory of another device than the stream's.
pub fn lend<T: Pod, S: DeviceSlice<T> + ?Sized, R>(
    src: &S,
    stream: &Stream,
    f: impl FnOnce(CudaView<'_, T>) -> R,
) -> Result<R> {
    let region = src.device_region();
    let mut lent = lend_slice::<T>("pinstream::cudarc::lend", &region, stream, Access::Read)?;
    let out = f(lent.slice.as_view());
    lent.give_back()?;
    Ok(out)
}

/// As [`lend`], writable: cudarc's work in `f` may write the memory, and pinstream's later
/// reads wait for it too.
pub fn lend_mut<T: Pod, D: DeviceSliceMut<T> + ?Sized, R>(
    dst: &mut D,
    stream: &Stream,
    f: impl FnOnce(CudaViewMut<'_, T>) -> R,
) -> Result<R> {
    let region = dst.device_region();
    let mut lent = lend_slice::<T>(
        "pinstream::cudarc::lend_mut",
        &region,
        stream,
        Access::Write,
    )?;
    let out = f(lent.slice.as_view_mut());
    lent.give_back()?;
    Ok(out)
}
