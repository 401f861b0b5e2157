//! `Pixels`: where a host batch's u8 pixels are — ordinary memory, page-locked memory (a block
//! of the batch's own, or a range of a buffer that stays), or a range of a file — and so how the
//! feeder moves them to the device.

use std::borrow::Cow;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::memory::sealed::{HostMem, HostRegion};
use crate::memory::tracker::Tracker;
use crate::memory::{
    pointer_kind, HostAlloc, HostKind, HostSlice, PinnedBuffer, PointerKind, PoolBlock,
};
use crate::staging::FileSource;
use crate::Device;

/// A host batch's pixels (`spec.input_len()` bytes of u8, laid out as the spec says), in one of
/// five places. Each costs host memory bandwidth differently on the way to the device:
///
/// - [`Pageable`](Pixels::Pageable): the loader writes the bytes, the staging engine reads them
///   and writes them into its pinned slots, the DMA reads the slots: three passes.
/// - [`Pinned`](Pixels::Pinned): the loader writes page-locked memory and the feeder issues one
///   DMA from it: two passes, no staging copy. Fill it with
///   [`HostBatch::pinned`](super::HostBatch::pinned).
/// - [`Resident`](Pixels::Resident): a range of a page-locked buffer that outlives the batch
///   (a dataset, or decoded images, held in pinned memory for the run) and one DMA from it:
///   one pass, nothing written per batch. Several prefetchers, on several devices, read one
///   buffer at once. Set it with [`HostBatch::set_resident`](super::HostBatch::set_resident).
/// - [`File`](Pixels::File): the staging engine reads the range with `pread` straight into its
///   pinned slots, then the DMA: no loader pass at all (the page cache, or the disk with
///   `O_DIRECT`, supplies the bytes).
/// - [`Foreign`](Pixels::Foreign): ordinary memory that something else owns (a numpy array or
///   a torch CPU tensor taken through DLPack, a memory map), held by the batch until it is
///   uploaded and read by the staging engine as `Pageable` is, with no copy into a vector first;
///   or page-locked memory that something else owns ([`ForeignBytes::page_locked`]: a torch
///   `pin_memory()` tensor), copied with one DMA as `Pinned` is.
#[derive(Debug)]
pub enum Pixels {
    /// Ordinary memory, uploaded through the staging engine (a host copy into its pinned slots,
    /// then the DMA).
    Pageable(Vec<u8>),
    /// Page-locked memory, copied to the device with one asynchronous DMA on the slot's stream.
    /// The block must belong to a pool of the prefetcher's device (any pool: its own, through
    /// [`HostBatch::pinned`](super::HostBatch::pinned), or one of yours); a block of another
    /// device is an [`Error::Loader`](crate::Error::Loader). The copy is recorded in the block's
    /// event: host access waits for it, and a pool hands the memory out again only after it.
    Pinned(PoolBlock<u8>),
    /// `len` bytes of `buf` from `offset`, copied to the device with one asynchronous DMA on
    /// the slot's stream. The buffer must be page-locked for the prefetcher's device: allocated
    /// on it, or with [`HostAlloc::PORTABLE`] to serve every device; otherwise, or for a range
    /// outside the buffer, the batch is an [`Error::Loader`](crate::Error::Loader). Copies only
    /// read the buffer, so they run beside each other on every device; writing it
    /// (`as_mut_slice`, which needs it unshared) and dropping it wait for them.
    Resident {
        /// The buffer; shared, so many batches (and prefetchers) can name ranges of it.
        buf: Arc<PinnedBuffer<u8>>,
        /// Where the batch's bytes start.
        offset: usize,
        /// How many bytes (`spec.input_len()`).
        len: usize,
    },
    /// `len` bytes of `file` from `offset`, read by the staging engine with `pread` straight
    /// into its pinned slots. A range outside the file (as it was when opened), an offset that
    /// `O_DIRECT` refuses, or a failed read is an [`Error::Loader`](crate::Error::Loader) naming
    /// the batch.
    File {
        /// The open file; shared, so many batches can name ranges of one file.
        file: Arc<FileSource>,
        /// Where the batch's bytes start.
        offset: u64,
        /// How many bytes (`spec.input_len()`).
        len: usize,
    },
    /// Memory another owner keeps, uploaded through the staging engine (or, where it was
    /// given as page-locked and the runtime agrees, with one DMA). Its `bytes` and its
    /// `Drop` are user code: they run under `catch_unwind` (a panic is an
    /// [`Error::Loader`](crate::Error::Loader) naming the batch, or is swallowed at the drop),
    /// and `bytes` must give the same slice every time (a length that changes is an error,
    /// never a wrong copy).
    Foreign(ForeignBytes),
}

