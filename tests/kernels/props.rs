//! Property-based tests of the normalize / denormalize kernels.
//!
//! Random batches (shapes, 1..=4 channels, both layouts in and out, crops, mirrors, padding to 4
//! channels, per-sample mean/std, uniform and variable-size batches), every output type, inputs
//! and outputs as views at aligned or odd offsets of larger buffers, guard bytes around every
//! output; each result is compared with the f64 CPU reference. Adversarial batches must be
//! refused with a typed error, without a panic and without touching the output; that part also
//! runs without a GPU, through `kernels::cpu`, which validates the same `Spec`.
//!
//! The generator is a seeded `SmallRng`, not proptest: proptest's runner owns the case loop (and
//! shrinks), which fights libtest-mimic's one-trial-per-case reporting and its ignored flag for
//! machines without a GPU. Instead every case has its own seed, derived from a base seed, and a
//! failure prints the base seed, the case number and the case. Environment:
//!
//! - `PINSTREAM_PROP_CASES` (default 200): cases of each kind.
//! - `PINSTREAM_PROP_SEED` (default: random): the base seed; with the same seed and case count
//!   the same cases run. `... kernels props/normalize/case-0007 --exact` reruns one.
//!
//! Shapes stay small (at most 4 samples of 24 x 48 pixels), so that 50 cases also run under
//! `compute-sanitizer --tool memcheck` in a couple of minutes.

use std::fmt::Debug;
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::common::guard::{self, Placement, GUARD};
use crate::common::{ensure, R};
use bytemuck::Pod;
use libtest_mimic::{Failed, Trial};
use pinstream::kernels::{cpu, Crop, DenormInput, Layout, Normalize, OutputElement, Sample, Spec};
use pinstream::{bf16, f16, Device, Error, Stream};
use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};

use crate::common::trial;

/// Prefix of this module's trial names (its path in the binary).
const PREFIX: &str = "";

const CASES_ENV: &str = "PINSTREAM_PROP_CASES";
const SEED_ENV: &str = "PINSTREAM_PROP_SEED";
const DEFAULT_CASES: usize = 200;

/// The trials of this module, named `...`.
pub fn trials() -> Vec<Trial> {
    let cases = match std::env::var(CASES_ENV) {
        Ok(v) => v.parse::<usize>().unwrap_or_else(|e| {
            eprintln!("{CASES_ENV}={v:?}: {e}");
            std::process::exit(2)
        }),
        Err(_) => DEFAULT_CASES,
    };
    let base = match std::env::var(SEED_ENV) {
        Ok(v) => v.parse::<u64>().unwrap_or_else(|e| {
            eprintln!("{SEED_ENV}={v:?}: {e}");
            std::process::exit(2)
        }),
        Err(_) => rand::random::<u64>(),
    };
    eprintln!("kernel_props: {SEED_ENV}={base} {CASES_ENV}={cases}");
    let ctx = Ctx { base, cases };
    let no_gpu = !pinstream::available();
    let mut trials = Vec::new();
    for i in 0..cases {
        trials.push(
            trial(PREFIX, format!("props/normalize/case-{i:04}"), move || {
                normalize_case(ctx, i)
            })
            .with_ignored_flag(no_gpu),
        );
    }
    trials.push(trial(PREFIX, "props/adversarial/cpu", move || {
        adversarial(ctx, None)
    }));
    trials.push(
        trial(PREFIX, "props/adversarial/gpu", move || {
            let dev = Device::get(0)?;
            adversarial(ctx, Some(&dev.stream()?))
        })
        .with_ignored_flag(no_gpu),
    );
    trials.push(trial(PREFIX, "props/lengths_never_panic", move || {
        lengths_never_panic(ctx)
    }));
    trials
}

/// The run's base seed and case count, and each case's own seed.
#[derive(Clone, Copy, Debug)]
struct Ctx {
    base: u64,
    cases: usize,
}

impl Ctx {
    /// splitmix64 of the base seed and the case's number and kind.
    fn rng(self, kind: u64, i: usize) -> SmallRng {
        let mut z = self
            .base
            .wrapping_add((i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15))
            .wrapping_add(kind.wrapping_mul(0xD1B5_4A32_D192_ED03));
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        SmallRng::seed_from_u64(z ^ (z >> 31))
    }

