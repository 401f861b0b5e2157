//! The runtime's CPU side: PCIe link and version parsing, driver advice, error formatting, and
//! — on a machine without a GPU — that every entry point reports `NoDevice`. CPU trials: run
//! everywhere.

use crate::common::{ensure, R};
use crate::discovery::scratch;
use libtest_mimic::Trial;
use pinstream::device::PcieLink;
use pinstream::driver::{DriverStatus, DriverVerdict};
use pinstream::{Device, Error, Version};

use crate::common::trial;

/// Prefix of this module's trial names (its path in the binary).
const PREFIX: &str = "runtime/";

/// The trials of this module, named `runtime/...`.
pub fn trials() -> Vec<Trial> {
    let has_gpu = pinstream::available();
    let t = |name: &str, f: fn() -> R| trial(PREFIX, name, f);
    vec![
        t("device/pcie_link_parsing", pcie_link_parsing),
        t("device/version_decoding", version_decoding),
        t("driver/old_driver_advice", old_driver_advice),
        t("driver/no_driver_advice", no_driver_advice),
        t(
            "driver/sufficient_driver_and_floors",
            sufficient_driver_and_floors,
        ),
        t("error/formatting", error_formatting),
        // On a machine with a GPU these have nothing to check: ignored there, not passed.
        trial(
            PREFIX,
            "no_device/every_entry_point_reports_it",
            every_entry_point_reports_no_device,
        )
        .with_ignored_flag(has_gpu),
    ]
}

fn pcie_link_parsing() -> R {
    ensure(
        pinstream::device::parse_link_speed("32.0 GT/s PCIe\n") == Some(32.0),
        || "32 GT/s".into(),
    )?;
    ensure(
        pinstream::device::parse_link_speed("Unknown").is_none(),
        || "Unknown".into(),
    )?;
    ensure(
        pinstream::device::parse_link_speed("2.5 GT/s") == Some(2.5),
        || "2.5".into(),
    )?;
    for (gts, gen) in [
        (2.5, 1),
        (5.0, 2),
        (8.0, 3),
        (16.0, 4),
        (32.0, 5),
        (64.0, 6),
    ] {
        ensure(
            pinstream::device::pcie_gen_from_gts(gts) == Some(gen),
            || format!("{gts} GT/s"),
        )?;
    }
    ensure(pinstream::device::pcie_gen_from_gts(7.0).is_none(), || {
        "7 GT/s".into()
    })?;

    let dir = scratch("sysfs");
    std::fs::write(dir.join("current_link_speed"), "16.0 GT/s PCIe\n").expect("write");
    std::fs::write(dir.join("current_link_width"), "8\n").expect("write");
    std::fs::write(dir.join("max_link_speed"), "32.0 GT/s PCIe\n").expect("write");
    std::fs::write(dir.join("max_link_width"), "16\n").expect("write");
    let link = PcieLink::from_sysfs_dir(&dir).ok_or("no link read")?;
    ensure(
        link.current_gen == Some(4) && link.current_width == Some(8) && link.max_gen == Some(5),
        || format!("{link:?}"),
    )?;
    let max = link.max_gbps().ok_or("no max rate")?;
    ensure((max - 63.015).abs() < 0.01, || {
        format!("Gen5 x16 = {max} GB/s")
    })?;
    ensure(link.to_string() == "Gen4 x8 (max Gen5 x16)", || {
        link.to_string()
    })?;
    let empty = scratch("sysfs-empty");
    ensure(PcieLink::from_sysfs_dir(&empty).is_none(), || {
        "link from an empty folder".into()
    })
}

fn version_decoding() -> R {
    for (raw, want) in [
        (13000, "13.0"),
        (12080, "12.8"),
        (11040, "11.4"),
        (0, "0.0"),
    ] {
        let v = Version::from_cuda(raw).to_string();
        ensure(v == want, || format!("{raw} -> {v}"))?;
    }
    ensure(
        Version::from_cuda(12080) < Version::from_cuda(13000),
        || "ordering".into(),
    )
}

/// Every needle in `text`, or a failure naming the first one missing.
fn contains_all(what: &str, text: &str, needles: &[&str]) -> R {
    for needle in needles {
        ensure(text.contains(needle), || {
            format!("{what}: missing {needle:?} in:\n{text}")
        })?;
    }
    Ok(())
}

fn old_driver_advice() -> R {
    let s = DriverStatus::from_parts(12040, Some("550.54.15".into()), 13000);
    ensure(s.verdict() == DriverVerdict::TooOld, || format!("{s:?}"))?;
    let advice = s
        .advice()
        .ok_or("no advice for a 12.4 driver and a 13.0 runtime")?;
    contains_all(
        "old driver",
        &advice,
        &[
            "550.54.15",
            "CUDA up to 12.4",
            "CUDA 13.0 runtime",
            "r580 or newer",
            "update the NVIDIA driver",
            "CUDA_HOME",
            "CUDA 12.x toolkit",
        ],
    )?;
    contains_all(
        "status",
        &s.to_string(),
        &[
            "driver: 550.54.15, supports CUDA 12.4",
            "this build: CUDA 13.0",
            "Ways out",
        ],
    )?;
    // An 11.x driver with a 12.x build.
    let s = DriverStatus::from_parts(11080, None, 12080);
    let advice = s.advice().ok_or("no advice for 11.8 / 12.8")?;
    contains_all("11.8 driver", &advice, &["r525", "CUDA 11.x toolkit"])
}

