//! `PinnedPool`: a caching allocator of page-locked host memory.
//!
//! `cudaHostAlloc` and `cudaHostRegister` are slow (hundreds of milliseconds per GiB) and
//! `cudaFreeHost` synchronises the device, so code that needs pinned buffers over and over should
//! keep them. The pool hands out [`PoolBlock`]s; dropping one gives its memory back to the pool,
//! together with its tracker (the event of the GPU's last use), and the pool hands that memory
//! out again only once the event has passed. A block whose last copy is still running is simply
//! skipped, so neither dropping a block nor asking for one waits for the GPU.
//!
//! Sizes are rounded up to classes with at most 12.5 % waste (see [`class_of`]); a request is
//! served by the smallest idle cached block at least as large as its class and at most an eighth
//! larger, otherwise by a fresh allocation of exactly the class size.

use std::collections::BTreeMap;
use std::os::raw::c_void;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use bytemuck::Pod;

use super::pinned::HostAlloc;
use super::registered::{read_only, HostRegister};
use super::sealed::{HostMem, HostRegion};
use super::tracker::{self, Tracker};
use super::{HostKind, HostSlice, HostSliceMut};
use crate::device::Device;
use crate::error::{byte_len, check_alloc, check_with, CudaError, Error, Result};
use crate::sys;

/// Every block starts on a page boundary: element types aligned to more than this are refused.
pub(crate) const BLOCK_ALIGN: usize = 4096;
/// The smallest class, and the class step below 32 KiB.
const MIN_STEP: usize = 4096;
/// With `huge_pages`, mappings are rounded up to (and aligned on) this.
const HUGE_PAGE: usize = 2 << 20;

/// The class (the size actually allocated) for a request of `bytes`: `bytes` rounded up to a
/// multiple of `max(4096, p / 8)`, where `p` is the largest power of two not above `bytes`. So a
/// class wastes less than 4 KiB below 32 KiB, and less than an eighth of the request above.
/// `Some(0)` for zero bytes, `None` when the rounding overflows `usize`.
pub(crate) fn class_of(bytes: usize) -> Option<usize> {
    if bytes == 0 {
        return Some(0);
    }
    let prev_pow2 = 1usize << (usize::BITS - 1 - bytes.leading_zeros());
    let step = (prev_pow2 / 8).max(MIN_STEP);
    bytes.div_ceil(step).checked_mul(step)
}

/// Whether a cached block of `size` bytes may serve a request of class `class`: at least the
/// class, and at most an eighth larger.
fn fits(class: usize, size: usize) -> bool {
    size >= class && size <= class.saturating_add(class / 8)
}

/// The byte length and class of `len` elements of `T`, or `Error::InvalidArgument` for a type
/// aligned beyond a page or a size that overflows.
fn layout<T>(len: usize) -> Result<(usize, usize)> {
    const OP: &str = "PinnedPool::alloc";
    let align = std::mem::align_of::<T>();
    if align > BLOCK_ALIGN {
        return Err(Error::invalid(
            OP,
            format!(
                "{} is aligned to {align} bytes; pool blocks are only aligned to {BLOCK_ALIGN}",
                std::any::type_name::<T>()
            ),
        ));
    }
    let bytes = byte_len::<T>(OP, len)?;
    let class = class_of(bytes).ok_or_else(|| {
        Error::invalid(
            OP,
            format!("{bytes} bytes cannot be rounded up to a size class"),
        )
    })?;
    Ok((bytes, class))
}

/// Where a pool gets its memory from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolBacking {
    /// `cudaHostAlloc` with these flags; fresh blocks are zeroed.
    HostAlloc(HostAlloc),
    /// An anonymous `mmap`, pre-faulted on `threads` threads (one byte written per page), then
    /// `cudaHostRegister(flags)`. Registering memory that is already faulted in measured
    /// 0.042 s/GiB against 0.347 for `cudaHostAlloc` (BENCHMARKS.md); this adds the page faults,
    /// spread over the threads (`bench::pool::pool_cost` measures the whole). A failed `mmap` for
    /// lack of memory is `Error::OutOfMemory` with `call: "mmap"`. Fresh blocks are zero (anonymous memory). Freed with
    /// `cudaHostUnregister` and `munmap`. The blocks count as registered memory
    /// ([`HostKind::Registered`]); with [`HostRegister::READ_ONLY`] they are never a copy's
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

