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
        if h.packer != self.id {
            return Err(Error::invalid(op, "the handle belongs to another packer"));
        }
        Ok(())
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
    pub fn upload_packed(&self, stream: &Stream, packer: &Packer<'_>) -> Result<PackedBatch> {
        const OP: &str = "Stager::upload_packed";
        stream.same_device(OP, self.device())?;
        let arena = DeviceBuffer::<u8>::new_async(stream, packer.bytes)?;
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
            OP,
            stream,
            Direction::Upload,
            Host::Memory,
            &transfers,
            &[d.tracker],
            Some((PACK_ALIGN - 1) as u64),
        )?;
        Ok(PackedBatch {
            id: packer.id,
            arena,
        })
    }
}
