//! CPU trials: run everywhere. Toolkit discovery (the build script's logic), parsing, error
//! formatting, and — on a machine without a GPU — that every entry point reports `NoDevice`.

#[path = "../build/toolkit.rs"]
#[allow(dead_code)]
mod toolkit;

mod common;

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use common::{ensure, R};
use libtest_mimic::{Arguments, Completion, Trial};
use pinstream::{Device, Error, HostAlloc, HostRegister, PcieLink, Version};
use toolkit::Source;

fn main() {
    let args = Arguments::from_args();
    let has_gpu = pinstream::available();
    let t = |name: &str, f: fn() -> R| Trial::test(name, f);
    let trials = vec![
        t(
            "toolkit/candidates_in_documented_order",
            candidates_in_documented_order,
        ),
        t(
            "toolkit/toolkit_at_checks_each_part",
            toolkit_at_checks_each_part,
        ),
        t(
            "toolkit/first_usable_candidate_wins",
            first_usable_candidate_wins,
        ),
        t(
            "toolkit/provisioned_dirs_and_target_dir",
            provisioned_dirs_and_target_dir,
        ),
        t("toolkit/no_provision_switch", no_provision_switch),
        t("toolkit/arch_list_parsing", arch_list_parsing),
        t(
            "toolkit/failure_messages_say_what_to_do",
            failure_messages_say_what_to_do,
        ),
        t("device/pcie_link_parsing", pcie_link_parsing),
        t("device/version_decoding", version_decoding),
        t("error/formatting", error_formatting),
        t("memory/flags", memory_flags),
        t("bench/stats_and_pattern", stats_and_pattern),
        t(
            "cli/program_found_beside_the_tests",
            program_found_beside_the_tests,
        ),
        cli("cli/normalize_cpu_writes_npy", normalize_cpu_writes_npy),
        cli("cli/normalize_report_formats", normalize_report_formats),
        cli(
            "cli/bandwidth_help_and_arguments",
            bandwidth_help_and_arguments,
        ),
        cli(
            "cli/no_arguments_prints_the_help",
            no_arguments_prints_the_help,
        ),
        cli(
            "cli/version_names_the_cuda_runtime",
            version_names_the_cuda_runtime,
        ),
        // On a machine with a GPU these have nothing to check: ignored there, not passed.
        Trial::test(
            "no_device/every_entry_point_reports_it",
            every_entry_point_reports_no_device,
        )
        .with_ignored_flag(has_gpu),
        cli(
            "no_device/info_exits_with_status_2",
            info_exits_with_status_2,
        )
        .with_ignored_flag(has_gpu),
    ];
    libtest_mimic::run(&args, trials).exit();
}

/// A scratch folder unique to this trial, removed first if it exists.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pinstream-cpu-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

fn touch(path: &Path) {
    std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
    std::fs::write(path, b"x").expect("write");
}

/// A fake toolkit with the given library folder name ("lib64" or "lib").
fn fake_toolkit(root: &Path, lib: &str) {
    touch(&root.join("bin/nvcc"));
    touch(&root.join("include/cuda_runtime_api.h"));
    touch(&root.join(lib).join("libcudart_static.a"));
}

fn env_of(pairs: Vec<(&'static str, OsString)>) -> impl Fn(&str) -> Option<OsString> {
    move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone())
}