/// How a [`PinnedPool`] allocates and how much it keeps.
///
/// Build it from the default so that later fields do not break your code:
/// `PoolConfig { max_cached_bytes: 1 << 30, ..Default::default() }`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolConfig {
    /// Where fresh memory comes from. Default: `PoolBacking::HostAlloc(HostAlloc::DEFAULT)`.
    pub backing: PoolBacking,
    /// The most bytes (counted in class sizes) kept idle in the cache; a block dropped while the
    /// cache is full is freed instead (its drop then waits for the GPU's last use of it).
    /// Default: 4 GiB.
    pub max_cached_bytes: usize,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            backing: PoolBacking::HostAlloc(HostAlloc::DEFAULT),
            max_cached_bytes: usize::try_from(4u64 << 30).unwrap_or(usize::MAX),
        }
    }
}

/// A pool's counters, from [`PinnedPool::stats`]. Byte counts are class sizes unless said
/// otherwise.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PoolStats {
    /// Bytes idle in the cache (including blocks whose last copy is still running).
    pub cached_bytes: usize,
    /// Bytes in blocks handed out and not yet dropped (their class sizes).
    pub in_use_bytes: usize,
    /// Bytes in blocks handed out, as asked for (`len * size_of::<T>()`).
    pub requested_bytes: usize,
    /// Requests served from the cache.
    pub hits: u64,
    /// Requests that found nothing idle in the cache and needed a fresh allocation.
    pub misses: u64,
    /// Successful backing allocations (`cudaHostAlloc`, or `mmap` + `cudaHostRegister`).
    pub allocations: u64,
    /// Backing allocations freed (on a full cache, by `trim`, or when the pool goes away).
    pub frees: u64,
    /// Seconds spent in backing allocations, zeroing and pre-faulting included.
    pub alloc_seconds: f64,
}

/// Checks a configuration before anything is allocated.
fn validate(config: &PoolConfig) -> Result<()> {
    if let PoolBacking::Register { threads: 0, .. } = config.backing {
        return Err(Error::invalid(
            "PinnedPool::new",
            "PoolBacking::Register needs at least one pre-faulting thread",
        ));
    }
    Ok(())
}

/// One backing allocation, owned by the pool's cache or by one `PoolBlock`.
#[derive(Debug)]
struct Block {
    /// The first byte: page-aligned.
    ptr: *mut u8,
    /// What the allocator returned (`ptr`, or below it when `cudaHostAlloc` gave an address
    /// that had to be moved up to a page boundary): what is freed.
    base: *mut u8,
    /// The class it was allocated for: what it may serve and what the stats count.
    size: usize,
    /// The length of the allocation (or mapping): `size`, or more with huge pages.
    mapped: usize,
    /// The GPU's last use; moves with the memory, into the cache and out again.
    tracker: Tracker,
}

// SAFETY: a `Block` owns its memory exclusively; the host reaches it only through the one
// `PoolBlock` that holds it (after the tracker's wait), and the tracker is thread-safe.
unsafe impl Send for Block {}
// SAFETY: `&Block` gives no access to the memory, only to the thread-safe tracker.
unsafe impl Sync for Block {}

#[derive(Debug, Default)]
struct State {
    /// Idle blocks by size; within a size, least recently returned first.
    cached: BTreeMap<usize, Vec<Block>>,
    stats: PoolStats,
}

#[derive(Debug)]
struct Inner {
    device: Device,
    config: PoolConfig,
    state: Mutex<State>,
}

