//! [`Tensor`]: an exported tensor before its handover — its memory, shape, strides and dtype,
//! views and splits of it — and the handover itself (`into_versioned`, `into_legacy`).

use std::marker::PhantomData;
use std::ops::RangeBounds;
use std::os::raw::c_void;
use std::sync::Arc;

use super::abi::{
    DLDataType, DLDevice, DLManagedTensor, DLManagedTensorVersioned, DLTensor, FLAG_READ_ONLY,
    KDL_CPU, KDL_CUDA, KDL_CUDA_HOST, VERSION,
};
use super::export::{delete_legacy, delete_versioned, Ctx, LegacyBox, VersionedBox};
use super::owner::{Consumer, DeviceOwner, Owner, PinnedOwner, Shared};
use super::{check_element, dtype_name, Element};
use crate::deferred::Scope;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::memory::sealed::{DeviceMem, HostMem};
use crate::memory::{resolve_range, DeviceBuffer, PinnedBuffer, PoolBlock};
#[cfg(feature = "staging")]
use crate::staging::{Packed, PackedBatch};
use crate::stream::Stream;

/// One tensor cut from a larger one by [`Tensor::split`]: where it starts (in bytes from the
/// larger tensor's first element), its element type and its shape (compact, row-major).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Part {
    /// Byte offset from the source tensor's first element.
    pub offset: usize,
    /// Element type (any DLPack type of whole bytes: `bits * lanes` a multiple of 8).
    pub dtype: DLDataType,
    /// Sizes; the part covers their product of elements.
    pub shape: Vec<usize>,
}

impl Part {
    /// A part of element type `T`.
    pub fn of<T: super::Element>(offset: usize, shape: &[usize]) -> Part {
        Part {
            offset,
            dtype: T::DTYPE,
            shape: shape.to_vec(),
        }
    }
}

/// The parts of a tensor a crate module builds (a prefetcher's batch).
pub(crate) struct TensorParts {
    pub(crate) data: *mut c_void,
    pub(crate) device: Device,
    pub(crate) dtype: DLDataType,
    pub(crate) elem: usize,
    pub(crate) len: usize,
    pub(crate) owner: Box<dyn Owner>,
}

/// A DLPack tensor of pinstream memory, not yet handed over: an owner (a device or pinned
/// buffer, a prefetched batch), a shape and strides. Hand it over with
/// [`into_versioned`](Self::into_versioned) (DLPack 1.x) or [`into_legacy`](Self::into_legacy);
/// dropping it instead gives the memory back at once.
///
/// ```no_run
/// use pinstream::dlpack::Tensor;
/// # fn main() -> pinstream::Result<()> {
/// # let dev = pinstream::Device::get(0)?;
/// let stream = dev.stream()?;
/// let buf = pinstream::DeviceBuffer::<f32>::new(&dev, 2 * 3)?;
/// let t = Tensor::from_device(buf)?.reshape(&[2, 3])?;
/// // `consumer` waits on the GPU for the buffer's last write; the deleter, when the
/// // consumer calls it, orders the free after `consumer`'s work.
/// let raw = t.into_versioned(Some(&stream))?;   // *mut DLManagedTensorVersioned
/// # let _ = raw;
/// # Ok(()) }
/// ```
pub struct Tensor {
    data: *mut c_void,
    device: DLDevice,
    dtype: DLDataType,
    /// Element size in bytes.
    elem: usize,
    /// Elements addressable from `data`.
    len: usize,
    shape: Vec<i64>,
    strides: Vec<i64>,
    flags: u64,
    /// The device the memory belongs to (for page-locked memory, the one it was allocated for).
    home: Device,
    owner: Option<Box<dyn Owner>>,
}

// SAFETY: `data` points into memory that `owner` (Send + Sync) keeps alive; the tensor never
// reads or writes through it.
unsafe impl Send for Tensor {}
// SAFETY: as above; `&Tensor` only reads the metadata.
unsafe impl Sync for Tensor {}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tensor")
            .field("data", &self.data)
            .field("device", &self.device)
            .field("dtype", &dtype_name(self.dtype))
            .field("shape", &self.shape)
            .field("strides", &self.strides)
            .field("flags", &self.flags)
            .finish()
    }
}

