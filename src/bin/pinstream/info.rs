//! `pinstream info`.

use pinstream::{Device, Result};

const GIB: f64 = (1u64 << 30) as f64;

pub fn run() -> Result<()> {
    let devices = Device::all()?;
    let runtime = Device::runtime_version()?;
    let driver = match (Device::driver_version()?, Device::driver_release()) {
        (None, _) => "none".to_string(),
        (Some(v), None) => v.to_string(),
        (Some(v), Some(r)) => format!("{v} ({r})"),
    };
    println!(
        "pinstream {}: CUDA runtime {runtime} (linked statically), driver {driver}, {} device(s)",
        env!("CARGO_PKG_VERSION"),
        devices.len()
    );
    for dev in devices {
        let (major, minor) = dev.compute_capability()?;
        let mem = dev.memory_info()?;
        println!("device {}: {}", dev.ordinal(), dev.name()?);
        println!(
            "  compute capability  {major}.{minor}, {} SMs",
            dev.multiprocessor_count()?
        );
        println!(
            "  memory              {:.1} GiB total, {:.1} GiB free, L2 {} MiB",
            mem.total as f64 / GIB,
            mem.free as f64 / GIB,
            dev.l2_cache_bytes()? >> 20
        );
        println!("  copy engines        {}", dev.async_engine_count()?);
        let numa = dev
            .numa_node()
            .map_or_else(|| "unknown".to_string(), |n| n.to_string());
        println!(
            "  PCI bus id          {} (NUMA node {numa})",
            dev.pci_bus_id()?
        );
        match dev.pcie_link() {
            Some(link) => {
                let rate = link
                    .current_gbps()
                    .map_or_else(String::new, |g| format!(", {g:.1} GB/s per direction"));
                println!("  PCIe link           {link}{rate}");
            }
            None => println!("  PCIe link           unknown (sysfs does not show it)"),
        }
    }
    Ok(())
}
