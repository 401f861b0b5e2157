//! nvJPEG's stream-ordered (v2) allocators, backed by pinstream's pools: device memory from the
//! device's stream-ordered pool (`DeviceBuffer::new_async`, which keeps freed memory for the next
//! allocation), page-locked host memory from a [`PinnedPool`] (size classes, cached).
//!
//! nvJPEG names the stream it will use each allocation on. An allocation is made on the
//! allocators' own stream, and nvJPEG's stream waits for it on the GPU; a free waits for what
//! nvJPEG's stream has queued by then (device memory: on the GPU, through the buffer's tracker;
//! pinned memory: on the host, before the block goes back to the pool, which cannot see
//! nvJPEG's copies). nvJPEG's stream is used only during the call that lends it.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Mutex;

use pinstream::memory::{DeviceBuffer, PinnedPool, PoolBlock, PoolConfig};
use pinstream::{Device, Result, Stream};

use super::sys;
use crate::util::lock;

/// What the callbacks return for a failure (any non-zero value; this is `cudaErrorMemoryAllocation`).
const FAILED: c_int = 2;

/// The allocators' state: the memory handed to nvJPEG, by address, until it frees it.
pub(crate) struct Allocators {
    device: Device,
    stream: Stream,
    pinned: PinnedPool,
    device_blocks: Mutex<HashMap<usize, DeviceBuffer<u8>>>,
    pinned_blocks: Mutex<HashMap<usize, PoolBlock<u8>>>,
}

impl Allocators {
    pub(crate) fn new(device: &Device) -> Result<Allocators> {
        Ok(Allocators {
            device: *device,
            stream: device.stream()?,
            pinned: PinnedPool::new(device, PoolConfig::default())?,
            device_blocks: Mutex::new(HashMap::new()),
            pinned_blocks: Mutex::new(HashMap::new()),
        })
    }

    /// The two allocator tables for `nvjpegCreateExV2`, with `self` as their context. `self`
    /// must outlive every handle made with them (`Shared` drops its handles first).
    pub(crate) fn tables(&self) -> (sys::nvjpegDevAllocatorV2_t, sys::nvjpegPinnedAllocatorV2_t) {
        let ctx = (self as *const Allocators).cast_mut().cast::<c_void>();
        (
            sys::nvjpegDevAllocatorV2_t {
                dev_malloc: Some(dev_malloc),
                dev_free: Some(dev_free),
                dev_ctx: ctx,
            },
            sys::nvjpegPinnedAllocatorV2_t {
                pinned_malloc: Some(pinned_malloc),
                pinned_free: Some(pinned_free),
                pinned_ctx: ctx,
            },
        )
    }

    /// nvJPEG's stream, for the length of one callback.
    fn lent(&self, raw: sys::cudaStream_t) -> Result<Stream> {
        // SAFETY: nvJPEG passes a live stream of the device its handle was made on (the
        // runtime's primary context), or null (the legacy default stream); the `Stream` is
        // dropped before the callback returns, so the handle is not kept past the call that
        // lent it.
        unsafe { Stream::from_raw(&self.device, raw.cast()) }
    }

    fn device_malloc(
        &self,
        out: *mut *mut c_void,
        size: usize,
        raw: sys::cudaStream_t,
    ) -> Result<()> {
        let buf = DeviceBuffer::<u8>::new_async(&self.stream, size.max(1))?;
        // nvJPEG's stream waits for the allocation (and its use is recorded).
        buf.record_stream(&self.lent(raw)?)?;
        let p = buf.as_device_ptr() as *mut c_void;
        lock(&self.device_blocks).insert(p as usize, buf);
        // SAFETY: `out` is nvJPEG's out-pointer for this call.
        unsafe { out.write(p) };
        Ok(())
    }

    fn device_free(&self, p: *mut c_void, raw: sys::cudaStream_t) -> Result<()> {
        let Some(mut buf) = lock(&self.device_blocks).remove(&(p as usize)) else {
            return Ok(()); // null, or not ours: nothing to free
        };
        // The free waits for what nvJPEG's stream has queued on the memory.
        buf.record_stream_mut(&self.lent(raw)?)?;
        drop(buf);
        Ok(())
    }

    fn pinned_malloc(&self, out: *mut *mut c_void, size: usize) -> Result<()> {
        let block = self.pinned.alloc::<u8>(size.max(1))?;
        let p = block.as_ptr() as *mut c_void;
        lock(&self.pinned_blocks).insert(p as usize, block);
        // SAFETY: `out` is nvJPEG's out-pointer for this call.
        unsafe { out.write(p) };
        Ok(())
    }

    fn pinned_free(&self, p: *mut c_void, raw: sys::cudaStream_t) -> Result<()> {
        let Some(block) = lock(&self.pinned_blocks).remove(&(p as usize)) else {
            return Ok(());
        };
        // The pool cannot see nvJPEG's copies from the block: wait for them here.
        self.lent(raw)?.synchronize()?;
        drop(block);
        Ok(())
    }
}

/// Runs a callback's body: a failure or a panic (which must not unwind into C) is `FAILED`.
fn guarded(f: impl FnOnce() -> Result<()>) -> c_int {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => 0,
        _ => FAILED,
    }
}

/// # Safety
/// `ctx` is the `Allocators` of `tables`, alive (see there).
unsafe extern "C" fn dev_malloc(
    ctx: *mut c_void,
    out: *mut *mut c_void,
    size: usize,
    stream: sys::cudaStream_t,
) -> c_int {
    // SAFETY: the caller's contract: `ctx` points at a live `Allocators`, used through `&`.
    let a = unsafe { &*ctx.cast::<Allocators>() };
    guarded(|| a.device_malloc(out, size, stream))
}

/// # Safety
/// As [`dev_malloc`].
unsafe extern "C" fn dev_free(
    ctx: *mut c_void,
    p: *mut c_void,
    _size: usize,
    stream: sys::cudaStream_t,
) -> c_int {
    // SAFETY: as in `dev_malloc`.
    let a = unsafe { &*ctx.cast::<Allocators>() };
    guarded(|| a.device_free(p, stream))
}

/// # Safety
/// As [`dev_malloc`].
unsafe extern "C" fn pinned_malloc(
    ctx: *mut c_void,
    out: *mut *mut c_void,
    size: usize,
    _stream: sys::cudaStream_t,
) -> c_int {
    // SAFETY: as in `dev_malloc`.
    let a = unsafe { &*ctx.cast::<Allocators>() };
    guarded(|| a.pinned_malloc(out, size))
}

/// # Safety
/// As [`dev_malloc`].
unsafe extern "C" fn pinned_free(
    ctx: *mut c_void,
    p: *mut c_void,
    _size: usize,
    stream: sys::cudaStream_t,
) -> c_int {
    // SAFETY: as in `dev_malloc`.
    let a = unsafe { &*ctx.cast::<Allocators>() };
    guarded(|| a.pinned_free(p, stream))
}

impl Allocators {
    /// Bytes handed to nvJPEG and not freed: (device, pinned).
    pub(crate) fn in_use(&self) -> (usize, usize) {
        let d = lock(&self.device_blocks).values().map(|b| b.len()).sum();
        let p = lock(&self.pinned_blocks).values().map(|b| b.len()).sum();
        (d, p)
    }
}