/// Host bytes that something other than pinstream owns, for [`Pixels::Foreign`].
pub trait HostBytes: Send + Sync + 'static {
    /// The bytes (the same slice on every call).
    fn bytes(&self) -> &[u8];
}

impl HostBytes for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }
}

impl HostBytes for Box<[u8]> {
    fn bytes(&self) -> &[u8] {
        self
    }
}

impl HostBytes for Arc<[u8]> {
    fn bytes(&self) -> &[u8] {
        self
    }
}

/// The owner behind [`Pixels::Foreign`]: its user code (`bytes`, `Drop`) runs under
/// `catch_unwind`.
pub struct ForeignBytes {
    owner: Option<Box<dyn HostBytes>>,
    /// `Some` for bytes given as page-locked ([`ForeignBytes::page_locked`]): the feeder's DMA
    /// from them is recorded here, and the drop waits for it before the owner goes.
    locked: Option<Tracker>,
}

impl ForeignBytes {
    /// Wraps an owner of host bytes: the staging engine copies them into its pinned slots.
    pub fn new(owner: impl HostBytes) -> Self {
        ForeignBytes {
            owner: Some(Box::new(owner)),
            locked: None,
        }
    }

    /// Wraps an owner of **page-locked** host bytes (a PyTorch `pin_memory()` tensor, another
    /// library's `cudaHostAlloc` memory): the feeder copies them to the device with one DMA,
    /// without the staging copy, and the drop waits for that DMA before it drops the owner.
    /// Where the runtime does not confirm that the first and the last byte are page-locked,
    /// they are staged as [`new`](Self::new)'s are.
    ///
    /// # Safety
    ///
    /// Where `owner.bytes()` is page-locked memory, it must lie within one page-locked
    /// allocation (`cudaHostAlloc`, `cudaMallocHost`, `cudaHostRegister`) that stays allocated,
    /// and that nothing writes, while the owner lives: the GPU reads it after `bytes` has
    /// returned, until the drop has waited for the copy. (Ordinary memory is staged, as
    /// [`new`](Self::new)'s is.)
    pub unsafe fn page_locked(owner: impl HostBytes) -> Self {
        ForeignBytes {
            owner: Some(Box::new(owner)),
            locked: Some(Tracker::new()),
        }
    }

    /// The owner's bytes; its panic comes back as the message.
    pub(crate) fn get(&self) -> std::result::Result<&[u8], String> {
        match &self.owner {
            Some(b) => crate::sync::quietly(|| b.bytes()),
            None => Ok(&[]),
        }
    }

    /// The bytes as the source of one DMA: `Some` where they were given as page-locked and
    /// the runtime says that both ends are; the owner's panic comes back as the message.
    pub(crate) fn dma_source(&self) -> std::result::Result<Option<LockedBytes<'_>>, String> {
        let Some(tracker) = &self.locked else {
            return Ok(None);
        };
        let bytes = self.get()?;
        let Some(last) = bytes.len().checked_sub(1) else {
            return Ok(None);
        };
        let locked = |p: *const u8| matches!(pointer_kind(p.cast()), Ok(PointerKind::Pinned));
        if !locked(bytes.as_ptr()) || !locked(bytes.as_ptr().wrapping_add(last)) {
            return Ok(None);
        }
        Ok(Some(LockedBytes { bytes, tracker }))
    }
}

/// Page-locked bytes of a [`ForeignBytes`] as a copy source, tracked by it.
pub(crate) struct LockedBytes<'a> {
    bytes: &'a [u8],
    tracker: &'a Tracker,
}

impl HostMem<u8> for LockedBytes<'_> {
    fn host_region(&self) -> HostRegion<'_> {
        HostRegion {
            ptr: self.bytes.as_ptr().cast_mut().cast(),
            len: self.bytes.len(),
            kind: HostKind::Pinned,
            tracker: Some(self.tracker),
            read_only: true,
        }
    }
    fn host_region_mut(&mut self) -> HostRegion<'_> {
        self.host_region()
    }
    fn host_read(&self) -> Result<&[u8]> {
        self.tracker.synchronize_writes()?;
        Ok(self.bytes)
    }
    fn host_write(&mut self) -> Result<&mut [u8]> {
        Err(Error::invalid(
            "ForeignBytes",
            "page-locked foreign bytes are only read",
        ))
    }
}

