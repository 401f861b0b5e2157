//! `Registered<'a, T>`: page-locks memory the caller already owns (`cudaHostRegister`) for the
//! length of a scope, so copies from and to it run like pinned ones without a second buffer.

use std::marker::PhantomData;

use bytemuck::Pod;

use super::sealed::{HostMem, HostRegion};
use super::tracker::Tracker;
use super::{HostKind, HostSlice, HostSliceMut};
use crate::device::Device;
use crate::error::{byte_len, check_with, Result};
use crate::sys;

super::flag_set! {
    /// Flags for `cudaHostRegister`; combine with `|`. `Default` is `DEFAULT`.
    HostRegister {
        /// Page-locked for the current device.
        DEFAULT = sys::cudaHostRegisterDefault;
        /// Treated as pinned by every device.
        PORTABLE = sys::cudaHostRegisterPortable;
        /// Also mapped into the device address space.
        MAPPED = sys::cudaHostRegisterMapped;
        /// The GPU only reads it: copies into it are refused with `Error::InvalidArgument`.
        READ_ONLY = sys::cudaHostRegisterReadOnly;
    }
}

/// A borrowed `&'a mut [T]`, page-locked with `cudaHostRegister` for the length of
/// `Registered::scope`. Copies from and to it are tracked like those of a `PinnedBuffer`;
/// `as_slice` / `as_mut_slice` wait for the GPU first, and at the end of the scope it waits for
/// the GPU's last use and unregisters.
///
/// Why a scope rather than a constructor: a value could be leaked with `mem::forget`, which
/// would end the borrow of the slice while a copy into it may still be running. Inside the scope
/// the closure only ever holds `&mut Registered`, so the wait at the end always happens.
#[derive(Debug)]
pub struct Registered<'a, T: Pod> {
    ptr: *mut T,
    len: usize,
    flags: HostRegister,
    device: Device,
    tracker: Tracker,
    registered: bool,
    _borrow: PhantomData<&'a mut [T]>,
}

// SAFETY: it stands for a `&mut [T]` (Send when T is); the tracker is thread-safe.
unsafe impl<T: Pod> Send for Registered<'_, T> {}
// SAFETY: shared access only reads, after the tracker's wait.
unsafe impl<T: Pod> Sync for Registered<'_, T> {}

