//! Where a pool's memory comes from, apart from the pool's policy: `cudaHostAlloc`, or an
//! anonymous `mmap` (transparent huge pages on request) pre-faulted on several threads and
//! `cudaHostRegister`ed; and the frees, each after the GPU's last use of the block.

use std::os::raw::c_void;

use crate::device::Device;
use crate::error::{check_alloc, check_with, CudaError, Error, Result};
use crate::memory::pinned::HostAlloc;
use crate::memory::registered::{read_only, HostRegister};
use crate::memory::tracker::{self, Tracker};
use crate::sys;

/// Every block starts on a page boundary: element types aligned to more than this are refused.
pub(crate) const BLOCK_ALIGN: usize = 4096;

/// With `huge_pages`, mappings are rounded up to (and aligned on) this.
pub(super) const HUGE_PAGE: usize = 2 << 20;

/// Where a pool gets its memory from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolBacking {
    /// `cudaHostAlloc` with these flags; fresh blocks are zeroed.
    HostAlloc(HostAlloc),
    /// An anonymous `mmap`, pre-faulted on `threads` threads (one byte written per page), then
    /// `cudaHostRegister(flags)`. Registering memory that is already faulted in measured
    /// 0.042 s/GiB against 0.347 for `cudaHostAlloc` (BENCHMARKS.md); this adds the page faults,
    /// spread over the threads (`pinstream staging --pool-size` measures the whole). A failed `mmap` for
    /// lack of memory is `Error::OutOfMemory` with `call: "mmap"`. Fresh blocks are zero (anonymous memory). Freed with
    /// `cudaHostUnregister` and `munmap`. The blocks count as registered memory
    /// ([`HostKind::Registered`](crate::HostKind::Registered)); with [`HostRegister::READ_ONLY`] they are never a copy's
    /// destination.
    Register {
        /// Threads that fault the pages in (at least 1).
        threads: usize,
        /// Ask for transparent huge pages (`MADV_HUGEPAGE`): each mapping is rounded up to, and
        /// aligned on, 2 MiB. The advice is ignored where the kernel has them turned off.
        huge_pages: bool,
        /// The `cudaHostRegister` flags.
        flags: HostRegister,
    },
}

/// One backing allocation, owned by the pool's cache or by one `PoolBlock`.
#[derive(Debug)]
pub(super) struct Block {
    /// The first byte: page-aligned.
    pub(super) ptr: *mut u8,
    /// What the allocator returned (`ptr`, or below it when `cudaHostAlloc` gave an address
    /// that had to be moved up to a page boundary): what is freed.
    pub(super) base: *mut u8,
    /// The class it was allocated for: what it may serve and what the stats count.
    pub(super) size: usize,
    /// The length of the allocation (or mapping): `size`, or more with huge pages.
    pub(super) mapped: usize,
    /// The GPU's last use; moves with the memory, into the cache and out again.
    pub(super) tracker: Tracker,
}

// SAFETY: a `Block` owns its memory exclusively; the host reaches it only through the one
// `PoolBlock` that holds it (after the tracker's wait), and the tracker is thread-safe.
unsafe impl Send for Block {}

// SAFETY: `&Block` gives no access to the memory, only to the thread-safe tracker.
unsafe impl Sync for Block {}

/// `cudaHostAlloc(size, flags)` on `device`, zeroed. The runtime may place a small
/// allocation off a page boundary; then it asks again for a page more and moves the start up.
pub(super) fn host_alloc(device: &Device, size: usize, flags: HostAlloc) -> Result<Block> {
    device.make_current()?;
    let alloc = |bytes: usize| -> Result<*mut c_void> {
        let mut base = std::ptr::null_mut::<c_void>();
        check_alloc(
            // SAFETY: `base` is a valid out-pointer; the flags are valid cudaHostAlloc flags.
            unsafe { sys::cudaHostAlloc(&mut base, bytes, flags.bits()) },
            "cudaHostAlloc",
            bytes,
        )?;
        if base.is_null() {
            return Err(Error::invalid(
                "PinnedPool::alloc",
                "cudaHostAlloc returned null",
            ));
        }
        Ok(base)
    };
    let mut base = alloc(size)?;
    let mut mapped = size;
    if base as usize % BLOCK_ALIGN != 0 {
        // SAFETY: allocated just above, never shared, freed once.
        unsafe {
            let _ = sys::cudaFreeHost(base);
        }
        mapped = size
            .checked_add(BLOCK_ALIGN)
            .ok_or_else(|| Error::invalid("PinnedPool::alloc", format!("{size} bytes overflow")))?;
        base = alloc(mapped)?;
    }
    let offset = (BLOCK_ALIGN - base as usize % BLOCK_ALIGN) % BLOCK_ALIGN;
    // Inside the allocation: `mapped` is `size + BLOCK_ALIGN` whenever `offset > 0`.
    let ptr = base.cast::<u8>().wrapping_add(offset);
    // SAFETY: `ptr..ptr + size` lies in the allocation, not yet shared with anyone or any
    // copy; zeroing makes every byte initialised.
    unsafe { std::ptr::write_bytes(ptr, 0, size) };
    Ok(Block {
        ptr,
        base: base.cast(),
        size,
        mapped,
        tracker: Tracker::new(),
    })
}