fn candidates_in_documented_order() -> R {
    let dir = scratch("order");
    let bin = dir.join("pathcuda/bin");
    touch(&bin.join("nvcc"));
    let path = std::env::join_paths([dir.join("nothing-here"), bin.clone()]).expect("join");
    let env = env_of(vec![
        ("CUDA_HOME", dir.join("home").into()),
        ("CUDA_PATH", dir.join("path").into()),
        ("PATH", path),
    ]);
    let provisioned = vec![dir.join("prov")];
    let c = toolkit::candidates(&env, &provisioned);
    let sources: Vec<Source> = c.iter().map(|(s, _)| *s).collect();
    ensure(
        sources
            == vec![
                Source::CudaHome,
                Source::CudaPath,
                Source::NvccOnPath,
                Source::UsrLocalCuda,
                Source::Provisioned,
            ],
        || format!("{sources:?}"),
    )?;
    ensure(c[2].1 == dir.join("pathcuda"), || {
        format!("nvcc on PATH root {:?}", c[2].1)
    })?;
    ensure(c[4].1 == dir.join("prov/nvidia/cu13"), || {
        format!("provisioned root {:?}", c[4].1)
    })?;
    // Empty variables are not candidates.
    let env = env_of(vec![("CUDA_HOME", OsString::new())]);
    let c = toolkit::candidates(&env, &[]);
    ensure(c.len() == 1 && c[0].0 == Source::UsrLocalCuda, || {
        format!("{c:?}")
    })
}

fn toolkit_at_checks_each_part() -> R {
    let dir = scratch("parts");
    let root = dir.join("cuda");
    let e = toolkit::toolkit_at(Source::CudaHome, &root).unwrap_err();
    ensure(e.contains("not a directory"), || e.clone())?;
    touch(&root.join("bin/nvcc"));
    let e = toolkit::toolkit_at(Source::CudaHome, &root).unwrap_err();
    ensure(e.contains("cuda_runtime_api.h"), || e.clone())?;
    touch(&root.join("include/cuda_runtime_api.h"));
    let e = toolkit::toolkit_at(Source::CudaHome, &root).unwrap_err();
    ensure(e.contains("libcudart_static.a"), || e.clone())?;
    touch(&root.join("lib/libcudart_static.a"));
    let tk = toolkit::toolkit_at(Source::CudaHome, &root).map_err(|e| e.to_string())?;
    ensure(
        tk.lib == root.join("lib") && tk.nvcc == root.join("bin/nvcc"),
        || format!("{tk:?}"),
    )?;
    // lib64 wins over lib, as in a regular toolkit.
    touch(&root.join("lib64/libcudart_static.a"));
    let tk = toolkit::toolkit_at(Source::CudaHome, &root).map_err(|e| e.to_string())?;
    ensure(tk.lib == root.join("lib64"), || format!("{tk:?}"))?;
    ensure(tk.include == root.join("include"), || format!("{tk:?}"))
}

fn first_usable_candidate_wins() -> R {
    let dir = scratch("first");
    let broken = dir.join("broken");
    touch(&broken.join("bin/nvcc"));
    let good_a = dir.join("a");
    let good_b = dir.join("b");
    fake_toolkit(&good_a, "lib64");
    fake_toolkit(&good_b, "lib");
    let c = vec![
        (Source::CudaHome, broken.clone()),
        (Source::UsrLocalCuda, good_a.clone()),
        (Source::Provisioned, good_b),
    ];
    let tk = toolkit::find_toolkit(&c).map_err(|e| e.join("; "))?;
    ensure(
        tk.root == good_a && tk.source == Source::UsrLocalCuda,
        || format!("{tk:?}"),
    )?;
    let why = toolkit::find_toolkit(&c[..1]).unwrap_err();
    ensure(
        why.len() == 1 && why[0].contains("cuda_runtime_api.h"),
        || format!("{why:?}"),
    )
}

