//! Decoded images kept in GPU memory between epochs (`ImageFeedConfig::gpu_cache_bytes`).
//!
//! A feed that decodes on the GPU decodes every image again each epoch. For a dataset whose
//! decoded images fit in a budget of device memory, the first epoch's decodes are kept: a
//! later epoch draws its crops as before and runs the resized crop from the kept pixels, with no
//! file read and no JPEG decoded (what `tf.data`'s `cache()` after the decode does, on the GPU).
//! What the JPEG engines cost a training step beside them (BENCHMARKS.md, ninth and tenth
//! sessions) is then paid in the first epoch only.
//!
//! The budget is one device allocation, made when the feed starts (an error there if the
//! device cannot give it). Images are placed one after another until the next one does not fit;
//! nothing is evicted. An image is kept the first time it is decoded whole; the files are not
//! read again while the feed lives, so a file changed on disk after it was kept is fed as it
//! was.
//!
//! Ordering: a kept image is written by one loader's stream and read by any loader's later.
//! The writer waits for its stream before the image is listed, so a reader never sees an
//! image whose pixels are still being written; the buffer's tracker orders its later reads and
//! writes as well, and its drop waits for them.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use pinstream::memory::DeviceBuffer;
use pinstream::{Error, Result, Stream};

use crate::util::lock;

/// Failures of [`GpuCache::keep`] to make, for tests: `(budget, n)` fails the next `n` keeps of
/// caches of exactly `budget` bytes ([`fail_keeps`]).
static FAIL_KEEPS: Mutex<Option<(usize, u64)>> = Mutex::new(None);

/// For tests of the cache's failure path, not for programs: the next `n` calls that keep a
/// batch's images in a cache of exactly `budget` bytes fail once their copies are queued, as a
/// CUDA error there would (the images are then not listed, and are decoded again the next time
/// they come; their room is not given back). Only caches of that budget are affected, so tests
/// running beside it are not; `n = 0` clears it.
#[doc(hidden)]
pub fn fail_keeps(budget: usize, n: u64) {
    *lock(&FAIL_KEEPS) = (n > 0).then_some((budget, n));
}

/// Whether this keep of a cache of `budget` bytes is to fail ([`fail_keeps`]), counting it.
fn failing(budget: usize) -> bool {
    let mut f = lock(&FAIL_KEEPS);
    match &mut *f {
        Some((b, n)) if *b == budget => {
            *n -= 1;
            if *n == 0 {
                *f = None;
            }
            true
        }
        _ => false,
    }
}

/// Where a kept image is: its pixels (interleaved RGB, `height * width * 3` bytes) at `offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Kept {
    pub offset: usize,
    pub height: usize,
    pub width: usize,
}

impl Kept {
    pub fn len(&self) -> usize {
        self.height * self.width * 3
    }
}

/// What the cache holds and how often it served (see [`ImageFeed::gpu_cache`](crate::ImageFeed::gpu_cache)).
/// Read its fields; more may come (`#[non_exhaustive]`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct GpuCacheStats {
    /// The budget: device bytes the cache took (0: no cache).
    pub budget: usize,
    /// Bytes of it given to images so far.
    pub used: usize,
    /// Images kept.
    pub images: usize,
    /// Images of batches served from it instead of decoded.
    pub hits: u64,
    /// Batches whose decoded images could not be kept (a CUDA error; said once on stderr).
    pub failures: u64,
}

pub(crate) struct GpuCache {
    budget: usize,
    inner: Mutex<Inner>,
}

struct Inner {
    buf: DeviceBuffer<u8>,
    /// The first byte not yet given out.
    next: usize,
    /// By the image's index in the dataset's list.
    kept: HashMap<usize, Kept>,
    /// Given room, being written.
    pending: HashSet<usize>,
    hits: u64,
    failures: u64,
}

impl GpuCache {
    /// A cache of `budget` bytes on `stream`'s device (allocated now). `InvalidArgument` for
    /// a budget above the device's memory; the allocation's own error (`OutOfMemory`: memory
    /// in use now) otherwise.
    pub fn new(stream: &Stream, budget: usize) -> Result<GpuCache> {
        let dev = stream.device();
        let total = dev.total_memory()?;
        if budget > total {
            return Err(Error::invalid(
                "ImageFeedConfig::gpu_cache_bytes",
                format!("{budget} bytes for the decoded images: the device has {total}"),
            ));
        }
        let buf = DeviceBuffer::<u8>::new(&dev, budget)?;
        Ok(GpuCache {
            budget,
            inner: Mutex::new(Inner {
                buf,
                next: 0,
                kept: HashMap::new(),
                pending: HashSet::new(),
                hits: 0,
                failures: 0,
            }),
        })
    }