impl HostSlice<u8> for LockedBytes<'_> {}

impl std::fmt::Debug for ForeignBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.locked.is_some() {
            "ForeignBytes(page-locked)"
        } else {
            "ForeignBytes"
        })
    }
}

impl Drop for ForeignBytes {
    fn drop(&mut self) {
        if let Some(t) = &self.locked {
            if let Err(e) = t.synchronize() {
                // The GPU may still read the bytes: the owner is never dropped.
                let len = self.get().map_or(0, <[u8]>::len);
                std::mem::forget(self.owner.take());
                crate::memory::tracker::leak("page-locked foreign pixels", len, &e);
                return;
            }
        }
        if let Some(b) = self.owner.take() {
            crate::sync::drop_quietly(b);
        }
    }
}

impl<H: HostBytes> From<H> for ForeignBytes {
    fn from(h: H) -> Self {
        ForeignBytes::new(h)
    }
}

impl Default for Pixels {
    /// Empty pageable pixels.
    fn default() -> Self {
        Pixels::Pageable(Vec::new())
    }
}

impl From<Vec<u8>> for Pixels {
    fn from(v: Vec<u8>) -> Self {
        Pixels::Pageable(v)
    }
}

impl From<PoolBlock<u8>> for Pixels {
    fn from(b: PoolBlock<u8>) -> Self {
        Pixels::Pinned(b)
    }
}

impl Pixels {
    /// Number of bytes.
    pub fn len(&self) -> usize {
        match self {
            Pixels::Pageable(v) => v.len(),
            Pixels::Pinned(b) => b.len(),
            Pixels::Resident { len, .. } | Pixels::File { len, .. } => *len,
            // A panicking owner counts as empty: the batch's length check then refuses it.
            Pixels::Foreign(f) => f.get().map_or(0, <[u8]>::len),
        }
    }

    /// Whether there are no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `"pageable"`, `"pinned"`, `"resident"`, `"file"` or `"foreign"`.
    pub fn kind(&self) -> &'static str {
        match self {
            Pixels::Pageable(_) => "pageable",
            Pixels::Pinned(_) => "pinned",
            Pixels::Resident { .. } => "resident",
            Pixels::File { .. } => "file",
            Pixels::Foreign(_) => "foreign",
        }
    }

    /// The bytes, for checking and debugging: pageable pixels borrowed, pinned ones borrowed
    /// after the GPU's last use of the block (this waits for it), a resident range borrowed
    /// after the GPU's last write to the buffer (an
    /// [`Error::InvalidArgument`](crate::Error::InvalidArgument) if it lies outside), a file
    /// range read into a new vector (an [`Error::Io`](crate::Error::Io) if the range is outside
    /// the file or the read fails, an [`Error::InvalidArgument`](crate::Error::InvalidArgument)
    /// if the host cannot allocate that many bytes).
    pub fn read(&self) -> Result<Cow<'_, [u8]>> {
        match self {
            Pixels::Pageable(v) => Ok(Cow::Borrowed(v)),
            Pixels::Pinned(b) => b.as_slice().map(Cow::Borrowed),
            Pixels::Resident { buf, offset, len } => {
                let all = buf.as_slice()?;
                resident_range(buf.len(), *offset, *len)
                    .and_then(|r| all.get(r))
                    .map(Cow::Borrowed)
                    .ok_or_else(|| {
                        Error::invalid("Pixels::read", resident_outside(buf, *offset, *len))
                    })
            }
            Pixels::File { file, offset, len } => file
                .read_range("Pixels::read", *offset, *len)
                .map(Cow::Owned),
            Pixels::Foreign(f) => f.get().map(Cow::Borrowed).map_err(|m| Error::Panicked {
                op: "Pixels::read",
                message: m,
            }),
        }
    }
}

/// The byte range `offset..offset + len` if it lies inside a buffer of `size` bytes.
pub(crate) fn resident_range(
    size: usize,
    offset: usize,
    len: usize,
) -> Option<std::ops::Range<usize>> {
    let end = offset.checked_add(len)?;
    (end <= size).then_some(offset..end)
}

/// Why a resident range is refused: it lies outside the buffer.
pub(crate) fn resident_outside(buf: &PinnedBuffer<u8>, offset: usize, len: usize) -> String {
    format!(
        "the resident range of {len} bytes at offset {offset} lies outside the buffer of {} \
         bytes",
        buf.len()
    )
}