/// A handover that failed: the error and the tensor, still owned by the caller.
#[derive(Debug)]
pub struct Refused {
    /// Why.
    pub error: Error,
    /// The tensor, unchanged.
    pub tensor: Tensor,
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DLPack handover refused: {}", self.error)
    }
}

impl std::error::Error for Refused {}

impl From<Refused> for Error {
    fn from(r: Refused) -> Error {
        r.error
    }
}

fn to_i64(op: &'static str, n: usize) -> Result<i64> {
    i64::try_from(n).map_err(|_| Error::invalid(op, format!("{n} does not fit in an int64")))
}

impl Tensor {
    pub(crate) fn from_parts(p: TensorParts, kind: i32) -> Result<Tensor> {
        let len = to_i64("dlpack::Tensor", p.len)?;
        let device_id = i32::try_from(p.device.ordinal())
            .map_err(|_| Error::invalid("dlpack::Tensor", "device ordinal out of range"))?;
        Ok(Tensor {
            data: p.data,
            device: DLDevice {
                device_type: kind,
                device_id: if kind == KDL_CUDA { device_id } else { 0 },
            },
            dtype: p.dtype,
            elem: p.elem,
            len: p.len,
            shape: vec![len],
            strides: vec![1],
            flags: 0,
            home: p.device,
            owner: Some(p.owner),
        })
    }

    /// A one-dimensional tensor of a whole device buffer (`kDLCUDA`). A shared buffer (an
    /// `Arc<DeviceBuffer<T>>` with other owners) stays usable by pinstream while exported, so
    /// its tensor is read-only (the consumer may not write what pinstream may be reading; the
    /// legacy struct, which cannot say so, refuses it); pinstream's uses and the consumer's
    /// are ordered at the handover and at the release.
    pub fn from_device<T: Element>(buf: impl Into<Arc<DeviceBuffer<T>>>) -> Result<Tensor> {
        check_element::<T>("dlpack::Tensor::from_device")?;
        let mut buf = buf.into();
        let shared = Arc::get_mut(&mut buf).is_none();
        let r = buf.device_region();
        let parts = TensorParts {
            data: r.ptr,
            device: r.device,
            dtype: T::DTYPE,
            elem: std::mem::size_of::<T>(),
            len: r.len,
            owner: Box::new(DeviceOwner(buf)),
        };
        let t = Tensor::from_parts(parts, KDL_CUDA)?;
        Ok(if shared { t.read_only() } else { t })
    }

    #[cfg(feature = "staging")]
    /// A one-dimensional tensor of one slice of a packed upload
    /// ([`Stager::upload_packed`](crate::Stager::upload_packed)): the arena stays alive until
    /// every tensor exported from it is released (each holds the `Arc`). Read-only when the
    /// `Arc` has other owners, as for [`from_device`](Self::from_device) (they could read the
    /// same slice).
    pub fn from_packed<T: Element>(
        batch: impl Into<Arc<PackedBatch>>,
        handle: Packed<T>,
    ) -> Result<Tensor> {
        check_element::<T>("dlpack::Tensor::from_packed")?;
        let mut batch = batch.into();
        let shared = Arc::get_mut(&mut batch).is_none();
        let (ptr, len) = {
            let v = batch.get(handle)?;
            (v.as_device_ptr(), v.len())
        };
        let parts = TensorParts {
            data: ptr.cast_mut().cast(),
            device: batch.arena().device(),
            dtype: T::DTYPE,
            elem: std::mem::size_of::<T>(),
            len,
            owner: Box::new(DeviceOwner(batch)),
        };
        let t = Tensor::from_parts(parts, KDL_CUDA)?;
        Ok(if shared { t.read_only() } else { t })
    }

    #[cfg(feature = "staging")]
    /// A one-dimensional `u8` tensor of a packed upload's whole arena, to cut into one tensor per pushed slice with
    /// [`split`](Self::split) at their [`offset`](Packed::offset)s: writable tensors when the
    /// batch is not shared otherwise.
    pub fn from_packed_batch(batch: impl Into<Arc<PackedBatch>>) -> Result<Tensor> {
        let mut batch = batch.into();
        let shared = Arc::get_mut(&mut batch).is_none();
        let (ptr, len) = {
            let v = batch.arena();
            (v.as_device_ptr(), v.len())
        };
        let parts = TensorParts {
            data: ptr.cast_mut().cast(),
            device: batch.arena().device(),
            dtype: u8::DTYPE,
            elem: 1,
            len,
            owner: Box::new(DeviceOwner(batch)),
        };
        let t = Tensor::from_parts(parts, KDL_CUDA)?;
        Ok(if shared { t.read_only() } else { t })
    }

