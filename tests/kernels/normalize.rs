//! Normalize / denormalize on the GPU against the f64 CPU reference (GPU trials, ignored without
//! a device), and the reference's own checks (CPU trials).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::common::guard::{self, Placement};
use crate::common::{ensure, rng, R};
use libtest_mimic::Trial;
use pinstream::kernels::{
    self, cpu, Crop, DenormInput, DevicePerSample, Layout, Normalize, OutputElement, Spec,
};
use pinstream::{bf16, f16, Device, DeviceBuffer, Error, Event, Stream};
use rand::rngs::SmallRng;
use rand::{Rng, RngCore};

use crate::common::trial;

/// Prefix of this module's trial names (its path in the binary).
const PREFIX: &str = "normalize/";

/// Which options a matrix trial turns on: every subset of {mirror, crop, pad, per-sample}.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Variant {
    mirror: bool,
    crop: bool,
    pad: bool,
    per_sample: bool,
}

impl Variant {
    fn all() -> Vec<Variant> {
        (0..16u8)
            .map(|m| Variant {
                mirror: m & 1 != 0,
                crop: m & 2 != 0,
                pad: m & 4 != 0,
                per_sample: m & 8 != 0,
            })
            .collect()
    }

    fn name(self) -> String {
        let mut parts = Vec::new();
        for (on, n) in [
            (self.mirror, "mirror"),
            (self.crop, "crop"),
            (self.pad, "pad"),
            (self.per_sample, "per-sample"),
        ] {
            if on {
                parts.push(n);
            }
        }
        if parts.is_empty() {
            "plain".into()
        } else {
            parts.join("+")
        }
    }
}

const LAYOUTS: [Layout; 2] = [Layout::Nchw, Layout::Nhwc];

/// Set in the environment of a child process that runs one trial alone (see `in_child`).
const CHILD_ENV: &str = "PINSTREAM_NORMALIZE_CHILD";

/// Kernel paths of `launch` in cuda/normalize.cu, for the guard-byte trials.
const PATHS: [&str; 3] = ["same_layout", "nhwc_to_nchw", "general"];
const DTYPES: [&str; 5] = ["f32", "f16", "bf16", "u8", "i8"];

/// A child process of one of these trials (this executable again, with the variable set): runs
/// its part and returns true, or exits; false in the test runner.
pub fn child_mode() -> bool {
    if let Ok(name) = std::env::var(CHILD_ENV) {
        std::process::exit(child_main(&name));
    }
    false
}

