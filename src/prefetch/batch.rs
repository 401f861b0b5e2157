//! `HostBatch`: one batch on the host as a source fills it, and the page-locked memory a
//! prefetcher lends it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use super::Pixels;
use crate::error::{Error, Result};
use crate::kernels::{Normalize, ResizeSpec, Spec};
use crate::memory::{PinnedBuffer, PinnedPool, PoolBlock};
use crate::staging::FileSource;

/// The page-locked memory a prefetcher lends its batches: its pool, and a mark, the longest
/// pixel block asked of it so far plus an eighth. Blocks come in sizes `mark / 2^k`, each request
/// getting the smallest that holds it, so batches whose lengths vary serve one another (the pool
/// holds a few sizes, not one per length) and a small batch never gets a block more than twice
/// its size, whatever came before it. When the mark rises, the idle cached blocks are trimmed and
/// blocks of the old sizes are freed as they come back ([`is_stale`](Self::is_stale)).
#[derive(Clone)]
pub(crate) struct PinnedSupply {
    pool: PinnedPool,
    mark: Arc<AtomicUsize>,
}

impl PinnedSupply {
    pub(crate) fn new(pool: PinnedPool) -> Self {
        PinnedSupply {
            pool,
            mark: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// The block length for a request of `len` bytes under `mark`: `mark / 2^k`, the smallest
    /// not below `len`.
    fn size_for(mark: usize, len: usize) -> usize {
        let mut size = mark.max(len);
        while size / 2 >= len.max(1) {
            size /= 2;
        }
        size
    }

    /// Whether a block of `capacity` bytes is of a size the current mark no longer hands out.
    fn is_stale(&self, capacity: usize) -> bool {
        let mark = self.mark.load(Ordering::Relaxed);
        let mut size = mark;
        while size > 0 {
            if crate::memory::pool_class_of(size) == Some(capacity) {
                return false;
            }
            size /= 2;
        }
        true
    }

    /// A block for `len` bytes. The mark rises (to `len` plus an eighth) only once the
    /// allocation has succeeded, so a refused length leaves it alone; when it rises, the idle
    /// cached blocks (of sizes no longer handed out) are freed.
    fn alloc(&self, len: usize) -> Result<PoolBlock<u8>> {
        if len == 0 {
            return self.pool.alloc::<u8>(0);
        }
        let mark = self.mark.load(Ordering::Relaxed);
        let new_mark = if len <= mark {
            mark
        } else {
            len.saturating_add(len / 8)
        };
        let block = self.pool.alloc::<u8>(Self::size_for(new_mark, len))?;
        if self.mark.fetch_max(new_mark, Ordering::Relaxed) < new_mark {
            self.pool.trim()?;
        }
        Ok(block)
    }
}

/// One batch on the host, as a source fills it: the pixels (u8, laid out as `spec` says; in
/// pageable memory, page-locked memory or a file, see [`Pixels`]), the normalize `spec`
/// (layouts, crops, mirrors, mean/std) or a `resize` spec (random-resized crops of decoded
/// images of any sizes), and per-sample extras such as labels.
///
/// A batch handed to a source by a [`Prefetcher`](super::Prefetcher) also carries the prefetcher's pinned pool, so
/// that [`pinned`](Self::pinned) can give page-locked memory on the right device; one made with
/// [`new`](Self::new) or `default()` has none.
pub struct HostBatch<E = i64> {
    /// `spec.input_len()` bytes; see [`pageable`](Self::pageable), [`pinned`](Self::pinned) and
    /// [`set_file`](Self::set_file).
    pub pixels: Pixels,
    /// How to normalize `pixels`; also the batch's shape.
    pub spec: Spec,
    /// `Some`: the batch is resampled with it instead
    /// ([`kernels::resized_crop`](crate::kernels::resized_crop): each sample's crop box of its
    /// own source image to one output size, mirrored, normalized, cast) and `spec` is not used.
    /// The pixels then hold the source images anywhere inside them: at least
    /// `input_extent()` bytes.
    pub resize: Option<ResizeSpec>,
    /// Anything per batch that goes to the device as is (labels, boxes); may be empty.
    pub extras: Vec<E>,
    /// The prefetcher's pool (set by the loader thread before each call of the source).
    pub(crate) pool: Option<PinnedSupply>,
    /// A pageable vector kept aside (empty, with its capacity) while the pixels are pinned or
    /// a file range, for `pageable()` to put back.
    stash: Vec<u8>,
}

impl<E> Default for HostBatch<E> {
    fn default() -> Self {
        HostBatch::new(
            Pixels::default(),
            Spec::variable(3, &[], Normalize::new(&[0.0; 3], &[1.0; 3])),
            Vec::new(),
        )
    }
}

impl<E: std::fmt::Debug> std::fmt::Debug for HostBatch<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBatch")
            .field("pixels", &self.pixels)
            .field("spec", &self.spec)
            .field("resize", &self.resize)
            .field("extras", &self.extras)
            .field("pool", &self.pool.as_ref().map(|p| p.pool.device()))
            .finish()
    }
}