    /// A one-dimensional tensor of a whole pinned buffer (`kDLCUDAHost`). The handover waits
    /// on the host for the GPU's uses of it (host consumers read it at once).
    ///
    /// Read-only when the `Arc` has other owners, as for [`from_device`](Self::from_device).
    pub fn from_pinned<T: Element>(buf: impl Into<Arc<PinnedBuffer<T>>>) -> Result<Tensor> {
        check_element::<T>("dlpack::Tensor::from_pinned")?;
        let mut buf = buf.into();
        let shared = Arc::get_mut(&mut buf).is_none();
        let r = buf.host_region();
        let parts = TensorParts {
            data: r.ptr,
            device: buf.device(),
            dtype: T::DTYPE,
            elem: std::mem::size_of::<T>(),
            len: r.len,
            owner: Box::new(PinnedOwner(buf.clone(), buf.device(), PhantomData)),
        };
        let t = Tensor::from_parts(parts, KDL_CUDA_HOST)?;
        Ok(if shared { t.read_only() } else { t })
    }

    /// A one-dimensional tensor of a whole [`PinnedPool`](crate::PinnedPool) block
    /// (`kDLCUDAHost`), as [`from_pinned`](Self::from_pinned): the block goes back to its pool
    /// when the last consumer releases the tensor. Read-only when the `Arc` has other owners or
    /// the pool's memory is read-only.
    pub fn from_pool_block<T: Element>(block: impl Into<Arc<PoolBlock<T>>>) -> Result<Tensor> {
        check_element::<T>("dlpack::Tensor::from_pool_block")?;
        let mut block = block.into();
        let shared = Arc::get_mut(&mut block).is_none();
        let r = block.host_region();
        let read_only = shared || r.read_only;
        let parts = TensorParts {
            data: r.ptr,
            device: block.device(),
            dtype: T::DTYPE,
            elem: std::mem::size_of::<T>(),
            len: r.len,
            owner: Box::new(PinnedOwner(block.clone(), block.device(), PhantomData)),
        };
        let t = Tensor::from_parts(parts, KDL_CUDA_HOST)?;
        Ok(if read_only { t.read_only() } else { t })
    }

    /// A page-locked tensor (`kDLCUDAHost`) labelled as plain CPU memory (`kDLCPU`), for
    /// consumers that take only that (PyTorch): page-locked memory is CPU memory. Any other
    /// tensor is refused (`Error::InvalidArgument`), and handed back in the error.
    ///
    /// A host consumer releases with no stream, yet may still have GPU work reading the
    /// memory (PyTorch's `non_blocking` copies from page-locked memory, on any device): the
    /// memory goes back only after every device finished what was queued before the release,
    /// waited for by a background thread, not the releasing one
    /// ([`wait_for_releases`](super::wait_for_releases) waits for those returns).
    pub fn host_as_cpu(mut self) -> std::result::Result<Tensor, Box<Refused>> {
        if self.device.device_type != KDL_CUDA_HOST {
            let error = Error::invalid(
                "dlpack::Tensor::host_as_cpu",
                format!(
                    "device type {} is not page-locked host memory",
                    self.device.device_type
                ),
            );
            return Err(Box::new(Refused {
                error,
                tensor: self,
            }));
        }
        // A host consumer's release names no stream: it is deferred (`Ctx::release`), waiting
        // for every device with a context, as for any page-locked tensor.
        self.device.device_type = KDL_CPU;
        Ok(self)
    }

    /// The elements of `range` (of the whole memory) as a one-dimensional tensor.
    pub fn slice(mut self, range: impl RangeBounds<usize>) -> Result<Tensor> {
        let r = resolve_range("dlpack::Tensor::slice", range, self.len)?;
        self.shape = vec![to_i64("dlpack::Tensor::slice", r.len())?];
        self.strides = vec![1];
        // Inside the memory (checked above); not dereferenced here.
        self.data = self
            .data
            .cast::<u8>()
            .wrapping_add(r.start * self.elem)
            .cast();
        self.len = r.len();
        Ok(self)
    }

