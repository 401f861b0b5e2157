//! Import: [`Imported`] owns another library's managed tensor; [`HostTensor`] is its host
//! memory as a copy source or destination.

use std::marker::PhantomData;
use std::os::raw::c_void;
use std::ptr::NonNull;

use super::abi::{
    DLDataType, DLDevice, DLManagedTensor, DLManagedTensorVersioned, DLTensor, FLAG_READ_ONLY,
    KDL_CPU, KDL_CUDA, KDL_CUDA_HOST, KDL_CUDA_MANAGED,
};
use super::{check_element, dtype_name, Element};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::memory::sealed::{HostMem, HostRegion};
use crate::memory::tracker::Tracker;
use crate::memory::{
    check_device_ptr, pointer_kind, DeviceView, DeviceViewMut, HostKind, HostSlice, HostSliceMut,
    PointerKind,
};

enum Raw {
    Versioned(NonNull<DLManagedTensorVersioned>),
    Legacy(NonNull<DLManagedTensor>),
}

/// Another library's DLPack tensor, owned: dropping it waits for pinstream's work on the
/// memory, then calls the producer's deleter (once).
///
/// Views of it are checked against the tensor: the element type, a compact row-major layout
/// (the copies move contiguous bytes), the device, and read-only flags.
pub struct Imported {
    raw: Raw,
    data: *mut c_void,
    device: DLDevice,
    dtype: DLDataType,
    shape: Vec<i64>,
    strides: Vec<i64>,
    flags: u64,
    /// Elements (the product of the shape).
    len: usize,
    tracker: Tracker,
}

// SAFETY: DLPack tensors are handed between threads (the deleter may run on any thread); the
// memory is used only through tracked, ordered work or checked host views.
unsafe impl Send for Imported {}
// SAFETY: `&Imported` hands out only read-only views; writes need `&mut`.
unsafe impl Sync for Imported {}

impl std::fmt::Debug for Imported {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Imported")
            .field("data", &self.data)
            .field("device", &self.device)
            .field("dtype", &dtype_name(self.dtype))
            .field("shape", &self.shape)
            .field("strides", &self.strides)
            .field("flags", &self.flags)
            .finish()
    }
}

const OP: &str = "dlpack::Imported";

impl Imported {
    /// Takes a DLPack 1.x tensor. On an error (an unsupported major version, a malformed
    /// tensor) the tensor's deleter has been called: it is given back, not leaked.
    ///
    /// # Safety
    ///
    /// `p` is a `DLManagedTensorVersioned` as DLPack defines it, owned by the caller, which
    /// passes that ownership here (it must not use `p` or call its deleter afterwards); its
    /// data is valid as the tensor describes it until the deleter is called; while this value
    /// lives, nobody else writes the data, and nobody else reads it while pinstream may write
    /// it (through `device_mut` / `host_mut`), unless ordered with pinstream's work through
    /// stream order or events. (pinstream's own exports of shared buffers are read-only.)
    pub unsafe fn from_versioned(p: *mut DLManagedTensorVersioned) -> Result<Imported> {
        let p = NonNull::new(p).ok_or_else(|| Error::invalid(OP, "a null tensor"))?;
        // SAFETY: the caller's contract: a live tensor; the version comes first in every
        // version's layout.
        let major = unsafe { p.as_ref().version.major };
        if major != 1 {
            // SAFETY: the fields up to `flags` (the deleter among them) are stable across
            // versions; ownership is ours, so we give it back.
            unsafe { delete(&Raw::Versioned(p)) };
            return Err(Error::invalid(
                OP,
                format!("DLPack major version {major} (pinstream reads 1)"),
            ));
        }
        // SAFETY: a live version-1 tensor (checked above).
        let (t, flags) = unsafe { (&p.as_ref().dl_tensor, p.as_ref().flags) };
        // SAFETY: `t` is the tensor's own DLTensor.
        unsafe { Imported::new(Raw::Versioned(p), t, flags) }
    }

    /// Takes a legacy `DLManagedTensor`, as [`from_versioned`](Self::from_versioned).
    ///
    /// # Safety
    ///
    /// As for `from_versioned`, for a `DLManagedTensor`.
    pub unsafe fn from_legacy(p: *mut DLManagedTensor) -> Result<Imported> {
        let p = NonNull::new(p).ok_or_else(|| Error::invalid(OP, "a null tensor"))?;
        // SAFETY: the caller's contract.
        let t = unsafe { &p.as_ref().dl_tensor };
        // SAFETY: as above.
        unsafe { Imported::new(Raw::Legacy(p), t, 0) }
    }

