//! `pinstream info`.

use pinstream::{Device, Result};

const GIB: f64 = (1u64 << 30) as f64;

pub fn run() -> Result<()> {
    // The driver lines come first: where there is no usable driver they are the answer.
    let status = pinstream::driver_status();
    println!("pinstream {}", env!("CARGO_PKG_VERSION"));
    println!("  driver              {}", status.driver_line());
    println!("  this build          {}", status.needs_line());
    if let Some(advice) = status.advice() {
        println!("{advice}");
    }
    let devices = Device::all()?;
    println!("{} device(s)", devices.len());
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
