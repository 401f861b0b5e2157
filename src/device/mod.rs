//! `Device`: which GPUs there are and what they are — SMs, memory, copy engines, PCI location
//! and link, driver and runtime versions.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Mutex;

use crate::driver::{Version, CUDART_VERSION};
use crate::error::{check, check_with, clear_last_error, CudaError, Error, Result};
use crate::sys;

pub use topology::{parse_link_speed, pcie_gen_from_gts, PcieLink};

pub mod topology;

/// One CUDA device, by ordinal. Cheap to copy; every call that needs it makes the device current
/// on the calling thread first, so several devices and threads can be used freely.
///
/// On a machine without a driver or a GPU, the first call says so with [`Error::NoDevice`]:
///
/// ```
/// use pinstream::Device;
/// # fn main() -> pinstream::Result<()> {
/// match Device::all() {
///     Ok(devices) => {
///         for dev in devices {
///             let (major, minor) = dev.compute_capability()?;
///             println!("{}: {} (sm_{major}{minor})", dev.ordinal(), dev.name()?);
///         }
///     }
///     Err(e) if e.is_no_device() => println!("no CUDA device: {e}"),
///     Err(e) => return Err(e),
/// }
/// # Ok(()) }
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Device {
    ordinal: i32,
}

/// Free and total device memory in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryInfo {
    /// Bytes free now (other processes' use included).
    pub free: usize,
    /// Bytes of device memory in all.
    pub total: usize,
}

impl Device {
    /// How many CUDA devices there are. Without a driver or a device this is
    /// `Err(Error::NoDevice)`, never a panic or a loader failure.
    pub fn count() -> Result<usize> {
        let mut n = 0;
        check(
            // SAFETY: `n` is a valid out-pointer for the duration of the call.
            unsafe { sys::cudaGetDeviceCount(&mut n) },
            "cudaGetDeviceCount",
        )?;
        Ok(n.max(0) as usize)
    }

    /// Device `ordinal`; an ordinal past the count is `Error::InvalidArgument`.
    pub fn get(ordinal: usize) -> Result<Device> {
        let n = Device::count()?;
        if ordinal >= n {
            return Err(Error::invalid(
                "Device::get",
                format!("device {ordinal} requested, but there are {n} devices"),
            ));
        }
        Ok(Device {
            ordinal: ordinal as i32,
        })
    }

    /// Every device.
    pub fn all() -> Result<Vec<Device>> {
        Ok((0..Device::count()?)
            .map(|i| Device { ordinal: i as i32 })
            .collect())
    }

    /// The device of `ordinal`, known to exist (another library's context is on it).
    #[cfg(feature = "cudarc-any")]
    pub(crate) fn existing(ordinal: usize) -> Device {
        Device {
            ordinal: i32::try_from(ordinal).unwrap_or(i32::MAX),
        }
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal as usize
    }

    pub(crate) fn raw(&self) -> i32 {
        self.ordinal
    }

    /// Makes this the current device of the calling thread (`cudaSetDevice`).
    pub fn make_current(&self) -> Result<()> {
        // SAFETY: plain call with a value argument.
        check_with(
            unsafe { sys::cudaSetDevice(self.ordinal) },
            "cudaSetDevice",
            || format!("device {}", self.ordinal),
        )
    }

    fn attribute(&self, attr: sys::cudaDeviceAttr) -> Result<i32> {
        let mut v = 0;
        check_with(
            // SAFETY: `v` is a valid out-pointer; `attr` is a valid enumerator.
            unsafe { sys::cudaDeviceGetAttribute(&mut v, attr, self.ordinal) },
            "cudaDeviceGetAttribute",
            || format!("{attr:?}, device {}", self.ordinal),
        )?;
        Ok(v)
    }

    fn properties(&self) -> Result<sys::cudaDeviceProp> {
        let mut prop = std::mem::MaybeUninit::<sys::cudaDeviceProp>::zeroed();
        check_with(
            // SAFETY: the struct comes from the same headers as the linked runtime (bindgen at build
            // time), so its layout matches; the runtime fills it in.
            unsafe { sys::cudaGetDeviceProperties(prop.as_mut_ptr(), self.ordinal) },
            "cudaGetDeviceProperties",
            || format!("device {}", self.ordinal),
        )?;
        // SAFETY: zero-initialised and then written by the runtime; all fields are plain data.
        Ok(unsafe { prop.assume_init() })
    }