    /// # Safety
    ///
    /// `t` belongs to the live tensor `raw`.
    unsafe fn new(raw: Raw, t: &DLTensor, flags: u64) -> Result<Imported> {
        // SAFETY: forwarded.
        match unsafe { Self::parse(t) } {
            Ok((shape, strides, len)) => Ok(Imported {
                data: t
                    .data
                    .cast::<u8>()
                    .wrapping_add(t.byte_offset as usize)
                    .cast(),
                device: t.device,
                dtype: t.dtype,
                shape,
                strides,
                flags,
                len,
                tracker: Tracker::new(),
                raw,
            }),
            Err(e) => {
                // SAFETY: ours to give back (the caller passed ownership).
                unsafe { delete(&raw) };
                Err(e)
            }
        }
    }

    /// Shape, strides (compact row-major when the producer gave none) and element count.
    ///
    /// # Safety
    ///
    /// `t`'s shape and strides pointers are valid for `ndim` elements (or null).
    unsafe fn parse(t: &DLTensor) -> Result<(Vec<i64>, Vec<i64>, usize)> {
        let bad = |why: String| Err(Error::invalid(OP, why));
        let Ok(ndim) = usize::try_from(t.ndim) else {
            return bad(format!("ndim = {}", t.ndim));
        };
        if ndim > 64 {
            return bad(format!("ndim = {ndim} (more than 64 dimensions)"));
        }
        if ndim > 0 && t.shape.is_null() {
            return bad("a null shape".into());
        }
        let shape: Vec<i64> = if ndim == 0 {
            Vec::new()
        } else {
            // SAFETY: the caller's contract: `ndim` sizes.
            unsafe { std::slice::from_raw_parts(t.shape, ndim) }.to_vec()
        };
        let mut len = 1usize;
        for &n in &shape {
            let Ok(n) = usize::try_from(n) else {
                return bad(format!("a negative size in {shape:?}"));
            };
            let Some(l) = len.checked_mul(n) else {
                return bad(format!("shape {shape:?} overflows"));
            };
            len = l;
        }
        let strides: Vec<i64> = if ndim > 0 && !t.strides.is_null() {
            // SAFETY: as above, `ndim` strides.
            unsafe { std::slice::from_raw_parts(t.strides, ndim) }.to_vec()
        } else {
            let mut s = vec![0i64; ndim];
            let mut acc = 1i64;
            for i in (0..ndim).rev() {
                s[i] = acc;
                acc = acc.saturating_mul(shape[i].max(1));
            }
            s
        };
        let d = t.dtype;
        if d.lanes == 0 || (u32::from(d.bits) * u32::from(d.lanes)) % 8 != 0 {
            return bad(format!("data type {}", dtype_name(d)));
        }
        let elem = (usize::from(d.bits) * usize::from(d.lanes)) / 8;
        if len
            .checked_mul(elem)
            .is_none_or(|b| b > isize::MAX as usize)
        {
            return bad(format!("{len} elements of {elem} bytes overflow"));
        }
        if len > 0 && t.data.is_null() {
            return bad("a null data pointer for a non-empty tensor".into());
        }
        // The first element's address and the end of the data must not wrap around the
        // address space (a byte offset that does would give views a null or low pointer).
        let bytes = len * elem; // checked above
        let wraps = usize::try_from(t.byte_offset)
            .ok()
            .and_then(|off| (t.data as usize).checked_add(off))
            .and_then(|first| first.checked_add(bytes))
            .is_none();
        if len > 0 && wraps {
            return bad(format!(
                "data {:p} + byte_offset {} + {bytes} bytes wraps around the address space",
                t.data, t.byte_offset
            ));
        }
        Ok((shape, strides, len))
    }

    /// Sizes.
    pub fn shape(&self) -> &[i64] {
        &self.shape
    }

    /// Strides in elements.
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

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the producer marked it read-only.
    pub fn is_read_only(&self) -> bool {
        self.flags & FLAG_READ_ONLY != 0
    }

    /// Whether it is compact row-major (C order): the layout the views need.
    pub fn is_contiguous(&self) -> bool {
        // No elements: nothing to lay out (producers give such tensors any strides).
        if self.shape.contains(&0) {
            return true;
        }
        let mut expect = 1i64;
        for (&n, &s) in self.shape.iter().zip(&self.strides).rev() {
            if n != 1 && s != expect {
                return false;
            }
            expect = expect.saturating_mul(n);
        }
        true
    }

    /// The first element's address.
    pub fn data_ptr(&self) -> *const c_void {
        self.data
    }