fn provisioned_dirs_and_target_dir() -> R {
    let dir = scratch("target");
    // target/ (with CACHEDIR.TAG) / tests/nested (a nested target dir with its own) / debug/build/pkg-hash/out
    let target = dir.join("target");
    let nested = target.join("tests/nested");
    let out = nested.join("debug/build/pinstream-abc/out");
    std::fs::create_dir_all(&out).expect("mkdir");
    touch(&target.join("CACHEDIR.TAG"));
    touch(&nested.join("CACHEDIR.TAG"));
    let td = toolkit::target_dir(&out);
    ensure(td == target, || format!("outermost target dir: {td:?}"))?;
    ensure(
        toolkit::provisioned_dirs(&out, toolkit::CUDA_DIR_NAME).is_empty(),
        || "none yet".into(),
    )?;
    std::fs::create_dir_all(target.join(toolkit::CUDA_DIR_NAME)).expect("mkdir");
    std::fs::create_dir_all(nested.join(toolkit::CUDA_DIR_NAME)).expect("mkdir");
    let found = toolkit::provisioned_dirs(&out, toolkit::CUDA_DIR_NAME);
    ensure(
        found
            == vec![
                target.join(toolkit::CUDA_DIR_NAME),
                nested.join(toolkit::CUDA_DIR_NAME),
            ],
        || format!("{found:?}"),
    )?;
    // Without any CACHEDIR.TAG: four levels above OUT_DIR.
    let plain = dir.join("t2/release/build/p-1/out");
    std::fs::create_dir_all(&plain).expect("mkdir");
    let td = toolkit::target_dir(&plain);
    ensure(td == dir.join("t2"), || format!("{td:?}"))
}

fn no_provision_switch() -> R {
    for (v, want) in [
        (None, false),
        (Some(""), false),
        (Some("0"), false),
        (Some("false"), false),
        (Some("1"), true),
        (Some("yes"), true),
    ] {
        let got = toolkit::provisioning_disabled(v.map(OsString::from));
        ensure(got == want, || {
            format!("PINSTREAM_NO_PROVISION={v:?} gave {got}")
        })?;
    }
    Ok(())
}

fn arch_list_parsing() -> R {
    let a = toolkit::parse_archs("75, sm_86;compute_90 90a").map_err(|e| e.to_string())?;
    ensure(a == ["75", "86", "90", "90a"], || format!("{a:?}"))?;
    let a = toolkit::parse_archs("90,90").map_err(|e| e.to_string())?;
    ensure(a == ["90"], || format!("{a:?}"))?;
    for bad in ["", " , ", "sm_9", "hopper", "sm_90ab", "1000"] {
        ensure(toolkit::parse_archs(bad).is_err(), || {
            format!("{bad:?} accepted")
        })?;
    }
    let default: Vec<String> = toolkit::DEFAULT_ARCHS
        .iter()
        .map(|s| s.to_string())
        .collect();
    let flags = toolkit::gencode_flags(&default);
    ensure(flags.len() == default.len() + 1, || format!("{flags:?}"))?;
    ensure(flags[0] == "-gencode=arch=compute_75,code=sm_75", || {
        flags[0].clone()
    })?;
    ensure(
        flags.last().map(String::as_str) == Some("-gencode=arch=compute_90,code=compute_90"),
        || format!("{flags:?}"),
    )
}

fn failure_messages_say_what_to_do() -> R {
    let m = toolkit::no_toolkit_message(&["/usr/local/cuda: not a directory".into()], None);
    for needle in [
        "no CUDA toolkit",
        "/usr/local/cuda",
        "PINSTREAM_NO_PROVISION",
        "CUDA_HOME",
        "nvidia-nvvm==13.0.88",
    ] {
        ensure(m.contains(needle), || {
            format!("missing {needle:?} in:\n{m}")
        })?;
    }
    let m = toolkit::no_toolkit_message(&[], Some("pip exploded"));
    ensure(m.contains("pip exploded"), || m.clone())?;
    let m = toolkit::no_libclang_message("not found", None);
    for needle in [
        "libclang",
        "LIBCLANG_PATH",
        "libclang==18.1.1",
        "libclang-dev",
    ] {
        ensure(m.contains(needle), || {
            format!("missing {needle:?} in:\n{m}")
        })?;
    }
    Ok(())
}