/// A caching allocator of pinned host memory on one device: [`alloc`](PinnedPool::alloc) hands
/// out [`PoolBlock`]s, which go back to the pool when dropped and are handed out again once the
/// GPU has finished with them.
///
/// Clones share the pool. The memory lives until it is freed by [`trim`](PinnedPool::trim), by a
/// full cache, or when the last clone and the last block are gone; it is never freed, nor handed
/// out again, while a copy may still read or write it.
///
/// ```no_run
/// use pinstream::{Device, DeviceBuffer, PinnedPool, PoolConfig};
/// # fn main() -> pinstream::Result<()> {
/// let dev = Device::get(0)?;
/// let stream = dev.stream()?;
/// let pool = PinnedPool::new(&dev, PoolConfig::default())?;
/// let mut d = DeviceBuffer::<f32>::new(&dev, 1 << 20)?;
/// for step in 0..100 {
///     // A fresh allocation the first time (or while earlier blocks are still being copied),
///     // a cached block after that.
///     let mut host = pool.alloc::<f32>(1 << 20)?;
///     host.as_mut_slice()?.fill(step as f32);
///     stream.copy_h2d(&host, &mut d)?;
///     // `host` goes back to the pool here with its copy still running: the pool will not hand
///     // it out again before the copy has finished.
/// }
/// println!("{:?}", pool.stats());
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PinnedPool {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for PinnedPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedPool")
            .field("device", &self.inner.device)
            .field("config", &self.inner.config)
            .field("stats", &self.stats())
            .finish()
    }
}

impl PinnedPool {
    /// An empty pool for `device`. Nothing is allocated yet. A `Register` backing with
    /// `threads == 0` is `Error::InvalidArgument`.
    pub fn new(device: &Device, config: PoolConfig) -> Result<PinnedPool> {
        validate(&config)?;
        Ok(PinnedPool {
            inner: Arc::new(Inner {
                device: *device,
                config,
                state: Mutex::new(State::default()),
            }),
        })
    }

    /// A block of `len` elements of `T`: a cached block whose last use on the GPU has finished,
    /// or a fresh allocation. A cached block holds whatever was last written to it; fresh memory
    /// is zeroed. `len == 0` gives an empty block without allocating.
    ///
    /// Errors: `Error::InvalidArgument` for a `T` aligned to more than 4096 bytes, or a size that
    /// overflows or exceeds the machine's physical memory; `Error::OutOfMemory` when the memory
    /// cannot be allocated or pinned, even after freeing the idle cached blocks.
    pub fn alloc<T: Pod>(&self, len: usize) -> Result<PoolBlock<T>> {
        let (bytes, class) = layout::<T>(len)?;
        let mut out = PoolBlock {
            block: None,
            ptr: std::ptr::NonNull::dangling().as_ptr(),
            len,
            requested: bytes,
            pool: self.inner.clone(),
        };
        if bytes == 0 {
            return Ok(out);
        }
        let block = match self.inner.take_cached(class, bytes) {
            Some(block) => block,
            None => self.inner.fresh(class, bytes)?,
        };
        out.ptr = block.ptr.cast();
        out.block = Some(block);
        Ok(out)
    }

    /// The pool's counters now.
    pub fn stats(&self) -> PoolStats {
        self.inner.lock().stats
    }

    /// Frees every cached block the GPU has finished with (blocks whose last copy still runs
    /// stay cached) and returns the bytes freed (class sizes). If a free fails, the others are
    /// still freed and the first error is returned.
    pub fn trim(&self) -> Result<usize> {
        self.inner.trim()
    }

    /// The device the pool allocates for.
    pub fn device(&self) -> Device {
        self.inner.device
    }

    /// The configuration it was made with.
    pub fn config(&self) -> PoolConfig {
        self.inner.config
    }

