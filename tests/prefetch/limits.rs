//! Extreme sizes (issue 19: no hang, abort or panic from any safe call). Every public constructor
//! and size-taking function is driven with 0, 1, `usize::MAX` and its neighbours, sizes past
//! `isize::MAX`, ranges whose end overflows and `u64::MAX` file offsets; each call must return
//! (a typed `Error`, of the variant named, or `Ok` where the size is fine), never panic nor
//! abort.
//!
//! Each sweep runs in a child process (this executable again, with `PINSTREAM_LIMITS_CHILD`
//! naming the sweep), every call inside `catch_unwind`: a panic is a failure naming the call, and
//! an abort (the child dies by a signal) is a failure naming the last call the child printed.
//! The CPU sweeps always run; the device sweeps are GPU trials.

use std::fmt::Debug;
use std::io::Write as _;
use std::ops::Bound;
use std::os::unix::process::ExitStatusExt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::Arc;

use crate::common::R;
use libtest_mimic::Trial;
use pinstream::kernels::{self, cpu, Crop, Layout, Normalize, Sample, Spec};
use pinstream::prefetch::{Pixels, PrefetchConfig, MAX_EXPORT_SPARES};
use pinstream::{
    Device, DeviceBuffer, Error, Event, FileSource, HostAlloc, HostRegister, PinnedBuffer,
    PinnedPool, PoolBacking, PoolConfig, Stager, StagerConfig, Stream, TimingEvent,
};

use crate::common::trial;

/// Prefix of this module's trial names (its path in the binary).
const PREFIX: &str = "limits/";

const CHILD_VAR: &str = "PINSTREAM_LIMITS_CHILD";

/// A child process of one of these trials (this executable again, with the variable set): runs
/// its part and returns true, or exits; false in the test runner.
pub fn child_mode() -> bool {
    if let Ok(what) = std::env::var(CHILD_VAR) {
        std::process::exit(child(&what));
    }
    false
}

/// The trials of this module, named `limits/...`.
pub fn trials() -> Vec<Trial> {
    let no_gpu = !pinstream::available();
    let cpu = |name: &str, f: fn() -> R| trial(PREFIX, name, f);
    let gpu = |name: &str, f: fn() -> R| trial(PREFIX, name, f).with_ignored_flag(no_gpu);
    vec![
        cpu("host/huge_file_read_is_an_error", || in_child("huge_file")),
        cpu("host/spec_uniform_of_usize_max_is_an_error", || {
            in_child("spec_uniform")
        }),
        cpu("host/sweep", || in_child("host_sweep")),
        gpu("device/read_only_pool_refused_by_stager", || {
            in_child("read_only_pool")
        }),
        gpu("device/sweep", || in_child("device_sweep")),
    ]
}

/// Runs `what` in a child process: passes if the child exits with 0; a child killed by a signal
/// (an abort) fails naming the last case it started.
fn in_child(what: &str) -> R {
    let exe = std::env::current_exe()?;
    let out = std::process::Command::new(exe)
        .env(CHILD_VAR, what)
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // The child's summary line; the cases only where it failed.
    if let Some(summary) = stdout.lines().rev().find(|l| l.ends_with(" failures")) {
        println!("{what}: {summary}");
    }
    if let Some(sig) = out.status.signal() {
        let last = stdout
            .lines()
            .rev()
            .find_map(|l| l.strip_prefix("case: "))
            .unwrap_or("(before the first case)");
        let failed: Vec<&str> = stdout.lines().filter(|l| l.starts_with("FAILED")).collect();
        return Err(format!(
            "the child died by signal {sig} (an abort) in case `{last}`; before that:\n{}\n\
             stderr:\n{stderr}",
            failed.join("\n")
        )
        .into());
    }
    if !out.status.success() {
        let failed: Vec<&str> = stdout.lines().filter(|l| l.starts_with("FAILED")).collect();
        return Err(format!(
            "child failed ({}):\n{}\n{stderr}",
            out.status,
            failed.join("\n")
        )
        .into());
    }
    Ok(())
}

fn child(what: &str) -> i32 {
    // The panics are caught and reported by `Sweep::case`; the default hook's message would
    // only repeat them.
    std::panic::set_hook(Box::new(|_| {}));
    let mut s = Sweep::default();
    match what {
        "huge_file" => huge_file(&mut s),
        "spec_uniform" => spec_uniform(&mut s),
        "host_sweep" => host_sweep(&mut s),
        "read_only_pool" => read_only_pool(&mut s),
        "device_sweep" => device_sweep(&mut s),
        _ => s.fail(format!("unknown child {what}")),
    }
    println!("{} cases, {} failures", s.cases, s.failures.len());
    i32::from(!s.failures.is_empty())
}

/// What a case must give: `Ok`, or an error of one of these variants.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Want {
    Ok,
    Invalid,
    Io,
    Mismatch,
    /// `OutOfMemory` or `InvalidArgument`: a size that may be refused before or by the runtime.
    OomOrInvalid,
    /// `Ok` or an error: only "no panic, no abort" is checked.
    Any,
}