/// An anonymous mapping of `size` bytes (rounded up to and aligned on 2 MiB with `huge_pages`),
/// faulted in on `threads` threads and registered with `flags` on `device`.
pub(super) fn register(
    device: &Device,
    size: usize,
    threads: usize,
    huge_pages: bool,
    flags: HostRegister,
) -> Result<Block> {
    let len = if huge_pages {
        size.checked_next_multiple_of(HUGE_PAGE).ok_or_else(|| {
            Error::invalid(
                "PinnedPool::alloc",
                format!("{size} bytes cannot be rounded up to huge pages"),
            )
        })?
    } else {
        size
    };
    let ptr = map_anonymous(len, huge_pages)?;
    prefault(ptr, len, threads);
    let registered = device.make_current().and_then(|()| {
        check_alloc(
            // SAFETY: `ptr..ptr + len` is a live mapping that only this function knows about; it
            // stays mapped until it is unregistered (in `free_block`, or just below on failure).
            unsafe { sys::cudaHostRegister(ptr.cast(), len, flags.bits()) },
            "cudaHostRegister",
            len,
        )
    });
    if let Err(e) = registered {
        // SAFETY: mapped above with this length, not registered, never shared.
        unsafe { unmap(ptr, len) };
        return Err(e);
    }
    if flags.contains(HostRegister::READ_ONLY) {
        read_only::insert(ptr as usize, len);
    }
    Ok(Block {
        ptr,
        size,
        mapped: len,
        base: ptr,
        tracker: Tracker::new(),
    })
}

/// `mmap` of `len` private anonymous bytes, read-write; with `huge_pages` aligned on 2 MiB and
/// advised `MADV_HUGEPAGE`.
pub(super) fn map_anonymous(len: usize, huge_pages: bool) -> Result<*mut u8> {
    let map = |len: usize| -> Result<*mut u8> {
        // SAFETY: a fresh anonymous mapping at an address of the kernel's choosing; it touches
        // no existing memory.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::ENOMEM) {
                return Err(Error::OutOfMemory {
                    call: "mmap",
                    bytes: len,
                    cuda: CudaError::from_raw(sys::cudaError::cudaErrorMemoryAllocation),
                });
            }
            return Err(Error::invalid(
                "PinnedPool::alloc",
                format!("mmap of {len} bytes failed: {err}"),
            ));
        }
        Ok(p.cast())
    };
    if !huge_pages {
        return map(len);
    }
    // Map a huge page more than needed and cut the ends off, so that the start is aligned.
    let padded = len.checked_add(HUGE_PAGE).ok_or_else(|| {
        Error::invalid(
            "PinnedPool::alloc",
            format!("{len} bytes plus huge-page alignment overflow usize"),
        )
    })?;
    let raw = map(padded)?;
    let head = (raw as usize).wrapping_neg() % HUGE_PAGE;
    let tail = padded - head - len;
    // SAFETY: `head + len + tail == padded`, so every pointer stays inside the mapping.
    let ptr = unsafe { raw.add(head) };
    if head > 0 {
        // SAFETY: the first `head` bytes of the fresh mapping; nothing uses them.
        unsafe { unmap(raw, head) };
    }
    if tail > 0 {
        // SAFETY: the last `tail` bytes of the fresh mapping, past `ptr + len`; nothing uses them.
        unsafe { unmap(ptr.add(len), tail) };
    }
    #[cfg(target_os = "linux")]
    {
        // Advice only: where transparent huge pages are off this fails, and the mapping simply
        // uses small pages.
        // SAFETY: `ptr..ptr + len` is a live mapping owned by this function.
        let _ = unsafe { libc::madvise(ptr.cast(), len, libc::MADV_HUGEPAGE) };
    }
    Ok(ptr)
}

/// Unmaps `ptr..ptr + len`.
///
/// # Safety
/// The range must be (part of) a mapping made by `map_anonymous` that nothing uses any more:
/// neither the host nor, through a registration, the GPU.
pub(super) unsafe fn unmap(ptr: *mut u8, len: usize) {
    // SAFETY: the caller's promise.
    let _ = unsafe { libc::munmap(ptr.cast(), len) };
}

