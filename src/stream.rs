//! `Stream`: an ordered queue of GPU work on one device; non-blocking by default.

use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::device::Device;
use crate::error::{check, check_with, Error, Result};
use crate::event::AnyEvent;
use crate::sys;

/// A CUDA stream created with `cudaStreamNonBlocking`, so it never synchronises with the legacy
/// default stream. Cloning is cheap and shares the stream; it is destroyed with the last clone
/// (work already queued still completes).
///
/// Work on one stream runs in order; work on two streams may overlap. Buffers remember their
/// last use, so a buffer handed from one stream to another is ordered without any call from
/// you; [`Event`](crate::Event) and [`Stream::wait`] order other work.
///
/// ```no_run
/// use pinstream::{Device, DeviceBuffer, Event};
/// # fn main() -> pinstream::Result<()> {
/// let dev = Device::get(0)?;
/// let (copies, compute) = (dev.stream()?, dev.stream()?);
/// let input = vec![1u8; 1 << 20];
/// let mut d = DeviceBuffer::<u8>::new(&dev, input.len())?;
/// copies.copy_h2d(&input[..], &mut d)?;
/// let uploaded = Event::new(&dev)?;
/// copies.record(&uploaded)?;
/// compute.wait(&uploaded)?; // later work on `compute` starts after the upload
/// compute.synchronize()?;
/// # Ok(()) }
/// ```
#[derive(Clone, Debug)]
pub struct Stream {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    raw: sys::cudaStream_t,
    /// Whether pinstream created the stream (and destroys it with the last clone); `false` for
    /// one lent by another library ([`Stream::from_raw`]).
    owned: bool,
    device: Device,
    priority: i32,
    /// Unique in the process, never reused (unlike the raw handle): trackers compare it.
    id: u64,
    /// A slot for a layer above that keeps memory per stream (the kernels' per-launch tables,
    /// `kernels::table`), type-erased so that the stream knows nothing of it. Held locked from
    /// upload to launch, which serialises table launches on the stream. While it holds
    /// anything, the stream's drop waits for the stream before the slot is freed.
    slot: Mutex<Slot>,
    /// What keeps a borrowed stream alive (the other library's owner, e.g. a cudarc
    /// `Arc<CudaStream>`): dropped last, after the drop above has synchronized what it must.
    keep: Option<Arc<dyn Any + Send + Sync>>,
}

/// What a layer above keeps per stream ([`Stream::slot`]).
pub(crate) type Slot = Option<Box<dyn Any + Send>>;

/// Ids start at 1: 0 stands for "no stream" in the trackers.
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

// SAFETY: CUDA streams may be used from any thread; the runtime synchronises internally.
unsafe impl Send for Inner {}
// SAFETY: as above.
unsafe impl Sync for Inner {}

impl Drop for Inner {
    fn drop(&mut self) {
        // What the slot holds (the kernels' table scratch and ring) is freed after this: let
        // its last uses finish first (the ring's drop also waits for its own events, and leaks
        // on failure).
        let tables = crate::sync::lock(&self.slot).is_some();
        // SAFETY: the stream is live and destroyed once. Queued work still completes; the buffers
        // it touches keep their own events, so nothing is freed under it.
        unsafe {
            let _ = sys::cudaSetDevice(self.device.raw());
            if tables {
                let _ = sys::cudaStreamSynchronize(self.raw);
            }
            if self.owned {
                let _ = sys::cudaStreamDestroy(self.raw);
            }
        }
    }
}

impl Stream {
    /// A non-blocking stream on `device` at the default priority.
    pub fn new(device: &Device) -> Result<Stream> {
        Stream::create(device, 0)
    }

    /// A non-blocking stream with `priority`, which must lie in
    /// `device.stream_priority_range()` (lower numbers run first).
    pub fn with_priority(device: &Device, priority: i32) -> Result<Stream> {
        let (least, greatest) = device.stream_priority_range()?;
        if priority > least || priority < greatest {
            return Err(Error::invalid(
                "Stream::with_priority",
                format!("priority {priority} is outside the device's range {greatest}..={least}"),
            ));
        }
        Stream::create(device, priority)
    }

    fn create(device: &Device, priority: i32) -> Result<Stream> {
        device.make_current()?;
        let mut raw = std::ptr::null_mut();
        check_with(
            // SAFETY: `raw` is a valid out-pointer; the flag is a valid stream flag.
            unsafe {
                sys::cudaStreamCreateWithPriority(&mut raw, sys::cudaStreamNonBlocking, priority)
            },
            "cudaStreamCreateWithPriority",
            || format!("device {}, priority {priority}", device.raw()),
        )?;
        Ok(Stream {
            inner: Arc::new(Inner {
                raw,
                owned: true,
                device: *device,
                priority,
                id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
                slot: Mutex::new(None),
                keep: None,
            }),
        })
    }