    /// Whether its blocks are registered [`HostRegister::READ_ONLY`]: never a copy's
    /// destination.
    pub(crate) fn is_read_only(&self) -> bool {
        self.inner.read_only()
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Every update leaves the state consistent before anything can panic.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn kind(&self) -> HostKind {
        match self.config.backing {
            PoolBacking::HostAlloc(_) => HostKind::Pinned,
            PoolBacking::Register { .. } => HostKind::Registered,
        }
    }

    fn read_only(&self) -> bool {
        matches!(
            self.config.backing,
            PoolBacking::Register { flags, .. } if flags.contains(HostRegister::READ_ONLY)
        )
    }

    /// The smallest idle cached block that fits `class`, counted as a hit; or `None`, counted
    /// as a miss. Only event queries happen under the lock.
    fn take_cached(&self, class: usize, bytes: usize) -> Option<Block> {
        let mut guard = self.lock();
        let st = &mut *guard;
        let found = st
            .cached
            .range(class..)
            .take_while(|(&size, _)| fits(class, size))
            .find_map(|(&size, blocks)| {
                // The one soundness rule of the pool: never hand out memory the GPU may still
                // read or write.
                let i = blocks.iter().position(|b| b.tracker.is_idle())?;
                Some((size, i))
            });
        let Some((size, i)) = found else {
            st.stats.misses = st.stats.misses.saturating_add(1);
            return None;
        };
        let blocks = st.cached.get_mut(&size)?;
        let block = blocks.remove(i);
        if blocks.is_empty() {
            st.cached.remove(&size);
        }
        let s = &mut st.stats;
        s.hits = s.hits.saturating_add(1);
        s.cached_bytes = s.cached_bytes.saturating_sub(block.size);
        s.in_use_bytes = s.in_use_bytes.saturating_add(block.size);
        s.requested_bytes = s.requested_bytes.saturating_add(bytes);
        Some(block)
    }

    /// A fresh block of `class` bytes, allocated without the lock held. When the memory runs
    /// out, the idle cached blocks are freed and it is tried once more.
    fn fresh(&self, class: usize, bytes: usize) -> Result<Block> {
        if let Some(total) = physical_memory() {
            if class > total {
                return Err(Error::invalid(
                    "PinnedPool::alloc",
                    format!("{class} bytes are more than the machine's {total} bytes of memory"),
                ));
            }
        }
        let mut result = self.timed_allocate(class);
        if matches!(result, Err(Error::OutOfMemory { .. })) && self.trim().is_ok_and(|n| n > 0) {
            result = self.timed_allocate(class);
        }
        let block = result?;
        super::live::pinned_allocated(block.mapped);
        let mut st = self.lock();
        let s = &mut st.stats;
        s.allocations = s.allocations.saturating_add(1);
        s.in_use_bytes = s.in_use_bytes.saturating_add(block.size);
        s.requested_bytes = s.requested_bytes.saturating_add(bytes);
        Ok(block)
    }

    fn timed_allocate(&self, size: usize) -> Result<Block> {
        let t = Instant::now();
        let result = match self.config.backing {
            PoolBacking::HostAlloc(flags) => host_alloc(&self.device, size, flags),
            PoolBacking::Register {
                threads,
                huge_pages,
                flags,
            } => register(&self.device, size, threads, huge_pages, flags),
        };
        let secs = t.elapsed().as_secs_f64();
        self.lock().stats.alloc_seconds += secs;
        result
    }

    /// Takes a block back from a dropped `PoolBlock`: into the cache, or freed (after the GPU's
    /// last use, outside the lock) when the cache would grow past `max_cached_bytes`.
    fn release(&self, block: Block, requested: usize) {
        self.release_or_free(block, requested, false)
    }

    /// As `release`, or (`free`) freed at once rather than cached.
    fn release_or_free(&self, block: Block, requested: usize, free: bool) {
        let overflow = {
            let mut guard = self.lock();
            let st = &mut *guard;
            let s = &mut st.stats;
            s.in_use_bytes = s.in_use_bytes.saturating_sub(block.size);
            s.requested_bytes = s.requested_bytes.saturating_sub(requested);
            match s.cached_bytes.checked_add(block.size) {
                Some(cached) if cached <= self.config.max_cached_bytes && !free => {
                    s.cached_bytes = cached;
                    st.cached.entry(block.size).or_default().push(block);
                    None
                }
                _ => Some(block),
            }
        };
        if let Some(block) = overflow {
            // Errors cannot be reported from a drop; a failed wait has leaked the block.
            let _ = self.free(block);
        }
    }

    /// A block in use changed its requested length from `old` to `new` bytes.
    fn rerequest(&self, old: usize, new: usize) {
        let mut st = self.lock();
        let s = &mut st.stats;
        s.requested_bytes = s.requested_bytes.saturating_sub(old).saturating_add(new);
    }

    fn trim(&self) -> Result<usize> {
        let idle: Vec<Block> = {
            let mut guard = self.lock();
            let st = &mut *guard;
            let mut idle = Vec::new();
            for blocks in st.cached.values_mut() {
                let (free, busy): (Vec<Block>, Vec<Block>) = std::mem::take(blocks)
                    .into_iter()
                    .partition(|b| b.tracker.is_idle());
                *blocks = busy;
                idle.extend(free);
            }
            st.cached.retain(|_, blocks| !blocks.is_empty());
            let bytes = idle.iter().fold(0usize, |n, b| n.saturating_add(b.size));
            st.stats.cached_bytes = st.stats.cached_bytes.saturating_sub(bytes);
            idle
        };
        let mut freed = 0usize;
        let mut first_error = None;
        for block in idle {
            let size = block.size;
            match self.free(block) {
                Ok(()) => freed = freed.saturating_add(size),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(freed),
        }
    }

    /// Waits for the GPU's last use, then frees; must not be called with the lock held. On a
    /// failed wait the block is leaked (counted in `memory::leaked`), never freed.
    fn free(&self, block: Block) -> Result<()> {
        free_block(&self.device, self.config.backing, block)?;
        let mut st = self.lock();
        st.stats.frees = st.stats.frees.saturating_add(1);
        Ok(())
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The last handle and the last block are gone: nobody else can reach the cache.
        let state = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        let cached = std::mem::take(&mut state.cached);
        for block in cached.into_values().flatten() {
            let _ = free_block(&self.device, self.config.backing, block);
        }
    }
}

/// `cudaHostAlloc(size, flags)` on `device`, zeroed. The runtime may place a small
/// allocation off a page boundary; then it asks again for a page more and moves the start up.
fn host_alloc(device: &Device, size: usize, flags: HostAlloc) -> Result<Block> {
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
fn register(
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
fn map_anonymous(len: usize, huge_pages: bool) -> Result<*mut u8> {
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
unsafe fn unmap(ptr: *mut u8, len: usize) {
    // SAFETY: the caller's promise.
    let _ = unsafe { libc::munmap(ptr.cast(), len) };
}

/// A pointer that may cross to the pre-faulting threads.
#[derive(Clone, Copy)]
struct FaultPtr(*mut u8);
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
fn prefault(ptr: *mut u8, len: usize, threads: usize) {
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

fn page_size() -> usize {
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
fn free_block(device: &Device, backing: PoolBacking, block: Block) -> Result<()> {
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
            .inspect(|()| super::live::pinned_freed(block.mapped, false))
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
            super::live::pinned_freed(block.mapped, false);
            Ok(())
        }
    }
}

/// `len` elements of `T` in pinned host memory from a [`PinnedPool`]; dropping it gives the
/// memory back to the pool.
///
/// Like a [`PinnedBuffer`](super::PinnedBuffer), every copy that touches it records an event;
/// `as_slice` and `as_mut_slice` wait for that event first, and the pool hands the memory out
/// again only after it has passed. Unlike a `PinnedBuffer`, dropping it never waits. A block
/// from the cache holds whatever was last written to it (any bit pattern is a valid `T`); fresh
/// memory is zeroed.
pub struct PoolBlock<T: Pod> {
    /// `None` for an empty block.
    block: Option<Block>,
    /// The first element (dangling for an empty block).
    ptr: *mut T,
    len: usize,
    /// `len * size_of::<T>()`.
    requested: usize,
    pool: Arc<Inner>,
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
            .field("device", &self.pool.device)
            .finish()
    }
}

impl<T: Pod> PoolBlock<T> {
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
        self.pool.device
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
        self.pool.rerequest(self.requested, requested);
        self.requested = requested;
        self.len = len;
        Ok(())
    }

    /// Gives the memory back to the pool to be freed rather than cached (for a block of a size
    /// nobody will ask for again); like a drop whose cache is full, this waits for the GPU's
    /// last use of it first.
    pub(crate) fn discard(mut self) {
        if let Some(block) = self.block.take() {
            self.pool.release_or_free(block, self.requested, true);
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
            self.pool.release(block, self.requested);
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

/// Ordinary (pageable, never registered) memory in an anonymous mapping advised
/// `MADV_HUGEPAGE`, pre-faulted on several threads: the measured alternative source for staged
/// copies (`bench::staging::compare`).
pub(crate) struct HugePageBuf {
    ptr: *mut u8,
    len: usize,
}

impl HugePageBuf {
    /// `len` bytes (at least 1), zeroed and faulted in.
    pub(crate) fn new(len: usize, threads: usize) -> Result<HugePageBuf> {
        let len = len.max(1);
        let ptr = map_anonymous(len, true)?;
        prefault(ptr, len, threads);
        Ok(HugePageBuf { ptr, len })
    }

    pub(crate) fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `ptr..ptr + len` is a live, zero-initialised mapping owned by `self`; the
        // `&mut self` borrow excludes every other access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    pub(crate) fn as_slice(&self) -> &[u8] {
        // SAFETY: as above, shared.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl Drop for HugePageBuf {
    fn drop(&mut self) {
        // SAFETY: the mapping came from `map_anonymous`, was never registered with CUDA, and
        // no borrow of it outlives `self`.
        unsafe { unmap(self.ptr, self.len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_cross_threads() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<PinnedPool>();
        send_sync::<PoolBlock<u8>>();
        send_sync::<PoolBlock<crate::f16>>();
    }

    #[test]
    fn class_examples() {
        assert_eq!(class_of(0), Some(0));
        assert_eq!(class_of(1), Some(4096));
        assert_eq!(class_of(4096), Some(4096));
        assert_eq!(class_of(4097), Some(8192));
        assert_eq!(class_of(32 << 10), Some(32 << 10));
        assert_eq!(class_of((32 << 10) + 1), Some(36 << 10));
        assert_eq!(class_of(1 << 20), Some(1 << 20));
        assert_eq!(class_of((1 << 20) + 1), Some((1 << 20) + (128 << 10)));
        assert_eq!(class_of((2 << 20) - 1), Some(2 << 20));
        assert_eq!(class_of(usize::MAX), None);
        assert_eq!(class_of(usize::MAX - 4095), None);
    }

    /// xorshift, so the property runs over sizes of every magnitude without a dependency.
    fn sizes() -> impl Iterator<Item = usize> {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let random = std::iter::from_fn(move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            // A random magnitude, then a random value below it.
            let bits = (x % 63) as u32 + 1;
            Some((x >> 1) as usize & ((1usize << bits.min(usize::BITS - 1)) - 1))
        });
        let edges = (0..usize::BITS - 1).flat_map(|k| {
            let p = 1usize << k;
            [p - 1, p, p + 1, p + p / 8, p + p / 8 + 1]
        });
        (1..=70_000).chain(edges).chain(random.take(200_000))
    }

    #[test]
    fn class_waste_is_bounded() {
        for bytes in sizes().filter(|&b| b > 0) {
            let Some(class) = class_of(bytes) else {
                // Only at the very top of the range.
                assert!(bytes > usize::MAX - (usize::MAX >> 3), "{bytes}");
                continue;
            };
            assert!(class >= bytes, "{bytes} -> {class}");
            assert_eq!(class % MIN_STEP, 0, "{bytes} -> {class}");
            if bytes >= 32 << 10 {
                assert!(class - bytes <= bytes / 8, "{bytes} -> {class}");
            } else {
                assert!(class - bytes < MIN_STEP, "{bytes} -> {class}");
            }
            // Classes are fixed points: a request of exactly a class size wastes nothing.
            assert_eq!(class_of(class), Some(class), "{bytes} -> {class}");
            // Monotonic.
            assert!(class_of(bytes - 1).is_none_or(|c| c <= class), "{bytes}");
        }
    }

    #[test]
    fn fit_window() {
        let c = 1 << 20;
        assert!(fits(c, c));
        assert!(fits(c, c + c / 8));
        assert!(!fits(c, c + c / 8 + 1));
        assert!(!fits(c, c - 1));
        // Below 32 KiB only the class itself fits (the 4 KiB step is more than an eighth)...
        assert!(!fits(8192, 12288));
        // ...above, the next class up fits too: a block of class `c + step` can serve `c`.
        for bytes in [40_000usize, 1 << 20, (3 << 20) + 5, 1 << 40] {
            let c = class_of(bytes).unwrap();
            let next = class_of(c + 1).unwrap();
            assert!(fits(c, next), "{c} {next}");
            assert!(fits(c, c.saturating_add(c / 8)));
        }
        assert!(fits(usize::MAX, usize::MAX));
    }

    #[repr(C, align(8192))]
    #[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
    struct Over([[u8; 4096]; 2]);

    #[repr(C, align(4096))]
    #[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
    struct Page([u8; 4096]);

    #[test]
    fn layout_refuses_without_panicking() {
        assert!(matches!(
            layout::<Over>(1),
            Err(Error::InvalidArgument { .. })
        ));
        assert!(matches!(
            layout::<Over>(0),
            Err(Error::InvalidArgument { .. })
        ));
        assert_eq!(layout::<Page>(3).unwrap(), (3 * 4096, 3 * 4096));
        assert_eq!(layout::<u8>(0).unwrap(), (0, 0));
        assert_eq!(layout::<()>(usize::MAX).unwrap(), (0, 0));
        for len in [
            usize::MAX,
            usize::MAX / 2,
            usize::MAX / 8 + 1,
            usize::MAX - 1,
        ] {
            assert!(matches!(
                layout::<u64>(len),
                Err(Error::InvalidArgument { .. })
            ));
        }
        assert!(matches!(
            layout::<u8>(usize::MAX),
            Err(Error::InvalidArgument { .. })
        ));
        // Large but representable: a class that is then refused by `fresh` as more than the
        // machine's memory.
        let (bytes, class) = layout::<u8>(1 << 50).unwrap();
        assert_eq!((bytes, class), (1 << 50, 1 << 50));
        assert!(physical_memory().is_none_or(|m| class > m));
    }

    #[test]
    fn config_is_validated() {
        let register = |threads| PoolConfig {
            backing: PoolBacking::Register {
                threads,
                huge_pages: false,
                flags: HostRegister::DEFAULT,
            },
            ..Default::default()
        };
        assert!(matches!(
            validate(&register(0)),
            Err(Error::InvalidArgument { .. })
        ));
        assert!(validate(&register(1)).is_ok());
        assert!(validate(&register(usize::MAX)).is_ok());
        let d = PoolConfig::default();
        assert!(validate(&d).is_ok());
        assert_eq!(d.max_cached_bytes, 4 << 30);
        assert_eq!(d.backing, PoolBacking::HostAlloc(HostAlloc::DEFAULT));
    }

    /// Whether every page of `ptr..ptr + len` is resident (`mincore`).
    fn resident(ptr: *mut u8, len: usize) -> bool {
        let page = page_size();
        let mut vec = vec![0u8; len.div_ceil(page)];
        // SAFETY: `ptr..ptr + len` is a live mapping; `vec` has one byte per page.
        let rc = unsafe { libc::mincore(ptr.cast(), len, vec.as_mut_ptr()) };
        assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
        vec.iter().all(|&v| v & 1 == 1)
    }

    #[test]
    fn prefault_touches_every_page() {
        for (threads, huge) in [(1, false), (3, false), (64, true)] {
            let len = (5 << 20) + 4096 * 3;
            let ptr = map_anonymous(len, huge).unwrap();
            if huge {
                assert_eq!(ptr as usize % HUGE_PAGE, 0);
            }
            assert!(!resident(ptr, len), "a fresh mapping is not faulted in yet");
            prefault(ptr, len, threads);
            assert!(resident(ptr, len), "{threads} threads, huge pages {huge}");
            // SAFETY: the mapping is live, zero-filled and used by nobody else.
            let bytes = unsafe { std::slice::from_raw_parts(ptr, len) };
            assert!(bytes.iter().all(|&b| b == 0));
            // SAFETY: mapped above; the slice is not used after this.
            unsafe { unmap(ptr, len) };
        }
    }
}