fn pcie_link_parsing() -> R {
    ensure(
        pinstream::parse_link_speed("32.0 GT/s PCIe\n") == Some(32.0),
        || "32 GT/s".into(),
    )?;
    ensure(pinstream::parse_link_speed("Unknown").is_none(), || {
        "Unknown".into()
    })?;
    ensure(pinstream::parse_link_speed("2.5 GT/s") == Some(2.5), || {
        "2.5".into()
    })?;
    for (gts, gen) in [
        (2.5, 1),
        (5.0, 2),
        (8.0, 3),
        (16.0, 4),
        (32.0, 5),
        (64.0, 6),
    ] {
        ensure(pinstream::pcie_gen_from_gts(gts) == Some(gen), || {
            format!("{gts} GT/s")
        })?;
    }
    ensure(pinstream::pcie_gen_from_gts(7.0).is_none(), || {
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

fn memory_flags() -> R {
    let f = HostAlloc::PORTABLE | HostAlloc::MAPPED;
    ensure(
        f.contains(HostAlloc::PORTABLE) && f.contains(HostAlloc::MAPPED),
        || format!("{f:?}"),
    )?;
    ensure(!f.contains(HostAlloc::WRITE_COMBINED), || format!("{f:?}"))?;
    ensure(
        HostAlloc::default() == HostAlloc::DEFAULT && HostAlloc::DEFAULT.bits() == 0,
        || "default".into(),
    )?;
    let r = HostRegister::READ_ONLY | HostRegister::PORTABLE;
    ensure(
        r.contains(HostRegister::READ_ONLY) && !r.contains(HostRegister::MAPPED),
        || format!("{r:?}"),
    )?;
    ensure(HostRegister::default().bits() == 0, || "default".into())
}

fn every_entry_point_reports_no_device() -> R {
    let e = Device::count().err();
    ensure(matches!(e, Some(Error::NoDevice { .. })), || {
        format!("count: {e:?}")
    })?;
    let e = e.ok_or("no error")?;
    let msg = e.to_string();
    ensure(
        msg.contains("cudaGetDeviceCount") && msg.contains("cudaError"),
        || msg.clone(),
    )?;
    ensure(e.is_no_device() && e.cuda().is_some(), || format!("{e:?}"))?;
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
    ensure(rt.major >= 12, || format!("runtime {rt}"))?;
    let drv = Device::driver_version()?;
    ensure(drv.is_none(), || {
        format!("driver {drv:?} on a machine without a device")
    })
}

/// Where the `pinstream` program may be, in order, for a test executable at `exe`: beside the
/// test executable's folder (cargo puts tests in `target/<profile>/deps/` and programs in
/// `target/<profile>/`), in `bin/` beside it (`../shared/gpu/pack` puts tests in `.gpu/test/`
/// and programs in `.gpu/bin/`), then where cargo built it for this test (only known when the
/// test was built by cargo with the program).
fn bin_candidates(exe: &Path) -> Vec<PathBuf> {
    let up = exe.parent().and_then(Path::parent);
    let mut c: Vec<PathBuf> = up
        .map(|d| vec![d.join("pinstream"), d.join("bin/pinstream")])
        .unwrap_or_default();
    c.extend(option_env!("CARGO_BIN_EXE_pinstream").map(PathBuf::from));
    c
}

/// The `pinstream` program, or why there is none: the first of `bin_candidates` that exists.
fn pinstream_bin() -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("no test executable path: {e}"))?;
    let candidates = bin_candidates(&exe);
    candidates
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .ok_or_else(|| {
            let looked: Vec<String> = candidates.iter().map(|p| p.display().to_string()).collect();
            format!(
                "the pinstream program was not found (looked at {}); build it with the tests \
             (cargo test, or ../shared/gpu/pack)",
                looked.join(", ")
            )
        })
}

/// A trial that runs the `pinstream` program: ignored at run time, with the reason, where the
/// program is not there (a test executable copied without it), never passed.
fn cli(name: &str, f: fn(&Path) -> R) -> Trial {
    Trial::ignorable_test(name, move || match pinstream_bin() {
        Ok(bin) => f(&bin).map(|()| Completion::Completed),
        Err(why) => Ok(Completion::ignored_with(why)),
    })
}

/// The lookup finds the program in cargo's layout and in the packed one, and nothing beside a
/// test executable that has none.
fn program_found_beside_the_tests() -> R {
    let dir = scratch("layouts");
    let cargo_test = dir.join("target/release/deps/cpu-0123abcd");
    let packed_test = dir.join(".gpu/test/cpu-0123abcd");
    let lone_test = dir.join("elsewhere/tests/cpu-0123abcd");
    for exe in [&cargo_test, &packed_test, &lone_test] {
        touch(exe);
    }
    touch(&dir.join("target/release/pinstream"));
    touch(&dir.join(".gpu/bin/pinstream"));
    let first = |exe: &Path| bin_candidates(exe).into_iter().find(|p| p.is_file());
    ensure(
        first(&cargo_test) == Some(dir.join("target/release/pinstream")),
        || format!("cargo layout: {:?}", bin_candidates(&cargo_test)),
    )?;
    ensure(
        first(&packed_test) == Some(dir.join(".gpu/bin/pinstream")),
        || format!("packed layout: {:?}", bin_candidates(&packed_test)),
    )?;
    // Beside a lone test executable: only cargo's own path, where this test has one.
    let lone = first(&lone_test);
    let cargo_path = option_env!("CARGO_BIN_EXE_pinstream").map(PathBuf::from);
    ensure(lone.is_none() || lone == cargo_path, || {
        format!("beside a lone test: {lone:?}")
    })
}

fn info_exits_with_status_2(bin: &Path) -> R {
    let out = std::process::Command::new(bin).arg("info").output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure(out.status.code() == Some(2), || {
        format!("status {:?}, stderr {stderr}", out.status)
    })?;
    ensure(
        stderr.lines().count() == 1 && stderr.contains("no usable CUDA device"),
        || stderr.to_string(),
    )?;
    ensure(out.stdout.is_empty(), || {
        String::from_utf8_lossy(&out.stdout).to_string()
    })
}

fn stats_and_pattern() -> R {
    use pinstream::bench::{gbps, host_memcpy_gbps, pattern, Stats};
    let s = Stats::new(vec![3.0, 1.0, 2.0, 10.0]).ok_or("no stats")?;
    ensure(s.median == 2.5 && s.min == 1.0 && s.max == 10.0, || {
        format!("{s:?}")
    })?;
    ensure((s.cv - 0.8839).abs() < 1e-3, || format!("cv {}", s.cv))?;
    ensure(Stats::new(vec![]).is_none(), || "stats of nothing".into())?;
    ensure(
        Stats::new(vec![7.0]).is_some_and(|s| s.median == 7.0 && s.cv == 0.0),
        || "one sample".into(),
    )?;
    ensure(
        (gbps(2e9, 0.5) - 4.0).abs() < 1e-12 && gbps(1.0, 0.0) == 0.0,
        || "gbps".into(),
    )?;
    // Sizes that cannot be allocated are errors, not panics or aborts.
    ensure(pattern(usize::MAX).is_err(), || {
        "pattern(usize::MAX)".into()
    })?;
    ensure(pattern(isize::MAX as usize).is_err(), || {
        "pattern(isize::MAX)".into()
    })?;
    ensure(host_memcpy_gbps(usize::MAX, 1).is_none(), || {
        "host_memcpy_gbps(usize::MAX)".into()
    })?;
    ensure(host_memcpy_gbps(usize::MAX - 100, 1).is_none(), || {
        "host_memcpy_gbps(usize::MAX - 100)".into()
    })?;
    let p = pattern(100_003)?;
    ensure(p.len() == 100_003 && p.iter().all(|&b| b != 0), || {
        "pattern has zeros".into()
    })?;
    let distinct = p.iter().collect::<std::collections::HashSet<_>>().len();
    ensure(distinct > 200, || format!("{distinct} distinct bytes"))
}

/// The sample images: `tests/data/images` under `CARGO_MANIFEST_DIR` where it is set (cargo, and
/// the packed tests' runner), else under the working directory.
fn sample_images() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_default()
        .join("tests/data/images")
}