/// The trials of this module, named `normalize/...`.
pub fn trials() -> Vec<Trial> {
    let no_gpu = !pinstream::available();
    let mut trials = Vec::new();
    for dtype in DTYPES {
        for path in PATHS {
            let f = move || match dtype {
                "f32" => guard_bytes::<f32>(path),
                "f16" => guard_bytes::<f16>(path),
                "bf16" => guard_bytes::<bf16>(path),
                "u8" => guard_bytes::<u8>(path),
                _ => guard_bytes::<i8>(path),
            };
            trials.push(
                trial(PREFIX, format!("guard_bytes/{dtype}/{path}"), f).with_ignored_flag(no_gpu),
            );
        }
    }
    for (dtype, f) in [
        ("f32", guard_bytes_denormalize::<f32> as fn() -> R),
        ("f16", guard_bytes_denormalize::<f16>),
        ("bf16", guard_bytes_denormalize::<bf16>),
    ] {
        trials.push(
            trial(PREFIX, format!("guard_bytes/denormalize/{dtype}"), f).with_ignored_flag(no_gpu),
        );
    }
    // 4.3 GB in + 4.3 GB out; needs 12 GiB free. PINSTREAM_SKIP_HUGE=1 skips it (e.g. under
    // compute-sanitizer, where it would take hours).
    let huge_fits = !no_gpu
        && std::env::var_os("PINSTREAM_SKIP_HUGE").is_none()
        && Device::get(0)
            .and_then(|d| d.memory_info())
            .is_ok_and(|m| m.free >= 12 << 30);
    trials.push(
        trial(PREFIX, "huge_sample_general_kernel_finishes", || {
            in_child(
                "huge_sample_general_kernel_finishes",
                Duration::from_secs(240),
            )
        })
        .with_ignored_flag(!huge_fits),
    );
    for il in LAYOUTS {
        for ol in LAYOUTS {
            for v in Variant::all() {
                for dtype in ["f32", "f16", "bf16", "u8", "i8"] {
                    let name = format!("matrix/{il:?}-{ol:?}/{dtype}/{}", v.name()).to_lowercase();
                    let f = move || match dtype {
                        "f32" => matrix::<f32>(il, ol, v),
                        "f16" => matrix::<f16>(il, ol, v),
                        "bf16" => matrix::<bf16>(il, ol, v),
                        "u8" => matrix::<u8>(il, ol, v),
                        _ => matrix::<i8>(il, ol, v),
                    };
                    trials.push(trial(PREFIX, name, f).with_ignored_flag(no_gpu));
                }
            }
        }
    }
    type Case = (&'static str, fn() -> R);
    let gpu: [Case; 10] = [
        ("fast_paths_uniform", fast_paths_uniform),
        ("tables_queued_back_to_back", tables_queued_back_to_back),
        (
            "table_launch_does_not_wait_for_the_stream",
            table_launch_does_not_wait_for_the_stream,
        ),
        ("tables_wrap_the_ring/one_thread", || {
            tables_wrap_the_ring(1)
        }),
        ("tables_wrap_the_ring/two_threads", || {
            tables_wrap_the_ring(2)
        }),
        ("misaligned_views_fall_back", misaligned_views_fall_back),
        ("many_samples", many_samples),
        ("real_images", real_images),
        ("denormalize_round_trip", denormalize_round_trip),
        (
            "bad_input_is_refused_before_launch",
            bad_input_is_refused_before_launch,
        ),
    ];
    for (name, f) in gpu {
        trials.push(trial(PREFIX, name, f).with_ignored_flag(no_gpu));
    }
    let two_gpus = Device::count().is_ok_and(|n| n >= 2);
    trials.push(
        trial(PREFIX, "wrong_device_is_refused", wrong_device_is_refused)
            .with_ignored_flag(!two_gpus),
    );
    trials.push(trial(PREFIX, "cpu/reference_checks", cpu_reference_checks));
    trials.push(trial(PREFIX, "cpu/reference_values", cpu_reference_values));
    trials.push(trial(
        PREFIX,
        "cpu/saturation_is_not_error",
        cpu_saturation_is_not_error,
    ));
    trials.push(trial(
        PREFIX,
        "cli/verify_integer_output_of_photographs",
        cli_verify_integer_output_of_photographs,
    ));
    trials
}

fn random_u8(rng: &mut SmallRng, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    rng.fill_bytes(&mut v);
    v
}

fn random_norm(rng: &mut SmallRng, c: usize, scaled: bool) -> Normalize {
    let mean: Vec<f32> = (0..c).map(|_| rng.random_range(0.0..255.0)).collect();
    let std: Vec<f32> = (0..c).map(|_| rng.random_range(1.0..90.0)).collect();
    let n = Normalize::new(&mean, &std);
    if scaled {
        n.with_scale_shift(rng.random_range(0.25..4.0), rng.random_range(-2.0..2.0))
    } else {
        n
    }
}

/// Compares GPU output with the exact reference through the library's one error measure,
/// `OutputElement::rounding_error`: f32 within 1e-6 relative (to |ref| + |shift|: adding the
/// shift rounds at the shift's magnitude), 16-bit floats within one unit of rounding plus that
/// f32 error (it matters only where `+ shift` cancels to a value near zero), integers within one
/// unit of the rounded and saturated reference. Names the first element that is off.
fn compare<O: OutputElement + std::fmt::Debug>(
    what: &str,
    got: &[O],
    exact: &[f64],
    shift: f32,
    seed: u64,
) -> R {
    ensure(got.len() == exact.len(), || {
        format!("{what}: {} vs {} elements", got.len(), exact.len())
    })?;
    for (i, (g, &e)) in got.iter().zip(exact).enumerate() {
        let units = g.rounding_error(e, shift);
        // An unwritten (poisoned, NaN) element is infinitely wrong and fails too.
        if units > 1.0 {
            return Err(format!(
                "{what}: element {i}: got {g:?} ({}), exact {e} (reference {}), error {units:.3} units of rounding (seed {seed})",
                g.to_f64(),
                O::reference(e)
            )
            .into());
        }
    }
    Ok(())
}

/// Runs `spec` on the GPU (output poisoned first) and compares with the reference.
fn run_and_compare<O: OutputElement + std::fmt::Debug>(
    stream: &Stream,
    input: &[u8],
    spec: &Spec,
    per: Option<(&[f32], &[f32])>,
    what: &str,
    seed: u64,
) -> R {
    let dev = stream.device();
    let mut d_in = DeviceBuffer::<u8>::new(&dev, input.len())?;
    stream.copy_h2d(input, &mut d_in)?;
    let mut d_out = DeviceBuffer::<O>::new(&dev, spec.output_len()?)?;
    kernels::fill(stream, &mut d_out, O::poison())?;
    let per_dev = match per {
        Some((m, s)) => {
            let mut dm = DeviceBuffer::<f32>::new(&dev, m.len())?;
            let mut ds = DeviceBuffer::<f32>::new(&dev, s.len())?;
            stream.copy_h2d(m, &mut dm)?;
            stream.copy_h2d(s, &mut ds)?;
            Some((dm, ds))
        }
        None => None,
    };
    let p = per_dev
        .as_ref()
        .map(|(m, s)| DevicePerSample { mean: m, std: s });
    kernels::normalize::<O, _, _>(stream, &d_in, spec, &mut d_out, p)?;
    let mut got = vec![O::poison(); spec.output_len()?];
    let got = stream.copy_d2h(&d_out, &mut got[..])?.wait()?;
    let exact = cpu::normalize_exact(
        input,
        spec,
        per.map(|(mean, std)| cpu::PerSample { mean, std }),
    )?;
    compare(what, got, &exact, spec.norm.shift, seed)?;
    // The CPU path gives the same converted values as the reference rounding.
    let mut cpu_out = vec![O::poison(); spec.output_len()?];
    cpu::normalize(
        input,
        spec,
        per.map(|(mean, std)| cpu::PerSample { mean, std }),
        &mut cpu_out,
    )?;
    compare(
        &format!("{what} (cpu path)"),
        &cpu_out,
        &exact,
        spec.norm.shift,
        seed,
    )
}

fn matrix<O: OutputElement + std::fmt::Debug>(il: Layout, ol: Layout, v: Variant) -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let (mut rng, seed) = rng();
    let channel_counts: &[usize] = if v.pad { &[1, 2, 3] } else { &[1, 2, 3, 4] };
    // Awkward shapes: 1x1, 7x13, widths not multiples of 4 or 16, one sample and several.
    let batches: [&[(usize, usize)]; 4] = [
        &[(1, 1)],
        &[(7, 13)],
        &[(7, 13), (1, 1), (5, 9), (16, 17)],
        &[(24, 24); 3],
    ];
    for &c in channel_counts {
        for sizes in batches {
            let scaled = v.per_sample;
            let mut spec =
                Spec::variable(c, sizes, random_norm(&mut rng, c, scaled)).layouts(il, ol);
            if v.mirror {
                for (i, s) in spec.samples.iter_mut().enumerate() {
                    s.mirror = i % 2 == 0 || rng.random_bool(0.5);
                }
            }
            if v.crop {
                for s in spec.samples.iter_mut() {
                    let w = rng.random_range(1..=s.w);
                    let h = rng.random_range(1..=s.h);
                    s.crop = Some(Crop {
                        x: rng.random_range(0..=s.w - w),
                        y: rng.random_range(0..=s.h - h),
                        w,
                        h,
                    });
                }
            }
            if v.pad && c < 4 {
                spec = spec.pad_to_4(rng.random_range(-3.0..3.0));
            }
            let per = v.per_sample.then(|| {
                let n = spec.samples.len() * c;
                let m: Vec<f32> = (0..n).map(|_| rng.random_range(0.0..255.0)).collect();
                let s: Vec<f32> = (0..n).map(|_| rng.random_range(1.0..90.0)).collect();
                (m, s)
            });
            let input = random_u8(&mut rng, spec.input_len()?);
            let what = format!(
                "{il:?}->{ol:?} {} {} C={c} sizes {sizes:?}",
                O::NAME,
                v.name()
            );
            run_and_compare::<O>(
                &stream,
                &input,
                &spec,
                per.as_ref().map(|(m, s)| (&m[..], &s[..])),
                &what,
                seed,
            )?;
        }
    }
    Ok(())
}

