//! `Device`: which GPUs there are and what they are — SMs, memory, copy engines, PCI location
//! and link, driver and runtime versions.

use std::collections::BTreeMap;
use std::ffi::CStr;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::error::{check, check_with, clear_last_error, CudaError, Error, Result};
use crate::stream::Stream;
use crate::sys;

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

/// A CUDA version such as 13.0 (the runtime reports 13000).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version {
    /// The major version, 13 in 13.0.
    pub major: u32,
    /// The minor version, 0 in 13.0.
    pub minor: u32,
}

impl Version {
    /// From the runtime's encoding, `1000 * major + 10 * minor`.
    pub fn from_cuda(v: i32) -> Version {
        let v = v.max(0) as u32;
        Version {
            major: v / 1000,
            minor: (v % 1000) / 10,
        }
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// Free and total device memory in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryInfo {
    /// Bytes free now (other processes' use included).
    pub free: usize,
    /// Bytes of device memory in all.
    pub total: usize,
}

/// The PCIe link of a device as Linux reports it in sysfs. Each field is `None` where the file
/// is missing or unreadable (virtual machines, other platforms).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PcieLink {
    /// Transfer rate per lane in GT/s (e.g. 32.0 for Gen5).
    pub current_speed_gts: Option<f64>,
    /// PCIe generation of the current speed (1 to 6).
    pub current_gen: Option<u32>,
    /// Lanes in use now (e.g. 16).
    pub current_width: Option<u32>,
    /// The fastest rate per lane in GT/s that the link supports.
    pub max_speed_gts: Option<f64>,
    /// PCIe generation of the fastest speed.
    pub max_gen: Option<u32>,
    /// The most lanes the link supports.
    pub max_width: Option<u32>,
}

impl PcieLink {
    /// Reads `current_link_speed`, `current_link_width`, `max_link_speed`, `max_link_width` from
    /// a sysfs PCI device folder. `None` when none of them could be read.
    pub fn from_sysfs_dir(dir: &Path) -> Option<PcieLink> {
        let read = |name: &str| std::fs::read_to_string(dir.join(name)).ok();
        let speed = |name: &str| read(name).and_then(|s| parse_link_speed(&s));
        let width = |name: &str| {
            read(name)
                .and_then(|s| s.trim().parse::<u32>().ok())
                .filter(|w| *w > 0)
        };
        let link = PcieLink {
            current_speed_gts: speed("current_link_speed"),
            current_gen: speed("current_link_speed").and_then(pcie_gen_from_gts),
            current_width: width("current_link_width"),
            max_speed_gts: speed("max_link_speed"),
            max_gen: speed("max_link_speed").and_then(pcie_gen_from_gts),
            max_width: width("max_link_width"),
        };
        (link != PcieLink::default()).then_some(link)
    }

    /// The theoretical data rate of the current link in one direction, in GB/s (10^9 bytes),
    /// after line encoding: Gen5 x16 gives 63.0.
    pub fn current_gbps(&self) -> Option<f64> {
        Some(lane_gbps(self.current_gen?)? * f64::from(self.current_width?))
    }

    /// The same for the link's maximum generation and width.
    pub fn max_gbps(&self) -> Option<f64> {
        Some(lane_gbps(self.max_gen?)? * f64::from(self.max_width?))
    }
}

impl fmt::Display for PcieLink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fn part(gen: Option<u32>, width: Option<u32>) -> String {
            let g = gen.map_or("?".to_string(), |g| g.to_string());
            let w = width.map_or("?".to_string(), |w| w.to_string());
            format!("Gen{g} x{w}")
        }
        write!(
            f,
            "{} (max {})",
            part(self.current_gen, self.current_width),
            part(self.max_gen, self.max_width)
        )
    }
}

/// "32.0 GT/s PCIe" -> 32.0; "Unknown" -> None.
pub fn parse_link_speed(s: &str) -> Option<f64> {
    let num = s.split_whitespace().next()?;
    let v: f64 = num.parse().ok()?;
    (v > 0.0).then_some(v)
}