    /// A compact row-major (C order) shape over all of the tensor's elements.
    ///
    /// Errors: `Error::InvalidArgument` when the shape's product is not the element count.
    pub fn reshape(self, shape: &[usize]) -> Result<Tensor> {
        const OP: &str = "dlpack::Tensor::reshape";
        let mut strides = vec![0usize; shape.len()];
        let mut acc = 1usize;
        for (i, &n) in shape.iter().enumerate().rev() {
            strides[i] = acc;
            acc = acc
                .checked_mul(n)
                .ok_or_else(|| Error::invalid(OP, format!("shape {shape:?} overflows")))?;
        }
        if acc != self.len {
            return Err(Error::invalid(
                OP,
                format!(
                    "shape {shape:?} has {acc} elements, the tensor {}",
                    self.len
                ),
            ));
        }
        self.strided(OP, shape, &strides)
    }

    /// Any shape and strides (in elements) whose every index lies inside the tensor's memory:
    /// transposed or channels-last views, broadcast (stride 0) dimensions.
    pub fn with_strides(self, shape: &[usize], strides: &[usize]) -> Result<Tensor> {
        self.strided("dlpack::Tensor::with_strides", shape, strides)
    }

    fn strided(mut self, op: &'static str, shape: &[usize], strides: &[usize]) -> Result<Tensor> {
        if shape.len() != strides.len() || i32::try_from(shape.len()).is_err() {
            return Err(Error::invalid(
                op,
                format!("{} sizes and {} strides", shape.len(), strides.len()),
            ));
        }
        // The furthest element any index reaches, when there is any element at all.
        if !shape.contains(&0) {
            let mut last = 0usize;
            for (&n, &s) in shape.iter().zip(strides) {
                last = (n - 1)
                    .checked_mul(s)
                    .and_then(|x| last.checked_add(x))
                    .ok_or_else(|| Error::invalid(op, "the strides overflow"))?;
            }
            if last >= self.len {
                return Err(Error::invalid(
                    op,
                    format!(
                        "shape {shape:?} with strides {strides:?} reaches element {last} of {}",
                        self.len
                    ),
                ));
            }
        }
        self.shape = shape
            .iter()
            .map(|&n| to_i64(op, n))
            .collect::<Result<_>>()?;
        self.strides = strides
            .iter()
            .map(|&n| to_i64(op, n))
            .collect::<Result<_>>()?;
        Ok(self)
    }