fn normalize_cpu_writes_npy(bin: &Path) -> R {
    let images = sample_images();
    let dir = scratch("npy");
    let out = dir.join("batch.npy");
    let run = |args: &[&std::ffi::OsStr]| {
        std::process::Command::new(bin)
            .arg("normalize")
            .args(args)
            .output()
    };
    let a = images.join("astronaut.png");
    let o = run(&[
        "--input".as_ref(),
        a.as_os_str(),
        a.as_os_str(),
        "--preset".as_ref(),
        "imagenet".as_ref(),
        "--dtype".as_ref(),
        "f16".as_ref(),
        "--cpu".as_ref(),
        "--verify".as_ref(),
        "--out".as_ref(),
        out.as_os_str(),
    ])?;
    let stdout = String::from_utf8_lossy(&o.stdout);
    ensure(o.status.success(), || {
        format!("{:?}: {}", o.status, String::from_utf8_lossy(&o.stderr))
    })?;
    ensure(stdout.contains("verify: max abs error"), || {
        stdout.to_string()
    })?;
    let bytes = std::fs::read(&out)?;
    ensure(bytes.starts_with(b"\x93NUMPY\x01\x00"), || {
        "npy magic".into()
    })?;
    let hlen = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
    let header = String::from_utf8_lossy(&bytes[10..10 + hlen]);
    ensure((10 + hlen) % 64 == 0 && header.ends_with('\n'), || {
        format!("header {header:?}")
    })?;
    ensure(
        header.contains("'descr': '<f2'") && header.contains("'shape': (2, 3, 512, 512)"),
        || header.to_string(),
    )?;
    ensure(bytes.len() == 10 + hlen + 2 * 3 * 512 * 512 * 2, || {
        format!("{} bytes", bytes.len())
    })?;
    // First value: (R(0,0) - 0.485*255) / (0.229*255) for the astronaut, as f16.
    let v = pinstream::f16::from_le_bytes([bytes[10 + hlen], bytes[11 + hlen]]).to_f32();
    ensure(v > -3.0 && v < 3.0 && v != 0.0, || {
        format!("first value {v}")
    })?;

    // Errors: one line, non-zero status, nothing written.
    let missing = dir.join("missing.png");
    let out2 = dir.join("never.npy");
    let c = images.join("camera.png");
    for (what, args) in [
        ("missing file", vec![missing.as_os_str(), "--cpu".as_ref()]),
        (
            "mixed channels",
            vec![a.as_os_str(), c.as_os_str(), "--cpu".as_ref()],
        ),
    ] {
        let mut full: Vec<&std::ffi::OsStr> = vec!["--input".as_ref()];
        full.extend(args);
        full.extend(["--out".as_ref(), out2.as_os_str()]);
        let o = run(&full)?;
        let stderr = String::from_utf8_lossy(&o.stderr);
        ensure(!o.status.success() && stderr.lines().count() == 1, || {
            format!("{what}: {:?} {stderr}", o.status)
        })?;
        ensure(!out2.exists(), || format!("{what}: a file was written"))?;
    }
    Ok(())
}