    /// Blocks until pinstream's work on the memory is over.
    pub fn synchronize(&self) -> Result<()> {
        self.tracker.synchronize()
    }

    fn check_view<T: Element>(&self, op: &'static str, write: bool) -> Result<()> {
        check_element::<T>(op)?;
        if self.dtype != T::DTYPE {
            return Err(Error::invalid(
                op,
                format!(
                    "the tensor holds {}, not {}",
                    dtype_name(self.dtype),
                    dtype_name(T::DTYPE)
                ),
            ));
        }
        self.check_layout(op, write)?;
        if self.len > 0 && (self.data as usize) % std::mem::align_of::<T>() != 0 {
            return Err(Error::invalid(
                op,
                format!("{:p} is not aligned for the element type", self.data),
            ));
        }
        Ok(())
    }

    fn cuda_device(&self, op: &'static str) -> Result<Device> {
        if !matches!(self.device.device_type, KDL_CUDA | KDL_CUDA_MANAGED) {
            return Err(Error::invalid(
                op,
                format!(
                    "device type {} is not CUDA device memory",
                    self.device.device_type
                ),
            ));
        }
        let bytes = self.byte_len()?;
        self.cuda_device_bytes(op, bytes)
    }

    /// Checks that `bytes` from the data pointer are device memory of the device the tensor
    /// names.
    fn cuda_device_bytes(&self, op: &'static str, bytes: usize) -> Result<Device> {
        if !matches!(self.device.device_type, KDL_CUDA | KDL_CUDA_MANAGED) {
            return Err(Error::invalid(
                op,
                format!(
                    "device type {} is not CUDA device memory",
                    self.device.device_type
                ),
            ));
        }
        let ordinal = usize::try_from(self.device.device_id)
            .map_err(|_| Error::invalid(op, format!("device id {}", self.device.device_id)))?;
        let device = Device::get(ordinal)?;
        check_device_ptr(op, &device, self.data.cast::<u8>(), bytes)?;
        Ok(device)
    }

    /// Its device memory (`kDLCUDA`) as a read-only view: a source of copies and kernels.
    pub fn device_view<T: Element>(&self) -> Result<DeviceView<'_, T>> {
        const OP: &str = "dlpack::Imported::device_view";
        self.check_view::<T>(OP, false)?;
        let device = self.cuda_device(OP)?;
        // SAFETY: checked above: device memory of `device`, `len` elements of `T`, aligned;
        // the caller of `from_*` keeps it valid while `self` (and the borrow) lives; every
        // pinstream use goes through `self.tracker`.
        Ok(unsafe { DeviceView::from_parts(self.data.cast(), self.len, device, &self.tracker) })
    }

    /// Its device memory (`kDLCUDA`) as a writable view: a checked destination for uploads,
    /// the `Stager` and the normalize kernels.
    ///
    /// Errors: `Error::InvalidArgument` for host memory, another element type, a
    /// non-contiguous layout, a read-only tensor, or an address that is not device memory of
    /// the device the tensor names.
    pub fn device_mut<T: Element>(&mut self) -> Result<DeviceViewMut<'_, T>> {
        const OP: &str = "dlpack::Imported::device_mut";
        self.check_view::<T>(OP, true)?;
        let device = self.cuda_device(OP)?;
        // SAFETY: as in `device_view`; `&mut self` makes it the only view.
        Ok(unsafe { DeviceViewMut::from_parts(self.data.cast(), self.len, device, &self.tracker) })
    }

    fn host_kind(&self, op: &'static str) -> Result<HostKind> {
        if !matches!(self.device.device_type, KDL_CPU | KDL_CUDA_HOST) {
            return Err(Error::invalid(
                op,
                format!("device type {} is not host memory", self.device.device_type),
            ));
        }
        if self.len == 0 {
            return Ok(HostKind::Pageable);
        }
        // What the runtime says the address is: a CPU tensor may be page-locked
        // (`pin_memory()` tensors are `kDLCPU`), and a tensor that calls device memory host
        // memory is refused (the host would read it). When the runtime cannot say (no
        // device), the pageable path is the safe one: its copies are over before they return.
        match pointer_kind(self.data) {
            Ok(PointerKind::Pinned) => Ok(HostKind::Pinned),
            Ok(PointerKind::Device(d)) => Err(Error::invalid(
                op,
                format!(
                    "the tensor says host memory, but {:p} is device memory of device {d}",
                    self.data
                ),
            )),
            _ => Ok(HostKind::Pageable),
        }
    }

    /// Its host memory (`kDLCPU`, `kDLCUDAHost`) as a read-only copy source (`copy_h2d`, and
    /// [`HostTensor::as_slice`] for the `Stager`).
    pub fn host<T: Element>(&self) -> Result<HostTensor<'_, T>> {
        const OP: &str = "dlpack::Imported::host";
        self.check_view::<T>(OP, false)?;
        let kind = self.host_kind(OP)?;
        Ok(HostTensor {
            ptr: self.data.cast(),
            len: self.len,
            kind,
            tracker: &self.tracker,
            writable: false,
            _marker: PhantomData,
        })
    }

    /// Its host memory as a writable copy destination (`copy_d2h`).
    pub fn host_mut<T: Element>(&mut self) -> Result<HostTensor<'_, T>> {
        const OP: &str = "dlpack::Imported::host_mut";
        self.check_view::<T>(OP, true)?;
        let kind = self.host_kind(OP)?;
        Ok(HostTensor {
            ptr: self.data.cast(),
            len: self.len,
            kind,
            tracker: &self.tracker,
            writable: true,
            _marker: PhantomData,
        })
    }
}

