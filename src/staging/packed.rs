//! Packed batches: many small host slices of any element types copied into one pinned arena
//! and moved with one DMA per slot into one device arena, then handed back as typed views.

use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};

use bytemuck::Pod;

use super::engine::{Direction, Host};
use super::plan::Transfer;
use super::Stager;
use crate::error::{byte_len, Error, Result};
use crate::memory::sealed::DeviceMem;
use crate::memory::{DeviceBuffer, DeviceView, DeviceViewMut};
use crate::stream::Stream;

/// Every slice in the arena starts at a multiple of this (like `cudaMalloc`'s alignment).
pub const PACK_ALIGN: usize = 256;

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Collects host slices to upload together with [`Stager::upload_packed`]. Each `push` returns
/// a typed handle that later names the slice's place in the [`PackedBatch`].
#[derive(Debug)]
pub struct Packer<'a> {
    id: u64,
    transfers: Vec<Transfer>,
    bytes: usize,
    _sources: PhantomData<&'a [u8]>,
}

/// Where one pushed slice lives in a [`PackedBatch`]: its byte offset and element count.
#[derive(Debug)]
pub struct Packed<T> {
    packer: u64,
    offset: usize,
    len: usize,
    _t: PhantomData<fn() -> T>,
}

impl<T> Clone for Packed<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Packed<T> {}

impl<T> Packed<T> {
    /// Elements in the slice.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the slice is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Byte offset of the slice in the arena.
    pub fn offset(&self) -> usize {
        self.offset
    }
}

impl Default for Packer<'_> {
    fn default() -> Self {
        Packer {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            transfers: Vec::new(),
            bytes: 0,
            _sources: PhantomData,
        }
    }
}

impl<'a> Packer<'a> {
    /// An empty packer.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `src`; it stays borrowed until the packer is dropped.
    pub fn push<T: Pod>(&mut self, src: &'a [T]) -> Result<Packed<T>> {
        const OP: &str = "Packer::push";
        if std::mem::align_of::<T>() > PACK_ALIGN {
            return Err(Error::invalid(
                OP,
                format!(
                    "a {}-byte aligned type does not fit the arena's {PACK_ALIGN}-byte alignment",
                    std::mem::align_of::<T>()
                ),
            ));
        }
        let len = byte_len::<T>(OP, src.len())?;
        let offset = self
            .bytes
            .checked_next_multiple_of(PACK_ALIGN)
            .filter(|o| o.checked_add(len).is_some())
            .ok_or_else(|| Error::invalid(OP, "the packed size overflows usize"))?;
        self.transfers.push(Transfer {
            host: src.as_ptr() as usize as u64,
            dev: offset as u64,
            len,
        });
        self.bytes = offset + len;
        Ok(Packed {
            packer: self.id,
            offset,
            len: src.len(),
            _t: PhantomData,
        })
    }

    /// Bytes of the arena so far (slices and padding).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Slices pushed.
    pub fn len(&self) -> usize {
        self.transfers.len()
    }

    /// Whether nothing was pushed.
    pub fn is_empty(&self) -> bool {
        self.transfers.is_empty()
    }
}

/// The device arena of one [`Stager::upload_packed`] call. Typed views of its slices come from
/// the handles that [`Packer::push`] returned.
#[derive(Debug)]
pub struct PackedBatch {
    id: u64,
    arena: DeviceBuffer<u8>,
}

impl PackedBatch {
    fn check<T>(&self, op: &'static str, h: &Packed<T>) -> Result<()> {
        check_handle::<T>(op, self.id, self.arena.len(), h)
    }

    /// A read-only view of the slice `h` names.
    pub fn get<T: Pod>(&self, h: Packed<T>) -> Result<DeviceView<'_, T>> {
        self.check("PackedBatch::get", &h)?;
        self.arena.view_as(h.offset, h.len)
    }

    /// A writable view of the slice `h` names.
    pub fn get_mut<T: Pod>(&mut self, h: Packed<T>) -> Result<DeviceViewMut<'_, T>> {
        self.check("PackedBatch::get_mut", &h)?;
        self.arena.view_as_mut(h.offset, h.len)
    }

    /// The whole arena.
    pub fn arena(&self) -> &DeviceBuffer<u8> {
        &self.arena
    }

    /// Blocks until the upload (and every later use of the arena) has finished.
    pub fn synchronize(&self) -> Result<()> {
        self.arena.synchronize()
    }
}

impl Stager {
    /// Uploads everything pushed into `packer` into one new device arena (stream-ordered
    /// allocation on `stream`): the slices are copied into the pinned slots on the engine's
    /// threads and moved with one DMA per slot. Returns when the host side is done.
    ///
    /// Each call allocates its arena; to fill the same one again batch after batch, use
    /// [`upload_packed_into`](Self::upload_packed_into).
    pub fn upload_packed(&self, stream: &Stream, packer: &Packer<'_>) -> Result<PackedBatch> {
        const OP: &str = "Stager::upload_packed";
        stream.same_device(OP, self.device())?;
        let arena = DeviceBuffer::<u8>::new_async(stream, packer.bytes)?;
        self.upload_packer(OP, stream, packer, &arena)?;
        Ok(PackedBatch {
            id: packer.id,
            arena,
        })
    }