impl<'a, T: Pod> Registered<'a, T> {
    /// Registers `data` with `flags` (on `device`), runs `f` with it, then waits for the GPU to
    /// finish with it and unregisters. Returns what `f` returns; registration and
    /// unregistration errors come back as `Err`.
    pub fn scope<R>(
        device: &Device,
        data: &'a mut [T],
        flags: HostRegister,
        f: impl FnOnce(&mut Registered<'a, T>) -> R,
    ) -> Result<R> {
        let mut reg = Registered::register(device, data, flags)?;
        let out = f(&mut reg);
        reg.release()?;
        Ok(out)
    }

    fn register(device: &Device, data: &'a mut [T], flags: HostRegister) -> Result<Self> {
        let bytes = byte_len::<T>("Registered::scope", data.len())?;
        let mut reg = Registered {
            ptr: data.as_mut_ptr(),
            len: data.len(),
            flags,
            device: *device,
            tracker: Tracker::new(),
            registered: false,
            _borrow: PhantomData,
        };
        if bytes > 0 {
            device.make_current()?;
            check_with(
                // SAFETY: `ptr` addresses `bytes` bytes the caller lent us mutably for 'a; it stays
                // registered no longer than that (unregistered in `release` or `Drop`).
                unsafe { sys::cudaHostRegister(reg.ptr.cast(), bytes, flags.bits()) },
                "cudaHostRegister",
                || format!("{bytes} bytes, flags {:#x}", flags.bits()),
            )?;
            reg.registered = true;
            if reg.read_only() {
                read_only::insert(reg.ptr as usize, bytes);
            }
        }
        Ok(reg)
    }

    /// Waits for the GPU, then unregisters; the first error is returned. If the wait fails the
    /// memory stays registered (its pages stay locked, counted in `memory::leaked`): a copy
    /// might still be using it.
    fn release(&mut self) -> Result<()> {
        if !self.registered {
            return Ok(());
        }
        self.registered = false;
        if self.read_only() {
            read_only::remove(self.ptr as usize);
        }
        if let Err(e) = self.tracker.synchronize() {
            let bytes = self.len * std::mem::size_of::<T>();
            super::tracker::leak("registered host memory (left registered)", bytes, &e);
            return Err(e);
        }
        // SAFETY: registered by `register` and unregistered once, after the GPU's last use.
        let err = unsafe { sys::cudaHostUnregister(self.ptr.cast()) };
        check_with(err, "cudaHostUnregister", || {
            format!("{} elements", self.len)
        })
    }

    fn read_only(&self) -> bool {
        self.flags.contains(HostRegister::READ_ONLY)
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The flags it was registered with.
    pub fn flags(&self) -> HostRegister {
        self.flags
    }

    /// The device that was current at registration.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Waits for the GPU's last write to it (copies that only read it may go on), then gives
    /// read access.
    pub fn as_slice(&self) -> Result<&[T]> {
        self.tracker.synchronize_writes()?;
        // SAFETY: the memory is the caller's initialised slice, borrowed for 'a; the GPU has
        // finished writing it (wait above) and cannot start writing while `&self` is held;
        // copies that read it beside the host are harmless.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr, self.len) })
    }

    /// Waits for the GPU's last use, then gives write access.
    pub fn as_mut_slice(&mut self) -> Result<&mut [T]> {
        self.tracker.synchronize()?;
        // SAFETY: as in `as_slice`; `&mut self` excludes every other access.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) })
    }
}

impl<T: Pod> Drop for Registered<'_, T> {
    fn drop(&mut self) {
        // Reached normally after `release`, or while unwinding out of the scope's closure.
        let _ = self.release();
    }
}

impl<T: Pod> HostMem<T> for Registered<'_, T> {
    fn host_region(&self) -> HostRegion<'_> {
        HostRegion {
            ptr: self.ptr.cast(),
            len: self.len,
            kind: HostKind::Registered,
            tracker: Some(&self.tracker),
            read_only: self.read_only(),
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
impl<T: Pod> HostSlice<T> for Registered<'_, T> {}
impl<T: Pod> HostSliceMut<T> for Registered<'_, T> {}

/// Times `cudaHostRegister(data, flags)` and the matching `cudaHostUnregister`.
pub(crate) fn time_register<T: Pod>(
    device: &Device,
    data: &mut [T],
    flags: HostRegister,
) -> Result<(std::time::Duration, std::time::Duration)> {
    let bytes = byte_len::<T>("time_register", data.len())?;
    device.make_current()?;
    let t = std::time::Instant::now();
    check_with(
        // SAFETY: `data` is borrowed mutably for the whole function and unregistered before it
        // returns; nothing uses it in between.
        unsafe { sys::cudaHostRegister(data.as_mut_ptr().cast(), bytes, flags.bits()) },
        "cudaHostRegister",
        || format!("{bytes} bytes"),
    )?;
    let register = t.elapsed();
    let t = std::time::Instant::now();
    check_with(
        // SAFETY: registered just above.
        unsafe { sys::cudaHostUnregister(data.as_mut_ptr().cast()) },
        "cudaHostUnregister",
        || format!("{bytes} bytes"),
    )?;
    Ok((register, t.elapsed()))
}

/// The address ranges registered `READ_ONLY` through `Registered::scope`, so that a device-to-host
/// copy into a plain slice of such memory (from `as_mut_slice`) is refused with the same error as
/// one into the `Registered` itself, before anything is queued.
pub(crate) mod read_only {
    use std::collections::BTreeMap;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;

    /// start -> end (exclusive) of each live read-only registration.
    static RANGES: Mutex<BTreeMap<usize, usize>> = Mutex::new(BTreeMap::new());
    /// How many there are: lets the common case (none) skip the lock.
    static COUNT: AtomicUsize = AtomicUsize::new(0);

    fn ranges() -> std::sync::MutexGuard<'static, BTreeMap<usize, usize>> {
        RANGES.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn insert(start: usize, bytes: usize) {
        let mut r = ranges();
        if r.insert(start, start.saturating_add(bytes)).is_none() {
            COUNT.fetch_add(1, Ordering::SeqCst);
        }
    }

    pub(crate) fn remove(start: usize) {
        let mut r = ranges();
        if r.remove(&start).is_some() {
            COUNT.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Whether `start..start + bytes` overlaps a live read-only registration.
    pub(crate) fn overlaps(start: usize, bytes: usize) -> bool {
        if bytes == 0 || COUNT.load(Ordering::SeqCst) == 0 {
            return false;
        }
        let end = start.saturating_add(bytes);
        let r = ranges();
        // Registrations never overlap each other (the runtime refuses that), so only the last
        // one starting before `end` can reach into the range.
        r.range(..end).next_back().is_some_and(|(_, &e)| e > start)
    }
}

/// Memory owned elsewhere, page-locked with `cudaHostRegister` until this value is dropped:
/// for memory whose owner outlives the registration and whose copies are not tracked here,
/// such as a mapping shared with another process that a prefetcher DMAs from. Unlike
/// [`Registered`] it is not scoped and tracks nothing: its drop unregisters at once.
#[derive(Debug)]
pub struct HostRegistration {
    ptr: *mut std::ffi::c_void,
    len: usize,
    device: Device,
}

// SAFETY: it only holds the address for the unregistration; the runtime's calls on it are
// thread-safe.
unsafe impl Send for HostRegistration {}
// SAFETY: `&HostRegistration` gives no access to the memory.
unsafe impl Sync for HostRegistration {}

impl HostRegistration {
    /// Registers the `len` bytes at `ptr` with `flags` for `device`.
    ///
    /// # Safety
    ///
    /// `ptr..ptr + len` must be mapped host memory that stays mapped until this value is
    /// dropped, and every GPU copy from or to it must be over before the drop.
    pub unsafe fn new(
        device: &Device,
        ptr: *mut u8,
        len: usize,
        flags: HostRegister,
    ) -> Result<Self> {
        if len == 0 || ptr.is_null() {
            return Err(crate::Error::invalid(
                "HostRegistration::new",
                format!("{len} bytes at {ptr:p}: give a mapped, non-empty range"),
            ));
        }
        device.make_current()?;
        check_with(
            // SAFETY: the caller's promise: `len` mapped bytes at `ptr` for as long as the
            // registration lives (unregistered in `Drop`).
            unsafe { sys::cudaHostRegister(ptr.cast(), len, flags.bits()) },
            "cudaHostRegister",
            || format!("{len} bytes, flags {:#x}", flags.bits()),
        )?;
        Ok(HostRegistration {
            ptr: ptr.cast(),
            len,
            device: *device,
        })
    }

    /// The number of bytes registered.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never true: an empty range is refused.
    pub fn is_empty(&self) -> bool {
        false
    }

    /// The device that was current at registration.
    pub fn device(&self) -> Device {
        self.device
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        // SAFETY: registered by `new`, unregistered once; the caller promised that no copy
        // uses it any more. A failure leaves the pages locked (reported, nothing else to do).
        let err = unsafe { sys::cudaHostUnregister(self.ptr) };
        if let Err(e) = check_with(err, "cudaHostUnregister", || format!("{} bytes", self.len)) {
            super::tracker::leak(
                "registered host memory (unregistration failed)",
                self.len,
                &e,
            );
        }
    }
}
