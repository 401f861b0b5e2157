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
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use bytemuck::Pod;

use crate::device::Device;
use crate::error::{byte_len, Error, Result};
use crate::memory::pinned::HostAlloc;
use crate::memory::registered::HostRegister;
use crate::memory::HostKind;
use backing::{free_block, host_alloc, register, Block, BLOCK_ALIGN};
use block::Home;

mod backing;
mod block;

pub(crate) use backing::physical_memory;
pub use backing::PoolBacking;
pub use block::PoolBlock;

/// The smallest class, and the class step below 32 KiB.
const MIN_STEP: usize = 4096;

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
        crate::memory::live::pinned_allocated(block.mapped);
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
    /// last use, outside the lock) when the cache would grow past `max_cached_bytes` or
    /// (`free`) is asked for.
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

impl Home for Inner {
    fn device(&self) -> Device {
        self.device
    }
    fn kind(&self) -> HostKind {
        Inner::kind(self)
    }
    fn read_only(&self) -> bool {
        Inner::read_only(self)
    }
    fn rerequest(&self, old: usize, new: usize) {
        Inner::rerequest(self, old, new)
    }
    fn release_or_free(&self, block: Block, requested: usize, free: bool) {
        Inner::release_or_free(self, block, requested, free)
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

#[cfg(test)]
mod tests;