    /// Cuts the tensor's memory into disjoint tensors that share its owner (the memory goes
    /// back when the last of them is released or dropped): many weights of one upload, many
    /// arrays of one packed batch, each its own consumer tensor. Each part is writable when the
    /// source was. The source's shape and strides do not matter, only its memory
    /// (`[data, data + len * element size)`).
    ///
    /// Errors (`Error::InvalidArgument`, the tensor dropped): a part outside the memory, parts
    /// that overlap, a dtype that is not whole bytes, a part whose address is not a multiple
    /// of its element size, a source from a prefetched batch (a slot comes back once).
    pub fn split(mut self, parts: &[Part]) -> Result<Vec<Tensor>> {
        const OP: &str = "dlpack::Tensor::split";
        let owner = self
            .owner
            .take()
            .ok_or_else(|| Error::invalid(OP, "already handed over"))?;
        // Given back (the source dropped) if anything below is refused.
        let owner: Arc<dyn Owner> = Arc::from(owner);
        if !owner.shareable() {
            return Err(Error::invalid(
                OP,
                "this tensor's memory (a prefetched batch) cannot be split",
            ));
        }
        let bytes = self
            .len
            .checked_mul(self.elem)
            .ok_or_else(|| Error::invalid(OP, "the tensor's size overflows"))?;
        let mut spans = Vec::with_capacity(parts.len());
        let mut out = Vec::with_capacity(parts.len());
        for (i, p) in parts.iter().enumerate() {
            let d = p.dtype;
            let bits = u64::from(d.bits) * u64::from(d.lanes);
            if bits == 0 || bits % 8 != 0 {
                return Err(Error::invalid(
                    OP,
                    format!("part {i}: the type {} is not whole bytes", dtype_name(d)),
                ));
            }
            let elem = (bits / 8) as usize; // at most 255 * 65535 / 8
            let mut count = 1usize;
            for &n in &p.shape {
                count = count
                    .checked_mul(n)
                    .ok_or_else(|| Error::invalid(OP, format!("part {i}: the shape overflows")))?;
            }
            let len = count
                .checked_mul(elem)
                .ok_or_else(|| Error::invalid(OP, format!("part {i}: the size overflows")))?;
            let end = p
                .offset
                .checked_add(len)
                .filter(|&e| e <= bytes)
                .ok_or_else(|| {
                    Error::invalid(
                        OP,
                        format!(
                            "part {i}: bytes {}..+{len} are outside the tensor's {bytes}",
                            p.offset
                        ),
                    )
                })?;
            let addr = (self.data as usize).wrapping_add(p.offset);
            if len > 0 && addr % (1usize << elem.trailing_zeros().min(4)) != 0 {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "part {i}: offset {} is not aligned for {}",
                        p.offset,
                        dtype_name(d)
                    ),
                ));
            }
            if len > 0 {
                spans.push((p.offset, end, i));
            }
            let shape: Vec<usize> = p.shape.clone();
            let mut t = Tensor {
                data: self.data.cast::<u8>().wrapping_add(p.offset).cast(),
                device: self.device,
                dtype: d,
                elem,
                len: count,
                shape: Vec::new(),
                strides: Vec::new(),
                flags: self.flags,
                home: self.home,
                owner: Some(Box::new(Shared(owner.clone()))),
            };
            t = t.reshape(&shape)?;
            out.push(t);
        }
        spans.sort_unstable();
        for w in spans.windows(2) {
            if w[1].0 < w[0].1 {
                return Err(Error::invalid(
                    OP,
                    format!("parts {} and {} overlap", w[0].2, w[1].2),
                ));
            }
        }
        Ok(out)
    }

    /// Marks it read-only (`DLPACK_FLAG_BITMASK_READ_ONLY`; the legacy struct has no flags).
    pub fn read_only(mut self) -> Tensor {
        self.flags |= FLAG_READ_ONLY;
        self
    }

    /// Sizes.
    pub fn shape(&self) -> &[i64] {
        &self.shape
    }

    /// Strides, in elements.
    pub fn strides(&self) -> &[i64] {
        &self.strides
    }

    /// Element type.
    pub fn dtype(&self) -> DLDataType {
        self.dtype
    }

    /// Where the data lives.
    pub fn device(&self) -> DLDevice {
        self.device
    }

    /// The first element's address (device memory for `kDLCUDA`).
    pub fn data_ptr(&self) -> *const c_void {
        self.data
    }

    /// `DLPACK_FLAG_*` bits.
    pub fn flags(&self) -> u64 {
        self.flags
    }

    /// Orders the consumer after the data, then takes the owner out for the box.
    fn hand_over(&mut self, consumer: Option<&Stream>) -> Result<Ctx> {
        let owner = self
            .owner
            .as_ref()
            .ok_or_else(|| Error::invalid("dlpack::Tensor", "already handed over"))?;
        owner.sync(consumer)?;
        // The release may use the consumer's stream only where that stream cannot be destroyed
        // (and its handle reused) before then: one pinstream owns or holds alive, or the legacy
        // default stream. A stream the consumer merely lent (`__dlpack__(stream=S)`, where the
        // protocol does not make it keep S alive) is not touched after this call.
        let kept = consumer.filter(|s| s.outlives_its_borrowers()).cloned();
        let scope = if self.device.device_type == KDL_CUDA {
            Scope::Device(self.home)
        } else {
            Scope::Active
        };
        Ok(Ctx {
            shape: std::mem::take(&mut self.shape),
            strides: std::mem::take(&mut self.strides),
            owner: self.owner.take(),
            consumer: kept,
            scope,
            pid: std::process::id(),
        })
    }

    fn dl_tensor(&self, ctx: &mut Ctx) -> DLTensor {
        let ndim = ctx.shape.len() as i32; // fits: checked in `strided`
        let (shape, strides) = if ndim == 0 {
            (std::ptr::null_mut(), std::ptr::null_mut())
        } else {
            (ctx.shape.as_mut_ptr(), ctx.strides.as_mut_ptr())
        };
        DLTensor {
            data: if self.len == 0 {
                std::ptr::null_mut()
            } else {
                self.data
            },
            device: self.device,
            ndim,
            dtype: self.dtype,
            shape,
            strides,
            byte_offset: 0,
        }
    }

    /// Hands it over as a DLPack 1.x `DLManagedTensorVersioned`, which the consumer releases
    /// by calling its `deleter` once (from any thread).
    ///
    /// `consumer`: the stream the consumer will use it on (`__dlpack__(stream=...)`); it waits
    /// on the GPU for pinstream's work on the memory. At the release, the memory's reuse is
    /// ordered after the work queued on that stream by then where the stream cannot have been
    /// destroyed meanwhile (pinstream's own streams, streams held alive as by
    /// `Stream::from_cudarc`, the legacy default stream); a stream merely lent
    /// ([`Stream::from_raw`]) is not touched after this call, and the memory goes back, from a
    /// background thread, once the device has finished what was queued before the release.
    /// `None` (`stream=-1`): no synchronisation at the handover (the consumer has ordered
    /// itself), and the release is deferred the same way. The deleter never waits for the GPU.
    ///
    /// Errors: the CUDA error of the wait, with the tensor back ([`Refused`]).
    pub fn into_versioned(
        mut self,
        consumer: Option<&Stream>,
    ) -> std::result::Result<*mut DLManagedTensorVersioned, Box<Refused>> {
        let mut ctx = match self.hand_over(consumer) {
            Ok(c) => c,
            Err(error) => {
                return Err(Box::new(Refused {
                    error,
                    tensor: self,
                }))
            }
        };
        let dl_tensor = self.dl_tensor(&mut ctx);
        let boxed = Box::new(VersionedBox {
            managed: DLManagedTensorVersioned {
                version: VERSION,
                manager_ctx: std::ptr::null_mut(),
                deleter: Some(delete_versioned),
                flags: self.flags,
                dl_tensor,
            },
            ctx,
        });
        let raw = Box::into_raw(boxed);
        // SAFETY: `raw` is a live box just made; the context points at itself for consumers
        // that look at it (pinstream's deleter does not need it).
        unsafe { (*raw).managed.manager_ctx = raw.cast() };
        Ok(raw.cast())
    }

    /// As [`into_versioned`](Self::into_versioned), as the legacy `DLManagedTensor` (no
    /// version, no flags: a read-only tensor is refused here, as the struct cannot say so).
    pub fn into_legacy(
        mut self,
        consumer: Option<&Stream>,
    ) -> std::result::Result<*mut DLManagedTensor, Box<Refused>> {
        if self.flags & FLAG_READ_ONLY != 0 {
            let error = Error::invalid(
                "dlpack::Tensor::into_legacy",
                "a read-only tensor cannot be handed over as a legacy DLManagedTensor",
            );
            return Err(Box::new(Refused {
                error,
                tensor: self,
            }));
        }
        let mut ctx = match self.hand_over(consumer) {
            Ok(c) => c,
            Err(error) => {
                return Err(Box::new(Refused {
                    error,
                    tensor: self,
                }))
            }
        };
        let dl_tensor = self.dl_tensor(&mut ctx);
        let boxed = Box::new(LegacyBox {
            managed: DLManagedTensor {
                dl_tensor,
                manager_ctx: std::ptr::null_mut(),
                deleter: Some(delete_legacy),
            },
            ctx,
        });
        let raw = Box::into_raw(boxed);
        // SAFETY: as in `into_versioned`.
        unsafe { (*raw).managed.manager_ctx = raw.cast() };
        Ok(raw.cast())
    }
}

impl From<Box<Refused>> for Error {
    fn from(r: Box<Refused>) -> Error {
        r.error
    }
}

impl Drop for Tensor {
    fn drop(&mut self) {
        if let Some(owner) = self.owner.take() {
            let _ = crate::sync::quietly(move || {
                owner.release(Consumer::Nobody);
                drop(owner);
            });
        }
    }
}
