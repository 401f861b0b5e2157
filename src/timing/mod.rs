//! The small API a measurement of your own needs: [`Stats`] of repeated samples and [`gbps`],
//! a [`Gate`] that holds streams while copies are queued behind it (so that the host's enqueue
//! time stays out of what events measure), [`CopyLoop`] (the same copy queued many times as one
//! tracked batch, optionally in pieces), the cost of pinning ([`host_alloc_cost`],
//! [`host_register_cost`]), [`cpu_seconds`], and [`batch_h2d_pageable`], the baseline the
//! staging engine is measured against. Time the GPU with [`TimingEvent`](crate::TimingEvent)s
//! recorded on the stream.
//!
//! The `pinstream` program's benchmarks (`pinstream bandwidth`, `staging`, `prefetch`) are built
//! on this module; they live in the `pinstream-cli` crate of this repository, so depending on
//! the library pulls in none of the program's dependencies.
//!
//! ```no_run
//! use std::time::Duration;
//! use pinstream::timing::{gbps, CopyLoop, Gate, Stats};
//! use pinstream::{Device, DeviceBuffer, HostAlloc, PinnedBuffer, TimingEvent};
//! # fn main() -> pinstream::Result<()> {
//! let dev = Device::get(0)?;
//! let stream = dev.stream()?;
//! let n = 64 << 20;
//! let host = PinnedBuffer::<u8>::new(&dev, n, HostAlloc::DEFAULT)?;
//! let mut d = DeviceBuffer::<u8>::new(&dev, n)?;
//! let gate = Gate::new(&dev, Duration::from_secs(5))?;
//! let (start, end) = (TimingEvent::new(&dev)?, TimingEvent::new(&dev)?);
//! let copies = CopyLoop::h2d(&stream, &host, &mut d, n)?;
//! let mut samples = Vec::new();
//! for _ in 0..10 {
//!     gate.close(&stream)?;         // the stream waits here...
//!     stream.record(&start)?;
//!     copies.queue(20)?;            // ...while 20 copies are queued
//!     stream.record(&end)?;
//!     gate.open();                  // now they run back to back
//!     end.synchronize()?;
//!     samples.push(gbps(20.0 * n as f64, start.elapsed(&end)?.as_secs_f64()));
//! }
//! let s = Stats::new(samples).expect("ten samples");
//! println!("{:.2} GB/s median, cv {:.1} %", s.median, 100.0 * s.cv);
//! # Ok(()) }
//! ```

mod copy_loop;
mod gate;

use std::time::Duration;

pub use copy_loop::CopyLoop;
pub use gate::Gate;

use crate::device::Device;
use crate::error::Result;
use crate::memory::{DeviceBuffer, HostAlloc, HostRegister};
use crate::stream::Stream;
use bytemuck::Pod;

/// Summary of repeated samples.
#[derive(Clone, Debug, PartialEq)]
pub struct Stats {
    /// The samples, in the order they were taken.
    pub samples: Vec<f64>,
    /// The middle sample (the mean of the two middle ones for an even count).
    pub median: f64,
    /// The smallest sample.
    pub min: f64,
    /// The largest sample.
    pub max: f64,
    /// Coefficient of variation: standard deviation over mean (population; 0 for a mean of 0).
    pub cv: f64,
}

impl Stats {
    /// The summary of `samples`; `None` for no samples.
    ///
    /// ```
    /// use pinstream::timing::Stats;
    /// let s = Stats::new(vec![3.0, 1.0, 2.0, 10.0]).unwrap();
    /// assert_eq!((s.median, s.min, s.max), (2.5, 1.0, 10.0));
    /// assert!(Stats::new(vec![]).is_none());
    /// ```
    pub fn new(samples: Vec<f64>) -> Option<Stats> {
        if samples.is_empty() {
            return None;
        }
        let mut sorted = samples.clone();
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len();
        let median = if n % 2 == 1 {
            sorted[n / 2]
        } else {
            (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
        };
        let mean = sorted.iter().sum::<f64>() / n as f64;
        let var = sorted.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
        let cv = if mean != 0.0 { var.sqrt() / mean } else { 0.0 };
        Some(Stats {
            median,
            min: sorted[0],
            max: sorted[n - 1],
            cv,
            samples,
        })
    }
}

/// Decimal GB/s (10^9 bytes per second) for `bytes` moved in `secs`; 0 for no time.
///
/// ```
/// assert_eq!(pinstream::timing::gbps(2e9, 0.5), 4.0);
/// ```
pub fn gbps(bytes: f64, secs: f64) -> f64 {
    if secs > 0.0 {
        bytes / secs / 1e9
    } else {
        0.0
    }
}

/// CPU time of the whole process so far (user + system, every thread), in seconds: take it
/// before and after a measurement for its CPU cost (the staging engine's threads included).
/// 0 where the system cannot tell.
pub fn cpu_seconds() -> f64 {
    let mut ru = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: `ru` is a valid out-pointer for one `rusage`.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_SELF, ru.as_mut_ptr()) };
    if rc != 0 {
        return 0.0;
    }
    // SAFETY: zero-initialised, then filled by a successful getrusage.
    let ru = unsafe { ru.assume_init() };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 * 1e-6;
    t(ru.ru_utime) + t(ru.ru_stime)
}

/// How long `cudaHostAlloc(bytes, flags)` and the matching `cudaFreeHost` take on `device`:
/// (allocation, free), with nothing in between (the memory is never touched). What pinning a
/// fresh buffer costs, before any pool.
pub fn host_alloc_cost(
    device: &Device,
    bytes: usize,
    flags: HostAlloc,
) -> Result<(Duration, Duration)> {
    crate::memory::time_alloc_free(device, bytes, flags)
}

/// How long `cudaHostRegister(data, flags)` and the matching `cudaHostUnregister` take:
/// (register, unregister). `data` is borrowed for the call and unregistered before it returns;
/// touch it first, as a real buffer would be, or the cost of faulting it in is counted too.
pub fn host_register_cost<T: Pod>(
    device: &Device,
    data: &mut [T],
    flags: HostRegister,
) -> Result<(Duration, Duration)> {
    crate::memory::time_register(device, data, flags)
}

/// Copies each plain slice of `srcs` into the device buffer at the same index with one
/// `cudaMemcpyBatchAsync` that reads the sources during the call (one `cudaMemcpyAsync` each
/// with a runtime older than 13.0), then waits for the stream: many small tensors straight from
/// pageable memory, the baseline that [`Uploads`](crate::Uploads) and
/// [`Packer`](crate::Packer) are measured against (`pinstream staging --many`). Lengths must
/// match pairwise ([`Error::LengthMismatch`](crate::Error::LengthMismatch) otherwise, before
/// anything is queued).
pub fn batch_h2d_pageable(
    stream: &Stream,
    srcs: &[&[u8]],
    dsts: &mut [DeviceBuffer<u8>],
) -> Result<()> {
    crate::copy::batch_h2d_pageable(stream, srcs, dsts)
}
