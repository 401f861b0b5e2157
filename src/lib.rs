//! # pinstream
//!
//! Fast, safe host ⇄ GPU transfers over the CUDA runtime, linked statically.
//!
//! ```no_run
//! use pinstream::{Device, DeviceBuffer, HostAlloc, PinnedBuffer};
//! # fn main() -> pinstream::Result<()> {
//! let dev = Device::get(0)?;
//! let stream = dev.stream()?;                       // non-blocking
//! let mut host = PinnedBuffer::<u8>::new(&dev, 1 << 20, HostAlloc::DEFAULT)?;
//! host.as_mut_slice()?.fill(7);                      // waits if the GPU still uses it
//! let mut d = DeviceBuffer::<u8>::new(&dev, 1 << 20)?;
//! stream.copy_h2d(&host, &mut d)?;
//! let mut back = vec![0u8; 1 << 20];
//! let done = stream.copy_d2h(&d, &mut back[..])?;   // `back` is borrowed until...
//! let values: &[u8] = done.wait()?;                  // ...the data has arrived
//! assert_eq!(values[0], 7);
//! # Ok(()) }
//! ```
//!
//! Every fallible call returns [`Result`]; a machine without a driver or GPU gets
//! [`Error::NoDevice`] from the first call.

#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]
#![warn(missing_docs)]
#![warn(missing_debug_implementations)]

pub mod sys;

mod affinity;
pub mod augment;
mod copy;
#[cfg(feature = "cudarc-any")]
pub mod cudarc;
pub mod dataset;
pub mod decode;
mod device;
pub mod dlpack;
mod error;
mod event;
pub mod kernels;
pub mod memory;
pub mod prefetch;
#[cfg(feature = "safetensors")]
pub mod safetensors;
pub mod sampler;
pub mod staging;
mod stream;
mod sync;
pub mod timing;

pub use bytemuck::{self, Pod, Zeroable};
pub use half::{self, bf16, f16};

pub use copy::{InFlight, Pending};
pub use device::{
    available, driver_floor, driver_status, parse_link_speed, pcie_gen_from_gts, Device,
    DriverStatus, DriverVerdict, MemoryInfo, PcieLink, Version, CUDART_VERSION,
    FAKE_DRIVER_VERSION_VAR,
};
pub use error::{CudaError, Error, Result};
pub use event::{AnyEvent, Event, TimingEvent};
pub use memory::{
    DeviceBuffer, DeviceSlice, DeviceSliceMut, DeviceView, DeviceViewMut, ForeignBuffer, HostAlloc,
    HostKind, HostRegister, HostSlice, HostSliceMut, PinnedBuffer, PinnedPool, PinnedView,
    PoolBacking, PoolBlock, PoolConfig, PoolStats, Registered,
};
pub use staging::{
    Downloads, FileSource, Packed, PackedBatch, Packer, Stager, StagerConfig, Uploads,
};
pub use stream::Stream;

pub use memory::{Download, DownloadTarget};
pub use staging::{ArenaBatch, PackedArena};