    /// Where image `item` is kept, if it is.
    pub fn get(&self, item: usize) -> Option<Kept> {
        lock(&self.inner).kept.get(&item).copied()
    }

    /// Counts `n` images served from the cache.
    pub fn served(&self, n: usize) {
        lock(&self.inner).hits += n as u64;
    }

    /// Says once, on stderr, why images could not be kept (the batch goes on without them:
    /// they are decoded again next time). Counted in [`GpuCacheStats::failures`].
    pub fn note_failure(&self, e: &Error) {
        let mut st = lock(&self.inner);
        st.failures += 1;
        if st.failures == 1 {
            eprintln!("pinstream-vision: decoded images could not be kept in the GPU cache: {e}");
        }
    }

    /// Keeps the decoded images `images` (`(item, height, width, offset in arena)`): copies
    /// each that fits and is not kept or being kept already from `arena` into the cache on
    /// `stream`, waits for the copies, then lists them. Returns how many it kept. On an error
    /// (or a panic) none of them is listed, and none stays marked as being kept (their room is
    /// not given back).
    pub fn keep(
        &self,
        stream: &Stream,
        arena: &DeviceBuffer<u8>,
        images: &[(usize, usize, usize, usize)],
    ) -> Result<usize> {
        /// Takes the batch's items off `pending` on every way out, listing them where `ok`.
        struct Unmark<'a> {
            cache: &'a GpuCache,
            placed: Vec<(usize, Kept, usize)>,
            ok: bool,
        }
        impl Drop for Unmark<'_> {
            fn drop(&mut self) {
                let mut st = lock(&self.cache.inner);
                for (item, k, _) in &self.placed {
                    st.pending.remove(item);
                    if self.ok {
                        st.kept.insert(*item, *k);
                    }
                }
            }
        }
        let mut placed = Unmark {
            cache: self,
            placed: Vec::new(),
            ok: false,
        };
        {
            let mut st = lock(&self.inner);
            for &(item, height, width, from) in images {
                if st.kept.contains_key(&item) || st.pending.contains(&item) {
                    continue;
                }
                let k = Kept {
                    offset: st.next,
                    height,
                    width,
                };
                let Some(end) = k.offset.checked_add(k.len()).filter(|&e| e <= self.budget) else {
                    continue;
                };
                if from.checked_add(k.len()).is_none_or(|e| e > arena.len()) {
                    continue;
                }
                st.next = end;
                st.pending.insert(item);
                placed.placed.push((item, k, from));
            }
            for &(_, k, from) in &placed.placed {
                let src = arena.slice(from..from + k.len())?;
                let mut dst = st.buf.slice_mut(k.offset..k.offset + k.len())?;
                stream.copy_d2d(&src, &mut dst)?;
            }
        }
        if placed.placed.is_empty() {
            return Ok(0);
        }
        if failing(self.budget) {
            return Err(Error::invalid(
                "GpuCache::keep",
                "a failure made by the tests (pinstream_vision::__fail_cache_keeps)",
            ));
        }
        // Listed once written (by `placed`'s drop): a reader on another stream may use them at
        // once.
        stream.synchronize()?;
        placed.ok = true;
        Ok(placed.placed.len())
    }

    /// Copies kept images into `arena` on `stream`: `(kept, offset in arena)` each.
    pub fn copy_out(
        &self,
        stream: &Stream,
        arena: &mut DeviceBuffer<u8>,
        images: &[(Kept, usize)],
    ) -> Result<()> {
        let st = lock(&self.inner);
        for &(k, to) in images {
            let src = st.buf.slice(k.offset..k.offset + k.len())?;
            let mut dst = arena.slice_mut(to..to + k.len())?;
            stream.copy_d2d(&src, &mut dst)?;
        }
        Ok(())
    }

    /// `f` with the cache's buffer (held locked: queue reads of it, do not wait).
    pub fn with_buffer<R>(&self, f: impl FnOnce(&DeviceBuffer<u8>) -> R) -> R {
        f(&lock(&self.inner).buf)
    }

    pub fn stats(&self) -> GpuCacheStats {
        let st = lock(&self.inner);
        GpuCacheStats {
            budget: self.budget,
            used: st.next,
            images: st.kept.len(),
            hits: st.hits,
            failures: st.failures,
        }
    }
}
