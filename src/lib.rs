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
// The core keeps a few services only its layers call (affinity, batched and non-temporal copies,
// pool block lengths, the panic guards): unused when a dependent turns the layers off. Dead
// code is still denied with the default features, where every layer is on (as tokio does).
#![cfg_attr(
    not(all(
        feature = "staging",
        feature = "prefetch",
        feature = "timing",
        feature = "dlpack"
    )),
    allow(dead_code)
)]

// The core (always built): each module imports only those above it in this list.
mod copy;
pub mod device;
pub mod driver;
mod error;
mod event;
pub mod kernels;
pub mod memory;
mod stream;
mod sync;
pub mod sys;

// Compile-fail doctests: the guarantees the compiler checks (rustdoc only).
#[cfg(all(
    doctest,
    feature = "staging",
    feature = "prefetch",
    feature = "timing",
    feature = "dlpack"
))]
mod compile_fail;

// The layers, one cargo feature each (see Cargo.toml).
#[cfg(feature = "cudarc-any")]
pub mod cudarc;
#[cfg(feature = "dlpack")]
mod deferred;
#[cfg(feature = "dlpack")]
pub mod dlpack;
#[cfg(feature = "prefetch")]
pub mod prefetch;
#[cfg(feature = "safetensors")]
pub mod safetensors;
#[cfg(feature = "staging")]
pub mod staging;
#[cfg(feature = "timing")]
pub mod timing;

pub use bytemuck::Pod;
pub use half::{bf16, f16};

pub use copy::{Download, DownloadTarget, InFlight, Pending};
pub use device::{available, Device, MemoryInfo};
pub use driver::{Version, CUDART_VERSION};
pub use error::{CudaError, Error, Result};
pub use event::{AnyEvent, Event, TimingEvent};
pub use memory::{
    DeviceBuffer, DeviceSlice, DeviceSliceMut, DeviceView, DeviceViewMut, ForeignBuffer, HostAlloc,
    HostKind, HostRegister, HostRegistration, HostSlice, HostSliceMut, PinnedBuffer, PinnedPool,
    PinnedView, PoolBacking, PoolBlock, PoolConfig, PoolStats, Registered,
};
#[cfg(feature = "staging")]
pub use staging::{
    ArenaBatch, Downloads, FileSource, Packed, PackedArena, PackedBatch, Packer, Stager,
    StagerConfig, Uploads,
};
pub use stream::Stream;
