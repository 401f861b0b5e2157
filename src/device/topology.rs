//! Where a device sits: its PCI bus id, PCIe link (generation, width, speed), NUMA node and
//! local CPUs, read from sysfs, and the parsers for sysfs's link fields.

use std::ffi::CStr;
use std::fmt;
use std::path::{Path, PathBuf};

use super::Device;
use crate::error::{check_with, Result};
use crate::sys;

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

/// CPUs a `cpu_set_t` can name.
pub(crate) const SET_SIZE: usize = libc::CPU_SETSIZE as usize;

/// Parses a Linux CPU list such as `"0-15,32-47"` or `"3"`. `None` for anything else, an empty
/// list, or a CPU a `cpu_set_t` cannot hold.
pub(crate) fn parse_cpulist(s: &str) -> Option<Vec<usize>> {
    let mut cpus = Vec::new();
    for part in s.trim().split(',') {
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (
                a.trim().parse::<usize>().ok()?,
                b.trim().parse::<usize>().ok()?,
            ),
            None => {
                let c = part.trim().parse::<usize>().ok()?;
                (c, c)
            }
        };
        if lo > hi || hi >= SET_SIZE {
            return None;
        }
        cpus.extend(lo..=hi);
    }
    cpus.sort_unstable();
    cpus.dedup();
    (!cpus.is_empty()).then_some(cpus)
}

impl Device {
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
        parse_cpulist(&s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpulists_parse() {
        assert_eq!(parse_cpulist("0-3"), Some(vec![0, 1, 2, 3]));
        assert_eq!(parse_cpulist("5\n"), Some(vec![5]));
        assert_eq!(parse_cpulist("0-1,8-9,4"), Some(vec![0, 1, 4, 8, 9]));
        assert_eq!(parse_cpulist("2,2,1-2"), Some(vec![1, 2]));
        for bad in ["", " ", "3-1", "a", "1-", "0-99999", "1,,2"] {
            assert_eq!(parse_cpulist(bad), None, "{bad:?}");
        }
    }
}
