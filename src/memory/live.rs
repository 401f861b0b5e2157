//! Process-wide counts of the memory pinstream itself holds, so that a test or a long run can
//! check that its own memory stays flat without being misled by other users of the device (a
//! sanitizer's allocations, other libraries, other processes), which `Device::memory_info`
//! counts too.

use std::sync::atomic::{AtomicUsize, Ordering};

static DEVICE: AtomicUsize = AtomicUsize::new(0);
static PINNED: AtomicUsize = AtomicUsize::new(0);
static CACHE: AtomicUsize = AtomicUsize::new(0);

/// Bytes this process holds through pinstream now, all devices together.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Live {
    /// Device memory of every live `DeviceBuffer` (the streams' scratch buffers and the
    /// prefetchers' slots included), and any leaked on purpose ([`leaked`](super::leaked)).
    pub device_bytes: usize,
    /// Page-locked host memory of every live `PinnedBuffer` and pool block (cached ones
    /// included), and any leaked on purpose. Memory a user registers is not counted, nor
    /// the caches below.
    pub pinned_bytes: usize,
    /// Page-locked memory of the process-wide caches that live as long as the process: the
    /// bounce blocks of small pageable uploads (bounded: 16 blocks per size class and device,
    /// about 8 MiB a device). It grows with how many such uploads run at once.
    pub cache_bytes: usize,
}

/// What pinstream holds now. Exact for its own allocations; it does not see the runtime's own
/// overheads (contexts, the stream-ordered allocator's reserve).
pub fn live() -> Live {
    Live {
        device_bytes: DEVICE.load(Ordering::Relaxed),
        pinned_bytes: PINNED.load(Ordering::Relaxed),
        cache_bytes: CACHE.load(Ordering::Relaxed),
    }
}

pub(crate) fn device_allocated(bytes: usize) {
    DEVICE.fetch_add(bytes, Ordering::Relaxed);
}

pub(crate) fn device_freed(bytes: usize) {
    DEVICE.fetch_sub(bytes, Ordering::Relaxed);
}

pub(crate) fn pinned_allocated(bytes: usize) {
    PINNED.fetch_add(bytes, Ordering::Relaxed);
}

pub(crate) fn pinned_freed(bytes: usize, cache: bool) {
    if cache {
        CACHE.fetch_sub(bytes, Ordering::Relaxed);
    } else {
        PINNED.fetch_sub(bytes, Ordering::Relaxed);
    }
}

pub(crate) fn pinned_to_cache(bytes: usize) {
    PINNED.fetch_sub(bytes, Ordering::Relaxed);
    CACHE.fetch_add(bytes, Ordering::Relaxed);
}
