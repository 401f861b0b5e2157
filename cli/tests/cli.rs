//! Trials of the `pinstream` program and of the measurement code's CPU parts: the command line
//! (help, arguments, versions, report formats, `normalize --cpu`), and — on a machine without a
//! GPU — its exit status and messages. Each trial that runs the program is ignored, with the
//! reason, where the program is not beside the test executable.

mod common;
#[path = "hostile30/mod.rs"]
mod hostile30;

use std::path::{Path, PathBuf};

use common::{ensure, R};
use libtest_mimic::{Arguments, Completion, Trial};
use pinstream::driver::DriverVerdict;
use pinstream::{Device, Version};

fn main() {
    let args = Arguments::from_args();
    let has_gpu = pinstream::available();
    let t = |name: &str, f: fn() -> R| Trial::test(name, f);
    let trials = vec![
        cli("driver/fake_version_in_info", fake_version_in_info),
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
        cli(
            "no_device/info_exits_with_status_2",
            info_exits_with_status_2,
        )
        .with_ignored_flag(has_gpu),
        cli(
            "no_device/bandwidth_says_it_once",
            bandwidth_says_no_device_once,
        )
        .with_ignored_flag(has_gpu),
        cli(
            "cli/load_arguments_and_bad_files",
            load_arguments_and_bad_files,
        ),
        cli("no_device/load_says_it_once", load_says_no_device_once).with_ignored_flag(has_gpu),
    ];
    let mut trials = trials;
    trials.extend(hostile30::trials());
    libtest_mimic::run(&args, trials).exit();
}

/// A scratch folder unique to this trial, removed first if it exists.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pinstream-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

fn touch(path: &Path) {
    std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
    std::fs::write(path, b"x").expect("write");
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

/// `pinstream info` with the driver version faked: the driver lines and the advice come first,
/// whatever the machine has.
fn fake_version_in_info(bin: &Path) -> R {
    let run = |fake: &str| -> Result<String, String> {
        let out = std::process::Command::new(bin)
            .arg("info")
            .env(pinstream::driver::FAKE_DRIVER_VERSION_VAR, fake)
            .output()
            .map_err(|e| e.to_string())?;
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let rt = Version::from_cuda(pinstream::CUDART_VERSION as i32);
    // A driver one major version older than this build's runtime.
    let old = format!("{}040", rt.major - 1);
    let out = run(&old)?;
    contains_all(
        "faked old driver",
        &out,
        &[
            &format!("supports CUDA {}.4", rt.major - 1),
            "faked by PINSTREAM_FAKE_DRIVER_VERSION",
            &format!("CUDA {rt} runtime"),
            "update the NVIDIA driver",
            "CUDA_HOME",
        ],
    )?;
    let out = run("0")?;
    contains_all(
        "faked missing driver",
        &out,
        &["no NVIDIA driver is installed", "CUDA_HOME", "Ways out"],
    )
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
    let out = std::process::Command::new(bin)
        .arg("info")
        .env_remove(pinstream::driver::FAKE_DRIVER_VERSION_VAR)
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure(out.status.code() == Some(2), || {
        format!("status {:?}, stderr {stderr}", out.status)
    })?;
    ensure(
        stderr.lines().count() == 1 && stderr.contains("no usable CUDA device"),
        || stderr.to_string(),
    )?;
    // Before failing it says what the driver is, what the build needs and what to do.
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    contains_all("info", &stdout, &["driver", "this build"])?;
    if pinstream::driver::driver_status().verdict() != DriverVerdict::Sufficient {
        contains_all("info", &stdout, &["Ways out", "CUDA_HOME"])?;
    }
    Ok(())
}

fn stats_and_pattern() -> R {
    use pinstream_cli::bench::{gbps, host_memcpy_gbps, pattern, Stats};
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

/// The sample images: the repository's `tests/data/images` (see `common::test_data`).
fn sample_images() -> PathBuf {
    common::test_data().join("images")
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
        "load",
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

/// Without a device, `pinstream bandwidth` fails with status 2 and says "no usable CUDA device"
/// once, not twice (the error's message already starts with it).
fn bandwidth_says_no_device_once(bin: &Path) -> R {
    let out = std::process::Command::new(bin)
        .arg("bandwidth")
        .env_remove(pinstream::driver::FAKE_DRIVER_VERSION_VAR)
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure(out.status.code() == Some(2), || {
        format!("status {:?}, stderr {stderr}", out.status)
    })?;
    ensure(
        stderr.starts_with("pinstream: no usable CUDA device")
            && stderr.matches("no usable CUDA device").count() == 1,
        || stderr.to_string(),
    )
}

/// A safetensors file in `dir`: the length prefix, `json`, then `data` zero bytes.
fn safetensors_file(dir: &Path, name: &str, json: &str, data: usize) -> PathBuf {
    let mut b = (json.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(json.as_bytes());
    b.resize(b.len() + data, 0);
    let path = dir.join(name);
    std::fs::write(&path, b).expect("write");
    path
}

/// `pinstream load`: `--help` names the options; bad arguments and bad files are one-line
/// errors with status 1, found before any device is touched (the same with or without a GPU).
fn load_arguments_and_bad_files(bin: &Path) -> R {
    let dir = scratch("load");
    let ok = safetensors_file(
        &dir,
        "ok.safetensors",
        r#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#,
        8,
    );
    let run = |args: &[&str]| {
        std::process::Command::new(bin)
            .arg("load")
            .args(args)
            .output()
    };
    let o = run(&["--help"])?;
    let help = String::from_utf8_lossy(&o.stdout);
    ensure(o.status.success(), || format!("--help: {:?}", o.status))?;
    contains_all(
        "load --help",
        &help,
        &["--direct", "auto", "always", "--repeat", "--verify"],
    )?;
    let ok = ok.to_str().ok_or("path")?;
    let dup = safetensors_file(
        &dir,
        "dup.safetensors",
        r#"{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"w":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}"#,
        2,
    );
    let dup = dup.to_str().ok_or("path")?;
    let missing = dir.join("missing.safetensors");
    let missing = missing.to_str().ok_or("path")?;
    for (args, needle) in [
        (&["--direct", "sometimes", ok][..], "--direct"),
        (&["--repeat", "0", ok][..], "--repeat"),
        (
            &[dup][..],
            "tensor \"w\": the header is not valid: the key \"w\" appears twice",
        ),
        (&[missing][..], "No such file"),
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

/// Without a device, `pinstream load` on a valid file fails with status 2 and says "no usable
/// CUDA device" once.
fn load_says_no_device_once(bin: &Path) -> R {
    let dir = scratch("load-nodev");
    let ok = safetensors_file(
        &dir,
        "ok.safetensors",
        r#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#,
        8,
    );
    let out = std::process::Command::new(bin)
        .arg("load")
        .arg(&ok)
        .env_remove(pinstream::driver::FAKE_DRIVER_VERSION_VAR)
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure(out.status.code() == Some(2), || {
        format!("status {:?}, stderr {stderr}", out.status)
    })?;
    ensure(
        stderr.starts_with("pinstream: no usable CUDA device")
            && stderr.matches("no usable CUDA device").count() == 1,
        || stderr.to_string(),
    )
}