    /// For failure messages: how to run this case again.
    fn again(self, i: usize) -> String {
        format!(
            "{SEED_ENV}={} {CASES_ENV}={}, case {i}",
            self.base, self.cases
        )
    }
}

// ---- random valid batches ----------------------------------------------------------------------

/// A batch, its input and optional per-sample statistics.
#[derive(Clone, Debug)]
struct Case {
    spec: Spec,
    per: Option<(Vec<f32>, Vec<f32>)>,
    input: Vec<u8>,
}

impl Case {
    fn per(&self) -> Option<(&[f32], &[f32])> {
        self.per.as_ref().map(|(m, s)| (&m[..], &s[..]))
    }

    fn cpu_per(&self) -> Option<cpu::PerSample<'_>> {
        self.per
            .as_ref()
            .map(|(mean, std)| cpu::PerSample { mean, std })
    }
}

/// Heights and widths that reach every kernel: widths that are multiples of 4 and 16 (the
/// vectorised paths), odd ones, and sizes above 512 pixels (several transpose tiles, the last
/// one partial).
fn random_hw(rng: &mut SmallRng) -> (usize, usize) {
    let h = rng.random_range(1..=24);
    let w = match rng.random_range(0..4) {
        0 => 4 * rng.random_range(1..=12),
        1 => 16 * rng.random_range(1..=3),
        _ => rng.random_range(1..=40),
    };
    (h, w)
}

fn random_layout(rng: &mut SmallRng) -> Layout {
    if rng.random_bool(0.5) {
        Layout::Nchw
    } else {
        Layout::Nhwc
    }
}

fn random_bytes(rng: &mut SmallRng, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    rng.fill_bytes(&mut v);
    v
}