fn variant(e: &Error) -> &'static str {
    match e {
        Error::NoDevice { .. } => "NoDevice",
        Error::OutOfMemory { .. } => "OutOfMemory",
        Error::LengthMismatch { .. } => "LengthMismatch",
        Error::WrongDevice { .. } => "WrongDevice",
        Error::NoPeerAccess { .. } => "NoPeerAccess",
        Error::InvalidArgument { .. } => "InvalidArgument",
        Error::Io { .. } => "Io",
        Error::Panicked { .. } => "Panicked",
        Error::Loader { .. } => "Loader",
        Error::Cuda { .. } => "Cuda",
        _ => "other",
    }
}

#[derive(Default)]
struct Sweep {
    cases: usize,
    failures: Vec<String>,
}

impl Sweep {
    /// Runs `f` as case `name`, printing the name first (so that an abort can be placed).
    fn case<T: Debug>(&mut self, name: &str, want: Want, f: impl FnOnce() -> pinstream::Result<T>) {
        self.cases += 1;
        println!("case: {name}");
        let _ = std::io::stdout().flush();
        let got = match catch_unwind(AssertUnwindSafe(f)) {
            Ok(r) => r,
            Err(payload) => {
                let msg = payload
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "(not a string)".into());
                self.fail(format!("{name}: panicked: {msg}"));
                return;
            }
        };
        let ok = match (&got, want) {
            (_, Want::Any) => true,
            (Ok(_), Want::Ok) => true,
            (Err(e), Want::Invalid) => variant(e) == "InvalidArgument",
            (Err(e), Want::Io) => variant(e) == "Io",
            (Err(e), Want::Mismatch) => variant(e) == "LengthMismatch",
            (Err(e), Want::OomOrInvalid) => {
                matches!(variant(e), "OutOfMemory" | "InvalidArgument")
            }
            _ => false,
        };
        if !ok {
            let shown = match &got {
                Ok(v) => format!("Ok({})", trimmed(format!("{v:?}"))),
                Err(e) => format!("Err({}: {e})", variant(e)),
            };
            self.fail(format!("{name}: want {want:?}, got {shown}"));
        }
    }

    /// Records a failure, and prints it at once (a later abort would lose the list).
    fn fail(&mut self, msg: String) {
        println!("FAILED: {msg}");
        let _ = std::io::stdout().flush();
        self.failures.push(msg);
    }

    /// A case that returns no `Result` (a plain function): only "no panic" is checked.
    fn plain<T: Debug>(&mut self, name: &str, f: impl FnOnce() -> T) {
        self.case(name, Want::Any, || Ok(f()));
    }
}

fn trimmed(s: String) -> String {
    if s.len() > 200 {
        format!("{}...", &s[..200])
    } else {
        s
    }
}

/// The sizes every size-taking call is driven with.
const HUGE: [(&str, usize); 5] = [
    ("usize::MAX", usize::MAX),
    ("usize::MAX-1", usize::MAX - 1),
    ("usize::MAX/2+1", usize::MAX / 2 + 1),
    ("isize::MAX+1", isize::MAX as usize + 1),
    ("isize::MAX", isize::MAX as usize),
];

/// A sparse file of `len` bytes in the temporary directory, removed on drop; `None` where the
/// filesystem cannot make one.
struct Sparse(PathBuf);

impl Sparse {
    fn new(name: &str, len: u64) -> Option<Sparse> {
        let path = std::env::temp_dir().join(format!(
            "pinstream-limits-{name}-{}.bin",
            std::process::id()
        ));
        let s = Sparse(path);
        let f = std::fs::File::create(&s.0).ok()?;
        f.set_len(len).ok()?;
        Some(s)
    }
}