fn no_driver_advice() -> R {
    let s = DriverStatus::from_parts(0, None, 13000);
    ensure(s.verdict() == DriverVerdict::NoDriver, || format!("{s:?}"))?;
    let advice = s.advice().ok_or("no advice without a driver")?;
    contains_all(
        "no driver",
        &advice,
        &[
            "no NVIDIA driver is installed",
            "r580 or newer",
            "CUDA_HOME",
        ],
    )?;
    ensure(
        s.driver_line().contains("no NVIDIA driver is installed"),
        || s.driver_line(),
    )?;
    // libcuda without the kernel module (a toolkit package pulled it in): still no driver.
    let mut s = DriverStatus::from_parts(12020, None, 13000);
    s.kernel_driver = false;
    ensure(s.verdict() == DriverVerdict::NoDriver, || format!("{s:?}"))?;
    let advice = s.advice().ok_or("no advice without a kernel module")?;
    contains_all(
        "no kernel module",
        &advice,
        &[
            "no NVIDIA driver is installed",
            "kernel module",
            "CUDA_HOME",
        ],
    )?;
    // The kernel module without libcuda (a container without the driver's libraries).
    let s = DriverStatus::from_parts(0, Some("580.95.05".into()), 13000);
    let advice = s.advice().ok_or("no advice without libcuda")?;
    contains_all(
        "no libcuda",
        &advice,
        &["580.95.05", "libcuda", "CUDA_HOME"],
    )
}

fn sufficient_driver_and_floors() -> R {
    for (driver, runtime) in [
        (13000, 13000),
        (13020, 13000),
        (12040, 12080),
        (13000, 11080),
    ] {
        let s = DriverStatus::from_parts(driver, Some("580.95.05".into()), runtime);
        ensure(
            s.verdict() == DriverVerdict::Sufficient && s.advice().is_none(),
            || format!("{driver} / {runtime}: {s:?}"),
        )?;
    }
    for (runtime, floor) in [(11080, Some(450)), (12000, Some(525)), (12090, Some(525))] {
        let got = pinstream::driver::driver_floor(Version::from_cuda(runtime));
        ensure(got == floor, || format!("{runtime}: {got:?}"))?;
    }
    ensure(
        pinstream::driver::driver_floor(Version::from_cuda(13000)) == Some(580),
        || "13.0".into(),
    )
}

fn error_formatting() -> R {
    let e = Error::LengthMismatch {
        op: "Stream::copy_h2d",
        src: 10,
        dst: 12,
    };
    ensure(
        e.to_string()
            == "Stream::copy_h2d: length mismatch: source has 10 elements, destination has 12",
        || e.to_string(),
    )?;
    let e = Error::WrongDevice {
        op: "Stream::record",
        expected: 0,
        found: 1,
    };
    ensure(
        e.to_string()
            .contains("stream is on device 0, the operand on device 1"),
        || e.to_string(),
    )?;
    let e = Error::InvalidArgument {
        op: "Device::get",
        reason: "device 3 requested, but there are 1 devices".into(),
    };
    ensure(
        e.to_string()
            .starts_with("Device::get: invalid argument: device 3"),
        || e.to_string(),
    )?;
    ensure(e.cuda().is_none() && !e.is_no_device(), || {
        "not a CUDA error".into()
    })?;
    // A boxed error keeps its message.
    let boxed: Box<dyn std::error::Error> = Box::new(e.clone());
    ensure(boxed.to_string() == e.to_string(), || boxed.to_string())
}

fn every_entry_point_reports_no_device() -> R {
    let e = Device::count().err();
    ensure(matches!(e, Some(Error::NoDevice { .. })), || {
        format!("count: {e:?}")
    })?;
    let first = e.ok_or("no error")?;
    let msg = first.to_string();
    ensure(
        msg.contains("cudaGetDeviceCount") && msg.contains("cudaError"),
        || msg.clone(),
    )?;
    ensure(first.is_no_device() && first.cuda().is_some(), || {
        format!("{first:?}")
    })?;
    println!("{msg}");
    let e = Device::get(0).err();
    ensure(matches!(e, Some(Error::NoDevice { .. })), || {
        format!("get: {e:?}")
    })?;
    let e = Device::all().err();
    ensure(matches!(e, Some(Error::NoDevice { .. })), || {
        format!("all: {e:?}")
    })?;
    ensure(!pinstream::available(), || "available".into())?;
    // The runtime's own version needs no driver.
    let rt = Device::runtime_version()?;
    ensure(
        rt == Version::from_cuda(pinstream::CUDART_VERSION as i32),
        || format!("runtime {rt}"),
    )?;
    // The error carries the driver's status and says what to do.
    let status = first
        .driver_status()
        .ok_or("NoDevice without a driver status")?;
    let drv = Device::driver_version()?;
    ensure(status.driver == drv || status.faked, || {
        format!("driver {drv:?} vs {status:?}")
    })?;
    if status.verdict() != DriverVerdict::Sufficient {
        contains_all("NoDevice", &msg, &["Ways out", "CUDA_HOME", "driver"])?;
    }
    Ok(())
}