fn random_case(rng: &mut SmallRng) -> Result<Case, Error> {
    let c = rng.random_range(1..=4);
    let n = rng.random_range(1..=4);
    let sizes: Vec<(usize, usize)> = if rng.random_bool(0.5) {
        vec![random_hw(rng); n]
    } else {
        (0..n).map(|_| random_hw(rng)).collect()
    };
    let mean: Vec<f32> = (0..c).map(|_| rng.random_range(0.0..255.0)).collect();
    let std: Vec<f32> = (0..c).map(|_| rng.random_range(1.0..90.0)).collect();
    let mut norm = Normalize::new(&mean, &std);
    // Scale and shift half of the time; large scales spread integer outputs over their range
    // (and beyond it: saturation).
    if rng.random_bool(0.5) {
        let scale = if rng.random_bool(0.5) {
            rng.random_range(0.25..4.0)
        } else {
            rng.random_range(4.0..128.0)
        };
        norm = norm.with_scale_shift(scale, rng.random_range(-2.0..2.0));
    }
    let mut spec = Spec::variable(c, &sizes, norm).layouts(random_layout(rng), random_layout(rng));
    // Half of the batches stay plain (uniform ones then take the vectorised kernels).
    if rng.random_bool(0.5) {
        for s in spec.samples.iter_mut() {
            s.mirror = rng.random_bool(0.3);
            if rng.random_bool(0.3) {
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
    }
    if rng.random_bool(0.25) {
        spec = spec.pad_to_4(rng.random_range(-3.0..3.0));
    }
    let per = rng.random_bool(0.25).then(|| {
        let k = spec.samples.len() * c;
        let m: Vec<f32> = (0..k).map(|_| rng.random_range(0.0..255.0)).collect();
        let s: Vec<f32> = (0..k).map(|_| rng.random_range(1.0..90.0)).collect();
        (m, s)
    });
    let input = random_bytes(rng, spec.input_len()?);
    Ok(Case { spec, per, input })
}

/// Aligned (16-byte input offset, output offset a multiple of 4 elements: the vectorised kernels
/// may run) or odd offsets, with guards of at least `GUARD` elements.
fn random_placement(rng: &mut SmallRng) -> Placement {
    if rng.random_bool(0.5) {
        Placement {
            in_offset: 16 * rng.random_range(0..4),
            in_tail: rng.random_range(0..16),
            out_before: GUARD + 4 * rng.random_range(0..4),
            out_after: GUARD + rng.random_range(0..8),
        }
    } else {
        Placement {
            in_offset: 1 + 2 * rng.random_range(0..8),
            in_tail: rng.random_range(0..16),
            out_before: GUARD + 4 * rng.random_range(0..4) + rng.random_range(1..4),
            out_after: GUARD + rng.random_range(0..8),
        }
    }
}

// ---- valid batches on the GPU ------------------------------------------------------------------

fn normalize_case(ctx: Ctx, i: usize) -> R {
    let mut rng = ctx.rng(1, i);
    let case = random_case(&mut rng)?;
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let exact = cpu::normalize_exact(&case.input, &case.spec, case.cpu_per())?;
    let again = ctx.again(i);
    let fail = |e: Failed| -> Failed {
        format!(
            "{} ({again})\n  case: {:?}, per-sample: {}",
            e.message().unwrap_or("failed"),
            case.spec,
            case.per.is_some()
        )
        .into()
    };
    run_dtype::<f32>(&stream, &case, &exact, &mut rng).map_err(fail)?;
    run_dtype::<f16>(&stream, &case, &exact, &mut rng).map_err(fail)?;
    run_dtype::<bf16>(&stream, &case, &exact, &mut rng).map_err(fail)?;
    run_dtype::<u8>(&stream, &case, &exact, &mut rng).map_err(fail)?;
    run_dtype::<i8>(&stream, &case, &exact, &mut rng).map_err(fail)?;
    let s = &case.spec;
    if s.is_uniform() && s.in_layout == s.out_layout && s.pad_to_4.is_none() {
        run_denormalize::<f32>(&stream, s, &mut rng).map_err(fail)?;
        run_denormalize::<f16>(&stream, s, &mut rng).map_err(fail)?;
        run_denormalize::<bf16>(&stream, s, &mut rng).map_err(fail)?;
    }
    Ok(())
}

fn run_dtype<O: OutputElement + Debug>(
    stream: &Stream,
    case: &Case,
    exact: &[f64],
    rng: &mut SmallRng,
) -> R {
    let at = random_placement(rng);
    let what = format!("normalize {} {at:?}", O::NAME);
    let spec = &case.spec;
    let run = guard::normalize_guarded::<O>(
        stream,
        &case.input,
        at,
        spec,
        case.per(),
        spec.output_len()?,
        &what,
    )?;
    run.result.map_err(|e| format!("{what}: {e}"))?;
    within_one_unit(&what, &run.out, exact, spec.norm.shift)?;
    // The CPU path converts like the reference.
    let mut host = vec![O::poison(); exact.len()];
    cpu::normalize(&case.input, spec, case.cpu_per(), &mut host)?;
    within_one_unit(&format!("cpu {}", O::NAME), &host, exact, spec.norm.shift)
}

fn within_one_unit<O: OutputElement + Debug>(
    what: &str,
    got: &[O],
    exact: &[f64],
    shift: f32,
) -> R {
    ensure(got.len() == exact.len(), || {
        format!("{what}: {} elements, {} expected", got.len(), exact.len())
    })?;
    if let Some(i) = (0..got.len()).find(|&i| got[i].rounding_error(exact[i], shift) > 1.0) {
        return Err(format!(
            "{what}: element {i}: got {:?}, exact {} (reference {}), error {:.3} units of rounding",
            got[i],
            exact[i],
            O::reference(exact[i]),
            got[i].rounding_error(exact[i], shift)
        )
        .into());
    }
    Ok(())
}

fn run_denormalize<I: DenormInput + OutputElement + Debug>(
    stream: &Stream,
    spec: &Spec,
    rng: &mut SmallRng,
) -> R {
    let len = spec.input_len()?;
    // Beyond the normalized range too: some results saturate.
    let input: Vec<I> = (0..len)
        .map(|_| <I as OutputElement>::from_f64(rng.random_range(-8.0..8.0)))
        .collect();
    let mut want = vec![0u8; len];
    cpu::denormalize(&input, spec, &mut want)?;
    let at = random_placement(rng);
    let what = format!("denormalize {} {at:?}", <I as OutputElement>::NAME);
    let run = guard::denormalize_guarded(stream, &input, at, spec, len, &what)?;
    run.result.map_err(|e| format!("{what}: {e}"))?;
    if let Some(i) = (0..len).find(|&i| (i32::from(run.out[i]) - i32::from(want[i])).abs() > 1) {
        return Err(format!(
            "{what}: element {i}: got {}, cpu {} (input {:?})",
            run.out[i], want[i], input[i]
        )
        .into());
    }
    Ok(())
}

// ---- adversarial batches -------------------------------------------------------------------------

/// The error kind a refused call must return.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Want {
    Invalid,
    Length,
}

impl Want {
    fn matches(self, r: &Result<(), Error>) -> bool {
        match self {
            Want::Invalid => matches!(r, Err(Error::InvalidArgument { .. })),
            Want::Length => matches!(r, Err(Error::LengthMismatch { .. })),
        }
    }
}

/// A broken call: the spec, the lengths of the buffers it is given, and what it must return.
#[derive(Clone, Debug)]
struct Bad {
    name: &'static str,
    spec: Spec,
    in_len: usize,
    out_len: usize,
    /// Per-sample statistics of this length (both), if any.
    per_len: Option<usize>,
    want: Want,
    /// Also a denormalize case (uniform, same layout, no padding before it was broken).
    denorm: bool,
}

const MUTATIONS: usize = 26;

/// Breaks a valid case in one of `MUTATIONS` ways.
fn mutate(case: &Case, m: usize, rng: &mut SmallRng) -> Result<Bad, Error> {
    let good = &case.spec;
    let (in_len, out_len) = (good.input_len()?, good.output_len()?);
    let per_len = case.per.as_ref().map(|(m, _)| m.len());
    let mut spec = good.clone();
    let j = rng.random_range(0..spec.samples.len());
    let c = rng.random_range(0..spec.channels);
    let (mut il, mut ol, mut pl) = (in_len, out_len, per_len);
    let mut want = Want::Invalid;
    let name = match m {
        0 => {
            spec.channels = 0;
            "zero channels"
        }
        1 => {
            spec.channels = 5;
            spec.norm = Normalize::new(&[1.0; 5], &[1.0; 5]);
            "five channels"
        }
        2 => {
            spec.channels = usize::MAX;
            "usize::MAX channels"
        }
        3 => {
            spec.samples.clear();
            "no samples"
        }
        4 => {
            spec.samples[j].h = 0;
            spec.samples[j].crop = None;
            "zero height"
        }
        5 => {
            spec.samples[j].w = 0;
            spec.samples[j].crop = None;
            "zero width"
        }
        6 => {
            spec.samples[j] = Sample::new(65536, 65536);
            "2^32 pixels in one sample"
        }
        7 => {
            spec.samples[j] = Sample::new(1 << 40, 1);
            "height beyond i32"
        }
        8 => {
            spec.samples[j] = Sample::new(usize::MAX, usize::MAX);
            "usize::MAX x usize::MAX"
        }
        9 => {
            let s = spec.samples[j];
            spec.samples[j].crop = Some(Crop {
                x: 1,
                y: 0,
                w: s.w,
                h: s.h,
            });
            "crop beyond the right edge"
        }
        10 => {
            let s = spec.samples[j];
            spec.samples[j].crop = Some(Crop {
                x: 0,
                y: s.h,
                w: s.w,
                h: 1,
            });
            "crop below the image"
        }
        11 => {
            spec.samples[j].crop = Some(Crop {
                x: usize::MAX,
                y: 0,
                w: 2,
                h: 1,
            });
            "crop x + w overflows"
        }
        12 => {
            spec.samples[j].crop = Some(Crop {
                x: 0,
                y: usize::MAX - 1,
                w: 1,
                h: 3,
            });
            "crop y + h overflows"
        }
        13 => {
            spec.samples[j].crop = Some(Crop {
                x: 0,
                y: 0,
                w: 0,
                h: 1,
            });
            "empty crop"
        }
        14 => {
            spec.norm.std[c] = 0.0;
            "zero std"
        }
        15 => {
            spec.norm.std[c] = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY][rng.random_range(0..3)];
            "NaN or infinite std"
        }
        16 => {
            spec.norm.mean[c] = [f32::NAN, f32::INFINITY][rng.random_range(0..2)];
            "NaN or infinite mean"
        }
        17 => {
            spec.norm.scale = f32::MAX;
            spec.norm.std[c] = 1e-30;
            "scale / std overflows"
        }
        18 => {
            spec.norm.shift = f32::INFINITY;
            "infinite shift"
        }
        19 => {
            spec = spec.pad_to_4(f32::NAN);
            "NaN pad fill"
        }
        20 => {
            spec.norm.mean.pop();
            "a mean missing"
        }
        21 => {
            want = Want::Length;
            il = if rng.random_bool(0.5) {
                in_len + 1
            } else {
                in_len - 1
            };
            "input length off by one"
        }
        22 => {
            want = Want::Length;
            ol = if rng.random_bool(0.5) {
                out_len + 1
            } else {
                out_len - 1
            };
            "output length off by one"
        }
        23 => {
            want = Want::Length;
            let k = good.samples.len() * good.channels;
            pl = Some(if rng.random_bool(0.5) { k + 1 } else { k - 1 });
            "per-sample statistics of the wrong length"
        }
        24 => {
            spec.norm.std[c] = -0.0;
            "negative zero std"
        }
        _ => {
            spec.samples[j].h = usize::MAX;
            spec.samples[j].crop = None;
            "usize::MAX height"
        }
    };
    let denorm = good.is_uniform() && good.in_layout == good.out_layout && good.pad_to_4.is_none();
    Ok(Bad {
        name,
        spec,
        in_len: il,
        out_len: ol,
        per_len: pl,
        want,
        // denormalize has one length and no per-sample statistics.
        denorm: denorm && !matches!(m, 22 | 23),
    })
}