/// A pointer that may cross to the pre-faulting threads.
#[derive(Clone, Copy)]
pub(super) struct FaultPtr(*mut u8);

// SAFETY: each thread writes its own, disjoint pages of a mapping that outlives the threads.
unsafe impl Send for FaultPtr {}

// SAFETY: as above.
unsafe impl Sync for FaultPtr {}

impl FaultPtr {
    /// Writes a zero to the first byte of each page `first..end`.
    ///
    /// # Safety
    /// The pages must lie inside a live, writable mapping that no one else reads or writes.
    unsafe fn touch(self, page: usize, first: usize, end: usize) {
        for p in first..end {
            // SAFETY: the caller's promise; the byte was zero (fresh anonymous memory) and stays
            // zero, the write only makes the kernel give the page its own frame.
            unsafe { std::ptr::write_volatile(self.0.add(p * page), 0) };
        }
    }
}

/// Faults in every page of `ptr..ptr + len` by writing one byte per page, on up to `threads`
/// threads (the calling one included). A thread that cannot be started leaves its share to the
/// calling thread.
pub(super) fn prefault(ptr: *mut u8, len: usize, threads: usize) {
    let page = page_size();
    let pages = len.div_ceil(page);
    if pages == 0 {
        return;
    }
    let threads = threads.clamp(1, pages);
    let per = pages.div_ceil(threads);
    let base = FaultPtr(ptr);
    std::thread::scope(|scope| {
        let mut handles = Vec::new();
        let mut own = Vec::new();
        for t in 1..threads {
            let first = t.saturating_mul(per).min(pages);
            let end = first.saturating_add(per).min(pages);
            if first >= end {
                break;
            }
            // SAFETY: pages `first..end` are inside the mapping of `len` bytes, which outlives
            // the scope; each range goes to one thread only.
            let work = move || unsafe { base.touch(page, first, end) };
            match std::thread::Builder::new().spawn_scoped(scope, work) {
                Ok(h) => handles.push(h),
                Err(_) => own.push((first, end)),
            }
        }
        own.push((0, per.min(pages)));
        for (first, end) in own {
            // SAFETY: as above; these ranges went to no other thread.
            unsafe { base.touch(page, first, end) };
        }
        for h in handles {
            let _ = h.join();
        }
    });
}

pub(super) fn page_size() -> usize {
    // SAFETY: plain call with a valid name.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(n).ok().filter(|&n| n > 0).unwrap_or(4096)
}

/// Total physical memory in bytes, where the system says.
pub(crate) fn physical_memory() -> Option<usize> {
    // SAFETY: plain call with a valid name.
    let pages = unsafe { libc::sysconf(libc::_SC_PHYS_PAGES) };
    usize::try_from(pages)
        .ok()
        .filter(|&p| p > 0)?
        .checked_mul(page_size())
}

/// Frees a block after the GPU's last use; on a failed wait leaks it instead.
pub(super) fn free_block(device: &Device, backing: PoolBacking, block: Block) -> Result<()> {
    if let Err(e) = block.tracker.synchronize() {
        tracker::leak("pooled pinned host memory", block.mapped, &e);
        return Err(e);
    }
    match backing {
        PoolBacking::HostAlloc(_) => {
            crate::error::check(
                // SAFETY: `base` came from cudaHostAlloc and is freed once, after the GPU's last
                // use (waited above); no `PoolBlock` holds it.
                unsafe { sys::cudaFreeHost(block.base.cast()) },
                "cudaFreeHost",
            )
            .inspect(|()| crate::memory::live::pinned_freed(block.mapped, false))
        }
        PoolBacking::Register { flags, .. } => {
            // The registration belongs to the device's context.
            let _ = device.make_current();
            // SAFETY: registered by `register` and unregistered once, after the GPU's last use.
            let err = unsafe { sys::cudaHostUnregister(block.ptr.cast()) };
            if let Err(e) = check_with(err, "cudaHostUnregister", || {
                format!("{} bytes", block.mapped)
            }) {
                // Still registered: unmapping could leave the driver with pages it believes
                // are ours. Keep the mapping.
                tracker::leak("pooled registered host memory", block.mapped, &e);
                return Err(e);
            }
            if flags.contains(HostRegister::READ_ONLY) {
                read_only::remove(block.ptr as usize);
            }
            // SAFETY: the whole mapping, unregistered above; no `PoolBlock` holds it.
            unsafe { unmap(block.ptr, block.mapped) };
            crate::memory::live::pinned_freed(block.mapped, false);
            Ok(())
        }
    }
}