/// `pinstream bandwidth --help` lists the `staged` kind and the file options; bad values of the
/// new arguments are one-line errors with status 1, found before any device is touched (so this
/// runs the same with or without a GPU).
fn bandwidth_help_and_arguments(bin: &Path) -> R {
    let run = |args: &[&str]| {
        std::process::Command::new(bin)
            .arg("bandwidth")
            .args(args)
            .output()
    };
    let o = run(&["--help"])?;
    let help = String::from_utf8_lossy(&o.stdout);
    ensure(o.status.success(), || format!("--help: {:?}", o.status))?;
    for needle in ["staged", "--file <FILE>", "--file-bytes", "O_DIRECT"] {
        ensure(help.contains(needle), || {
            format!("missing {needle:?} in:\n{help}")
        })?;
    }
    for (args, needle) in [
        (&["--kinds", "staged,bogus"][..], "registered, staged"),
        (&["--file-bytes", "0"][..], "--file-bytes"),
        (&["--file-bytes", "12Q"][..], "unknown unit"),
    ] {
        let o = run(args)?;
        let stderr = String::from_utf8_lossy(&o.stderr);
        ensure(o.status.code() == Some(1), || {
            format!("{args:?}: status {:?}, stderr {stderr}", o.status)
        })?;
        ensure(
            stderr.lines().count() == 1 && stderr.contains(needle),
            || format!("{args:?}: {stderr}"),
        )?;
    }
    Ok(())
}

