//! Memory: `DeviceBuffer<T>` (and views), `PinnedBuffer<T>` (`cudaHostAlloc`) and
//! `Registered<'a, T>` (`cudaHostRegister` over a borrowed slice), `PinnedPool` (a cache of
//! pinned blocks, `PoolBlock<T>`), plus the traits that say which of them a copy accepts on each
//! side.

pub use device::{DeviceBuffer, DeviceView, DeviceViewMut};
#[cfg(any(feature = "dlpack", feature = "cudarc-any"))]
pub(crate) use foreign::check_device_ptr;
pub use foreign::ForeignBuffer;
#[cfg(any(feature = "dlpack", feature = "prefetch"))]
pub(crate) use foreign::{pointer_kind, PointerKind};
pub use live::{live, Live};
#[cfg(feature = "timing")]
pub(crate) use pinned::time_alloc_free;
pub use pinned::{HostAlloc, PinnedBuffer, PinnedView};
#[cfg(feature = "prefetch")]
pub(crate) use pool::class_of as pool_class_of;
pub use pool::{PinnedPool, PoolBacking, PoolBlock, PoolConfig, PoolStats};
#[cfg(feature = "timing")]
pub(crate) use registered::time_register;
pub use registered::{HostRegister, HostRegistration, Registered};
pub use tracker::{leaked, Leaked};
// Where they were before issue 30 (they live in `copy` now).
pub use crate::copy::{Download, DownloadTarget};

use std::os::raw::c_void;

use bytemuck::Pod;

use crate::device::Device;
use tracker::Tracker;

/// A newtype over `cudaHostAlloc` / `cudaHostRegister` flag bits: constants, `bits`,
/// `contains`, `|`, and `Default` (no flags).
macro_rules! flag_set {
    ($(#[$doc:meta])* $name:ident { $($(#[$cdoc:meta])* $flag:ident = $value:expr;)* }) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
        pub struct $name(u32);

        impl $name {
            $($(#[$cdoc])* pub const $flag: $name = $name($value);)*

            /// The raw flag bits.
            pub fn bits(self) -> u32 {
                self.0
            }

            /// Whether every flag in `other` is set.
            pub fn contains(self, other: $name) -> bool {
                self.0 & other.0 == other.0
            }
        }

        impl std::ops::BitOr for $name {
            type Output = $name;
            fn bitor(self, rhs: $name) -> $name {
                $name(self.0 | rhs.0)
            }
        }
    };
}
pub(crate) use flag_set;

mod device;
mod foreign;
mod live;
mod pinned;
pub(crate) mod pool;
mod registered;
pub(crate) mod stream_pool;
pub(crate) mod tracker;

/// What kind of host memory a copy reads or writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostKind {
    /// Ordinary (pageable) memory: the runtime stages copies through its own pinned buffers.
    Pageable,
    /// `cudaHostAlloc` memory (`PinnedBuffer`, `PoolBlock` of a `HostAlloc` pool).
    Pinned,
    /// `cudaHostRegister`ed memory (`Registered`, `PoolBlock` of a `Register` pool).
    Registered,
}

pub(crate) mod sealed {
    use super::*;

    /// Device memory as the copy functions see it.
    #[derive(Debug)]
    pub struct DeviceRegion<'a> {
        pub ptr: *mut c_void,
        pub len: usize,
        pub device: Device,
        pub tracker: &'a Tracker,
    }

    /// Host memory as the copy functions see it.
    #[derive(Debug)]
    pub struct HostRegion<'a> {
        pub ptr: *mut c_void,
        pub len: usize,
        pub kind: HostKind,
        /// Pinned and registered memory track the GPU's use of them; pageable memory is only
        /// ever used by calls that finish with it before they return.
        pub tracker: Option<&'a Tracker>,
        /// Registered read-only: the GPU may not write it.
        pub read_only: bool,
    }

    pub trait DeviceMem<T> {
        fn device_region(&self) -> DeviceRegion<'_>;
    }

    pub trait HostMem<T> {
        /// The region for a copy that reads it (host to device).
        fn host_region(&self) -> HostRegion<'_>;
        /// The region for a copy that writes it (device to host). Taken from `&mut self`, so
        /// the write pointer never derives from a shared reference.
        fn host_region_mut(&mut self) -> HostRegion<'_>;
        /// Host access after the GPU's last use (used by the measurement code to check data).
        fn host_read(&self) -> crate::Result<&[T]>;
        /// Write access after the GPU's last use.
        fn host_write(&mut self) -> crate::Result<&mut [T]>;
    }
}

