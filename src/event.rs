//! `Event` (ordering and host waits, no timing) and `TimingEvent` (elapsed time), as two types
//! so that an event created without timing can never be asked for a time.

use std::time::Duration;

use crate::device::Device;
use crate::error::{check, Error, Result};
use crate::sys;

macro_rules! event_type {
    ($(#[$doc:meta])* $name:ident, $flags:expr) => {
        $(#[$doc])*
        #[derive(Debug)]
        pub struct $name {
            raw: sys::cudaEvent_t,
            device: Device,
            /// `false` for an event lent by another library (`from_raw`): not destroyed here.
            owned: bool,
        }

        // SAFETY: CUDA events may be recorded, queried and destroyed from any thread.
        unsafe impl Send for $name {}
        // SAFETY: as above; all methods take `&self` and the runtime synchronises internally.
        unsafe impl Sync for $name {}

        impl $name {
            /// A new event on `device`.
            pub fn new(device: &Device) -> Result<Self> {
                device.make_current()?;
                let mut raw = std::ptr::null_mut();
                check(
                    // SAFETY: `raw` is a valid out-pointer; the flags are valid event flags.
                    unsafe { sys::cudaEventCreateWithFlags(&mut raw, $flags) },
                    "cudaEventCreateWithFlags",
                )?;
                Ok($name {
                    raw,
                    device: *device,
                    owned: true,
                })
            }

            /// An event pinstream did not create (PyTorch's, cudarc's), used without owning it:
            /// [`Stream::wait`](crate::Stream::wait) on it orders a pinstream stream after the
            /// other library's work, [`Stream::record`](crate::Stream::record) into it lets the
            /// other library wait for pinstream's; dropping it does not destroy it.
            ///
            /// # Safety
            ///
            /// `raw` is a live event of `device`'s primary context (the runtime's, which
            /// PyTorch and cudarc's `CudaContext::new` share), and it stays live until the
            /// returned value is dropped.
            pub unsafe fn from_raw(device: &Device, raw: sys::cudaEvent_t) -> Self {
                $name {
                    raw,
                    device: *device,
                    owned: false,
                }
            }

            /// The device the event belongs to.
            pub fn device(&self) -> Device {
                self.device
            }

            /// Blocks until the work before the last `record` has finished (at once if the
            /// event was never recorded). It spins for the first 200 µs (a DMA of a staging
            /// slot is over within it, and a spin wakes at once), then polls with short sleeps,
            /// so a thread that waits long (a pipeline ahead of a slow consumer) does not burn a
            /// core. With `PINSTREAM_BLOCKING_SYNC=1` the driver sleeps instead.
            pub fn synchronize(&self) -> Result<()> {
                if self.owned && blocking_flag() != 0 {
                    return check(
                        // SAFETY: `raw` is a live event owned by `self`.
                        unsafe { sys::cudaEventSynchronize(self.raw) },
                        "cudaEventSynchronize",
                    );
                }
                let start = std::time::Instant::now();
                while !self.is_complete()? {
                    if start.elapsed() < SPIN {
                        std::hint::spin_loop();
                    } else {
                        std::thread::sleep(POLL);
                    }
                }
                Ok(())
            }

            /// Whether the work before the last `record` has finished, without blocking.
            pub fn is_complete(&self) -> Result<bool> {
                // SAFETY: `raw` is a live event owned by `self`.
                let err = unsafe { sys::cudaEventQuery(self.raw) };
                if err == sys::cudaError::cudaErrorNotReady {
                    return Ok(false);
                }
                check(err, "cudaEventQuery").map(|()| true)
            }

            /// The raw handle, for use with other CUDA libraries. It stays owned by `self`.
            pub fn as_raw(&self) -> sys::cudaEvent_t {
                self.raw
            }
        }

        impl Drop for $name {
            fn drop(&mut self) {
                if !self.owned {
                    return;
                }
                // SAFETY: `raw` is live and destroyed once; CUDA defers the release until any
                // pending record completes. Errors cannot be reported from drop.
                unsafe {
                    let _ = sys::cudaEventDestroy(self.raw);
                }
            }
        }

        impl crate::event::sealed::RawEvent for $name {
            fn raw_event(&self) -> sys::cudaEvent_t {
                self.raw
            }
            fn event_device(&self) -> Device {
                self.device
            }
        }
        impl crate::event::AnyEvent for $name {}
    };
}

event_type!(
    /// An event for ordering streams and waiting from the host; it keeps no time, which makes
    /// recording and waiting cheaper.
    ///
    /// ```no_run
    /// use pinstream::{Device, Event};
    /// # fn main() -> pinstream::Result<()> {
    /// let dev = Device::get(0)?;
    /// let stream = dev.stream()?;
    /// stream.spin(std::time::Duration::from_millis(1))?; // some queued work
    /// let done = Event::new(&dev)?;
    /// stream.record(&done)?;
    /// while !done.is_complete()? {
    ///     // do host work meanwhile
    /// }
    /// # Ok(()) }
    /// ```
    Event,
    sys::cudaEventDisableTiming | blocking_flag()
);

/// How long [`Event::synchronize`] spins before it polls with sleeps.
const SPIN: Duration = Duration::from_micros(200);
/// The sleep between polls of a long wait.
const POLL: Duration = Duration::from_micros(20);

/// `cudaEventBlockingSync` when host waits should sleep instead of spin
/// (`PINSTREAM_BLOCKING_SYNC=1`), else nothing. Read once.
fn blocking_flag() -> u32 {
    static FLAG: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *FLAG.get_or_init(
        || match std::env::var("PINSTREAM_BLOCKING_SYNC").as_deref() {
            Ok("1") => sys::cudaEventBlockingSync,
            _ => 0,
        },
    )
}
event_type!(
    /// An event that keeps a GPU timestamp: `start.elapsed(&end)` gives the time between two.
    ///
    /// ```no_run
    /// use pinstream::{Device, DeviceBuffer, TimingEvent};
    /// # fn main() -> pinstream::Result<()> {
    /// let dev = Device::get(0)?;
    /// let stream = dev.stream()?;
    /// let (src, mut dst) = (DeviceBuffer::<u8>::new(&dev, 1 << 28)?, DeviceBuffer::<u8>::new(&dev, 1 << 28)?);
    /// let (start, end) = (TimingEvent::new(&dev)?, TimingEvent::new(&dev)?);
    /// stream.record(&start)?;
    /// stream.copy_d2d(&src, &mut dst)?;
    /// stream.record(&end)?;
    /// end.synchronize()?;
    /// let ms = start.elapsed_ms(&end)?;
    /// println!("{:.1} GB/s", 2.0 * (1u64 << 28) as f64 / (ms as f64 * 1e6));
    /// # Ok(()) }
    /// ```
    TimingEvent,
    sys::cudaEventDefault
);

impl TimingEvent {
    /// GPU time in milliseconds from `self` to `end`; both must have been recorded and reached.
    pub fn elapsed_ms(&self, end: &TimingEvent) -> Result<f32> {
        if self.device != end.device {
            return Err(Error::WrongDevice {
                op: "TimingEvent::elapsed_ms",
                expected: self.device.raw(),
                found: end.device.raw(),
            });
        }
        let mut ms = 0f32;
        check(
            // SAFETY: both events are live, timing-enabled events; `ms` is a valid out-pointer.
            unsafe { sys::cudaEventElapsedTime(&mut ms, self.raw, end.raw) },
            "cudaEventElapsedTime",
        )?;
        Ok(ms)
    }

    /// As `elapsed_ms`, as a `Duration`.
    pub fn elapsed(&self, end: &TimingEvent) -> Result<Duration> {
        Ok(Duration::from_secs_f64(
            f64::from(self.elapsed_ms(end)?.max(0.0)) / 1e3,
        ))
    }
}

pub(crate) mod sealed {
    pub trait RawEvent {
        fn raw_event(&self) -> crate::sys::cudaEvent_t;
        fn event_device(&self) -> crate::device::Device;
    }
}

/// `Event` or `TimingEvent`: what `Stream::record` and `Stream::wait` accept.
pub trait AnyEvent: sealed::RawEvent {}