/// Per-lane transfer rate in GT/s to PCIe generation (2.5 -> 1 ... 64 -> 6).
pub fn pcie_gen_from_gts(gts: f64) -> Option<u32> {
    const GENS: [(f64, u32); 7] = [
        (2.5, 1),
        (5.0, 2),
        (8.0, 3),
        (16.0, 4),
        (32.0, 5),
        (64.0, 6),
        (128.0, 7),
    ];
    GENS.iter()
        .find(|(r, _)| (gts - r).abs() < 0.01)
        .map(|(_, g)| *g)
}

/// GB/s per lane and direction after encoding (8b/10b to Gen2, 128b/130b from Gen3, FLIT from Gen6).
fn lane_gbps(gen: u32) -> Option<f64> {
    Some(match gen {
        1 => 2.5 * 0.8 / 8.0,
        2 => 5.0 * 0.8 / 8.0,
        3 => 8.0 * 128.0 / 130.0 / 8.0,
        4 => 16.0 * 128.0 / 130.0 / 8.0,
        5 => 32.0 * 128.0 / 130.0 / 8.0,
        6 => 64.0 * 242.0 / 256.0 / 8.0,
        7 => 128.0 * 242.0 / 256.0 / 8.0,
        _ => return None,
    })
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

    /// The PCI bus id in sysfs form, e.g. "0000:3b:00.0".
    pub fn pci_bus_id(&self) -> Result<String> {
        let mut buf = [0 as std::os::raw::c_char; 64];
        check_with(
            // SAFETY: the buffer is writable for its full length, which is passed.
            unsafe { sys::cudaDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as i32, self.ordinal) },
            "cudaDeviceGetPCIBusId",
            || format!("device {}", self.ordinal),
        )?;
        // SAFETY: the runtime wrote a NUL-terminated string into the (zeroed) buffer.
        let id = unsafe { CStr::from_ptr(buf.as_ptr()) };
        Ok(id.to_string_lossy().to_ascii_lowercase())
    }

    fn sysfs_dir(&self) -> Option<PathBuf> {
        let id = self.pci_bus_id().ok()?;
        Some(Path::new("/sys/bus/pci/devices").join(id))
    }

    /// The PCIe link (generation and width, current and maximum), where sysfs shows it.
    pub fn pcie_link(&self) -> Option<PcieLink> {
        PcieLink::from_sysfs_dir(&self.sysfs_dir()?)
    }

    /// The NUMA node the device hangs off, where sysfs shows it (-1 there means none).
    pub fn numa_node(&self) -> Option<i32> {
        let s = std::fs::read_to_string(self.sysfs_dir()?.join("numa_node")).ok()?;
        s.trim().parse().ok().filter(|n: &i32| *n >= 0)
    }

    /// The CPUs next to the device (sysfs `local_cpulist`), where sysfs shows them.
    pub fn local_cpus(&self) -> Option<Vec<usize>> {
        let s = std::fs::read_to_string(self.sysfs_dir()?.join("local_cpulist")).ok()?;
        crate::affinity::parse_cpulist(&s)
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
        if let Ok(v) = std::fs::read_to_string("/sys/module/nvidia/version") {
            let v = v.trim();
            if !v.is_empty() {
                return Some(v.to_string());
            }
        }
        // "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  <date>"
        let text = std::fs::read_to_string("/proc/driver/nvidia/version").ok()?;
        let line = text.lines().next()?;
        let after = line.split("Kernel Module").nth(1)?;
        after.split_whitespace().next().map(str::to_string)
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
    /// (`cudaDeviceCanAccessPeer`): then [`Stream::copy_peer`] between them works, at the
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
    /// (`cudaErrorPeerAccessAlreadyEnabled`) counts as enabled. [`Stream::copy_peer`] calls it
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

    /// A new non-blocking stream on this device at default priority.
    pub fn stream(&self) -> Result<Stream> {
        Stream::new(self)
    }

    /// Gives the device memory that pinstream's stream-ordered pool keeps for reuse (freed
    /// [`DeviceBuffer::new_async`](crate::DeviceBuffer::new_async) buffers, DLPack tensors
    /// released by their consumers) back to the driver, as `torch.cuda.empty_cache()` does
    /// for PyTorch's allocator. Memory still in use, or whose free is still queued on a
    /// stream, stays. pinstream's own allocations ([`DeviceBuffer::new`](crate::DeviceBuffer::new)
    /// and `new_async`) trim the pool themselves before they report [`Error::OutOfMemory`];
    /// other libraries' allocators (PyTorch's, cudarc's) do not: call this where they need the
    /// room.
    pub fn empty_cache(&self) -> Result<()> {
        crate::memory::stream_pool::trim(self).map(drop)
    }

    /// Bytes pinstream's stream-ordered pool of this device holds from the driver now: in use
    /// and kept for reuse (0 before its first allocation).
    pub fn pool_reserved(&self) -> Result<u64> {
        crate::memory::stream_pool::reserved(self)
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

/// The CUDA runtime this program was built with and links statically: `CUDART_VERSION` of
/// the toolkit's `cuda_runtime_api.h` (13000 for 13.0), as the build script read it.
pub const CUDART_VERSION: u32 = parse_u32(env!("PINSTREAM_CUDART_VERSION"));

const fn parse_u32(s: &str) -> u32 {
    let b = s.as_bytes();
    let mut v = 0u32;
    let mut i = 0;
    while i < b.len() {
        v = v * 10 + (b[i] - b'0') as u32;
        i += 1;
    }
    v
}

/// The testing knob that replaces the driver's CUDA version in [`driver_status`]: e.g. `12040`
/// makes it report a driver for CUDA 12.4, `0` no driver at all. It changes only the diagnosis
/// (messages, `pinstream info`), never which driver the runtime uses, and exists so that the
/// old-driver and no-driver messages can be tested on any machine.
pub const FAKE_DRIVER_VERSION_VAR: &str = "PINSTREAM_FAKE_DRIVER_VERSION";

/// The oldest NVIDIA driver branch that runs programs built with CUDA runtime `runtime`, through
/// minor-version compatibility (any driver of the major version's first release): 450 for 11.x,
/// 525 for 12.x, 580 for 13.x. `None` for versions this crate does not know.
pub fn driver_floor(runtime: Version) -> Option<u32> {
    match runtime.major {
        11 => Some(450),
        12 => Some(525),
        13 => Some(580),
        _ => None,
    }
}

/// What a [`DriverStatus`] means for this program.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DriverVerdict {
    /// No NVIDIA driver is installed (the runtime finds no `libcuda`).
    NoDriver,
    /// A driver is installed, but it is older than this build's runtime needs.
    TooOld,
    /// The driver is new enough for this build.
    Sufficient,
}

/// The installed NVIDIA driver against what this build needs: the answer to "why does CUDA not
/// work here, and what do I do?". [`driver_status`] fills it in; `pinstream info` prints it and
/// [`Error::NoDevice`] carries it.
///
/// ```
/// let status = pinstream::DriverStatus::from_parts(12040, Some("550.54.15".into()), 13000);
/// assert_eq!(status.verdict(), pinstream::DriverVerdict::TooOld);
/// let advice = status.advice().unwrap_or_default();
/// assert!(advice.contains("r580") && advice.contains("CUDA_HOME"));
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DriverStatus {
    /// The newest CUDA version the installed driver supports (`cudaDriverGetVersion`), e.g. 12.4;
    /// `None` when no NVIDIA driver is installed.
    pub driver: Option<Version>,
    /// The NVIDIA kernel module's release, e.g. "580.95.05" (`/sys/module/nvidia/version`, else
    /// `/proc/driver/nvidia/version`); `None` where neither shows one.
    pub release: Option<String>,
    /// Whether the NVIDIA kernel driver is there: `/proc/driver/nvidia` or `/sys/module/nvidia`
    /// exists, or WSL's GPU device `/dev/dxg` (WSL has no NVIDIA kernel module). A `libcuda`
    /// without it (a toolkit package pulled in the user-space library) runs nothing.
    pub kernel_driver: bool,
    /// The CUDA runtime this program was built with and links ([`CUDART_VERSION`]).
    pub runtime: Version,
    /// The oldest driver branch that runs that runtime ([`driver_floor`]), e.g. 580 for 13.x.
    pub driver_floor: Option<u32>,
    /// Whether `driver` came from `PINSTREAM_FAKE_DRIVER_VERSION` ([`FAKE_DRIVER_VERSION_VAR`])
    /// rather than from the driver.
    pub faked: bool,
}

impl DriverStatus {
    /// From raw values: the driver's CUDA version as `cudaDriverGetVersion` encodes it (0 for
    /// none), the kernel module's release, and the runtime's `CUDART_VERSION`. Pure: for tests
    /// and for diagnosing another machine's figures. `kernel_driver` is taken to be there when
    /// either of the first two is; set the field to say otherwise.
    pub fn from_parts(driver: i32, release: Option<String>, runtime: u32) -> DriverStatus {
        let runtime = Version::from_cuda(i32::try_from(runtime).unwrap_or(i32::MAX));
        DriverStatus {
            driver: (driver > 0).then(|| Version::from_cuda(driver)),
            kernel_driver: driver > 0 || release.is_some(),
            release,
            runtime,
            driver_floor: driver_floor(runtime),
            faked: false,
        }
    }

    /// Whether the driver is missing (no `libcuda`, or no kernel driver), too old, or new
    /// enough. A driver runs every runtime of its own CUDA major version and older ones
    /// (minor-version compatibility), so 12.4 runs a 12.8 runtime but not a 13.0 one.
    pub fn verdict(&self) -> DriverVerdict {
        match self.driver {
            None => DriverVerdict::NoDriver,
            Some(_) if !self.kernel_driver => DriverVerdict::NoDriver,
            Some(d) if d.major < self.runtime.major => DriverVerdict::TooOld,
            Some(_) => DriverVerdict::Sufficient,
        }
    }

    /// "r580 or newer" for this build's runtime.
    fn floor_text(&self) -> String {
        match self.driver_floor {
            Some(f) => format!("r{f} or newer"),
            None => format!("one for CUDA {}.x or newer", self.runtime.major),
        }
    }

    /// "driver r580 or newer".
    fn needs(&self) -> String {
        format!("driver {}", self.floor_text())
    }

    /// One line on the installed driver: "580.95.05 (CUDA 13.0)", "CUDA 12.4", or "none".
    pub fn driver_line(&self) -> String {
        let fake = if self.faked {
            format!(" [faked by {FAKE_DRIVER_VERSION_VAR}]")
        } else {
            String::new()
        };
        match (&self.driver, &self.release) {
            (Some(v), _) if !self.kernel_driver => format!(
                "none: no NVIDIA kernel driver is loaded (libcuda for CUDA {v} is present){fake}"
            ),
            (None, None) => format!("none: no NVIDIA driver is installed{fake}"),
            (None, Some(r)) => format!(
                "none usable: kernel module {r} is loaded, but the runtime finds no libcuda{fake}"
            ),
            (Some(v), None) => format!("supports CUDA {v}{fake}"),
            (Some(v), Some(r)) => format!("{r}, supports CUDA {v}{fake}"),
        }
    }

    /// One line on what this build needs: "CUDA 13.0 runtime (linked statically), needs driver
    /// r580 or newer".
    pub fn needs_line(&self) -> String {
        format!(
            "CUDA {} runtime (linked statically), needs {}",
            self.runtime,
            self.needs()
        )
    }

    /// What to do, when the driver is missing or too old (`None` when it is new enough): the
    /// two ways out, updating (or installing) the driver, or building against an older toolkit
    /// with `CUDA_HOME`. Several lines, no trailing newline.
    pub fn advice(&self) -> Option<String> {
        let older = "build with CUDA_HOME pointing at an older CUDA toolkit (11.x runs on \
                     driver r450+, 12.x on r525+, 13.x on r580+; see pinstream's README)";
        match self.verdict() {
            DriverVerdict::Sufficient => None,
            DriverVerdict::NoDriver => {
                let what = match (&self.release, &self.driver) {
                    (None, Some(v)) => format!(
                        "no NVIDIA driver is installed: the NVIDIA kernel module is not loaded \
                         (no /proc/driver/nvidia), though a libcuda for CUDA {v} is present"
                    ),
                    (None, None) => "no NVIDIA driver is installed".to_string(),
                    (Some(r), _) => format!(
                        "no usable NVIDIA driver: the kernel module ({r}) is loaded but the \
                         runtime cannot load libcuda.so.1 (in a container: start it with the GPU \
                         and driver libraries, e.g. --gpus all)"
                    ),
                };
                Some(format!(
                    "{what}; this program was built with the CUDA {} runtime and needs {}.\n\
                     Ways out:\n  1. install an NVIDIA driver, {} (https://www.nvidia.com/drivers \
                     or your distribution's package); or\n  2. to run on an older driver you \
                     must keep, {older}.",
                    self.runtime,
                    self.needs(),
                    self.floor_text()
                ))
            }
            DriverVerdict::TooOld => {
                let d = self.driver.unwrap_or(self.runtime);
                let release = self
                    .release
                    .as_ref()
                    .map_or_else(String::new, |r| format!(" ({r})"));
                Some(format!(
                    "the installed NVIDIA driver{release} supports CUDA up to {d}, but this \
                     program was built with the CUDA {} runtime, which needs {}.\n\
                     Ways out:\n  1. update the NVIDIA driver to {} (https://www.nvidia.com/drivers \
                     or your distribution's package); or\n  2. build with CUDA_HOME pointing \
                     at a CUDA {}.x toolkit, which this driver runs (11.x runs on r450+, 12.x \
                     on r525+, 13.x on r580+; see pinstream's README).",
                    self.runtime,
                    self.needs(),
                    self.floor_text(),
                    d.major
                ))
            }
        }
    }
}

impl fmt::Display for DriverStatus {
    /// `driver: ...`, `this build: ...`, then the advice where there is any.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "driver: {}\nthis build: {}",
            self.driver_line(),
            self.needs_line()
        )?;
        if let Some(a) = self.advice() {
            write!(f, "\n{a}")?;
        }
        Ok(())
    }
}