/// Device memory a copy or kernel may read: `DeviceBuffer`, `DeviceView`, `DeviceViewMut`.
pub trait DeviceSlice<T: Pod>: sealed::DeviceMem<T> {}
/// Device memory a copy or kernel may write: `DeviceBuffer`, `DeviceViewMut`.
pub trait DeviceSliceMut<T: Pod>: DeviceSlice<T> {}
/// Host memory a copy may read: `PinnedBuffer`, `PoolBlock`, `Registered`, or a plain `[T]` /
/// `Vec<T>`.
pub trait HostSlice<T: Pod>: sealed::HostMem<T> {}
/// Host memory a copy may write: `PinnedBuffer`, `PoolBlock`, `Registered`, or a plain `[T]` /
/// `Vec<T>`.
pub trait HostSliceMut<T: Pod>: HostSlice<T> {}

impl<T: Pod> sealed::HostMem<T> for [T] {
    fn host_region(&self) -> sealed::HostRegion<'_> {
        // Read-only use: the pointer is only ever read through.
        pageable_region(self.as_ptr().cast_mut().cast(), self.len())
    }
    fn host_region_mut(&mut self) -> sealed::HostRegion<'_> {
        let mut r = pageable_region(self.as_mut_ptr().cast(), self.len());
        // Memory registered read-only elsewhere in this process (a `Registered` handed out as a
        // plain slice): the GPU may not write it.
        r.read_only = registered::read_only::overlaps(r.ptr as usize, std::mem::size_of_val(self));
        r
    }
    fn host_read(&self) -> crate::Result<&[T]> {
        Ok(self)
    }
    fn host_write(&mut self) -> crate::Result<&mut [T]> {
        Ok(self)
    }
}
fn pageable_region<'a>(ptr: *mut c_void, len: usize) -> sealed::HostRegion<'a> {
    sealed::HostRegion {
        ptr,
        len,
        kind: HostKind::Pageable,
        tracker: None,
        read_only: false,
    }
}

impl<T: Pod> HostSlice<T> for [T] {}
impl<T: Pod> HostSliceMut<T> for [T] {}

impl<T: Pod> sealed::HostMem<T> for Vec<T> {
    fn host_region(&self) -> sealed::HostRegion<'_> {
        self.as_slice().host_region()
    }
    fn host_region_mut(&mut self) -> sealed::HostRegion<'_> {
        self.as_mut_slice().host_region_mut()
    }
    fn host_read(&self) -> crate::Result<&[T]> {
        Ok(self)
    }
    fn host_write(&mut self) -> crate::Result<&mut [T]> {
        Ok(self)
    }
}
impl<T: Pod> HostSlice<T> for Vec<T> {}
impl<T: Pod> HostSliceMut<T> for Vec<T> {}

/// Resolves a range against a length, for the `slice` methods.
pub(crate) fn resolve_range(
    op: &'static str,
    range: impl std::ops::RangeBounds<usize>,
    len: usize,
) -> crate::Result<std::ops::Range<usize>> {
    use std::ops::Bound;
    let start = match range.start_bound() {
        Bound::Included(&s) => Some(s),
        Bound::Excluded(&s) => s.checked_add(1),
        Bound::Unbounded => Some(0),
    };
    let end = match range.end_bound() {
        Bound::Included(&e) => e.checked_add(1),
        Bound::Excluded(&e) => Some(e),
        Bound::Unbounded => Some(len),
    };
    match (start, end) {
        (Some(s), Some(e)) if s <= e && e <= len => Ok(s..e),
        _ => Err(crate::Error::invalid(
            op,
            format!(
                "range {:?}..{:?} is outside 0..{len}",
                range.start_bound(),
                range.end_bound()
            ),
        )),
    }
}
