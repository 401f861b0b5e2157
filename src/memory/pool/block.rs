//! [`PoolBlock`]: a pool's memory as its user holds it, and what the block needs of the pool it
//! goes back to ([`Home`]).

use std::sync::Arc;

use bytemuck::Pod;

use super::backing::Block;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::memory::sealed::{HostMem, HostRegion};
use crate::memory::{HostKind, HostSlice, HostSliceMut};

/// What a [`PoolBlock`] needs of its pool: the pool's policy implements it (`Inner`).
pub(super) trait Home: Send + Sync {
    /// The device the pool allocates for.
    fn device(&self) -> Device;
    /// What kind of host memory the blocks are.
    fn kind(&self) -> HostKind;
    /// Whether the blocks are registered read-only (never a copy's destination).
    fn read_only(&self) -> bool;
    /// A block in use changed its requested length from `old` to `new` bytes.
    fn rerequest(&self, old: usize, new: usize);
    /// Takes a block back: into the cache, or (`free`, or a full cache) freed after the GPU's
    /// last use.
    fn release_or_free(&self, block: Block, requested: usize, free: bool);
}

/// `len` elements of `T` in pinned host memory from a [`PinnedPool`](crate::PinnedPool); dropping it gives the
/// memory back to the pool.
///
/// Like a [`PinnedBuffer`](crate::PinnedBuffer), every copy that touches it records an event;
/// `as_slice` and `as_mut_slice` wait for that event first, and the pool hands the memory out
/// again only after it has passed. Unlike a `PinnedBuffer`, dropping it never waits. A block
/// from the cache holds whatever was last written to it (any bit pattern is a valid `T`); fresh
/// memory is zeroed.
pub struct PoolBlock<T: Pod> {
    /// `None` for an empty block.
    pub(super) block: Option<Block>,
    /// The first element (dangling for an empty block).
    pub(super) ptr: *mut T,
    pub(super) len: usize,
    pub(super) pool: Arc<dyn Home>,
}

// SAFETY: the block owns its memory; host access goes through `&`/`&mut` after the tracker's
// wait, and the tracker and the pool are thread-safe.
unsafe impl<T: Pod> Send for PoolBlock<T> {}

// SAFETY: as above.
unsafe impl<T: Pod> Sync for PoolBlock<T> {}

impl<T: Pod> std::fmt::Debug for PoolBlock<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolBlock")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("block_bytes", &self.block.as_ref().map_or(0, |b| b.size))
            .field("device", &self.pool.device())
            .finish()
    }
}

impl<T: Pod> PoolBlock<T> {
    /// The bytes asked for: `len * size_of::<T>()` (within the block, so no overflow).
    fn requested(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device of the pool it came from.
    pub fn device(&self) -> Device {
        self.pool.device()
    }

    /// The first element's address (page-aligned unless the block is empty). For comparing and
    /// for other CUDA code; reading through it is only sound after the GPU's last use.
    pub fn as_ptr(&self) -> *const T {
        self.ptr
    }

    /// How many elements the block's memory holds (its class size over the element size): the
    /// most [`set_len`](Self::set_len) accepts.
    pub(crate) fn capacity(&self) -> usize {
        self.block
            .as_ref()
            .map_or(0, |b| b.size / std::mem::size_of::<T>().max(1))
    }

    /// Makes the block `len` elements long, within its [`capacity`](Self::capacity), so that
    /// one block serves batches of varying lengths. `Error::InvalidArgument` past the capacity.
    pub(crate) fn set_len(&mut self, len: usize) -> Result<()> {
        let cap = self.capacity();
        if len > cap || (len > 0 && self.block.is_none()) {
            return Err(Error::invalid(
                "PoolBlock::set_len",
                format!("{len} elements, the block holds {cap}"),
            ));
        }
        // Within the block: `len * size_of::<T>() <= size`, so no overflow.
        let requested = len * std::mem::size_of::<T>();
        self.pool.rerequest(self.requested(), requested);
        self.len = len;
        Ok(())
    }

    /// Gives the memory back to the pool to be freed rather than cached (for a block of a size
    /// nobody will ask for again); like a drop whose cache is full, this waits for the GPU's
    /// last use of it first.
    pub(crate) fn discard(mut self) {
        if let Some(block) = self.block.take() {
            self.pool.release_or_free(block, self.requested(), true);
        }
    }

    /// Whether the GPU has finished every use of it so far, without blocking.
    pub(crate) fn is_idle(&self) -> bool {
        self.block.as_ref().is_none_or(|b| b.tracker.is_idle())
    }

    fn wait(&self) -> Result<()> {
        match &self.block {
            Some(b) => b.tracker.synchronize(),
            None => Ok(()),
        }
    }

    /// Waits for the GPU's last use, then gives read access.
    pub fn as_slice(&self) -> Result<&[T]> {
        self.wait()?;
        // SAFETY: `ptr` holds `len` initialised elements inside a block of at least
        // `len * size_of::<T>()` bytes (`alloc` and `set_len` keep `len` within the capacity), aligned for `T` (page-aligned, and `T` is refused above
        // a page) or dangling for an empty block. The bytes were zeroed at allocation and later
        // written only through `&mut` or by copies, which the wait above has seen finish; any
        // bit pattern is a valid `T`. No copy can write while this borrow lives (that needs
        // `&mut self`).
        Ok(unsafe { std::slice::from_raw_parts(self.ptr, self.len) })
    }

    /// Waits for the GPU's last use, then gives write access.
    pub fn as_mut_slice(&mut self) -> Result<&mut [T]> {
        self.wait()?;
        // SAFETY: as in `as_slice`; `&mut self` excludes every other access for the borrow.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) })
    }
}

impl<T: Pod> Drop for PoolBlock<T> {
    fn drop(&mut self) {
        if let Some(block) = self.block.take() {
            self.pool.release_or_free(block, self.requested(), false);
        }
    }
}

impl<T: Pod> HostMem<T> for PoolBlock<T> {
    fn host_region(&self) -> HostRegion<'_> {
        HostRegion {
            ptr: self.ptr.cast(),
            len: self.len,
            kind: self.pool.kind(),
            tracker: self.block.as_ref().map(|b| &b.tracker),
            read_only: self.pool.read_only(),
        }
    }
    fn host_region_mut(&mut self) -> HostRegion<'_> {
        self.host_region()
    }
    fn host_read(&self) -> Result<&[T]> {
        self.as_slice()
    }
    fn host_write(&mut self) -> Result<&mut [T]> {
        self.as_mut_slice()
    }
}

impl<T: Pod> HostSlice<T> for PoolBlock<T> {}

impl<T: Pod> HostSliceMut<T> for PoolBlock<T> {}