    /// As [`upload_packed`](Self::upload_packed), into an arena you keep: it is allocated on the
    /// first call (stream-ordered, on `stream`), reused by later ones, and grown only when a
    /// batch does not fit (to what that batch needs plus an eighth; the old arena is freed
    /// after its last use). The returned [`ArenaBatch`] borrows the arena, so its views cannot
    /// outlive the next call (a compile error); and the next call's upload is ordered on the GPU
    /// after every copy or kernel queued on those views, on any stream, so reusing the arena
    /// never overwrites data something still reads.
    ///
    /// Errors: those of `upload_packed`, and `Error::WrongDevice` for an arena of another
    /// device. After an error the arena stays usable (its contents are unspecified).
    ///
    /// ```no_run
    /// use pinstream::{Device, PackedArena, Packer, Stager, StagerConfig};
    /// # fn main() -> pinstream::Result<()> {
    /// # let batches: Vec<(Vec<f32>, Vec<i64>)> = Vec::new();
    /// let dev = Device::get(0)?;
    /// let stream = dev.stream()?;
    /// let stager = Stager::new(&dev, StagerConfig::default())?;
    /// let mut arena = PackedArena::new();
    /// for (features, labels) in &batches {
    ///     let mut packer = Packer::new();
    ///     let (hf, hl) = (packer.push(features)?, packer.push(labels)?);
    ///     let batch = stager.upload_packed_into(&stream, &packer, &mut arena)?;
    ///     let (features_on_gpu, labels_on_gpu) = (batch.get(hf)?, batch.get(hl)?);
    ///     // ... queue kernels on them; the next iteration's upload waits for those.
    /// }
    /// # Ok(()) }
    /// ```
    pub fn upload_packed_into<'a>(
        &self,
        stream: &Stream,
        packer: &Packer<'_>,
        arena: &'a mut PackedArena,
    ) -> Result<ArenaBatch<'a>> {
        const OP: &str = "Stager::upload_packed_into";
        stream.same_device(OP, self.device())?;
        if let Some(buf) = &arena.buf {
            stream.same_device(OP, buf.device())?;
        }
        let need = packer.bytes;
        if arena.buf.as_ref().is_none_or(|b| b.len() < need) {
            let cap = grown_capacity(need);
            // Free the old arena first (after its last use, stream-ordered), so its memory can
            // serve the new one.
            arena.buf = None;
            arena.buf = Some(DeviceBuffer::<u8>::new_async(stream, cap)?);
        }
        let Some(buf) = arena.buf.as_mut() else {
            return Err(Error::invalid(OP, "the arena was not allocated"));
        };
        self.upload_packer(OP, stream, packer, buf)?;
        Ok(ArenaBatch {
            id: packer.id,
            bytes: need,
            arena: buf,
        })
    }

    /// Uploads `packer`'s slices to their offsets in `arena` (at least `packer.bytes` long).
    fn upload_packer(
        &self,
        op: &'static str,
        stream: &Stream,
        packer: &Packer<'_>,
        arena: &DeviceBuffer<u8>,
    ) -> Result<()> {
        if arena.len() < packer.bytes {
            return Err(Error::invalid(
                op,
                format!(
                    "{} packed bytes do not fit in an arena of {}",
                    packer.bytes,
                    arena.len()
                ),
            ));
        }
        let d = arena.device_region();
        let base = d.ptr as usize as u64;
        let transfers: Vec<Transfer> = packer
            .transfers
            .iter()
            .map(|t| Transfer {
                dev: base + t.dev,
                ..*t
            })
            .collect();
        // The padding between slices belongs to the arena: runs may cross it.
        self.run(
            op,
            stream,
            Direction::Upload,
            Host::Memory,
            &transfers,
            &[d.tracker],
            Some((PACK_ALIGN - 1) as u64),
        )
    }
}

/// What an arena that must hold `need` bytes is grown to: `need` plus an eighth, so that batches
/// that vary a little in size do not reallocate every time (`need` itself where that overflows).
fn grown_capacity(need: usize) -> usize {
    need.checked_add(need / 8).unwrap_or(need)
}

/// A device arena that [`Stager::upload_packed_into`] fills batch after batch, growing only
/// when a batch needs more room. Empty until the first call; dropping it frees the memory after
/// its last use on the GPU.
#[derive(Debug, Default)]
pub struct PackedArena {
    buf: Option<DeviceBuffer<u8>>,
}