/// The per-sample tables live in one scratch buffer per stream, reused launch after launch:
/// launches with different crops, queued back to back without a wait (the table growing and
/// shrinking), from four threads sharing clones of one stream, each must still read its own
/// table. Every output is checked only after all were queued.
fn tables_queued_back_to_back() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let (_, seed) = rng();
    let results = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..4u64)
            .map(|t| {
                let stream = stream.clone();
                scope.spawn(move || -> R {
                    let mut rng = <SmallRng as rand::SeedableRng>::seed_from_u64(seed ^ t);
                    let mut queued = Vec::new();
                    for k in 0..24 {
                        // 1..64 samples (tables of 48 B .. 3 KiB, growing and shrinking).
                        let n = 1 + (k * 7 + t as usize * 13) % 64;
                        let sizes: Vec<(usize, usize)> = (0..n)
                            .map(|_| (rng.random_range(4..20), rng.random_range(4..20)))
                            .collect();
                        let mut spec = Spec::variable(3, &sizes, random_norm(&mut rng, 3, false))
                            .layouts(Layout::Nhwc, Layout::Nchw);
                        for s in spec.samples.iter_mut() {
                            let (w, h) = (rng.random_range(1..=s.w), rng.random_range(1..=s.h));
                            s.crop = Some(Crop {
                                x: rng.random_range(0..=s.w - w),
                                y: rng.random_range(0..=s.h - h),
                                w,
                                h,
                            });
                            s.mirror = rng.random_bool(0.5);
                        }
                        let input = random_u8(&mut rng, spec.input_len()?);
                        let mut d_in = DeviceBuffer::<u8>::new(&dev, input.len())?;
                        stream.copy_h2d(&input[..], &mut d_in)?;
                        let mut d_out = DeviceBuffer::<f32>::new(&dev, spec.output_len()?)?;
                        stream.memset(&mut d_out, 0xFF)?; // NaN until written
                        kernels::normalize::<f32, _, _>(&stream, &d_in, &spec, &mut d_out, None)?;
                        queued.push((spec, input, d_in, d_out));
                    }
                    stream.synchronize()?;
                    for (k, (spec, input, _d_in, d_out)) in queued.iter().enumerate() {
                        let mut got = vec![0f32; spec.output_len()?];
                        stream.copy_d2h(d_out, &mut got[..])?.wait()?;
                        let exact = cpu::normalize_exact(input, spec, None)?;
                        let what =
                            format!("thread {t}, launch {k}, {} samples", spec.samples.len());
                        compare::<f32>(&what, &got, &exact, spec.norm.shift, seed)?;
                    }
                    Ok(())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("a thread panicked".into())))
            .collect::<Vec<R>>()
    });
    results.into_iter().collect()
}

/// A batch of `n` RGB samples with sides in `sides`, each cropped at random and mirrored every
/// other time on average: a different per-sample table on every call.
fn random_table_spec(rng: &mut SmallRng, n: usize, sides: std::ops::Range<usize>) -> Spec {
    let sizes: Vec<(usize, usize)> = (0..n)
        .map(|_| {
            (
                rng.random_range(sides.clone()),
                rng.random_range(sides.clone()),
            )
        })
        .collect();
    let mut spec =
        Spec::variable(3, &sizes, random_norm(rng, 3, false)).layouts(Layout::Nhwc, Layout::Nchw);
    for s in spec.samples.iter_mut() {
        let (w, h) = (rng.random_range(1..=s.w), rng.random_range(1..=s.h));
        s.crop = Some(Crop {
            x: rng.random_range(0..=s.w - w),
            y: rng.random_range(0..=s.h - h),
            w,
            h,
        });
        s.mirror = rng.random_bool(0.5);
    }
    spec
}

/// One non-uniform normalize: random input already on the device, the output poisoned (NaN
/// until written), both uploaded on `stream` before the launch is queued.
struct TableLaunch {
    spec: Spec,
    input: Vec<u8>,
    d_in: DeviceBuffer<u8>,
    d_out: DeviceBuffer<f32>,
}

impl TableLaunch {
    fn new(dev: &Device, stream: &Stream, rng: &mut SmallRng, spec: Spec) -> Result<Self, Error> {
        let input = random_u8(rng, spec.input_len()?);
        let mut d_in = DeviceBuffer::<u8>::new(dev, input.len())?;
        stream.copy_h2d(&input[..], &mut d_in)?;
        let mut d_out = DeviceBuffer::<f32>::new(dev, spec.output_len()?)?;
        stream.memset(&mut d_out, 0xFF)?;
        Ok(TableLaunch {
            spec,
            input,
            d_in,
            d_out,
        })
    }

    fn launch(&mut self, stream: &Stream) -> Result<(), Error> {
        kernels::normalize::<f32, _, _>(stream, &self.d_in, &self.spec, &mut self.d_out, None)
    }

    /// Against the CPU reference (reads back on `stream`, after every earlier use).
    fn check(&self, stream: &Stream, what: &str, seed: u64) -> R {
        let mut got = vec![0f32; self.spec.output_len()?];
        stream.copy_d2h(&self.d_out, &mut got[..])?.wait()?;
        let exact = cpu::normalize_exact(&self.input, &self.spec, None)?;
        let what = format!("{what}, {} samples", self.spec.samples.len());
        compare::<f32>(&what, &got, &exact, self.spec.norm.shift, seed)
    }
}

/// A launch with a per-sample table returns without waiting for the stream's earlier work:
/// behind a 300 ms spin it must return within 30 ms, with the stream still busy (the table used
/// to be a pageable `cudaMemcpyAsync`, which the driver staged only once the stream had drained:
/// the call returned after 304 ms on the H100). The output is checked afterwards.
fn table_launch_does_not_wait_for_the_stream() -> R {
    // Up to 256 samples the table travels in the launch's parameters, above through the ring.
    for n in [64, 256, 257, 1000] {
        table_launch_behind_a_spin(n)?;
    }
    Ok(())
}

fn table_launch_behind_a_spin(n: usize) -> R {
    const SPIN: Duration = Duration::from_millis(300);
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let (mut rng, seed) = rng();
    // The first table allocates the stream's scratch and ring: warm them with one of the size
    // the timed launch uploads.
    let spec = random_table_spec(&mut rng, n, 4..20);
    let mut warm = TableLaunch::new(&dev, &stream, &mut rng, spec)?;
    warm.launch(&stream)?;
    stream.synchronize()?;
    warm.check(&stream, "warm-up launch", seed)?;
    let spec = random_table_spec(&mut rng, n, 4..20);
    let mut timed = TableLaunch::new(&dev, &stream, &mut rng, spec)?;
    stream.synchronize()?;
    stream.spin(SPIN)?;
    let t = Instant::now();
    timed.launch(&stream)?;
    let took = t.elapsed();
    let busy = !stream.is_idle()?;
    stream.synchronize()?;
    timed.check(&stream, "launch behind the spin", seed)?;
    // A state check, not a clock: the spin still runs when the launch returns.
    ensure(busy, || {
        format!("{n} samples: the stream had finished its {SPIN:?} spin when the launch returned after {took:?}: it waited for the stream")
    })
}

