//! The driver against this build: the CUDA runtime linked in ([`CUDART_VERSION`]), the
//! installed driver's version and release, and the diagnosis ([`driver_status`]) that
//! [`Error::NoDevice`](crate::Error::NoDevice) and `pinstream info` print. Below `error.rs`: it
//! asks the runtime directly and never fails.

use std::fmt;
use std::path::Path;

use crate::sys;

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
/// [`Error::NoDevice`](crate::Error::NoDevice) carries it.
///
/// ```
/// use pinstream::driver::{DriverStatus, DriverVerdict};
/// let status = DriverStatus::from_parts(12040, Some("550.54.15".into()), 13000);
/// assert_eq!(status.verdict(), DriverVerdict::TooOld);
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
                     driver r450+, 12.x on r525+, 13.x on r580+; see pinstream's docs/toolkit.md)";
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
                     on r525+, 13.x on r580+; see pinstream's docs/toolkit.md).",
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
                clear_last_error();
                v = 0;
            }
            (v, release())
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

/// The NVIDIA kernel module's release (e.g. "580.159.04"), where sysfs or procfs shows it.
pub fn release() -> Option<String> {
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

/// Clears the runtime's sticky last error after a call whose failure is an answer here.
fn clear_last_error() {
    // SAFETY: plain call without arguments.
    unsafe {
        let _ = sys::cudaGetLastError();
    }
}