impl PackedArena {
    /// An empty arena: the first [`Stager::upload_packed_into`] allocates it.
    pub fn new() -> Self {
        Self::default()
    }

    /// An arena of `bytes` allocated now (stream-ordered, on `stream`), so that batches up to
    /// that size never allocate.
    pub fn with_capacity(stream: &Stream, bytes: usize) -> Result<Self> {
        Ok(PackedArena {
            buf: Some(DeviceBuffer::new_async(stream, bytes)?),
        })
    }

    /// Bytes allocated (0 before the first use).
    pub fn capacity(&self) -> usize {
        self.buf.as_ref().map_or(0, |b| b.len())
    }

    /// The device it lives on, once allocated.
    pub fn device(&self) -> Option<crate::Device> {
        self.buf.as_ref().map(|b| b.device())
    }
}

/// The batch that one [`Stager::upload_packed_into`] call put in a [`PackedArena`], which it
/// borrows: typed views of its slices come from the handles that [`Packer::push`] returned.
#[derive(Debug)]
pub struct ArenaBatch<'a> {
    id: u64,
    /// Bytes of the arena this batch uploaded (its packer's size at the call).
    bytes: usize,
    arena: &'a mut DeviceBuffer<u8>,
}

impl ArenaBatch<'_> {
    fn check<T>(&self, op: &'static str, h: &Packed<T>) -> Result<()> {
        check_handle::<T>(op, self.id, self.bytes, h)
    }

    /// A read-only view of the slice `h` names.
    ///
    /// Errors: `Error::InvalidArgument` for a handle of another packer, or one pushed after the
    /// upload (it lies beyond what this batch uploaded).
    pub fn get<T: Pod>(&self, h: Packed<T>) -> Result<DeviceView<'_, T>> {
        self.check("ArenaBatch::get", &h)?;
        self.arena.view_as(h.offset, h.len)
    }

    /// A writable view of the slice `h` names.
    pub fn get_mut<T: Pod>(&mut self, h: Packed<T>) -> Result<DeviceViewMut<'_, T>> {
        self.check("ArenaBatch::get_mut", &h)?;
        self.arena.view_as_mut(h.offset, h.len)
    }

    /// Bytes this batch occupies at the start of the arena (slices and padding).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Bytes of the arena it lives in (what [`PackedArena::capacity`] says once the batch is
    /// gone).
    pub fn capacity(&self) -> usize {
        self.arena.len()
    }

    /// The bytes this batch occupies, as one view.
    pub fn as_view(&self) -> Result<DeviceView<'_, u8>> {
        self.arena.slice(..self.bytes)
    }

    /// Blocks until the upload (and every later use of the arena) has finished.
    pub fn synchronize(&self) -> Result<()> {
        self.arena.synchronize()
    }
}

/// Accepts a handle of packer `id` that lies within the first `bytes` bytes of the arena.
fn check_handle<T>(op: &'static str, id: u64, bytes: usize, h: &Packed<T>) -> Result<()> {
    if h.packer != id {
        return Err(Error::invalid(op, "the handle belongs to another packer"));
    }
    let end = byte_len::<T>(op, h.len)?.checked_add(h.offset);
    if end.is_none_or(|end| end > bytes) {
        return Err(Error::invalid(
            op,
            format!(
                "the handle's {} elements at byte {} lie beyond the {bytes} bytes uploaded \
                 (pushed after the upload?)",
                h.len, h.offset
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn growth_adds_an_eighth_without_overflow() {
        assert_eq!(grown_capacity(0), 0);
        assert_eq!(grown_capacity(800), 900);
        assert_eq!(grown_capacity(usize::MAX), usize::MAX);
        assert!(grown_capacity(usize::MAX - 10) >= usize::MAX - 10);
    }

    #[test]
    fn handles_are_checked_against_packer_and_uploaded_bytes() {
        let data = [1.0f32; 100];
        let mut p = Packer::new();
        let a = p.push(&data[..10]).unwrap();
        let bytes = p.bytes();
        let late = p.push(&data).unwrap();
        let empty = p.push::<u64>(&[]).unwrap();
        assert!(check_handle("t", p.id, bytes, &a).is_ok());
        assert!(check_handle("t", p.id, p.bytes(), &late).is_ok());
        for (id, bytes, h) in [(p.id + 1, p.bytes(), a), (p.id, bytes, late)] {
            assert!(matches!(
                check_handle("t", id, bytes, &h),
                Err(Error::InvalidArgument { .. })
            ));
        }
        assert!(check_handle("t", p.id, p.bytes(), &empty).is_ok());
        // A forged length that overflows is an error, not a wrapped size.
        let forged = Packed::<u64> {
            packer: p.id,
            offset: 256,
            len: usize::MAX / 4,
            _t: PhantomData,
        };
        assert!(check_handle("t", p.id, usize::MAX, &forged).is_err());
    }
}