impl Imported {
    /// The tensor's size in bytes (elements × element size).
    pub fn byte_len(&self) -> Result<usize> {
        let bits = u64::from(self.dtype.bits) * u64::from(self.dtype.lanes);
        if bits == 0 || bits % 8 != 0 {
            return Err(Error::invalid(
                "dlpack::Imported::byte_len",
                format!("{} is not whole bytes", dtype_name(self.dtype)),
            ));
        }
        self.len
            .checked_mul((bits / 8) as usize)
            .ok_or_else(|| Error::invalid("dlpack::Imported::byte_len", "the size overflows"))
    }

    fn check_bytes(&self, op: &'static str, write: bool) -> Result<usize> {
        let bytes = self.byte_len()?;
        self.check_layout(op, write)?;
        Ok(bytes)
    }

    /// What every view needs: a compact row-major layout, and for a writable one a tensor the
    /// producer did not mark read-only.
    fn check_layout(&self, op: &'static str, write: bool) -> Result<()> {
        if !self.is_contiguous() {
            return Err(Error::invalid(
                op,
                format!(
                    "shape {:?} with strides {:?} is not compact row-major",
                    self.shape, self.strides
                ),
            ));
        }
        if write && self.is_read_only() {
            return Err(Error::invalid(
                op,
                "the producer marked the tensor read-only",
            ));
        }
        Ok(())
    }

    /// Its host memory as bytes, whatever the element type (bool, complex, float8 ...): a
    /// read-only copy source, as [`host`](Self::host). The tensor must be compact row-major.
    pub fn host_bytes(&self) -> Result<HostTensor<'_, u8>> {
        const OP: &str = "dlpack::Imported::host_bytes";
        let len = self.check_bytes(OP, false)?;
        let kind = self.host_kind(OP)?;
        Ok(HostTensor {
            ptr: self.data.cast(),
            len,
            kind,
            tracker: &self.tracker,
            writable: false,
            _marker: PhantomData,
        })
    }

    /// Its device memory as bytes, whatever the element type: a read-only source, as
    /// [`device_view`](Self::device_view). The tensor must be compact row-major.
    pub fn device_bytes(&self) -> Result<DeviceView<'_, u8>> {
        const OP: &str = "dlpack::Imported::device_bytes";
        let len = self.check_bytes(OP, false)?;
        let device = self.cuda_device_bytes(OP, len)?;
        // SAFETY: checked above: `len` bytes of device memory of `device`; the caller of
        // `from_*` keeps it valid while `self` (and the borrow) lives; every pinstream use goes
        // through `self.tracker`.
        Ok(unsafe { DeviceView::from_parts(self.data.cast(), len, device, &self.tracker) })
    }

    /// Its device memory as writable bytes, as [`device_mut`](Self::device_mut).
    pub fn device_bytes_mut(&mut self) -> Result<DeviceViewMut<'_, u8>> {
        const OP: &str = "dlpack::Imported::device_bytes_mut";
        let len = self.check_bytes(OP, true)?;
        let device = self.cuda_device_bytes(OP, len)?;
        // SAFETY: as in `device_bytes`; `&mut self` makes it the only view.
        Ok(unsafe { DeviceViewMut::from_parts(self.data.cast(), len, device, &self.tracker) })
    }
}