/// Per-sample tables that overflow the stream's pinned table ring at its largest size (1 MiB,
/// `memory::ring::GROW_BYTES`: over 2 MiB of tables per thread here, each different), queued
/// behind a 200 ms spin from `threads` threads on clones of one stream: the ring grows, then
/// wraps onto regions whose uploads have not run yet, and must wait for them rather than
/// overwrite them (a table overwritten before its upload gives another batch's offsets and
/// crops, and the output check fails). Every output is checked after all were queued.
fn tables_wrap_the_ring(threads: usize) -> R {
    const LAUNCHES: usize = 24;
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let (mut rng, seed) = rng();
    let mut work: Vec<Vec<TableLaunch>> = Vec::new();
    for t in 0..threads {
        let mut mine = Vec::new();
        let mut table_bytes = 0;
        for _ in 0..LAUNCHES {
            // 1500..2600 samples: tables of 72..125 KB.
            let n = rng.random_range(1500..2600);
            table_bytes += n * 48;
            let spec = random_table_spec(&mut rng, n, 2..7);
            mine.push(TableLaunch::new(&dev, &stream, &mut rng, spec)?);
        }
        ensure(table_bytes > 2 << 20, || {
            format!("thread {t}: only {table_bytes} bytes of tables, the ring would not wrap")
        })?;
        work.push(mine);
    }
    // Inputs and poisoned outputs are in place; now hold the stream and queue every launch.
    stream.synchronize()?;
    stream.spin(Duration::from_millis(200))?;
    let done: Vec<Result<Vec<TableLaunch>, libtest_mimic::Failed>> = std::thread::scope(|scope| {
        let handles: Vec<_> = work
            .into_iter()
            .map(|mut mine| {
                let stream = stream.clone();
                scope.spawn(move || -> Result<Vec<TableLaunch>, libtest_mimic::Failed> {
                    for q in mine.iter_mut() {
                        q.launch(&stream)?;
                    }
                    Ok(mine)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err("a thread panicked".into())))
            .collect()
    });
    stream.synchronize()?;
    for (t, mine) in done.into_iter().enumerate() {
        for (k, q) in mine?.iter().enumerate() {
            q.check(&stream, &format!("thread {t}, launch {k}"), seed)?;
        }
    }
    Ok(())
}

/// Uniform batches that take the vectorised kernels (h*w a multiple of 4, aligned buffers),
/// including a last transpose tile that is only partly full, for every type and layout pair.
fn fast_paths_uniform() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let (mut rng, seed) = rng();
    for &(n, h, w) in &[
        (4usize, 32usize, 40usize),
        (2, 24, 24),
        (3, 1, 4),
        (1, 64, 64),
    ] {
        for c in 1..=4 {
            for il in LAYOUTS {
                for ol in LAYOUTS {
                    let spec =
                        Spec::uniform(n, c, h, w, random_norm(&mut rng, c, false))?.layouts(il, ol);
                    let input = random_u8(&mut rng, spec.input_len()?);
                    let what = format!("uniform {n}x{c}x{h}x{w} {il:?}->{ol:?}");
                    run_and_compare::<f32>(&stream, &input, &spec, None, &what, seed)?;
                    run_and_compare::<f16>(&stream, &input, &spec, None, &what, seed)?;
                    run_and_compare::<bf16>(&stream, &input, &spec, None, &what, seed)?;
                    run_and_compare::<u8>(&stream, &input, &spec, None, &what, seed)?;
                    run_and_compare::<i8>(&stream, &input, &spec, None, &what, seed)?;
                }
            }
        }
    }
    // Per-sample statistics through the fast kernels.
    let spec = Spec::uniform(3, 3, 32, 32, Normalize::imagenet())?;
    let m: Vec<f32> = (0..9).map(|_| rng.random_range(0.0..255.0)).collect();
    let s: Vec<f32> = (0..9).map(|_| rng.random_range(1.0..90.0)).collect();
    for (il, ol) in [
        (Layout::Nchw, Layout::Nchw),
        (Layout::Nhwc, Layout::Nchw),
        (Layout::Nhwc, Layout::Nhwc),
    ] {
        let spec = spec.clone().layouts(il, ol);
        let input = random_u8(&mut rng, spec.input_len()?);
        run_and_compare::<f32>(
            &stream,
            &input,
            &spec,
            Some((&m, &s)),
            "uniform per-sample",
            seed,
        )?;
    }
    Ok(())
}

/// Views that start at odd offsets cannot take the vectorised kernels: still right.
fn misaligned_views_fall_back() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let (mut rng, seed) = rng();
    let spec =
        Spec::uniform(2, 3, 16, 16, Normalize::imagenet())?.layouts(Layout::Nhwc, Layout::Nchw);
    let input = random_u8(&mut rng, spec.input_len()?);
    let mut d_in = DeviceBuffer::<u8>::new(&dev, input.len() + 1)?;
    stream.copy_h2d(&input[..], &mut d_in.slice_mut(1..)?)?;
    let mut d_out = DeviceBuffer::<f32>::new(&dev, spec.output_len()? + 1)?;
    kernels::fill(&stream, &mut d_out, f32::NAN)?;
    kernels::normalize::<f32, _, _>(
        &stream,
        &d_in.slice(1..)?,
        &spec,
        &mut d_out.slice_mut(1..)?,
        None,
    )?;
    let mut got = vec![0f32; spec.output_len()? + 1];
    let got = stream.copy_d2h(&d_out, &mut got[..])?.wait()?;
    ensure(got[0].is_nan(), || {
        "the element before the view was written".into()
    })?;
    let exact = cpu::normalize_exact(&input, &spec, None)?;
    compare("misaligned views", &got[1..], &exact, 0.0, seed)
}

fn many_samples() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let (mut rng, seed) = rng();
    let sizes: Vec<(usize, usize)> = (0..300)
        .map(|_| (rng.random_range(1..20), rng.random_range(1..20)))
        .collect();
    let mut spec =
        Spec::variable(3, &sizes, Normalize::imagenet()).layouts(Layout::Nhwc, Layout::Nchw);
    for s in spec.samples.iter_mut() {
        s.mirror = rng.random_bool(0.5);
    }
    let input = random_u8(&mut rng, spec.input_len()?);
    run_and_compare::<f16>(&stream, &input, &spec, None, "300 variable samples", seed)
}

