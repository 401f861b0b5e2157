//! Pinned bounce blocks for host-to-device copies from plain (pageable) slices.
//!
//! `cudaMemcpyAsync` from pageable memory returns once the driver has staged the data, as CUDA
//! documents it for most systems; but the same documentation allows it to be asynchronous, and
//! where the GPU reads pageable memory directly (HMM / ATS, e.g. Grace Hopper) it can be. The
//! safe API must not depend on that. So a small pageable source (at most [`MAX_BYTES`]) is
//! copied on the host into a pinned block from this pool and the DMA reads the block, which its
//! own event guards; the caller's slice is free the moment the call returns and the call does
//! not wait for the GPU. Larger sources go to the driver and the call waits for the copy.
//!
//! Blocks come in power-of-two classes from 4 KiB to [`CHUNK`], at most [`PER_CLASS`] per
//! class and device; a block is reused once its event has passed (when all of a full class are
//! busy, the least recently used one is waited for). They live as long as the process.

use std::sync::Mutex;

use crate::device::Device;
use crate::error::Result;
use crate::memory::{HostAlloc, PinnedBuffer};

/// Largest pageable host-to-device copy staged through a bounce block.
pub(crate) const MAX_BYTES: usize = 1 << 20;
/// Larger copies are staged in pieces of this size, each queued as soon as it is in its block.
pub(crate) const CHUNK: usize = 256 << 10;
const MIN_BYTES: usize = 4 << 10;
/// Blocks per size class and device.
const PER_CLASS: usize = 16;

struct Pool {
    device: Device,
    /// Free (returned) blocks, least recently returned first.
    blocks: Vec<PinnedBuffer<u8>>,
}

static POOLS: Mutex<Vec<Pool>> = Mutex::new(Vec::new());

/// The class size for `bytes` (at most `CHUNK`).
fn class_of(bytes: usize) -> usize {
    bytes.max(MIN_BYTES).next_power_of_two()
}

/// A block of at least `bytes` (<= `CHUNK`) for `device`. Its contents may be anything;
/// `as_mut_slice` on it waits for any copy still reading it.
pub(crate) fn take(device: Device, bytes: usize) -> Result<PinnedBuffer<u8>> {
    let class = class_of(bytes);
    {
        let mut pools = POOLS.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(pool) = pools.iter_mut().find(|p| p.device == device) {
            let same_class = |b: &PinnedBuffer<u8>| b.len() == class;
            if let Some(i) = pool
                .blocks
                .iter()
                .position(|b| same_class(b) && b.is_idle())
            {
                return Ok(pool.blocks.remove(i));
            }
            let in_class = pool.blocks.iter().filter(|b| same_class(b)).count();
            if in_class >= PER_CLASS {
                // All busy: take the least recently used; the caller's host write waits for it.
                if let Some(i) = pool.blocks.iter().position(same_class) {
                    return Ok(pool.blocks.remove(i));
                }
            }
        }
    }
    let mut block = PinnedBuffer::new(&device, class, HostAlloc::DEFAULT)?;
    block.count_as_cache();
    Ok(block)
}

/// Returns a block to its device's pool, to be reused once its event has passed.
pub(crate) fn give_back(block: PinnedBuffer<u8>) {
    let device = block.device();
    let mut pools = POOLS.lock().unwrap_or_else(|e| e.into_inner());
    match pools.iter_mut().find(|p| p.device == device) {
        Some(pool) => pool.blocks.push(block),
        None => pools.push(Pool {
            device,
            blocks: vec![block],
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classes() {
        assert_eq!(class_of(1), 4096);
        assert_eq!(class_of(4096), 4096);
        assert_eq!(class_of(4097), 8192);
        assert_eq!(class_of(CHUNK), CHUNK);
        assert_eq!(class_of(CHUNK - 1), CHUNK);
    }
}
