//! pinstream's pool of stream-ordered device memory: one per device, made on first use, kept for
//! the process. [`DeviceBuffer::new_async`](crate::DeviceBuffer::new_async) allocates from it.
//!
//! The device's default pool gives its free memory back to the driver at every synchronization
//! (release threshold 0), so a program that allocates, waits and frees in a loop — an upload per
//! call, as the Python package does — maps fresh memory on every call: a 1 GiB allocation then
//! costs milliseconds. This pool keeps what it freed (threshold: unbounded), as PyTorch's caching
//! allocator does, and hands it back only when asked ([`Device::empty_cache`]) or when an
//! allocation would otherwise fail (then it trims itself and tries once more). It is a pool of
//! its own, not the default pool with a new threshold, so other users of the default pool
//! (cudarc, candle) keep the behaviour they chose.

use std::os::raw::c_void;
use std::sync::Mutex;

use crate::device::Device;
use crate::error::{check, Error, Result};
use crate::sys;

/// A `cudaMemPool_t`, created once per device and never destroyed.
#[derive(Clone, Copy)]
struct Handle(sys::cudaMemPool_t);

// SAFETY: a memory pool handle is an opaque driver object; the runtime's pool calls are
// thread-safe.
unsafe impl Send for Handle {}

static POOLS: Mutex<Vec<Option<Handle>>> = Mutex::new(Vec::new());

fn table() -> std::sync::MutexGuard<'static, Vec<Option<Handle>>> {
    POOLS.lock().unwrap_or_else(|e| e.into_inner())
}

/// The pool of `device`, made on first use.
pub(crate) fn get(device: &Device) -> Result<sys::cudaMemPool_t> {
    let ordinal = device.ordinal();
    let mut t = table();
    if let Some(Some(h)) = t.get(ordinal) {
        return Ok(h.0);
    }
    let props = sys::cudaMemPoolProps {
        allocType: sys::cudaMemAllocationType_cudaMemAllocationTypePinned,
        handleTypes: sys::cudaMemAllocationHandleType_cudaMemHandleTypeNone,
        location: sys::cudaMemLocation {
            type_: sys::cudaMemLocationType_cudaMemLocationTypeDevice,
            id: device.raw(),
        },
        win32SecurityAttributes: std::ptr::null_mut(),
        maxSize: 0,
        usage: 0,
        reserved: [0; 54],
    };
    let mut pool: sys::cudaMemPool_t = std::ptr::null_mut();
    check(
        // SAFETY: valid out-pointer and a fully initialised properties struct (no handle
        // types, no size limit) that outlives the call.
        unsafe { sys::cudaMemPoolCreate(&mut pool, &props) },
        "cudaMemPoolCreate",
    )?;
    let mut keep: u64 = u64::MAX;
    check(
        // SAFETY: `pool` was created above; the release threshold attribute takes a `u64`
        // that outlives the call.
        unsafe {
            sys::cudaMemPoolSetAttribute(
                pool,
                sys::cudaMemPoolAttr_cudaMemPoolAttrReleaseThreshold,
                (&mut keep as *mut u64).cast::<c_void>(),
            )
        },
        "cudaMemPoolSetAttribute",
    )?;
    if t.len() <= ordinal {
        t.resize(ordinal + 1, None);
    }
    t[ordinal] = Some(Handle(pool));
    Ok(pool)
}

/// Gives the memory of `device`'s pool that no buffer uses back to the driver (a no-op where
/// the pool was never made). Whether any was given back.
pub(crate) fn trim(device: &Device) -> Result<bool> {
    let Some(Some(h)) = table().get(device.ordinal()).copied() else {
        return Ok(false);
    };
    check(
        // SAFETY: a live pool handle (pools are never destroyed); keeping 0 bytes only
        // releases memory no allocation holds.
        unsafe { sys::cudaMemPoolTrimTo(h.0, 0) },
        "cudaMemPoolTrimTo",
    )?;
    Ok(true)
}

/// Runs the allocation `alloc`; where it runs out of memory and `device`'s pool was made,
/// gives back what the pool holds unused and runs it once more.
pub(crate) fn retry_after_trim(
    device: &Device,
    mut alloc: impl FnMut() -> Result<()>,
) -> Result<()> {
    match alloc() {
        Err(Error::OutOfMemory { .. }) if trim(device)? => alloc(),
        r => r,
    }
}

/// Bytes `device`'s pool holds from the driver now, in use or cached (0 where it was never
/// made).
pub(crate) fn reserved(device: &Device) -> Result<u64> {
    let Some(Some(h)) = table().get(device.ordinal()).copied() else {
        return Ok(0);
    };
    let mut v: u64 = 0;
    check(
        // SAFETY: a live pool handle; the attribute is a `u64` written to a valid out-pointer.
        unsafe {
            sys::cudaMemPoolGetAttribute(
                h.0,
                sys::cudaMemPoolAttr_cudaMemPoolAttrReservedMemCurrent,
                (&mut v as *mut u64).cast::<c_void>(),
            )
        },
        "cudaMemPoolGetAttribute",
    )?;
    Ok(v)
}

/// The pool as a device sees it (`Device::empty_cache`, `Device::pool_reserved`).
impl Device {
    /// Gives the device memory that pinstream's stream-ordered pool keeps for reuse (freed
    /// [`DeviceBuffer::new_async`](crate::DeviceBuffer::new_async) buffers, DLPack tensors
    /// released by their consumers) back to the driver, as `torch.cuda.empty_cache()` does
    /// for PyTorch's allocator. Memory still in use, or whose free is still queued on a
    /// stream, stays. pinstream's own allocations ([`DeviceBuffer::new`](crate::DeviceBuffer::new)
    /// and `new_async`) trim the pool themselves before they report [`Error::OutOfMemory`];
    /// other libraries' allocators (PyTorch's, cudarc's) do not: call this where they need the
    /// room.
    pub fn empty_cache(&self) -> Result<()> {
        trim(self).map(drop)
    }

    /// Bytes pinstream's stream-ordered pool of this device holds from the driver now: in use
    /// and kept for reuse (0 before its first allocation).
    pub fn pool_reserved(&self) -> Result<u64> {
        reserved(self)
    }
}