/// The directory of the sample images, found at run time.
fn images_dir() -> Result<PathBuf, String> {
    let roots = [
        std::env::var_os("CARGO_MANIFEST_DIR").map(PathBuf::from),
        std::env::current_dir().ok(),
    ];
    roots
        .into_iter()
        .flatten()
        .map(|r| r.join("tests/data/images"))
        .find(|p| p.join("astronaut.png").is_file())
        .ok_or_else(|| "tests/data/images not found (run from the repository root)".to_string())
}

/// A variable-size batch of the real images, one batch per channel count (1, 3 and 4).
fn real_images() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let dir = images_dir()?;
    let groups: [(usize, &[&str]); 3] = [
        (1, &["camera.png"]),
        (
            3,
            &["astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg"],
        ),
        (4, &["logo.png"]),
    ];
    for (c, files) in groups {
        let mut pixels = Vec::new();
        let mut sizes = Vec::new();
        for f in files {
            let img = image::open(dir.join(f)).map_err(|e| format!("{f}: {e}"))?;
            let (w, h) = (img.width() as usize, img.height() as usize);
            let raw = match c {
                1 => img.to_luma8().into_raw(),
                3 => img.to_rgb8().into_raw(),
                _ => img.to_rgba8().into_raw(),
            };
            ensure(raw.len() == w * h * c, || {
                format!("{f}: decoded {} bytes", raw.len())
            })?;
            pixels.extend_from_slice(&raw);
            sizes.push((h, w));
        }
        let mean = vec![120.0f32; c];
        let std = vec![60.0f32; c];
        let spec = Spec::variable(c, &sizes, Normalize::new(&mean, &std))
            .layouts(Layout::Nhwc, Layout::Nchw);
        run_and_compare::<f32>(
            &stream,
            &pixels,
            &spec,
            None,
            &format!("images {files:?}"),
            0,
        )?;
        run_and_compare::<bf16>(
            &stream,
            &pixels,
            &spec,
            None,
            &format!("images {files:?}"),
            0,
        )?;
    }
    Ok(())
}

fn denormalize_round_trip() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let (mut rng, seed) = rng();
    for layout in LAYOUTS {
        let spec = Spec::uniform(2, 3, 9, 11, Normalize::imagenet())?.layouts(layout, layout);
        let input = random_u8(&mut rng, spec.input_len()?);
        let mut d_in = DeviceBuffer::<u8>::new(&dev, input.len())?;
        stream.copy_h2d(&input[..], &mut d_in)?;
        let mut norm32 = DeviceBuffer::<f32>::new(&dev, spec.output_len()?)?;
        let mut norm16 = DeviceBuffer::<bf16>::new(&dev, spec.output_len()?)?;
        kernels::normalize::<f32, _, _>(&stream, &d_in, &spec, &mut norm32, None)?;
        kernels::normalize::<bf16, _, _>(&stream, &d_in, &spec, &mut norm16, None)?;
        let mut back = DeviceBuffer::<u8>::new(&dev, input.len())?;
        for (name, exact) in [("f32", true), ("bf16", false)] {
            kernels::fill(&stream, &mut back, 0xABu8)?;
            if exact {
                kernels::denormalize::<f32, _, _>(&stream, &norm32, &spec, &mut back)?;
            } else {
                kernels::denormalize::<bf16, _, _>(&stream, &norm16, &spec, &mut back)?;
            }
            let mut got = vec![0u8; input.len()];
            let got = stream.copy_d2h(&back, &mut got[..])?.wait()?;
            for (i, (&g, &x)) in got.iter().zip(&input).enumerate() {
                let tol = if exact { 0 } else { 1 };
                ensure((i32::from(g) - i32::from(x)).abs() <= tol, || {
                    format!("{layout:?} {name}: element {i}: {x} came back as {g} (seed {seed})")
                })?;
            }
        }
        // The reference inverse agrees.
        let mut host32 = vec![0f32; spec.output_len()?];
        cpu::normalize(&input, &spec, None, &mut host32)?;
        let mut back_cpu = vec![0u8; input.len()];
        cpu::denormalize(&host32, &spec, &mut back_cpu)?;
        ensure(back_cpu == input, || {
            format!("{layout:?}: cpu round trip differs")
        })?;
    }
    Ok(())
}

/// Input, output or per-sample table on another device than the stream: a typed error, and the
/// output is left untouched.
fn wrong_device_is_refused() -> R {
    let (d0, d1) = (Device::get(0)?, Device::get(1)?);
    let s0 = d0.stream()?;
    let spec = Spec::uniform(2, 3, 4, 4, Normalize::imagenet())?;
    let in0 = DeviceBuffer::<u8>::new(&d0, spec.input_len()?)?;
    let in1 = DeviceBuffer::<u8>::new(&d1, spec.input_len()?)?;
    let mut out0 = DeviceBuffer::<f32>::new(&d0, spec.output_len()?)?;
    let mut out1 = DeviceBuffer::<f32>::new(&d1, spec.output_len()?)?;
    kernels::fill(&s0, &mut out0, 7.0f32)?;
    let wrong = |e: Result<(), Error>| matches!(e, Err(Error::WrongDevice { .. }));
    ensure(
        wrong(kernels::normalize::<f32, _, _>(
            &s0, &in1, &spec, &mut out0, None,
        )),
        || "input on device 1".into(),
    )?;
    ensure(
        wrong(kernels::normalize::<f32, _, _>(
            &s0, &in0, &spec, &mut out1, None,
        )),
        || "output on device 1".into(),
    )?;
    let back = s0
        .copy_d2h(&out0, &mut vec![0f32; spec.output_len()?][..])?
        .wait()?
        .to_vec();
    ensure(back.iter().all(|&x| x == 7.0), || {
        "output was touched".into()
    })
}