/// The installed driver against what this build needs. Asks the runtime
/// (`cudaDriverGetVersion`, which works without a device) and sysfs / procfs for the release;
/// honours the testing knob [`FAKE_DRIVER_VERSION_VAR`]. Never fails.
pub fn driver_status() -> DriverStatus {
    let fake = std::env::var(FAKE_DRIVER_VERSION_VAR)
        .ok()
        .and_then(|v| v.trim().parse::<i32>().ok());
    let (driver, release) = match fake {
        // A faked version has no release: the machine's own would contradict it.
        Some(v) => (v, None),
        None => {
            let mut v = 0;
            // SAFETY: valid out-pointer. Not through `check`, whose no-device path calls this.
            let err = unsafe { sys::cudaDriverGetVersion(&mut v) };
            if err != sys::cudaError::cudaSuccess {
                crate::error::clear_last_error();
                v = 0;
            }
            (v, Device::driver_release())
        }
    };
    let mut status = DriverStatus::from_parts(driver, release, CUDART_VERSION);
    status.faked = fake.is_some();
    if fake.is_none() {
        status.kernel_driver = ["/proc/driver/nvidia", "/sys/module/nvidia", "/dev/dxg"]
            .iter()
            .any(|p| Path::new(p).exists());
    }
    status
}

/// Whether this machine can run CUDA work at all: a driver and at least one device.
pub fn available() -> bool {
    Device::count().is_ok_and(|n| n > 0)
}