impl Drop for Sparse {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn norm(c: usize) -> Normalize {
    Normalize::new(&vec![0.0; c], &vec![1.0; c])
}

/// `Pixels::read` of a whole 1 TiB (sparse) file: the range is inside the file, so only the
/// allocation can refuse it. It aborted the process ("memory allocation of 1099511627776 bytes
/// failed"); now an `Error::InvalidArgument`.
fn huge_file(s: &mut Sweep) {
    let Some(sparse) = Sparse::new("tib", 1 << 40) else {
        println!("no sparse files in the temporary directory: nothing to check");
        return;
    };
    let file = match FileSource::open(&sparse.0) {
        Ok(f) => Arc::new(f),
        Err(e) => return s.fail(format!("open: {e}")),
    };
    let read = |offset: u64, len: usize| {
        let p = Pixels::File {
            file: file.clone(),
            offset,
            len,
        };
        p.read().map(|v| v.len())
    };
    s.case(
        "Pixels::read(file of 1 TiB, 0, 1 TiB)",
        Want::Invalid,
        || read(0, 1 << 40),
    );
    s.case(
        "Pixels::read(file of 1 TiB, 1 MiB, 1 TiB - 1 MiB)",
        Want::Invalid,
        || read(1 << 20, (1 << 40) - (1 << 20)),
    );
    s.case(
        "Pixels::read(file of 1 TiB, 1 TiB - 3, 3)",
        Want::Ok,
        || read((1 << 40) - 3, 3),
    );
    for (name, len) in HUGE {
        s.case(
            &format!("Pixels::read(file of 1 TiB, 0, {name})"),
            Want::Io,
            || read(0, len),
        );
    }
    s.case("Pixels::read(file of 1 TiB, u64::MAX, 1)", Want::Io, || {
        read(u64::MAX, 1)
    });
    s.case("Pixels::read(file of 1 TiB, u64::MAX, 0)", Want::Io, || {
        read(u64::MAX, 0)
    });
    s.case(
        "Pixels::read(file of 1 TiB, 1 TiB - 1, 2)",
        Want::Io,
        || read((1 << 40) - 1, 2),
    );
}

/// `Spec::uniform` with `n` near `usize::MAX` panicked ("capacity overflow"); now an error.
fn spec_uniform(s: &mut Sweep) {
    s.case(
        "Spec::uniform(usize::MAX / 8, 3, 224, 224)",
        Want::Invalid,
        || {
            Spec::uniform(usize::MAX / 8, 3, 224, 224, Normalize::imagenet())
                .map(|s| s.samples.len())
        },
    );
    for (name, n) in HUGE {
        s.case(
            &format!("Spec::uniform({name}, 3, 224, 224)"),
            Want::Invalid,
            || Spec::uniform(n, 3, 224, 224, Normalize::imagenet()).map(|s| s.samples.len()),
        );
    }
    // A size no machine has, but no overflow: the allocation itself is refused.
    s.case("Spec::uniform(isize::MAX / 64, ..)", Want::Invalid, || {
        Spec::uniform(isize::MAX as usize / 64, 3, 1, 1, Normalize::imagenet())
            .map(|s| s.samples.len())
    });
    s.case("Spec::uniform(0, ..)", Want::Ok, || {
        Spec::uniform(0, 3, 224, 224, Normalize::imagenet()).map(|s| s.samples.len())
    });
    s.case("Spec::uniform(1, ..)", Want::Ok, || {
        Spec::uniform(1, 3, 224, 224, Normalize::imagenet()).map(|s| s.samples.len())
    });
}

/// Everything that needs no device.
fn host_sweep(s: &mut Sweep) {
    // Specs: huge dimensions, lengths, offsets, validation.
    for (name, x) in HUGE.into_iter().chain([("0", 0), ("1", 1)]) {
        let small = matches!(x, 0 | 1);
        let want_len = if small { Want::Ok } else { Want::Invalid };
        let spec = Spec::uniform(2, x, x, x, norm(3));
        s.case(
            &format!("Spec::uniform(2, {name}, {name}, {name})"),
            Want::Ok,
            || spec.as_ref().map(|s| s.samples.len()).map_err(Clone::clone),
        );
        let Ok(spec) = spec else { continue };
        s.case(&format!("input_len of 2x{name}^3"), want_len, || {
            spec.input_len()
        });
        s.case(&format!("output_len of 2x{name}^3"), want_len, || {
            spec.output_len()
        });
        s.case(&format!("offsets of 2x{name}^3"), want_len, || {
            spec.offsets()
        });
        s.case(&format!("validate 2x{name}^3"), Want::Invalid, || {
            spec.validate("limits")
        });
        let padded = spec.clone().pad_to_4(0.0);
        s.case(
            &format!("output_len of 2x{name}^3 padded"),
            want_len,
            || padded.output_len(),
        );
        s.plain(&format!("is_uniform / out_channels of 2x{name}^3"), || {
            (spec.is_uniform(), spec.out_channels())
        });
        // One huge sample of 1 channel, and two whose sum overflows.
        let one = Spec::variable(1, &[(x, 1)], norm(1));
        s.case(&format!("input_len of one 1x{name}x1"), Want::Ok, || {
            one.input_len()
        });
        s.case(
            &format!("validate one 1x{name}x1"),
            if x == 1 { Want::Ok } else { Want::Invalid },
            || one.validate("limits"),
        );
        let two = Spec::variable(1, &[(x, 1), (x, 1)], norm(1));
        let sum_overflows = x > usize::MAX / 2;
        s.case(
            &format!("input_len of two 1x{name}x1"),
            if sum_overflows {
                Want::Invalid
            } else {
                Want::Ok
            },
            || two.input_len(),
        );
        s.case(
            &format!("offsets of two 1x{name}x1"),
            if sum_overflows {
                Want::Invalid
            } else {
                Want::Ok
            },
            || two.offsets().map(|v| v.len()),
        );
        // Crops past the image and crops whose end overflows (0 and 1 make valid crops).
        let crops = if small {
            vec![]
        } else {
            vec![
                (
                    "at x",
                    Crop {
                        x,
                        y: 0,
                        w: 2,
                        h: 2,
                    },
                ),
                (
                    "at y",
                    Crop {
                        x: 0,
                        y: x,
                        w: 2,
                        h: 2,
                    },
                ),
                (
                    "wide",
                    Crop {
                        x: 1,
                        y: 0,
                        w: x,
                        h: 1,
                    },
                ),
                (
                    "tall",
                    Crop {
                        x: 0,
                        y: 1,
                        w: 1,
                        h: x,
                    },
                ),
                (
                    "huge",
                    Crop {
                        x,
                        y: x,
                        w: x,
                        h: x,
                    },
                ),
            ]
        };
        for (what, crop) in crops {
            let mut c = Spec::variable(3, &[(4, 4)], norm(3));
            c.samples[0].crop = Some(crop);
            c.samples[0].mirror = true;
            s.case(
                &format!("validate crop {what} {name}"),
                Want::Invalid,
                || c.validate("limits"),
            );
            s.case(&format!("output_len crop {what} {name}"), Want::Any, || {
                c.output_len()
            });
            s.case(&format!("offsets crop {what} {name}"), Want::Any, || {
                c.offsets().map(|v| v.len())
            });
            s.plain(&format!("Sample::out_hw crop {what} {name}"), || {
                c.samples[0].out_hw()
            });
            let mut out = vec![0f32; 48];
            s.case(
                &format!("cpu::normalize crop {what} {name}"),
                Want::Invalid,
                || cpu::normalize(&[0u8; 48], &c, None, &mut out),
            );
        }
        // The CPU reference with huge specs: refused by validation before any allocation.
        let spec = Spec::uniform(1, 3, x.max(1), x.max(1), norm(3)).unwrap();
        let mut out = vec![0f32; 3];
        let want = if small { Want::Ok } else { Want::Invalid };
        s.case(&format!("cpu::normalize 1x3x{name}x{name}"), want, || {
            cpu::normalize(&[0u8; 3], &spec, None, &mut out)
        });
        s.case(
            &format!("cpu::normalize_exact 1x3x{name}x{name}"),
            want,
            || cpu::normalize_exact(&[0u8; 3], &spec, None).map(|v| v.len()),
        );
        let mut back = vec![0u8; 3];
        s.case(&format!("cpu::denormalize 1x3x{name}x{name}"), want, || {
            cpu::denormalize(&[0f32; 3], &spec, &mut back)
        });
    }
    // Statistics that do not match the channels, empty and huge.
    for (mean, std) in [(0usize, 3usize), (3, 0), (1, 3), (4, 4), (0, 0)] {
        let spec = Spec::variable(
            3,
            &[(2, 2)],
            Normalize::new(&vec![1.0; mean], &vec![1.0; std]),
        );
        s.case(
            &format!("validate {mean} means, {std} stds"),
            Want::Invalid,
            || spec.validate("limits"),
        );
        let mut out = vec![0f32; 12];
        s.case(
            &format!("cpu::normalize {mean} means, {std} stds"),
            Want::Invalid,
            || cpu::normalize(&[0u8; 12], &spec, None, &mut out),
        );
        let mut back = vec![0u8; 12];
        s.case(
            &format!("cpu::denormalize {mean} means, {std} stds"),
            Want::Invalid,
            || cpu::denormalize(&[0f32; 12], &spec, &mut back),
        );
    }
    // The largest sample the kernels take, and one pixel more.
    let big = Spec::variable(4, &[(65535, 65535)], norm(4));
    s.case("validate 4x65535x65535", Want::Ok, || {
        big.validate("limits")
    });
    s.case(
        "cpu::normalize 4x65535x65535, 3 bytes in",
        Want::Mismatch,
        || cpu::normalize(&[0u8; 3], &big, None, &mut [0f32; 3]),
    );
    let wide = Spec::variable(1, &[(1, u32::MAX as usize + 1)], norm(1));
    s.case("validate 1x1x2^32", Want::Invalid, || {
        wide.validate("limits")
    });
    // Per-sample statistics of the wrong lengths.
    let spec = Spec::variable(3, &[(2, 2)], norm(3));
    for n in [0usize, 1, 2, 4] {
        let stats = vec![1.0f32; n];
        let p = cpu::PerSample {
            mean: &stats,
            std: &stats,
        };
        s.case(
            &format!("cpu::normalize per-sample of {n}"),
            Want::Mismatch,
            || cpu::normalize(&[0u8; 12], &spec, Some(p), &mut [0f32; 12]),
        );
    }
    s.case("cpu::worst_error lengths 2 and 3", Want::Mismatch, || {
        cpu::worst_error(&[0f32; 2], &[0f64; 3], 0.0)
    });
    // Configurations at their extremes.
    for (name, x) in HUGE.into_iter().chain([("0", 0)]) {
        let base = StagerConfig::default;
        // Lower bounds only: a huge value is valid (one thread per call, no ramp).
        let lower = if x == 0 { Want::Invalid } else { Want::Ok };
        for (field, c, want) in [
            (
                "threads",
                StagerConfig {
                    threads: x,
                    ..base()
                },
                Want::Invalid,
            ),
            (
                "slot_bytes",
                StagerConfig {
                    slot_bytes: x,
                    ..base()
                },
                Want::Invalid,
            ),
            ("slots", StagerConfig { slots: x, ..base() }, Want::Invalid),
            (
                "bytes_per_thread",
                StagerConfig {
                    bytes_per_thread: x,
                    ..base()
                },
                lower,
            ),
            (
                "pieces_per_thread",
                StagerConfig {
                    pieces_per_thread: x,
                    ..base()
                },
                Want::Invalid,
            ),
            (
                "first_piece_bytes",
                StagerConfig {
                    first_piece_bytes: x,
                    ..base()
                },
                lower,
            ),
        ] {
            s.case(&format!("StagerConfig {{ {field}: {name} }}"), want, || {
                c.validate()
            });
            let p = PrefetchConfig {
                stager: c,
                ..Default::default()
            };
            s.case(
                &format!("PrefetchConfig {{ stager.{field}: {name} }}"),
                want,
                || p.validate(),
            );
        }
        // Fields where any value is accepted.
        for (field, c) in [
            (
                "min_bytes",
                StagerConfig {
                    min_bytes: x,
                    ..base()
                },
            ),
            (
                "streaming_max_bytes",
                StagerConfig {
                    streaming_max_bytes: x,
                    ..base()
                },
            ),
        ] {
            s.case(
                &format!("StagerConfig {{ {field}: {name} }}"),
                Want::Ok,
                || c.validate(),
            );
        }
        // Slots whose total overflows: a multiple of 64 KiB times many slots.
        let total = StagerConfig {
            slot_bytes: (x / 2) & !0xffff,
            slots: 4096,
            ..base()
        };
        s.case(
            &format!("StagerConfig 4096 slots of ({name} / 2)"),
            Want::Invalid,
            || total.validate(),
        );
        let base = PrefetchConfig::default;
        for (field, c) in [
            ("depth", PrefetchConfig { depth: x, ..base() }),
            (
                "loader_threads",
                PrefetchConfig {
                    loader_threads: x,
                    ..base()
                },
            ),
        ] {
            s.case(
                &format!("PrefetchConfig {{ {field}: {name} }}"),
                Want::Invalid,
                || c.validate(),
            );
        }
        // Spares are made only when batches are held: beyond MAX_EXPORT_SPARES is refused (the
        // values up to it: after the loop).
        let spares = PrefetchConfig {
            export_spares: x.max(MAX_EXPORT_SPARES + 1),
            ..base()
        };
        s.case(
            &format!("PrefetchConfig {{ export_spares: max({name}, MAX + 1) }}"),
            Want::Invalid,
            || spares.validate(),
        );
        let ahead = PrefetchConfig { ahead: x, ..base() };
        s.case(
            &format!("PrefetchConfig {{ ahead: {name} }}"),
            if x == 0 { Want::Ok } else { Want::Invalid },
            || ahead.validate(),
        );
    }
    // Export spares up to MAX_EXPORT_SPARES are accepted (the Python feed asks for 1024), one
    // more is refused.
    for (spares, want) in [
        (1024, Want::Ok),
        (MAX_EXPORT_SPARES, Want::Ok),
        (MAX_EXPORT_SPARES + 1, Want::Invalid),
    ] {
        let c = PrefetchConfig {
            export_spares: spares,
            ..PrefetchConfig::default()
        };
        s.case(
            &format!("PrefetchConfig {{ export_spares: {spares} }}"),
            want,
            || c.validate(),
        );
    }
    // Files: ranges past the end and offsets whose end overflows, on a small real file.
    if let Some(small) = Sparse::new("small", 4096) {
        if let Ok(file) = FileSource::open(&small.0) {
            let file = Arc::new(file);
            for (name, offset, len) in [
                ("4096, 1", 4096u64, 1usize),
                ("4097, 0", 4097, 0),
                ("0, 4097", 0, 4097),
                ("1, usize::MAX", 1, usize::MAX),
                ("u64::MAX, 1", u64::MAX, 1),
                ("u64::MAX, usize::MAX", u64::MAX, usize::MAX),
                ("u64::MAX - 1, 2", u64::MAX - 1, 2),
            ] {
                let p = Pixels::File {
                    file: file.clone(),
                    offset,
                    len,
                };
                s.case(
                    &format!("Pixels::read(file of 4096, {name})"),
                    Want::Io,
                    || p.read().map(|v| v.len()),
                );
            }
        }
    }
    // Plain functions with extreme inputs: no panic.
    s.plain("pcie_gen_from_gts(inf, nan, -1, 0, MAX)", || {
        [f64::INFINITY, f64::NAN, -1.0, 0.0, f64::MAX].map(pinstream::device::pcie_gen_from_gts)
    });
    s.plain("parse_link_speed of odd strings", || {
        ["", "x GT/s", "1e400 GT/s", "-5 GT/s", "NaN GT/s"].map(pinstream::device::parse_link_speed)
    });
    s.plain("Version::from_cuda(i32::MIN, -1, i32::MAX)", || {
        [i32::MIN, -1, i32::MAX].map(pinstream::Version::from_cuda)
    });
    s.plain("DriverStatus::from_parts at the extremes", || {
        [(i32::MIN, 0), (-1, u32::MAX), (i32::MAX, u32::MAX), (0, 0)].map(|(d, r)| {
            let st = pinstream::driver::DriverStatus::from_parts(d, None, r);
            (st.verdict(), st.driver_line(), st.needs_line(), st.advice())
        })
    });
    s.plain("driver_floor at the extremes", || {
        [0, -1, i32::MAX, i32::MIN]
            .map(|v| pinstream::driver::driver_floor(pinstream::Version::from_cuda(v)))
    });
    let (want_get, want_devices) = if pinstream::available() {
        (Want::Invalid, Want::Ok)
    } else {
        (Want::Any, Want::Any)
    };
    for (name, n) in HUGE {
        s.case(&format!("Device::get({name})"), want_get, || {
            Device::get(n).map(|d| d.ordinal())
        });
    }
    s.case("Device::all()", want_devices, || {
        Device::all().map(|v| v.len())
    });
}

/// `Stager::with_pool` refuses a pool registered read-only (downloads would write its slots,
/// and the driver answered them with cudaErrorInvalidValue).
fn read_only_pool(s: &mut Sweep) {
    let dev = match Device::get(0) {
        Ok(d) => d,
        Err(e) => return s.fail(format!("Device::get(0): {e}")),
    };
    for threads in [1usize, 4] {
        let config = PoolConfig {
            backing: PoolBacking::Register {
                threads,
                huge_pages: false,
                flags: HostRegister::READ_ONLY,
            },
            ..Default::default()
        };
        s.case(
            &format!("Stager::with_pool(READ_ONLY pool, {threads} fault threads)"),
            Want::Invalid,
            || {
                let pool = PinnedPool::new(&dev, config)?;
                Stager::with_pool(&pool, StagerConfig::default()).map(|st| st.config().slots)
            },
        );
    }
    // Other registrations, and the default pool, are fine.
    for flags in [HostRegister::DEFAULT, HostRegister::PORTABLE] {
        let config = PoolConfig {
            backing: PoolBacking::Register {
                threads: 2,
                huge_pages: false,
                flags,
            },
            ..Default::default()
        };
        s.case(
            &format!("Stager::with_pool({flags:?} pool)"),
            Want::Ok,
            || {
                let pool = PinnedPool::new(&dev, config)?;
                Stager::with_pool(&pool, StagerConfig::default()).map(|st| st.config().slots)
            },
        );
    }
}

/// A range as `slice` takes it.
type Bounds = (Bound<usize>, Bound<usize>);

/// Everything that needs a device.
fn device_sweep(s: &mut Sweep) {
    let dev = match Device::get(0) {
        Ok(d) => d,
        Err(e) => return s.fail(format!("Device::get(0): {e}")),
    };
    let stream = match dev.stream() {
        Ok(st) => st,
        Err(e) => return s.fail(format!("stream: {e}")),
    };
    // Constructors.
    s.case("Stream::new", Want::Ok, || Stream::new(&dev).map(drop));
    for p in [i32::MIN, i32::MAX, -1_000_000, 1_000_000] {
        s.case(
            &format!("Stream::with_priority({p})"),
            Want::Invalid,
            || Stream::with_priority(&dev, p).map(drop),
        );
    }
    s.case("Event::new", Want::Ok, || Event::new(&dev).map(drop));
    s.case("TimingEvent::new", Want::Ok, || {
        TimingEvent::new(&dev).map(drop)
    });
    for (name, n) in [("0", 0usize), ("1", 1)] {
        s.case(
            &format!("DeviceBuffer::<u8>::new({name})"),
            Want::Ok,
            || DeviceBuffer::<u8>::new(&dev, n).map(|b| b.len()),
        );
        s.case(
            &format!("DeviceBuffer::<u8>::new_async({name})"),
            Want::Ok,
            || DeviceBuffer::<u8>::new_async(&stream, n).map(|b| b.len()),
        );
        s.case(
            &format!("PinnedBuffer::<u8>::new({name})"),
            Want::Ok,
            || PinnedBuffer::<u8>::new(&dev, n, HostAlloc::DEFAULT).map(|b| b.len()),
        );
    }
    let pool = PinnedPool::new(&dev, PoolConfig::default());
    let register = PinnedPool::new(
        &dev,
        PoolConfig {
            backing: PoolBacking::Register {
                threads: usize::MAX,
                huge_pages: true,
                flags: HostRegister::DEFAULT,
            },
            max_cached_bytes: 0,
        },
    );
    s.case(
        "PinnedPool::new(Register, usize::MAX threads)",
        Want::Ok,
        || register.as_ref().map(drop).map_err(Clone::clone),
    );
    s.case(
        "PinnedPool::new(Register, 0 threads)",
        Want::Invalid,
        || {
            PinnedPool::new(
                &dev,
                PoolConfig {
                    backing: PoolBacking::Register {
                        threads: 0,
                        huge_pages: false,
                        flags: HostRegister::DEFAULT,
                    },
                    ..Default::default()
                },
            )
            .map(drop)
        },
    );
    for (name, n) in HUGE {
        s.case(
            &format!("DeviceBuffer::<u8>::new({name})"),
            Want::OomOrInvalid,
            || DeviceBuffer::<u8>::new(&dev, n).map(|b| b.len()),
        );
        s.case(
            &format!("DeviceBuffer::<u64>::new({name})"),
            Want::OomOrInvalid,
            || DeviceBuffer::<u64>::new(&dev, n).map(|b| b.len()),
        );
        s.case(
            &format!("DeviceBuffer::<u8>::new_async({name})"),
            Want::OomOrInvalid,
            || DeviceBuffer::<u8>::new_async(&stream, n).map(|b| b.len()),
        );
        for flags in [
            HostAlloc::DEFAULT,
            HostAlloc::PORTABLE,
            HostAlloc::MAPPED,
            HostAlloc::WRITE_COMBINED,
            HostAlloc::PORTABLE | HostAlloc::MAPPED | HostAlloc::WRITE_COMBINED,
        ] {
            s.case(
                &format!("PinnedBuffer::<u8>::new({name}, {flags:?})"),
                Want::OomOrInvalid,
                || PinnedBuffer::<u8>::new(&dev, n, flags).map(|b| b.len()),
            );
        }
        s.case(
            &format!("PinnedBuffer::<u32>::new({name})"),
            Want::OomOrInvalid,
            || PinnedBuffer::<u32>::new(&dev, n, HostAlloc::DEFAULT).map(|b| b.len()),
        );
        if let Ok(pool) = &pool {
            s.case(
                &format!("PinnedPool::alloc::<u8>({name})"),
                Want::OomOrInvalid,
                || pool.alloc::<u8>(n).map(|b| b.len()),
            );
            s.case(
                &format!("PinnedPool::alloc::<f64>({name})"),
                Want::OomOrInvalid,
                || pool.alloc::<f64>(n).map(|b| b.len()),
            );
        }
        if let Ok(pool) = &register {
            s.case(
                &format!("PinnedPool(Register)::alloc::<u8>({name})"),
                Want::OomOrInvalid,
                || pool.alloc::<u8>(n).map(|b| b.len()),
            );
        }
        let huge_slots = StagerConfig {
            slots: 1,
            slot_bytes: (n.min(1 << 40)) & !0xffff,
            ..Default::default()
        };
        s.case(
            &format!("Stager::new(1 slot of min({name}, 1 TiB))"),
            Want::OomOrInvalid,
            || Stager::new(&dev, huge_slots.clone()).map(|st| st.config().slots),
        );
    }
    if let Ok(pool) = &register {
        s.case(
            "PinnedPool(Register, usize::MAX threads)::alloc(4096)",
            Want::Ok,
            || pool.alloc::<u8>(4096).map(|b| b.len()),
        );
    }
    // Slices past the end and with overflowing bounds, on buffers of 16 elements.
    let (mut d, mut h) = match (
        DeviceBuffer::<u32>::new(&dev, 16),
        PinnedBuffer::<u32>::new(&dev, 16, HostAlloc::DEFAULT),
    ) {
        (Ok(d), Ok(h)) => (d, h),
        (d, h) => return s.fail(format!("buffers: {:?} {:?}", d.err(), h.err())),
    };
    let bad: [(&str, Bounds); 8] = [
        ("17..", (Bound::Included(17), Bound::Unbounded)),
        ("..17", (Bound::Unbounded, Bound::Excluded(17))),
        ("..=16", (Bound::Unbounded, Bound::Included(16))),
        (
            "..=usize::MAX",
            (Bound::Unbounded, Bound::Included(usize::MAX)),
        ),
        (
            "(usize::MAX excl)..",
            (Bound::Excluded(usize::MAX), Bound::Unbounded),
        ),
        (
            "usize::MAX..usize::MAX",
            (Bound::Included(usize::MAX), Bound::Excluded(usize::MAX)),
        ),
        ("5..4", (Bound::Included(5), Bound::Excluded(4))),
        (
            "1..usize::MAX",
            (Bound::Included(1), Bound::Excluded(usize::MAX)),
        ),
    ];
    for (name, r) in bad {
        s.case(
            &format!("DeviceBuffer::slice({name})"),
            Want::Invalid,
            || d.slice(r).map(|v| v.len()),
        );
        s.case(
            &format!("DeviceBuffer::slice_mut({name})"),
            Want::Invalid,
            || d.slice_mut(r).map(|v| v.len()),
        );
        s.case(
            &format!("PinnedBuffer::slice({name})"),
            Want::Invalid,
            || h.slice(r).map(|v| v.len()),
        );
    }
    s.case("DeviceBuffer::slice(16..16)", Want::Ok, || {
        d.slice(16..16).map(|v| v.len())
    });
    // Copies of mismatched lengths.
    for n in [0usize, 15, 17] {
        let src = vec![0u32; n];
        s.case(&format!("copy_h2d {n} -> 16"), Want::Mismatch, || {
            stream.copy_h2d(&src[..], &mut d).map(drop)
        });
        let mut dst = vec![0u32; n];
        s.case(&format!("copy_d2h 16 -> {n}"), Want::Mismatch, || {
            stream.copy_d2h(&d, &mut dst[..]).map(drop)
        });
        if let Ok(mut other) = DeviceBuffer::<u32>::new(&dev, n) {
            s.case(&format!("copy_d2d 16 -> {n}"), Want::Mismatch, || {
                stream.copy_d2d(&d, &mut other).map(drop)
            });
        }
    }
    s.case("copy_h2d pinned 16 -> 16", Want::Ok, || {
        stream.copy_h2d(&h, &mut d).map(drop)
    });
    let _ = h.as_mut_slice().map(|v| v.fill(1));
    // Normalize launches with huge specs: refused before the launch.
    if let (Ok(d_in), Ok(mut d_out)) = (
        DeviceBuffer::<u8>::new(&dev, 12),
        DeviceBuffer::<f32>::new(&dev, 12),
    ) {
        for (name, x) in HUGE {
            let spec = Spec::uniform(1, 3, x, x, norm(3)).unwrap();
            s.case(
                &format!("kernels::normalize 1x3x{name}x{name}"),
                Want::Invalid,
                || kernels::normalize::<f32, _, _>(&stream, &d_in, &spec, &mut d_out, None),
            );
        }
        let spec = Spec::uniform(1, 3, 2, 2, norm(3)).unwrap();
        s.case("kernels::normalize 12 in, 12 out", Want::Ok, || {
            kernels::normalize::<f32, _, _>(&stream, &d_in, &spec, &mut d_out, None)
        });
        let spec = Spec::uniform(1, 3, 2, 3, norm(3))
            .unwrap()
            .layouts(Layout::Nhwc, Layout::Nchw);
        s.case(
            "kernels::normalize 18 expected, 12 given",
            Want::Mismatch,
            || kernels::normalize::<f32, _, _>(&stream, &d_in, &spec, &mut d_out, None),
        );
        let mut sp = Spec::variable(3, &[(2, 2)], norm(3));
        sp.samples[0] = Sample {
            crop: Some(Crop {
                x: usize::MAX,
                y: 0,
                w: 2,
                h: 2,
            }),
            ..sp.samples[0]
        };
        s.case(
            "kernels::normalize crop at usize::MAX",
            Want::Invalid,
            || kernels::normalize::<f32, _, _>(&stream, &d_in, &sp, &mut d_out, None),
        );
    }
    // Resident pixels: ranges past the buffer and overflowing.
    if let Ok(buf) = PinnedBuffer::<u8>::new(&dev, 4096, HostAlloc::PORTABLE) {
        let buf = Arc::new(buf);
        for (name, offset, len) in [
            ("4096, 1", 4096usize, 1usize),
            ("0, 4097", 0, 4097),
            ("usize::MAX, 1", usize::MAX, 1),
            ("1, usize::MAX", 1, usize::MAX),
        ] {
            let p = Pixels::Resident {
                buf: buf.clone(),
                offset,
                len,
            };
            s.case(
                &format!("Pixels::read(resident of 4096, {name})"),
                Want::Invalid,
                || p.read().map(|v| v.len()),
            );
        }
    }
    // The stager: file ranges past the end, offsets whose end overflows, a 1 TiB sparse file.
    let stager = match Stager::new(&dev, StagerConfig::default()) {
        Ok(st) => st,
        Err(e) => return s.fail(format!("Stager::new: {e}")),
    };
    if let Some(sparse) = Sparse::new("stager", 1 << 40) {
        if let Ok(file) = FileSource::open(&sparse.0) {
            let mut d8 = match DeviceBuffer::<u8>::new(&dev, 1 << 20) {
                Ok(d) => d,
                Err(e) => return s.fail(format!("DeviceBuffer: {e}")),
            };
            for (name, offset) in [
                ("u64::MAX", u64::MAX),
                ("u64::MAX - 1", u64::MAX - 1),
                ("1 TiB", 1u64 << 40),
                ("1 TiB - 1", (1u64 << 40) - 1),
            ] {
                s.case(
                    &format!("Stager::upload_file(1 TiB file, {name}, 1 MiB)"),
                    Want::Io,
                    || stager.upload_file(&stream, &file, offset, &mut d8),
                );
            }
            s.case(
                "Stager::upload_file(1 TiB file, 1 TiB - 1 MiB, 1 MiB)",
                Want::Ok,
                || stager.upload_file(&stream, &file, (1 << 40) - (1 << 20), &mut d8),
            );
        }
    }
    let src = vec![0u32; 17];
    s.case("Stager::upload 17 -> 16", Want::Mismatch, || {
        stager.upload(&stream, &src, &mut d)
    });
    let mut dst = vec![0u32; 15];
    s.case("Stager::download 16 -> 15", Want::Mismatch, || {
        stager.download(&stream, &d, &mut dst)
    });
    s.case("synchronize", Want::Ok, || stream.synchronize());
}