/// `pinstream` alone prints the help (the subcommands) to stdout and exits with status 0.
fn no_arguments_prints_the_help(bin: &Path) -> R {
    let o = std::process::Command::new(bin).output()?;
    let stdout = String::from_utf8_lossy(&o.stdout);
    ensure(o.status.code() == Some(0), || {
        format!(
            "status {:?}, stderr {}",
            o.status,
            String::from_utf8_lossy(&o.stderr)
        )
    })?;
    for needle in [
        "Usage: pinstream <COMMAND>",
        "info",
        "bandwidth",
        "normalize",
        "staging",
    ] {
        ensure(stdout.contains(needle), || {
            format!("missing {needle:?} in:\n{stdout}")
        })?;
    }
    Ok(())
}

/// `pinstream --version` names the crate's version and the CUDA runtime linked in, with or
/// without a driver.
fn version_names_the_cuda_runtime(bin: &Path) -> R {
    let o = std::process::Command::new(bin).arg("--version").output()?;
    let stdout = String::from_utf8_lossy(&o.stdout);
    ensure(o.status.success(), || format!("status {:?}", o.status))?;
    let runtime = Device::runtime_version()?;
    let want = format!(
        "pinstream {} (CUDA runtime {runtime}, linked statically)",
        env!("CARGO_PKG_VERSION")
    );
    ensure(stdout.trim_end() == want, || {
        format!("{stdout:?}, want {want:?}")
    })
}

/// `normalize --format json` and `--format csv` print one report with the same fields (and
/// nothing else on stdout); the table keeps its lines.
fn normalize_report_formats(bin: &Path) -> R {
    let a = sample_images().join("astronaut.png");
    let dir = scratch("formats");
    let out = dir.join("one.npy");
    let run = |format: &str| {
        std::process::Command::new(bin)
            .arg("normalize")
            .arg("--input")
            .arg(&a)
            .args(["--cpu", "--verify", "--dtype", "u8", "--format", format])
            .arg("--out")
            .arg(&out)
            .output()
    };
    let o = run("json")?;
    ensure(o.status.success(), || {
        format!(
            "json: {:?} {}",
            o.status,
            String::from_utf8_lossy(&o.stderr)
        )
    })?;
    let v: serde_json::Value = serde_json::from_slice(&o.stdout)?;
    ensure(
        v["dtype"] == "u8" && v["shape"] == "1x3x512x512" && v["images"] == 1,
        || format!("{v}"),
    )?;
    ensure(
        v["verify_units"].as_f64().is_some_and(|u| u <= 1.0) && v["bench_kernel_ms"].is_null(),
        || format!("{v}"),
    )?;
    let o = run("csv")?;
    let csv = String::from_utf8_lossy(&o.stdout);
    let lines: Vec<&str> = csv.lines().collect();
    ensure(o.status.success() && lines.len() == 2, || csv.to_string())?;
    let fields = v.as_object().ok_or("not an object")?;
    let header: Vec<&str> = lines[0].split(',').collect();
    ensure(
        header.len() == fields.len() && header.iter().all(|h| fields.contains_key(*h)),
        || format!("csv header {header:?} against json {v}"),
    )?;
    let o = run("table")?;
    let table = String::from_utf8_lossy(&o.stdout);
    ensure(
        table.starts_with("verify: max abs error") && table.contains("\nwrote "),
        || table.to_string(),
    )
}