/// Refusals that only denormalize makes: batches it does not handle.
fn denorm_refusals(good: &Spec) -> Vec<(&'static str, Spec)> {
    let mut v = Vec::new();
    let mut s = good.clone();
    s.samples[0].mirror = true;
    v.push(("denormalize of a mirrored batch", s));
    let mut s = good.clone();
    s.out_layout = match s.in_layout {
        Layout::Nchw => Layout::Nhwc,
        Layout::Nhwc => Layout::Nchw,
    };
    v.push(("denormalize across layouts", s));
    v.push(("denormalize with padding", good.clone().pad_to_4(0.0)));
    let mut s = good.clone();
    let first = s.samples[0];
    s.samples.push(Sample::new(first.h + 1, first.w));
    v.push(("denormalize of a variable batch", s));
    v
}

/// Runs `f`, turning a panic into a failure.
fn no_panic<T>(what: &str, f: impl FnOnce() -> T) -> Result<T, Failed> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|p| {
        let msg = p
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| p.downcast_ref::<&str>().copied())
            .unwrap_or("?");
        format!("{what}: panicked: {msg}").into()
    })
}

/// Every mutation of `ctx.cases` random valid batches (each mutation at least once), through the
/// CPU reference (`stream` None) or the GPU launchers: refused with the right typed error, no
/// panic, and on the GPU an output (poisoned, between guards) left exactly as it was.
fn adversarial(ctx: Ctx, stream: Option<&Stream>) -> R {
    let n = ctx.cases.max(MUTATIONS);
    for i in 0..n {
        let mut rng = ctx.rng(2, i);
        let case = random_case(&mut rng)?;
        let m = if i < MUTATIONS {
            i
        } else {
            rng.random_range(0..MUTATIONS)
        };
        let bad = mutate(&case, m, &mut rng)?;
        let again = ctx.again(i);
        let what = format!("{} ({again}; {:?})", bad.name, bad.spec);
        let per = bad.per_len.map(|k| (vec![100.0f32; k], vec![50.0f32; k]));
        let per_ref = per.as_ref().map(|(m, s)| (&m[..], &s[..]));
        let input = random_bytes(&mut rng, bad.in_len);
        match stream {
            None => {
                if bad.want == Want::Invalid {
                    let r = no_panic(&what, || bad.spec.validate("props"))?;
                    ensure(Want::Invalid.matches(&r), || {
                        format!("{what}: validate gave {r:?}")
                    })?;
                }
                let r = no_panic(&what, || {
                    let mut out = vec![0f32; bad.out_len];
                    cpu::normalize(
                        &input,
                        &bad.spec,
                        per_ref.map(|(mean, std)| cpu::PerSample { mean, std }),
                        &mut out,
                    )
                })?;
                ensure(bad.want.matches(&r), || {
                    format!("{what}: cpu::normalize gave {r:?}, want {:?}", bad.want)
                })?;
                if bad.denorm {
                    let r = no_panic(&what, || {
                        let y = vec![0.5f32; bad.in_len];
                        let mut out = vec![0u8; bad.in_len];
                        cpu::denormalize(&y, &bad.spec, &mut out)
                    })?;
                    ensure(bad.want.matches(&r), || {
                        format!("{what}: cpu::denormalize gave {r:?}, want {:?}", bad.want)
                    })?;
                }
            }
            Some(stream) => {
                let at = random_placement(&mut rng);
                match rng.random_range(0..5) {
                    0 => refused_gpu::<f32>(stream, &bad, &input, per_ref, at, &what)?,
                    1 => refused_gpu::<f16>(stream, &bad, &input, per_ref, at, &what)?,
                    2 => refused_gpu::<bf16>(stream, &bad, &input, per_ref, at, &what)?,
                    3 => refused_gpu::<u8>(stream, &bad, &input, per_ref, at, &what)?,
                    _ => refused_gpu::<i8>(stream, &bad, &input, per_ref, at, &what)?,
                }
                if bad.denorm {
                    let y = vec![0.5f32; bad.in_len];
                    let run = no_panic(&what, || {
                        guard::denormalize_guarded(stream, &y, at, &bad.spec, bad.in_len, &what)
                    })??;
                    untouched(
                        &what,
                        "denormalize",
                        &run.result,
                        bad.want,
                        &run.out,
                        0xABu8,
                    )?;
                }
            }
        }
        // Batches denormalize does not take.
        let good = &case.spec;
        if good.is_uniform() && good.in_layout == good.out_layout && good.pad_to_4.is_none() {
            let len = good.input_len()?;
            for (name, spec) in denorm_refusals(good) {
                let what = format!("{name} ({again})");
                let y = vec![0.5f32; len];
                match stream {
                    None => {
                        let r =
                            no_panic(&what, || cpu::denormalize(&y, &spec, &mut vec![0u8; len]))?;
                        ensure(Want::Invalid.matches(&r), || {
                            format!("{what}: cpu::denormalize gave {r:?}")
                        })?;
                    }
                    Some(stream) => {
                        let at = random_placement(&mut rng);
                        let run = no_panic(&what, || {
                            guard::denormalize_guarded(stream, &y, at, &spec, len, &what)
                        })??;
                        untouched(
                            &what,
                            "denormalize",
                            &run.result,
                            Want::Invalid,
                            &run.out,
                            0xAB,
                        )?;
                    }
                }
            }
        }
    }
    Ok(())
}

