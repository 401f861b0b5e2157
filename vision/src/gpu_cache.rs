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
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GpuCacheStats {
    /// The budget: device bytes the cache took (0: no cache).
    pub budget: usize,
    /// Bytes of it given to images so far.
    pub used: usize,
    /// Images kept.
    pub images: usize,
    /// Images of batches served from it instead of decoded.
    pub hits: u64,
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
}

impl GpuCache {
    /// A cache of `budget` bytes on `stream`'s device (allocated now).
    pub fn new(stream: &Stream, budget: usize) -> Result<GpuCache> {
        let buf = DeviceBuffer::<u8>::new(&stream.device(), budget).map_err(|e| {
            Error::invalid(
                "ImageFeedConfig::gpu_cache_bytes",
                format!("{budget} bytes of device memory for the decoded images: {e}"),
            )
        })?;
        Ok(GpuCache {
            budget,
            inner: Mutex::new(Inner {
                buf,
                next: 0,
                kept: HashMap::new(),
                pending: HashSet::new(),
                hits: 0,
            }),
        })
    }

    /// Where image `item` is kept, if it is.
    pub fn get(&self, item: usize) -> Option<Kept> {
        lock(&self.inner).kept.get(&item).copied()
    }

    /// Whether an image of `len` bytes would fit now (decode it whole to keep it).
    pub fn has_room(&self, len: usize) -> bool {
        let st = lock(&self.inner);
        st.next
            .checked_add(len)
            .is_some_and(|end| end <= self.budget)
    }

    /// Counts `n` images served from the cache.
    pub fn served(&self, n: usize) {
        lock(&self.inner).hits += n as u64;
    }

    /// Keeps the decoded images `images` (`(item, height, width, offset in arena)`): copies
    /// each that fits and is not kept or being kept already from `arena` into the cache on
    /// `stream`, waits for the copies, then lists them. Returns how many it kept. On an error
    /// none of them is listed (their room is not given back).
    pub fn keep(
        &self,
        stream: &Stream,
        arena: &DeviceBuffer<u8>,
        images: &[(usize, usize, usize, usize)],
    ) -> Result<usize> {
        let mut placed = Vec::new();
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
                placed.push((item, k, from));
            }
            let copied = (|| -> Result<()> {
                for &(_, k, from) in &placed {
                    let src = arena.slice(from..from + k.len())?;
                    let mut dst = st.buf.slice_mut(k.offset..k.offset + k.len())?;
                    stream.copy_d2d(&src, &mut dst)?;
                }
                Ok(())
            })();
            if let Err(e) = copied {
                for (item, _, _) in &placed {
                    st.pending.remove(item);
                }
                return Err(e);
            }
        }
        if placed.is_empty() {
            return Ok(0);
        }
        // Listed once written: a reader on another stream may use them at once.
        let waited = stream.synchronize();
        let mut st = lock(&self.inner);
        for (item, k, _) in &placed {
            st.pending.remove(item);
            if waited.is_ok() {
                st.kept.insert(*item, *k);
            }
        }
        waited.map(|()| placed.len())
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
        }
    }
}
