//! DLPack: hand pinstream's device and pinned memory to other libraries (PyTorch, CuPy, JAX,
//! candle, anything that takes a `DLManagedTensorVersioned`) without a copy, and take theirs.
//!
//! **Export.** A [`Tensor`] owns (or shares) a pinstream buffer, a prefetched batch's pixels or
//! extras ([`DeviceBatch::into_dlpack`](crate::prefetch::DeviceBatch::into_dlpack)), or a pinned
//! buffer (`kDLCUDAHost`), with a shape and strides. [`Tensor::into_versioned`] /
//! [`Tensor::into_legacy`] hand it over as the C struct, with the stream semantics of
//! `__dlpack__(stream=...)`: the consumer names its stream and that stream waits on the GPU for
//! the data (no host wait); `None` (the protocol's `-1`) means the consumer synchronises
//! itself. The memory stays alive until the consumer calls the deleter, from any thread. The
//! deleter never waits for the GPU: where the consumer's stream is one that cannot have been
//! destroyed meanwhile (a pinstream stream, the legacy default stream), an event recorded on it
//! orders the free — or a prefetcher slot's refill — after the consumer's work; where it is a
//! stream the consumer only lent for the handover (the protocol does not make it keep that
//! stream alive, and CUDA reuses a destroyed stream's handle), or no stream was named, a
//! background thread gives the memory back once the tensor's device (for page-locked memory:
//! every device the process has a context on) has finished what was queued before the
//! release ([`wait_for_releases`] waits for those). A consumer that never calls the deleter leaks what it holds
//! (as with any DLPack producer); a prefetcher replaces the slots such batches hold, up to
//! [`PrefetchConfig::export_spares`](crate::prefetch::PrefetchConfig::export_spares), then
//! `next()` says so with an error instead of waiting.
//!
//! **Import.** [`Imported`] takes ownership of another library's managed tensor and calls its
//! deleter when dropped (after pinstream's work on it): a `kDLCPU` or `kDLCUDAHost` tensor is a
//! source for copies and the `Stager` ([`Imported::host`]), a `kDLCUDA` tensor a source or a
//! checked destination ([`Imported::device`], [`Imported::device_mut`]: device, dtype,
//! contiguity and size are checked).
//!
//! The ABI is written here from `dlpack.h` (1.3) rather than taken from the `dlpark` crate: it
//! is five `repr(C)` structs; what pinstream needs around them — deleters that order the free
//! after the consumer's stream, prefetcher slots as owners, trackers on imported memory — is
//! its own either way, and the library stays free of dlpark's dependencies.

pub mod abi;
#[cfg(feature = "prefetch")]
mod batch;
pub(crate) mod export;
mod import;
mod owner;
mod tensor;

pub use crate::deferred::wait_for_releases;
pub use import::{HostTensor, Imported};
#[cfg(feature = "prefetch")]
pub(crate) use tensor::TensorParts;
pub use tensor::{Part, Refused, Tensor};

use abi::{DLDataType, KDL_BFLOAT, KDL_FLOAT, KDL_INT, KDL_UINT};
use bytemuck::Pod;

/// An element type with a DLPack data type.
///
/// Implemented for `f32`, `f64`, `f16`, `bf16`, `u8`, `i8`, `u16`, `i16`, `u32`, `i32`, `u64`,
/// `i64`. Another implementation must give a `DTYPE` whose size (`bits * lanes / 8`) is
/// `size_of::<Self>()`; imports and exports check that and refuse a type where it differs.
pub trait Element: Pod + Send + Sync {
    /// The DLPack data type.
    const DTYPE: DLDataType;
}

macro_rules! element {
    ($($t:ty => $code:expr, $bits:expr;)*) => {
        $(impl Element for $t {
            const DTYPE: DLDataType = DLDataType { code: $code, bits: $bits, lanes: 1 };
        })*
    };
}

element! {
    f32 => KDL_FLOAT, 32;
    f64 => KDL_FLOAT, 64;
    half::f16 => KDL_FLOAT, 16;
    half::bf16 => KDL_BFLOAT, 16;
    u8 => KDL_UINT, 8;
    u16 => KDL_UINT, 16;
    u32 => KDL_UINT, 32;
    u64 => KDL_UINT, 64;
    i8 => KDL_INT, 8;
    i16 => KDL_INT, 16;
    i32 => KDL_INT, 32;
    i64 => KDL_INT, 64;
}

/// Checks that `T::DTYPE` describes `T`'s size.
fn check_element<T: Element>(op: &'static str) -> crate::Result<()> {
    let d = T::DTYPE;
    let bits = u64::from(d.bits) * u64::from(d.lanes);
    if d.lanes == 0 || bits % 8 != 0 || bits / 8 != std::mem::size_of::<T>() as u64 {
        return Err(crate::Error::invalid(
            op,
            format!(
                "the DLPack type {d:?} does not describe a {}-byte element",
                std::mem::size_of::<T>()
            ),
        ));
    }
    Ok(())
}

/// A readable name for a DLPack data type, for error messages.
pub(crate) fn dtype_name(d: DLDataType) -> String {
    let kind = match d.code {
        KDL_INT => "i",
        KDL_UINT => "u",
        KDL_FLOAT => "f",
        KDL_BFLOAT => "bf",
        abi::KDL_BOOL => "bool",
        _ => "code",
    };
    if d.lanes == 1 {
        format!("{kind}{}", d.bits)
    } else {
        format!("{kind}{}x{}", d.bits, d.lanes)
    }
}