fn bad_input_is_refused_before_launch() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let spec = Spec::uniform(2, 3, 4, 4, Normalize::imagenet())?;
    let d_in = DeviceBuffer::<u8>::new(&dev, spec.input_len()?)?;
    let mut d_out = DeviceBuffer::<f32>::new(&dev, spec.output_len()?)?;
    kernels::fill(&stream, &mut d_out, 7.0f32)?;
    let invalid = |e: Result<(), Error>| matches!(e, Err(Error::InvalidArgument { .. }));
    let mut bad = spec.clone();
    bad.norm.std[1] = 0.0;
    ensure(
        invalid(kernels::normalize::<f32, _, _>(
            &stream, &d_in, &bad, &mut d_out, None,
        )),
        || "std 0".into(),
    )?;
    bad.norm.std[1] = f32::NAN;
    ensure(
        invalid(kernels::normalize::<f32, _, _>(
            &stream, &d_in, &bad, &mut d_out, None,
        )),
        || "std NaN".into(),
    )?;
    let mut bad = spec.clone();
    bad.channels = 5;
    ensure(
        invalid(kernels::normalize::<f32, _, _>(
            &stream, &d_in, &bad, &mut d_out, None,
        )),
        || "5 channels".into(),
    )?;
    let mut bad = spec.clone();
    bad.samples.clear();
    ensure(
        invalid(kernels::normalize::<f32, _, _>(
            &stream, &d_in, &bad, &mut d_out, None,
        )),
        || "no samples".into(),
    )?;
    let mut bad = spec.clone();
    bad.samples[1].crop = Some(Crop {
        x: 2,
        y: 0,
        w: 3,
        h: 4,
    });
    ensure(
        invalid(kernels::normalize::<f32, _, _>(
            &stream, &d_in, &bad, &mut d_out, None,
        )),
        || "crop outside".into(),
    )?;
    let short = DeviceBuffer::<u8>::new(&dev, spec.input_len()? - 1)?;
    let e = kernels::normalize::<f32, _, _>(&stream, &short, &spec, &mut d_out, None);
    ensure(matches!(e, Err(Error::LengthMismatch { .. })), || {
        format!("{e:?}")
    })?;
    let mut wrong_out = DeviceBuffer::<f32>::new(&dev, spec.output_len()? + 1)?;
    let e = kernels::normalize::<f32, _, _>(&stream, &d_in, &spec, &mut wrong_out, None);
    ensure(matches!(e, Err(Error::LengthMismatch { .. })), || {
        format!("{e:?}")
    })?;
    let short_stats = DeviceBuffer::<f32>::new(&dev, 5)?;
    let e = kernels::normalize::<f32, _, _>(
        &stream,
        &d_in,
        &spec,
        &mut d_out,
        Some(DevicePerSample {
            mean: &short_stats,
            std: &short_stats,
        }),
    );
    ensure(matches!(e, Err(Error::LengthMismatch { .. })), || {
        format!("{e:?}")
    })?;
    let e = kernels::denormalize::<f32, _, _>(
        &stream,
        &d_out,
        &spec.clone().pad_to_4(0.0),
        &mut DeviceBuffer::<u8>::new(&dev, spec.input_len()?)?,
    );
    ensure(invalid(e), || "denormalize with padding".into())?;
    // Nothing was written.
    let mut got = vec![0f32; spec.output_len()?];
    let got = stream.copy_d2h(&d_out, &mut got[..])?.wait()?;
    ensure(got.iter().all(|&v| v == 7.0), || {
        "a refused launch wrote the output".into()
    })
}

fn cpu_reference_checks() -> R {
    let spec = Spec::uniform(1, 3, 2, 2, Normalize::imagenet())?;
    let input = vec![1u8; 12];
    let mut out = vec![0f32; 12];
    cpu::normalize(&input, &spec, None, &mut out)?;
    let e = cpu::normalize(&input[..11], &spec, None, &mut out);
    ensure(matches!(e, Err(Error::LengthMismatch { .. })), || {
        format!("{e:?}")
    })?;
    let mut bad = spec.clone();
    bad.norm.mean.pop();
    let e = cpu::normalize(&input, &bad, None, &mut out);
    ensure(matches!(e, Err(Error::InvalidArgument { .. })), || {
        format!("{e:?}")
    })?;
    let mut bad = spec.clone();
    bad.samples[0].h = 0;
    let e = cpu::normalize(&input, &bad, None, &mut out);
    ensure(matches!(e, Err(Error::InvalidArgument { .. })), || {
        format!("{e:?}")
    })?;
    let e = cpu::normalize(
        &input,
        &spec,
        Some(cpu::PerSample {
            mean: &[1.0],
            std: &[1.0],
        }),
        &mut out,
    );
    ensure(matches!(e, Err(Error::LengthMismatch { .. })), || {
        format!("{e:?}")
    })?;
    let msg = Spec::uniform(
        1,
        3,
        2,
        2,
        Normalize::new(&[0.0, 0.0, 0.0], &[1.0, 0.0, 1.0]),
    )?
    .validate("x")
    .err()
    .map(|e| e.to_string())
    .unwrap_or_default();
    ensure(msg.contains("std[1]"), || msg.clone())
}

/// Hand-computed values: layouts, mirror, crop, pad and conversions.
fn cpu_reference_values() -> R {
    // One 2x3 RGB image, NHWC, pixel (y, x) channel c = 10*(3*y + x) + c.
    let input: Vec<u8> = (0..2 * 3)
        .flat_map(|p| (0..3).map(move |c| (10 * p + c) as u8))
        .collect();
    let norm = Normalize::new(&[1.0, 2.0, 3.0], &[2.0, 4.0, 8.0]);
    let mut spec = Spec::variable(3, &[(2, 3)], norm).layouts(Layout::Nhwc, Layout::Nchw);
    spec.samples[0].crop = Some(Crop {
        x: 1,
        y: 1,
        w: 2,
        h: 1,
    });
    spec.samples[0].mirror = true;
    let spec = spec.pad_to_4(-1.0);
    let exact = cpu::normalize_exact(&input, &spec, None)?;
    // Crop row 1, columns 1..3 -> pixels 4 and 5; mirrored -> 5, 4.
    let want = [
        (50.0 - 1.0) / 2.0,
        (40.0 - 1.0) / 2.0,
        (51.0 - 2.0) / 4.0,
        (41.0 - 2.0) / 4.0,
        (52.0 - 3.0) / 8.0,
        (42.0 - 3.0) / 8.0,
        -1.0,
        -1.0,
    ];
    ensure(exact == want, || format!("{exact:?} != {want:?}"))?;
    ensure(
        u8::from_f64(2.5) == 2
            && u8::from_f64(3.5) == 4
            && u8::from_f64(-7.0) == 0
            && u8::from_f64(300.0) == 255,
        || "u8 rounding".into(),
    )?;
    ensure(
        i8::from_f64(-200.0) == -128 && i8::from_f64(-0.5) == 0 && i8::from_f64(126.5) == 126,
        || "i8 rounding".into(),
    )?;
    ensure(
        f16::from_f64(1.0 + 1.0 / 2048.0) == f16::from_f64(1.0),
        || "f16 ties to even".into(),
    )
}

// ---- guard bytes -------------------------------------------------------------------------------