impl<E> HostBatch<E> {
    /// A batch of these parts, without a pinned pool (so [`pinned`](Self::pinned) refuses):
    /// for [`Source::iter`](super::Source::iter) and for tests.
    pub fn new(pixels: Pixels, spec: Spec, extras: Vec<E>) -> Self {
        HostBatch {
            pixels,
            spec,
            resize: None,
            extras,
            pool: None,
            stash: Vec::new(),
        }
    }

    /// The pixels as a vector of ordinary memory to fill (resize it to `spec.input_len()`):
    /// the one already there, or in place of page-locked pixels or a file range, the vector
    /// that [`pinned`](Self::pinned) or [`set_file`](Self::set_file) put aside (empty, with its
    /// capacity), so a source that switches kinds does not reallocate. A page-locked block goes
    /// back to its pool.
    pub fn pageable(&mut self) -> &mut Vec<u8> {
        if !matches!(self.pixels, Pixels::Pageable(_)) {
            self.pixels = Pixels::Pageable(std::mem::take(&mut self.stash));
        }
        match &mut self.pixels {
            Pixels::Pageable(v) => v,
            // Not reached (made pageable just above); the stash is empty then anyway.
            _ => &mut self.stash,
        }
    }

    /// Takes the pixels out, leaving empty pageable ones; a pageable vector is put aside
    /// (emptied) for `pageable()`, anything else is returned to be dropped.
    pub(crate) fn take_pixels(&mut self) -> Pixels {
        match std::mem::take(&mut self.pixels) {
            Pixels::Pageable(mut v) => {
                v.clear();
                self.stash = v;
                Pixels::default()
            }
            other => other,
        }
    }

    /// The pixels as `len` bytes of page-locked memory from the prefetcher's pool, to fill:
    /// the feeder then uploads them with one DMA, without the staging copy. The block already
    /// there is kept if it can hold `len` bytes (and is at most four times as long), belongs to
    /// the pool's device and its last copy has finished; otherwise it goes back to its pool
    /// (which hands it out again only after that copy) and the pool gives another. Blocks come
    /// in a few sizes — the longest batch so far plus an eighth, and its halves — so batches
    /// whose lengths vary reuse one another's blocks and the pool stays flat; a pageable vector
    /// is put aside for [`pageable`](Self::pageable). So
    /// this does not wait for the GPU (unless the pool's cache is full and a block has to be
    /// freed), and a steady run allocates nothing.
    ///
    /// The memory holds whatever an earlier batch left there (or zeros): **write every byte**.
    ///
    /// A batch without a pool — in a [`DryRun`](super::DryRun), or one made with
    /// [`new`](Self::new) or `default()` — gets ordinary memory instead (its pageable vector,
    /// `len` bytes), so that the same source runs with and without a GPU.
    ///
    /// Errors: `Error::InvalidArgument` for a length no block (or vector) can have; the pool's
    /// errors (`Error::OutOfMemory`, ...) when it must allocate.
    pub fn pinned(&mut self, len: usize) -> Result<&mut [u8]> {
        let Some(supply) = self.pool.clone() else {
            // Where memory is overcommitted, a reservation larger than the machine succeeds
            // and the fill below would then run the process out of memory: refuse first.
            if crate::memory::pool::physical_memory().is_some_and(|ram| len > ram) {
                return Err(Error::invalid(
                    "HostBatch::pinned",
                    format!("{len} bytes of host memory: more than the machine has"),
                ));
            }
            let v = self.pageable();
            v.clear();
            v.try_reserve_exact(len).map_err(|e| {
                Error::invalid(
                    "HostBatch::pinned",
                    format!("{len} bytes of host memory: {e}"),
                )
            })?;
            v.resize(len, 0);
            return Ok(&mut v[..]);
        };
        let pool = &supply.pool;
        // Kept: an idle block of this device that holds `len` bytes and is at most four times
        // as long (a block from a batch much larger than this one goes back).
        let reuse = matches!(
            &self.pixels,
            Pixels::Pinned(b) if b.capacity() >= len
                && b.capacity() / 4 <= len
                && b.device() == pool.device()
                && b.is_idle()
        );
        if !reuse {
            // The old block goes back first, so that the pool may hand it out again; one of a
            // size the mark has left behind is freed instead (it would sit in the cache).
            match self.take_pixels() {
                Pixels::Pinned(b)
                    if b.device() == pool.device() && supply.is_stale(b.capacity()) =>
                {
                    b.discard()
                }
                old => drop(old),
            }
            self.pixels = Pixels::Pinned(supply.alloc(len)?);
        }
        match &mut self.pixels {
            Pixels::Pinned(b) => {
                b.set_len(len)?;
                b.as_mut_slice()
            }
            _ => Err(Error::invalid("HostBatch::pinned", "lost the block")),
        }
    }

