//! `pinstream info`.

use clap::Args;
use pinstream::{Device, Result};
use serde::Serialize;

use crate::output::{self, Format};

const GIB: f64 = (1u64 << 30) as f64;

#[derive(Args, Debug)]
pub struct InfoArgs {
    /// Output format (csv: one line per device).
    #[arg(long, value_enum, ignore_case = true, default_value_t = Format::Table)]
    format: Format,
}

/// What `pinstream info` reports about the machine: the JSON object, the table's first line.
#[derive(Debug, Serialize)]
struct InfoReport {
    /// This program's version.
    pinstream: &'static str,
    /// The CUDA runtime linked in, e.g. "13.0".
    runtime: String,
    /// The CUDA version the driver supports, e.g. "13.0"; `None` without a driver.
    driver: Option<String>,
    /// The NVIDIA kernel module's release, e.g. "580.95.05", where the system shows it.
    driver_release: Option<String>,
    devices: Vec<DeviceRow>,
}

/// One device: a block of the table, a line of the CSV, an element of the JSON's `devices`.
#[derive(Debug, Serialize)]
struct DeviceRow {
    ordinal: usize,
    name: String,
    /// e.g. "9.0".
    compute_capability: String,
    multiprocessors: u32,
    memory_total_bytes: usize,
    memory_free_bytes: usize,
    l2_cache_bytes: usize,
    copy_engines: u32,
    pci_bus_id: String,
    numa_node: Option<i32>,
    /// e.g. "Gen5 x16 (max Gen5 x16)", where sysfs shows it.
    pcie_link: Option<String>,
    /// Decimal GB/s per direction of the current link, where known.
    pcie_gbps: Option<f64>,
}

fn device_row(dev: Device) -> Result<DeviceRow> {
    let (major, minor) = dev.compute_capability()?;
    let mem = dev.memory_info()?;
    let link = dev.pcie_link();
    Ok(DeviceRow {
        ordinal: dev.ordinal(),
        name: dev.name()?,
        compute_capability: format!("{major}.{minor}"),
        multiprocessors: dev.multiprocessor_count()?,
        memory_total_bytes: mem.total,
        memory_free_bytes: mem.free,
        l2_cache_bytes: dev.l2_cache_bytes()?,
        copy_engines: dev.async_engine_count()?,
        pci_bus_id: dev.pci_bus_id()?,
        numa_node: dev.numa_node(),
        pcie_link: link.map(|l| l.to_string()),
        pcie_gbps: link.and_then(|l| l.current_gbps()),
    })
}

fn report() -> Result<InfoReport> {
    let devices = Device::all()?;
    Ok(InfoReport {
        pinstream: env!("CARGO_PKG_VERSION"),
        runtime: Device::runtime_version()?.to_string(),
        driver: Device::driver_version()?.map(|v| v.to_string()),
        driver_release: Device::driver_release(),
        devices: devices.into_iter().map(device_row).collect::<Result<_>>()?,
    })
}

fn table(r: &InfoReport) -> String {
    let driver = match (&r.driver, &r.driver_release) {
        (None, _) => "none".to_string(),
        (Some(v), None) => v.clone(),
        (Some(v), Some(rel)) => format!("{v} ({rel})"),
    };
    let mut lines = vec![format!(
        "pinstream {}: CUDA runtime {} (linked statically), driver {driver}, {} device(s)",
        r.pinstream,
        r.runtime,
        r.devices.len()
    )];
    for d in &r.devices {
        lines.push(format!("device {}: {}", d.ordinal, d.name));
        lines.push(format!(
            "  compute capability  {}, {} SMs",
            d.compute_capability, d.multiprocessors
        ));
        lines.push(format!(
            "  memory              {:.1} GiB total, {:.1} GiB free, L2 {} MiB",
            d.memory_total_bytes as f64 / GIB,
            d.memory_free_bytes as f64 / GIB,
            d.l2_cache_bytes >> 20
        ));
        lines.push(format!("  copy engines        {}", d.copy_engines));
        let numa = d
            .numa_node
            .map_or_else(|| "unknown".to_string(), |n| n.to_string());
        lines.push(format!(
            "  PCI bus id          {} (NUMA node {numa})",
            d.pci_bus_id
        ));
        lines.push(match &d.pcie_link {
            Some(link) => {
                let rate = d
                    .pcie_gbps
                    .map_or_else(String::new, |g| format!(", {g:.1} GB/s per direction"));
                format!("  PCIe link           {link}{rate}")
            }
            None => "  PCIe link           unknown (sysfs does not show it)".to_string(),
        });
    }
    let mut s = lines.join("\n");
    s.push('\n');
    s
}

pub fn run(args: InfoArgs) -> Result<()> {
    // The driver lines come first: where there is no usable driver they are the answer.
    if args.format == Format::Table {
        let status = pinstream::driver::driver_status();
        println!("pinstream {}", env!("CARGO_PKG_VERSION"));
        println!("  driver              {}", status.driver_line());
        println!("  this build          {}", status.needs_line());
        if let Some(advice) = status.advice() {
            println!("{advice}");
        }
    }
    let r = report()?;
    match args.format {
        Format::Table => print!("{}", table(&r)),
        Format::Csv => print!("{}", output::csv(&r.devices)?),
        Format::Json => print!("{}", output::json(&r)?),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> InfoReport {
        InfoReport {
            pinstream: "0.1.0",
            runtime: "13.0".into(),
            driver: Some("13.0".into()),
            driver_release: Some("580.95.05".into()),
            devices: vec![DeviceRow {
                ordinal: 0,
                name: "NVIDIA H100 80GB HBM3".into(),
                compute_capability: "9.0".into(),
                multiprocessors: 132,
                memory_total_bytes: 85 << 30,
                memory_free_bytes: 84 << 30,
                l2_cache_bytes: 50 << 20,
                copy_engines: 3,
                pci_bus_id: "0000:19:00.0".into(),
                numa_node: None,
                pcie_link: Some("Gen5 x16".into()),
                pcie_gbps: Some(63.0),
            }],
        }
    }

    #[test]
    fn table_lines() {
        let t = table(&sample());
        assert_eq!(
            t,
            "pinstream 0.1.0: CUDA runtime 13.0 (linked statically), driver 13.0 (580.95.05), 1 device(s)\n\
             device 0: NVIDIA H100 80GB HBM3\n  \
             compute capability  9.0, 132 SMs\n  \
             memory              85.0 GiB total, 84.0 GiB free, L2 50 MiB\n  \
             copy engines        3\n  \
             PCI bus id          0000:19:00.0 (NUMA node unknown)\n  \
             PCIe link           Gen5 x16, 63.0 GB/s per direction\n"
        );
    }

    #[test]
    fn json_and_csv_share_the_fields() {
        let r = sample();
        let v: serde_json::Value = serde_json::from_str(&output::json(&r).unwrap()).unwrap();
        assert_eq!(v["driver_release"], "580.95.05");
        assert_eq!(v["devices"][0]["multiprocessors"], 132);
        assert!(v["devices"][0]["numa_node"].is_null());
        let csv = output::csv(&r.devices).unwrap();
        let header = csv.lines().next().unwrap();
        let dev = v["devices"][0].as_object().unwrap();
        assert_eq!(header.split(',').count(), dev.len());
        for name in header.split(',') {
            assert!(dev.contains_key(name), "{name}");
        }
    }
}