/// A batch that `launch` in cuda/normalize.cu sends down `path` when its buffers are aligned:
/// same_layout (uniform, one layout, h*w % 4 == 0), nhwc_to_nchw (uniform, h*w % 4 == 0,
/// h*w*c % 16 == 0; 16x40 gives a full and a partial 512-pixel tile), general (mirror, crops,
/// padding, variable sizes).
fn path_specs(path: &str, rng: &mut SmallRng) -> Vec<Spec> {
    let mut specs = Vec::new();
    for c in 1..=4 {
        match path {
            "same_layout" => {
                for l in LAYOUTS {
                    specs.push(
                        Spec::uniform(3, c, 8, 12, random_norm(rng, c, true))
                            .unwrap()
                            .layouts(l, l),
                    );
                }
            }
            "nhwc_to_nchw" => specs.push(
                Spec::uniform(2, c, 16, 40, random_norm(rng, c, true))
                    .unwrap()
                    .layouts(Layout::Nhwc, Layout::Nchw),
            ),
            _ => {
                for (il, ol) in [
                    (Layout::Nchw, Layout::Nchw),
                    (Layout::Nhwc, Layout::Nchw),
                    (Layout::Nchw, Layout::Nhwc),
                ] {
                    let mut spec =
                        Spec::variable(c, &[(7, 13), (5, 8), (16, 17)], random_norm(rng, c, true))
                            .layouts(il, ol);
                    spec.samples[0].mirror = true;
                    spec.samples[2].crop = Some(Crop {
                        x: 3,
                        y: 2,
                        w: 9,
                        h: 11,
                    });
                    if c < 4 {
                        spec = spec.pad_to_4(rng.random_range(-3.0..3.0));
                    }
                    specs.push(spec);
                }
            }
        }
    }
    specs
}

/// The output view of every batch in `path_specs(path)` sits between guard regions: aligned
/// (the fast kernel) and at odd offsets (the general kernel); the guards must stay intact and the
/// values match the reference.
fn guard_bytes<O: OutputElement + std::fmt::Debug>(path: &str) -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let (mut rng, seed) = rng();
    for spec in path_specs(path, &mut rng) {
        let input = random_u8(&mut rng, spec.input_len()?);
        let exact = cpu::normalize_exact(&input, &spec, None)?;
        for at in [Placement::ALIGNED, Placement::ODD] {
            let what = format!(
                "{path} {} {:?}->{:?} C={} {at:?} (seed {seed})",
                O::NAME,
                spec.in_layout,
                spec.out_layout,
                spec.channels
            );
            let run = guard::normalize_guarded::<O>(
                &stream,
                &input,
                at,
                &spec,
                None,
                spec.output_len()?,
                &what,
            )?;
            run.result?;
            compare(&what, &run.out, &exact, spec.norm.shift, seed)?;
        }
    }
    Ok(())
}

/// denormalize into a u8 view between guards, both layouts, aligned and odd placements; the
/// result matches the CPU inverse within one unit (the kernel divides in f32).
fn guard_bytes_denormalize<I: DenormInput + OutputElement + std::fmt::Debug>() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let (mut rng, seed) = rng();
    for c in 1..=4 {
        for layout in LAYOUTS {
            let spec =
                Spec::uniform(2, c, 9, 12, random_norm(&mut rng, c, true))?.layouts(layout, layout);
            // Values beyond the normalized range too, so that some saturate.
            let input: Vec<I> = (0..spec.input_len()?)
                .map(|_| <I as OutputElement>::from_f64(rng.random_range(-6.0..6.0)))
                .collect();
            let mut want = vec![0u8; input.len()];
            cpu::denormalize(&input, &spec, &mut want)?;
            for at in [Placement::ALIGNED, Placement::ODD] {
                let what = format!(
                    "denormalize {} {layout:?} C={c} {at:?} (seed {seed})",
                    <I as OutputElement>::NAME
                );
                let run =
                    guard::denormalize_guarded(&stream, &input, at, &spec, input.len(), &what)?;
                run.result?;
                for (i, (&g, &w)) in run.out.iter().zip(&want).enumerate() {
                    ensure((i32::from(g) - i32::from(w)).abs() <= 1, || {
                        format!("{what}: element {i}: got {g}, cpu {w}")
                    })?;
                }
            }
        }
    }
    Ok(())
}

// ---- one sample of 2^32 - 2^16 pixels ---------------------------------------------------------

/// Runs the trial `name` in a child process (this executable, with `CHILD_ENV` set) and kills
/// it after `limit`: a kernel that never finishes cannot hang this process (freeing memory,
/// and the other trials, would wait for it forever; killing the child ends its context).
fn in_child(name: &str, limit: Duration) -> R {
    let exe = std::env::current_exe()?;
    let mut child = std::process::Command::new(exe)
        .env(CHILD_ENV, name)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    let drain = |r: Option<Box<dyn std::io::Read + Send>>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            if let Some(mut r) = r {
                let _ = r.read_to_string(&mut s);
            }
            s
        })
    };
    let out = drain(child.stdout.take().map(|o| Box::new(o) as _));
    let err = drain(child.stderr.take().map(|e| Box::new(e) as _));
    let start = Instant::now();
    let status = loop {
        if let Some(st) = child.try_wait()? {
            break Some(st);
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let text = format!(
        "{}{}",
        out.join().unwrap_or_default(),
        err.join().unwrap_or_default()
    );
    match status {
        Some(st) if st.success() => Ok(()),
        Some(st) => Err(format!("{name} (child process, {st}): {text}").into()),
        None => Err(format!(
            "{name}: the child process had not finished after {limit:?} and was killed: {text}"
        )
        .into()),
    }
}

/// The child side of `in_child`: runs one trial, exit status 0 if it passed.
fn child_main(name: &str) -> i32 {
    let r = match name {
        "huge_sample_general_kernel_finishes" => huge_sample_general_kernel_finishes(),
        _ => Err(format!("unknown child trial {name}").into()),
    };
    match r {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("{}", e.message().unwrap_or("failed"));
            1
        }
    }
}