    /// Checks the batch as a feeder does before it moves anything: a valid spec, and pixels of
    /// the length it describes. Returns the input and output lengths; a bad batch is an
    /// `Error::Loader` naming `global`.
    pub(crate) fn checked_lens(&self, global: u64) -> Result<(usize, usize)> {
        let bad = |message: String| Error::Loader {
            batch: global,
            message,
        };
        let lens = match &self.resize {
            // Resized: the pixels may be longer than the images need (a loader's arena).
            Some(r) => r.validate("Prefetcher").and_then(|()| {
                let need = r.input_extent()?;
                if self.pixels.len() < need {
                    return Err(Error::invalid(
                        "Prefetcher",
                        format!(
                            "{} pixel bytes ({}), the resize spec's images reach byte {need}",
                            self.pixels.len(),
                            self.pixels.kind()
                        ),
                    ));
                }
                Ok((self.pixels.len(), r.output_len()?))
            }),
            None => self
                .spec
                .validate("Prefetcher")
                .and_then(|()| Ok((self.spec.input_len()?, self.spec.output_len()?))),
        };
        lens.map_err(|e| bad(e.to_string()))
            .and_then(|(in_len, out_len)| {
                if let Pixels::Foreign(f) = &self.pixels {
                    f.get()
                        .map_err(|m| bad(format!("the pixels' owner panicked: {m}")))?;
                }
                if self.pixels.len() != in_len {
                    return Err(bad(format!(
                        "{} pixel bytes ({}), the spec describes {in_len}",
                        self.pixels.len(),
                        self.pixels.kind()
                    )));
                }
                Ok((in_len, out_len))
            })
    }

    /// The pixels as `len` bytes of `buf` from `offset`: a range of page-locked memory that
    /// outlives the batch (a dataset held in pinned memory), which the feeder copies to the
    /// device with one DMA; nothing is written per batch (a page-locked block already there
    /// goes back to its pool). Checked when the batch is uploaded: a range outside the buffer,
    /// or a buffer page-locked for another device and not [`HostAlloc::PORTABLE`], is an
    /// [`Error::Loader`] naming the batch.
    ///
    /// [`HostAlloc::PORTABLE`]: crate::HostAlloc::PORTABLE
    pub fn set_resident(&mut self, buf: Arc<PinnedBuffer<u8>>, offset: usize, len: usize) {
        drop(self.take_pixels());
        self.pixels = Pixels::Resident { buf, offset, len };
    }

    /// The pixels as `len` bytes of `file` from `offset`, which the staging engine reads with
    /// `pread` straight into its pinned slots (a page-locked block already there goes back to
    /// its pool). The range is checked when the batch is uploaded: one outside the file is an
    /// [`Error::Loader`] naming the batch.
    pub fn set_file(&mut self, file: Arc<FileSource>, offset: u64, len: usize) {
        drop(self.take_pixels());
        self.pixels = Pixels::File { file, offset, len };
    }
}