/// Calls the tensor's deleter, if it has one.
///
/// # Safety
///
/// `raw` is a live tensor owned by the caller, not used afterwards.
unsafe fn delete(raw: &Raw) {
    match *raw {
        Raw::Versioned(p) => {
            // SAFETY: the caller's contract.
            if let Some(d) = unsafe { p.as_ref().deleter } {
                // SAFETY: DLPack: the owner calls the deleter once with the tensor.
                unsafe { d(p.as_ptr()) }
            }
        }
        Raw::Legacy(p) => {
            // SAFETY: as above.
            if let Some(d) = unsafe { p.as_ref().deleter } {
                // SAFETY: as above.
                unsafe { d(p.as_ptr()) }
            }
        }
    }
}

impl Drop for Imported {
    fn drop(&mut self) {
        if let Err(e) = self.tracker.synchronize() {
            // The GPU may still use the memory: never give it back.
            crate::memory::tracker::leak(
                "an imported DLPack tensor",
                self.len * usize::from(self.dtype.bits) / 8,
                &e,
            );
            return;
        }
        // SAFETY: we own the tensor (from `from_*`), give it back once, and do not touch it
        // afterwards.
        unsafe { delete(&self.raw) }
    }
}

/// Host memory of an [`Imported`] tensor: a source (or, from
/// [`Imported::host_mut`], a destination) of copies.
pub struct HostTensor<'a, T: Element> {
    ptr: *mut T,
    len: usize,
    kind: HostKind,
    tracker: &'a Tracker,
    writable: bool,
    _marker: PhantomData<&'a [T]>,
}

// SAFETY: a borrow of an `Imported`, which is Send and Sync; host access goes through the
// tracker's waits.
unsafe impl<T: Element> Send for HostTensor<'_, T> {}
// SAFETY: as above.
unsafe impl<T: Element> Sync for HostTensor<'_, T> {}

impl<T: Element> std::fmt::Debug for HostTensor<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostTensor")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("kind", &self.kind)
            .field("writable", &self.writable)
            .finish()
    }
}

impl<T: Element> HostTensor<'_, T> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Page-locked or pageable, as the runtime sees the address.
    pub fn kind(&self) -> HostKind {
        self.kind
    }

    /// Read access after pinstream's last write to it (for `Stager::upload`).
    pub fn as_slice(&self) -> Result<&[T]> {
        self.tracker.synchronize_writes()?;
        if self.len == 0 {
            return Ok(&[]);
        }
        // SAFETY: `len` elements of `T` at `ptr` (checked at import: contiguous, aligned,
        // the type's size), valid while the `Imported` lives (its creator's contract);
        // pinstream's writes are over (waited above) and new ones need `&mut`.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr, self.len) })
    }
}

impl<'a, T: Element> HostTensor<'a, T> {
    /// As [`as_slice`](Self::as_slice), borrowing the [`Imported`] rather than the view, for a
    /// read-only view ([`Imported::host`], [`Imported::host_bytes`]). A writable one
    /// ([`Imported::host_mut`]) is refused (`Error::InvalidArgument`): it may still be a copy's
    /// destination.
    pub fn into_slice(self) -> Result<&'a [T]> {
        if self.writable {
            return Err(Error::invalid(
                "dlpack::HostTensor::into_slice",
                "a writable view (host_mut) stays borrowed as a view",
            ));
        }
        self.tracker.synchronize_writes()?;
        if self.len == 0 {
            return Ok(&[]);
        }
        // SAFETY: as in `as_slice`; the view is read-only and borrowed the `Imported` shared
        // for `'a`, so nothing writes the memory through pinstream for `'a`.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr, self.len) })
    }
}

impl<T: Element> HostMem<T> for HostTensor<'_, T> {
    fn host_region(&self) -> HostRegion<'_> {
        HostRegion {
            ptr: self.ptr.cast(),
            len: self.len,
            kind: self.kind,
            tracker: (self.kind != HostKind::Pageable).then_some(self.tracker),
            read_only: !self.writable,
        }
    }
    fn host_region_mut(&mut self) -> HostRegion<'_> {
        self.host_region()
    }
    fn host_read(&self) -> Result<&[T]> {
        self.as_slice()
    }
    fn host_write(&mut self) -> Result<&mut [T]> {
        if !self.writable {
            return Err(Error::invalid(
                "dlpack::HostTensor",
                "a read-only view (use Imported::host_mut)",
            ));
        }
        self.tracker.synchronize()?;
        if self.len == 0 {
            return Ok(&mut []);
        }
        // SAFETY: as in `as_slice`; `host_mut` took `&mut Imported`, so this is the only view,
        // and every GPU use is over (waited above).
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) })
    }
}
impl<T: Element> HostSlice<T> for HostTensor<'_, T> {}
impl<T: Element> HostSliceMut<T> for HostTensor<'_, T> {}