/// Why a resident buffer cannot feed `device`, if it cannot: it is page-locked for another
/// device and not portable.
pub(crate) fn resident_foreign(buf: &PinnedBuffer<u8>, device: Device) -> Option<String> {
    (buf.device() != device && !buf.flags().contains(HostAlloc::PORTABLE)).then(|| {
        format!(
            "the resident pixels are page-locked for {} (allocate them with \
             HostAlloc::PORTABLE to share them), the prefetcher uploads to {device}",
            buf.device()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn pageable_len_and_read() {
        let p = Pixels::default();
        assert!(p.is_empty());
        assert_eq!(p.len(), 0);
        assert_eq!(p.kind(), "pageable");
        assert_eq!(&*p.read().unwrap(), &[] as &[u8]);
        let p = Pixels::from(vec![1u8, 2, 3]);
        assert_eq!(p.len(), 3);
        assert!(!p.is_empty());
        assert!(matches!(p.read().unwrap(), Cow::Borrowed([1, 2, 3])));
    }

    /// A temporary file removed on drop.
    struct Temp(std::path::PathBuf);

    impl Drop for Temp {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn temp_file(name: &str, bytes: &[u8]) -> Temp {
        let path = std::env::temp_dir().join(format!(
            "pinstream-pixels-{name}-{}-{:?}.bin",
            std::process::id(),
            std::thread::current().id()
        ));
        let t = Temp(path);
        let mut f = std::fs::File::create(&t.0).unwrap();
        f.write_all(bytes).unwrap();
        t
    }

    #[test]
    fn resident_ranges() {
        assert_eq!(resident_range(100, 0, 100), Some(0..100));
        assert_eq!(resident_range(100, 100, 0), Some(100..100));
        assert_eq!(resident_range(100, 40, 7), Some(40..47));
        assert_eq!(resident_range(100, 94, 7), None);
        assert_eq!(resident_range(100, 101, 0), None);
        assert_eq!(resident_range(usize::MAX, usize::MAX, 1), None);
        assert_eq!(resident_range(usize::MAX, 1, usize::MAX), None);
    }

    #[test]
    fn file_len_and_read() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
        let t = temp_file("read", &data);
        let file = Arc::new(FileSource::open(&t.0).unwrap());
        let p = Pixels::File {
            file: file.clone(),
            offset: 123,
            len: 4567,
        };
        assert_eq!(p.len(), 4567);
        assert_eq!(p.kind(), "file");
        assert_eq!(&*p.read().unwrap(), &data[123..123 + 4567]);
        // The whole file, and an empty range at its end.
        let whole = Pixels::File {
            file: file.clone(),
            offset: 0,
            len: data.len(),
        };
        assert_eq!(&*whole.read().unwrap(), &data[..]);
        let empty = Pixels::File {
            file: file.clone(),
            offset: data.len() as u64,
            len: 0,
        };
        assert!(empty.is_empty());
        assert!(empty.read().unwrap().is_empty());
        // Past the end, and an offset whose end overflows: errors, no panic.
        for (offset, len) in [(9_000u64, 1_001usize), (u64::MAX, 2), (10_001, 0)] {
            let bad = Pixels::File {
                file: file.clone(),
                offset,
                len,
            };
            assert!(
                matches!(bad.read(), Err(Error::Io { .. })),
                "{offset} {len}"
            );
        }
    }

    #[test]
    fn direct_file_read() {
        let data: Vec<u8> = (0..3 * 4096 + 100u32).map(|i| (i % 253) as u8).collect();
        let t = temp_file("direct", &data);
        // tmpfs has no O_DIRECT: nothing to test there.
        let Ok(file) = FileSource::open_direct(&t.0) else {
            return;
        };
        let file = Arc::new(file);
        for (offset, len) in [
            (0u64, 1usize),
            (4096, 4096),
            (4096, 2 * 4096 + 100),
            (0, 17),
        ] {
            let p = Pixels::File {
                file: file.clone(),
                offset,
                len,
            };
            let o = offset as usize;
            assert_eq!(&*p.read().unwrap(), &data[o..o + len], "{offset} {len}");
        }
        let misaligned = Pixels::File {
            file,
            offset: 100,
            len: 10,
        };
        assert!(matches!(
            misaligned.read(),
            Err(Error::InvalidArgument { .. })
        ));
    }
}