    /// The marketing name, e.g. "NVIDIA H100 80GB HBM3".
    pub fn name(&self) -> Result<String> {
        let prop = self.properties()?;
        let bytes: Vec<u8> = prop
            .name
            .iter()
            .take_while(|&&c| c != 0)
            .map(|&c| c as u8)
            .collect();
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// Compute capability (major, minor), e.g. (9, 0) for Hopper.
    pub fn compute_capability(&self) -> Result<(u32, u32)> {
        use sys::cudaDeviceAttr as A;
        Ok((
            self.attribute(A::cudaDevAttrComputeCapabilityMajor)? as u32,
            self.attribute(A::cudaDevAttrComputeCapabilityMinor)? as u32,
        ))
    }

    /// Number of streaming multiprocessors.
    pub fn multiprocessor_count(&self) -> Result<u32> {
        Ok(self.attribute(sys::cudaDeviceAttr::cudaDevAttrMultiProcessorCount)? as u32)
    }

    /// Number of asynchronous copy engines (2 or more: H2D and D2H can run at once).
    pub fn async_engine_count(&self) -> Result<u32> {
        Ok(self.attribute(sys::cudaDeviceAttr::cudaDevAttrAsyncEngineCount)? as u32)
    }

    /// L2 cache size in bytes.
    pub fn l2_cache_bytes(&self) -> Result<usize> {
        Ok(self.attribute(sys::cudaDeviceAttr::cudaDevAttrL2CacheSize)? as usize)
    }

    /// Total device memory in bytes (no context is created for this).
    pub fn total_memory(&self) -> Result<usize> {
        Ok(self.properties()?.totalGlobalMem)
    }

    /// Free and total memory right now (creates the device's context if needed).
    pub fn memory_info(&self) -> Result<MemoryInfo> {
        self.make_current()?;
        let (mut free, mut total) = (0usize, 0usize);
        check(
            // SAFETY: valid out-pointers; the device is current.
            unsafe { sys::cudaMemGetInfo(&mut free, &mut total) },
            "cudaMemGetInfo",
        )?;
        Ok(MemoryInfo { free, total })
    }

    /// Whether pinned host memory can be mapped into the device's address space.
    pub fn can_map_host_memory(&self) -> Result<bool> {
        Ok(self.attribute(sys::cudaDeviceAttr::cudaDevAttrCanMapHostMemory)? != 0)
    }

    /// The driver's CUDA version; `None` when no driver is installed.
    pub fn driver_version() -> Result<Option<Version>> {
        let mut v = 0;
        check(
            // SAFETY: valid out-pointer.
            unsafe { sys::cudaDriverGetVersion(&mut v) },
            "cudaDriverGetVersion",
        )?;
        Ok((v > 0).then(|| Version::from_cuda(v)))
    }

    /// The NVIDIA kernel module's release (e.g. "580.159.04"), where sysfs or procfs shows it.
    pub fn driver_release() -> Option<String> {
        crate::driver::release()
    }

    /// The version of the CUDA runtime linked into this program. Works without a driver or
    /// device: where the runtime will not say (CUDA 11.8's reports `cudaErrorNoDevice` when it
    /// finds a `libcuda` but no GPU), it is the [`CUDART_VERSION`] the build linked.
    pub fn runtime_version() -> Result<Version> {
        let mut v = 0;
        // SAFETY: valid out-pointer.
        let err = unsafe { sys::cudaRuntimeGetVersion(&mut v) };
        if err != sys::cudaError::cudaSuccess || v <= 0 {
            crate::error::clear_last_error();
            v = i32::try_from(CUDART_VERSION).unwrap_or(i32::MAX);
        }
        Ok(Version::from_cuda(v))
    }

    /// The range of stream priorities as (least, greatest); greater priority is the lower number.
    pub fn stream_priority_range(&self) -> Result<(i32, i32)> {
        self.make_current()?;
        let (mut least, mut greatest) = (0, 0);
        check(
            // SAFETY: valid out-pointers; the device is current.
            unsafe { sys::cudaDeviceGetStreamPriorityRange(&mut least, &mut greatest) },
            "cudaDeviceGetStreamPriorityRange",
        )?;
        Ok((least, greatest))
    }

    /// Whether this device can read and write `peer`'s memory directly, over NVLink or PCIe
    /// (`cudaDeviceCanAccessPeer`): then [`Stream::copy_peer`](crate::Stream::copy_peer) between them works, at the
    /// speed of that link. A device always reaches its own memory (`true` for `self`).
    /// The answer can differ between the two directions of a pair.
    ///
    /// ```no_run
    /// use pinstream::Device;
    /// # fn main() -> pinstream::Result<()> {
    /// let (a, b) = (Device::get(0)?, Device::get(1)?);
    /// println!("0 -> 1: {}, 1 -> 0: {}", a.can_access_peer(&b)?, b.can_access_peer(&a)?);
    /// # Ok(()) }
    /// ```
    pub fn can_access_peer(&self, peer: &Device) -> Result<bool> {
        if self == peer {
            return Ok(true);
        }
        let mut v = 0;
        check_with(
            // SAFETY: `v` is a valid out-pointer; both ordinals are plain values (the runtime
            // checks them).
            unsafe { sys::cudaDeviceCanAccessPeer(&mut v, self.ordinal, peer.ordinal) },
            "cudaDeviceCanAccessPeer",
            || format!("device {}, peer {}", self.ordinal, peer.ordinal),
        )?;
        Ok(v != 0)
    }

    /// Lets this device access `peer`'s memory directly (`cudaDeviceEnablePeerAccess` with this
    /// device current), once per ordered pair and process: the result is kept in a
    /// process-wide table, and access that other code already enabled
    /// (`cudaErrorPeerAccessAlreadyEnabled`) counts as enabled. [`Stream::copy_peer`](crate::Stream::copy_peer) calls it
    /// for the stream's device and the other buffer's; call it yourself to pay its cost (the
    /// driver maps `peer`'s allocations into this device's address space) before the first
    /// copy. Access is one-way: `b.enable_peer_access(&a)` is a separate call. A no-op for
    /// `self`.
    ///
    /// Where the devices cannot reach each other this is [`Error::NoPeerAccess`] (remembered:
    /// asking again costs nothing). Access enabled here covers memory from `cudaMalloc`
    /// ([`DeviceBuffer::new`](crate::DeviceBuffer::new)), not the stream-ordered pool of
    /// [`DeviceBuffer::new_async`](crate::DeviceBuffer::new_async): copies from or to such
    /// buffers still work, through whatever path the driver picks.
    pub fn enable_peer_access(&self, peer: &Device) -> Result<()> {
        const OP: &str = "Device::enable_peer_access";
        if self == peer {
            return Ok(());
        }
        let key = (self.ordinal, peer.ordinal);
        // Held across the CUDA calls: a pair is enabled by one thread, once.
        let mut table = PEERS.lock().unwrap_or_else(|e| e.into_inner());
        let refused = |cuda| Error::NoPeerAccess {
            op: OP,
            device: self.ordinal,
            peer: peer.ordinal,
            cuda,
        };
        match table.get(&key) {
            Some(PeerAccess::Enabled) => return Ok(()),
            Some(PeerAccess::Impossible(cuda)) => return Err(refused(*cuda)),
            None => {}
        }
        if !self.can_access_peer(peer)? {
            table.insert(key, PeerAccess::Impossible(None));
            return Err(refused(None));
        }
        self.make_current()?;
        // SAFETY: plain call with value arguments; the device is current, flags must be 0.
        let err = unsafe { sys::cudaDeviceEnablePeerAccess(peer.ordinal, 0) };
        use sys::cudaError as E;
        match err {
            E::cudaSuccess => {}
            E::cudaErrorPeerAccessAlreadyEnabled => {
                // Enabled by other code in this process: what we wanted. The failed call left
                // its code as the thread's last error; clear it so no later check finds it.
                clear_last_error();
            }
            E::cudaErrorPeerAccessUnsupported | E::cudaErrorInvalidDevice => {
                // Not possible on this system (cudaErrorInvalidDevice is what the call returns
                // when cudaDeviceCanAccessPeer would say no).
                clear_last_error();
                let cuda = Some(CudaError::from_raw(err));
                table.insert(key, PeerAccess::Impossible(cuda));
                return Err(refused(cuda));
            }
            E::cudaErrorTooManyPeers => {
                // A limit of this process's state, not of the pair: not remembered.
                clear_last_error();
                return Err(refused(Some(CudaError::from_raw(err))));
            }
            other => check_with(other, "cudaDeviceEnablePeerAccess", || {
                format!("device {}, peer {}", self.ordinal, peer.ordinal)
            })?,
        }
        table.insert(key, PeerAccess::Enabled);
        Ok(())
    }

    /// Waits until all work on the device has finished (`cudaDeviceSynchronize`).
    pub fn synchronize(&self) -> Result<()> {
        self.make_current()?;
        // SAFETY: plain call; the device is current.
        check(
            unsafe { sys::cudaDeviceSynchronize() },
            "cudaDeviceSynchronize",
        )
    }
}

/// What `Device::enable_peer_access` found for an ordered pair (accessing device, owner).
#[derive(Clone, Copy, Debug)]
enum PeerAccess {
    Enabled,
    /// `cudaDeviceCanAccessPeer` said no (`None`), or the driver refused to enable it.
    Impossible(Option<CudaError>),
}

/// Peer access per ordered pair of ordinals, for the whole process (peer access belongs to the
/// devices' primary contexts, which every thread shares).
static PEERS: Mutex<BTreeMap<(i32, i32), PeerAccess>> = Mutex::new(BTreeMap::new());

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "cuda:{}", self.ordinal)
    }
}

/// Whether this machine can run CUDA work at all: a driver and at least one device.
pub fn available() -> bool {
    Device::count().is_ok_and(|n| n > 0)
}