fn refused_gpu<O: OutputElement + Debug>(
    stream: &Stream,
    bad: &Bad,
    input: &[u8],
    per: Option<(&[f32], &[f32])>,
    at: Placement,
    what: &str,
) -> R {
    let run = no_panic(what, || {
        guard::normalize_guarded::<O>(stream, input, at, &bad.spec, per, bad.out_len, what)
    })??;
    untouched(
        what,
        &format!("normalize {}", O::NAME),
        &run.result,
        bad.want,
        &run.out,
        O::poison(),
    )
}

/// The call was refused as `want` says and the output still holds `poison` everywhere.
fn untouched<T: Pod + Debug>(
    what: &str,
    call: &str,
    result: &Result<(), Error>,
    want: Want,
    out: &[T],
    poison: T,
) -> R {
    ensure(want.matches(result), || {
        format!("{what}: {call} gave {result:?}, want {want:?}")
    })?;
    if let Some(i) = out.iter().position(|v| !guard::same_bits(v, &poison)) {
        return Err(format!(
            "{what}: {call} was refused but wrote element {i} of the output: {:?}",
            out[i]
        )
        .into());
    }
    Ok(())
}

/// `input_len` / `output_len` / `offsets` / `validate` on batches whose sizes overflow (never
/// validated, so any value is possible): an error, never a panic or a wrapped value.
fn lengths_never_panic(ctx: Ctx) -> R {
    let n = ctx.cases.max(8);
    for i in 0..n {
        let mut rng = ctx.rng(3, i);
        let huge = |rng: &mut SmallRng| match rng.random_range(0..4) {
            0 => usize::MAX,
            1 => usize::MAX / 2 + rng.random_range(0..1000),
            2 => 1usize << rng.random_range(32..64),
            _ => rng.random_range(1..=u32::MAX as usize),
        };
        let c = if rng.random_bool(0.5) {
            huge(&mut rng)
        } else {
            rng.random_range(1..=4)
        };
        let samples: Vec<Sample> = (0..rng.random_range(1..=3))
            .map(|_| {
                let mut s = Sample::new(huge(&mut rng), huge(&mut rng));
                if rng.random_bool(0.5) {
                    s.crop = Some(Crop {
                        x: huge(&mut rng),
                        y: 0,
                        w: huge(&mut rng),
                        h: huge(&mut rng),
                    });
                }
                s
            })
            .collect();
        let k = c.min(4);
        let mut spec = Spec::variable(k, &[], Normalize::new(&vec![1.0; k], &vec![2.0; k]));
        spec.channels = c;
        spec.samples = samples;
        if rng.random_bool(0.5) {
            spec = spec.pad_to_4(0.0);
        }
        let what = format!("{} ({:?})", ctx.again(i), spec);
        // Each must agree with exact arithmetic (u128, checked): the value where it fits in
        // usize, an error where not.
        let co = spec.out_channels() as u128;
        let total = |f: &dyn Fn(&Sample) -> [usize; 2], ch: u128| -> Option<usize> {
            let mut t = 0u128;
            for s in &spec.samples {
                let [h, w] = f(s);
                let e = (h as u128 * w as u128).checked_mul(ch)?;
                t = t.checked_add(e)?;
            }
            usize::try_from(t).ok()
        };
        let want_in = total(&|s| [s.h, s.w], c as u128);
        let want_out = total(
            &|s| {
                let (h, w) = s.out_hw();
                [h, w]
            },
            co,
        );
        let got_in = no_panic(&what, || spec.input_len())?;
        let got_out = no_panic(&what, || spec.output_len())?;
        ensure(got_in.as_ref().ok().copied() == want_in, || {
            format!("{what}: input_len {got_in:?}, exact {want_in:?}")
        })?;
        ensure(got_out.as_ref().ok().copied() == want_out, || {
            format!("{what}: output_len {got_out:?}, exact {want_out:?}")
        })?;
        for r in [&got_in, &got_out] {
            if let Err(e) = r {
                ensure(matches!(e, Error::InvalidArgument { .. }), || {
                    format!("{what}: {e:?}")
                })?;
            }
        }
        let offsets = no_panic(&what, || spec.offsets())?;
        ensure(
            offsets.is_ok() == (want_in.is_some() && want_out.is_some()),
            || format!("{what}: offsets {offsets:?}"),
        )?;
        // Valid or not, validate answers; where a total overflows it must refuse.
        let v = no_panic(&what, || spec.validate("props"))?;
        if want_in.is_none() || want_out.is_none() {
            ensure(matches!(v, Err(Error::InvalidArgument { .. })), || {
                format!("{what}: validate gave {v:?}")
            })?;
        }
    }
    Ok(())
}