/// One 1-channel sample of 65536 x 65535 = 2^32 - 2^16 pixels, mirrored (which forces the
/// general kernel), u8 out. The general kernel's 32-bit pixel index used to wrap for samples
/// above 2^32 - 2^20 pixels and loop forever: this fails (does not hang) if the kernel has not
/// finished within 60 s, then checks all of the first and last 4 MiB of the output and 10^6
/// random pixels against the formula.
fn huge_sample_general_kernel_finishes() -> R {
    const H: usize = 65536;
    const W: usize = 65535;
    const CHUNK: usize = 64 << 20;
    const ENDS: usize = 4 << 20;
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let (mut rng, seed) = rng();
    // A small std and a shift of 128 put many results beyond 0..255: saturation is covered.
    let norm = Normalize::new(
        &[rng.random_range(0.0..255.0)],
        &[rng.random_range(0.5..2.0)],
    )
    .with_scale_shift(1.0, 128.0);
    let mut spec = Spec::variable(1, &[(H, W)], norm);
    spec.samples[0].mirror = true;
    let n = spec.input_len()?;
    // Input: one random 64 MiB chunk, repeated.
    let chunk = random_u8(&mut rng, CHUNK);
    let mut d_chunk = DeviceBuffer::<u8>::new(&dev, CHUNK)?;
    stream.copy_h2d(&chunk[..], &mut d_chunk)?;
    let mut d_in = DeviceBuffer::<u8>::new(&dev, n)?;
    for start in (0..n).step_by(CHUNK) {
        let len = CHUNK.min(n - start);
        stream.copy_d2d(
            &d_chunk.slice(..len)?,
            &mut d_in.slice_mut(start..start + len)?,
        )?;
    }
    let mut d_out = DeviceBuffer::<u8>::new(&dev, n)?;
    kernels::fill(&stream, &mut d_out, u8::poison())?;
    let t0 = Instant::now();
    kernels::normalize::<u8, _, _>(&stream, &d_in, &spec, &mut d_out, None)?;
    let done = Event::new(&dev)?;
    stream.record(&done)?;
    while !done.is_complete()? {
        if t0.elapsed() > Duration::from_secs(60) {
            eprintln!(
                "the general kernel has not finished a {H}x{W} sample after 60 s: its pixel index wraps (seed {seed})"
            );
            // Exit without dropping the buffers: freeing them would wait for the kernel.
            std::process::exit(3);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    println!("{H}x{W} sample normalized in {:?}", t0.elapsed());
    let mut host = vec![0u8; n];
    let got = stream.copy_d2h(&d_out, &mut host[..])?.wait()?;
    let (mean, std) = (f64::from(spec.norm.mean[0]), f64::from(spec.norm.std[0]));
    let shift = spec.norm.shift;
    let check = |p: usize| -> R {
        let (y, x) = (p / W, p % W);
        let xin = chunk[(y * W + (W - 1 - x)) % CHUNK];
        let exact = (f64::from(xin) - mean) / std + f64::from(shift);
        let units = got[p].rounding_error(exact, shift);
        ensure(units <= 1.0, || {
            format!(
                "pixel {p} (y {y}, x {x}): got {}, exact {exact} from input {xin}, error {units} units (seed {seed})",
                got[p]
            )
        })
    };
    for p in (0..ENDS).chain(n - ENDS..n) {
        check(p)?;
    }
    for _ in 0..1_000_000 {
        check(rng.random_range(0..n))?;
    }
    Ok(())
}

// ---- saturation and --verify ------------------------------------------------------------------

/// Integer outputs saturate: the reference they are measured against saturates too. The exact
/// values here reach far beyond 0..255 and -128..127 (the old measure, against the exact value,
/// called them errors of hundreds of units).
fn cpu_saturation_is_not_error() -> R {
    let (mut rng, seed) = rng();
    let spec = Spec::uniform(2, 3, 17, 19, Normalize::new(&[128.0; 3], &[0.25; 3]))?
        .layouts(Layout::Nhwc, Layout::Nchw);
    let input = random_u8(&mut rng, spec.input_len()?);
    let exact = cpu::normalize_exact(&input, &spec, None)?;
    ensure(
        exact.iter().any(|&e| e > 300.0) && exact.iter().any(|&e| e < -300.0),
        || format!("the values do not saturate (seed {seed})"),
    )?;
    let mut u = vec![0u8; exact.len()];
    cpu::normalize(&input, &spec, None, &mut u)?;
    let mut i = vec![0i8; exact.len()];
    cpu::normalize(&input, &spec, None, &mut i)?;
    for (name, w) in [
        ("u8", cpu::worst_error(&u, &exact, 0.0)?),
        ("i8", cpu::worst_error(&i, &exact, 0.0)?),
    ] {
        let w = w.ok_or("no elements")?;
        ensure(w.units == 0.0, || {
            format!("{name}: worst error {w:?} (seed {seed})")
        })?;
    }
    // A value off by two is still found.
    u[5] = if u[5] >= 128 { u[5] - 2 } else { u[5] + 2 };
    let w = cpu::worst_error(&u, &exact, 0.0)?.ok_or("no elements")?;
    ensure(w.index == 5 && w.units == 2.0, || {
        format!("a wrong value: {w:?} (seed {seed})")
    })
}

/// The pinstream program next to this test executable (cargo builds it for integration tests).
fn pinstream_bin() -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut candidates: Vec<PathBuf> = exe
        .parent()
        .and_then(Path::parent)
        .map(|d| d.join("pinstream"))
        .into_iter()
        .collect();
    if let Some(root) = std::env::var_os("CARGO_MANIFEST_DIR") {
        candidates.push(PathBuf::from(root).join(".gpu/bin/pinstream"));
    }
    candidates
        .into_iter()
        .find(|p| p.is_file())
        .ok_or_else(|| "the pinstream program was not found (run via cargo test)".to_string())
}

/// `pinstream normalize --cpu --dtype u8|i8 --verify` on photographs with the ImageNet
/// statistics (half of the results are negative, so u8 saturates) used to fail with "error of
/// 2.12 units of rounding"; it must pass, in both layouts.
fn cli_verify_integer_output_of_photographs() -> R {
    let bin = pinstream_bin()?;
    let images = images_dir()?;
    let dir = std::env::temp_dir().join(format!("pinstream-normalize-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let out = dir.join("batch.npy");
    let result = (|| -> R {
        for dtype in ["u8", "i8"] {
            for layout in ["nchw", "nhwc"] {
                let o = std::process::Command::new(&bin)
                    .arg("normalize")
                    .arg("--input")
                    .arg(images.join("astronaut.png"))
                    .arg(images.join("coffee.png"))
                    .args(["--preset", "imagenet", "--dtype", dtype, "--layout", layout])
                    .args(["--cpu", "--verify", "--out"])
                    .arg(&out)
                    .output()?;
                let stdout = String::from_utf8_lossy(&o.stdout);
                ensure(o.status.success(), || {
                    format!(
                        "{dtype} {layout}: {:?}: {stdout}{}",
                        o.status,
                        String::from_utf8_lossy(&o.stderr)
                    )
                })?;
                ensure(
                    stdout.contains("verify: max abs error")
                        && stdout.contains("(0.00 units of rounding)"),
                    || format!("{dtype} {layout}: {stdout}"),
                )?;
            }
        }
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&dir);
    result
}