    /// A `Stream` for a CUDA stream that pinstream did not create — PyTorch's current stream,
    /// a cudarc `CudaStream`, the legacy default stream (null) — used without owning it: every
    /// copy, kernel, `Stager` call, wait and record works on it, and dropping the last clone
    /// does not destroy it (when kernel tables were used on it, the drop synchronizes it first,
    /// as for a stream of pinstream's own). Ordering with the other library's work on the
    /// stream is plain stream order; with its other streams, use events
    /// ([`Event::from_raw`](crate::Event::from_raw), [`Stream::wait`], [`Stream::record`]).
    ///
    /// Errors: `Error::InvalidArgument` if the runtime says the stream belongs to another
    /// device than `device`.
    ///
    /// # Safety
    ///
    /// - `raw` is a live stream (or null / `cudaStreamLegacy`, the legacy default stream) of
    ///   `device`'s primary context: the context the CUDA runtime
    ///   uses, which PyTorch and cudarc's `CudaContext::new` share.
    /// - It stays live until the returned `Stream` and every clone of it have been dropped
    ///   (buffers from [`DeviceBuffer::new_async`](crate::DeviceBuffer::new_async) on it and prefetchers consuming on it hold
    ///   clones): destroying it earlier is a use after free in the driver.
    ///
    /// `cudaStreamPerThread` is refused (`Error::InvalidArgument`): it names a different stream
    /// on every thread, while a `Stream` (and the events recorded on it, by DLPack deleters
    /// among others) may be used from any thread.
    pub unsafe fn from_raw(device: &Device, raw: sys::cudaStream_t) -> Result<Stream> {
        // The runtime's `cudaStreamPerThread` handle, `((cudaStream_t)0x2)`.
        if raw as usize == 0x2 {
            return Err(Error::invalid(
                "Stream::from_raw",
                "cudaStreamPerThread names another stream on each thread; pass the thread's \
                 own stream (or the legacy default stream) instead",
            ));
        }
        // SAFETY: the caller's contract is `borrowed`'s.
        unsafe { Stream::borrowed(device, raw, None) }
    }

    /// [`from_raw`](Self::from_raw) that also holds `keep` (what keeps `raw` alive) until the
    /// last clone drops. The caller refuses `cudaStreamPerThread`.
    ///
    /// # Safety
    ///
    /// As `from_raw`; holding `keep` may be what keeps `raw` live.
    pub(crate) unsafe fn borrowed(
        device: &Device,
        raw: sys::cudaStream_t,
        keep: Option<Arc<dyn Any + Send + Sync>>,
    ) -> Result<Stream> {
        device.make_current()?;
        let mut priority = 0;
        check(
            // SAFETY: the caller promises a live stream of this device's primary context (or
            // a special handle the runtime accepts); `priority` is a valid out-pointer.
            unsafe { sys::cudaStreamGetPriority(raw, &mut priority) },
            "cudaStreamGetPriority",
        )?;
        let mut on = 0;
        check(
            // SAFETY: as above; `on` is a valid out-pointer.
            unsafe { sys::cudaStreamGetDevice(raw, &mut on) },
            "cudaStreamGetDevice",
        )?;
        if on != device.raw() {
            return Err(Error::WrongDevice {
                op: "Stream::from_raw",
                expected: device.raw(),
                found: on,
            });
        }
        Ok(Stream {
            inner: Arc::new(Inner {
                raw,
                owned: false,
                device: *device,
                priority,
                id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
                slot: Mutex::new(None),
                keep,
            }),
        })
    }

    /// Whether pinstream created the stream (rather than [`from_raw`](Self::from_raw)).
    pub fn is_owned(&self) -> bool {
        self.inner.owned
    }

    /// Whether the stream stays the same live stream for as long as this `Stream` is held:
    /// pinstream created it, holds what keeps it alive (`from_cudarc`), or it is the legacy
    /// default stream (null or `cudaStreamLegacy`), which is never destroyed. A stream merely
    /// lent by another library ([`from_raw`](Self::from_raw)) may be destroyed, and its handle
    /// given to a new stream, once the call that lent it returns.
    pub(crate) fn outlives_its_borrowers(&self) -> bool {
        let raw = self.inner.raw as usize;
        self.inner.owned || self.inner.keep.is_some() || raw == 0 || raw == 0x1
    }

    /// What keeps a borrowed stream alive, if the stream holds it (`Stream::from_cudarc`).
    #[cfg(feature = "cudarc-any")]
    pub(crate) fn keep(&self) -> Option<&Arc<dyn Any + Send + Sync>> {
        self.inner.keep.as_ref()
    }

    /// The device the stream runs on.
    pub fn device(&self) -> Device {
        self.inner.device
    }

    /// The priority it was created with.
    pub fn priority(&self) -> i32 {
        self.inner.priority
    }

    /// An id unique to this stream (its clones share it) for the life of the process.
    pub(crate) fn id(&self) -> u64 {
        self.inner.id
    }

    /// The raw handle, for use with other CUDA libraries. It stays owned by the `Stream`.
    pub fn as_raw(&self) -> sys::cudaStream_t {
        self.inner.raw
    }

    /// The stream's slot for a layer above, locked (see `Inner::slot`).
    pub(crate) fn slot(&self) -> MutexGuard<'_, Slot> {
        crate::sync::lock(&self.inner.slot)
    }

    /// Makes the stream's device current on this thread; every operation does this first.
    pub(crate) fn enter(&self) -> Result<()> {
        self.inner.device.make_current()
    }

    pub(crate) fn same_device(&self, op: &'static str, device: Device) -> Result<()> {
        if device != self.inner.device {
            return Err(Error::WrongDevice {
                op,
                expected: self.inner.device.raw(),
                found: device.raw(),
            });
        }
        Ok(())
    }

    /// Blocks until all work queued on the stream has finished.
    pub fn synchronize(&self) -> Result<()> {
        self.enter()?;
        // SAFETY: the stream is live.
        check(
            unsafe { sys::cudaStreamSynchronize(self.inner.raw) },
            "cudaStreamSynchronize",
        )
    }

    /// Whether all queued work has finished, without blocking.
    pub fn is_idle(&self) -> Result<bool> {
        self.enter()?;
        // SAFETY: the stream is live.
        let err = unsafe { sys::cudaStreamQuery(self.inner.raw) };
        if err == sys::cudaError::cudaErrorNotReady {
            return Ok(false);
        }
        check(err, "cudaStreamQuery").map(|()| true)
    }

    /// Records `event` at this point of the stream. The event must be on the stream's device.
    pub fn record<E: AnyEvent>(&self, event: &E) -> Result<()> {
        self.same_device("Stream::record", event.event_device())?;
        self.enter()?;
        // SAFETY: event and stream are live and on the same device.
        check(
            unsafe { sys::cudaEventRecord(event.raw_event(), self.inner.raw) },
            "cudaEventRecord",
        )
    }

    /// `record` for a thread whose current device is already the stream's (the staging
    /// workers set it once), without the `cudaSetDevice` call.
    pub(crate) fn record_here(&self, event: &crate::event::Event) -> Result<()> {
        self.same_device("Stream::record", event.device())?;
        // SAFETY: event and stream are live and on the same device, which is current.
        check(
            unsafe { sys::cudaEventRecord(event.as_raw(), self.inner.raw) },
            "cudaEventRecord",
        )
    }

    /// `wait` without the `cudaSetDevice` call, as `record_here`.
    pub(crate) fn wait_here(&self, event: &crate::event::Event) -> Result<()> {
        // SAFETY: event and stream are live; cross-device waits are allowed.
        check(
            unsafe { sys::cudaStreamWaitEvent(self.inner.raw, event.as_raw(), 0) },
            "cudaStreamWaitEvent",
        )
    }

    /// Makes all later work on this stream wait for `event` (which may be on another device).
    /// Waiting for an event never recorded is a no-op.
    pub fn wait<E: AnyEvent>(&self, event: &E) -> Result<()> {
        self.enter()?;
        // SAFETY: event and stream are live; cross-device waits are allowed.
        check(
            unsafe { sys::cudaStreamWaitEvent(self.inner.raw, event.raw_event(), 0) },
            "cudaStreamWaitEvent",
        )
    }

    /// Queues a kernel that keeps the stream busy for `duration` of GPU time (for tests and
    /// benchmarks that need work in flight).
    pub fn spin(&self, duration: Duration) -> Result<()> {
        self.enter()?;
        let ns = u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX);
        // SAFETY: the launcher only reads its arguments; the stream is live and current.
        check_with(
            unsafe { sys::pinstream_spin(ns, self.inner.raw) },
            "pinstream_spin",
            || format!("{ns} ns"),
        )
    }
}

impl Device {
    /// A new non-blocking stream on this device at default priority.
    pub fn stream(&self) -> Result<Stream> {
        Stream::new(self)
    }
}
