//! The fused resized crop (`kernels::resized_crop`) and its f64 reference (`kernels::cpu`).
//!
//! CPU trials (always run) pin the reference's semantics: identity, constants, mirror,
//! hand-computed antialiased weights, `Resize` + `CenterCrop` done in two steps,
//! `RandomResizedCrop` as crop-then-resize, and every adversarial spec refused with a typed
//! error. GPU trials (ignored without a GPU) run random batches — 1..=4 channels, both layouts
//! in and out, padding, every output type, antialias on and off, random boxes of both kinds,
//! flips, images at random offsets of an arena with gaps, noisy pixels — into a poisoned output
//! between guard bytes and compare with the reference; plus a table too large for the launch's
//! parameters, heavy downscales (the kernel's direct path), and the adversarial specs again.
//!
//! `PINSTREAM_PROP_CASES` (default 120) and `PINSTREAM_PROP_SEED` (default random) as in
//! `props` (kernels/props.rs).

use std::fmt::Debug;

use super::boxes::{BoxRng, RandomResizedCrop};
use crate::common::guard::Guarded;
use crate::common::{ensure, R};
use libtest_mimic::{Failed, Trial};
use pinstream::kernels::CropBox;
use pinstream::kernels::{self, cpu, Layout, Normalize, OutputElement, ResizeSpec};
use pinstream::{bf16, f16, Device, DeviceBuffer, Error, Stream};
use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};

use crate::common::trial;

/// Prefix of this module's trial names (its path in the binary).
const PREFIX: &str = "resize/";

/// The trials of this module, named `resize/...`.
pub fn trials() -> Vec<Trial> {
    let cases: usize = std::env::var("PINSTREAM_PROP_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(120);
    let base: u64 = std::env::var("PINSTREAM_PROP_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("resize: PINSTREAM_PROP_SEED={base} PINSTREAM_PROP_CASES={cases}");
    let no_gpu = !pinstream::available();
    let mut trials = vec![
        trial(PREFIX, "cpu/identity", cpu_identity),
        trial(PREFIX, "cpu/constant_stays_constant", cpu_constant),
        trial(PREFIX, "cpu/mirror_reverses_columns", cpu_mirror),
        trial(PREFIX, "cpu/known_weights", cpu_known_weights),
        trial(
            PREFIX,
            "cpu/center_is_resize_then_crop",
            cpu_center_two_steps,
        ),
        trial(
            PREFIX,
            "cpu/random_box_is_crop_then_resize",
            cpu_crop_then_resize,
        ),
        trial(PREFIX, "cpu/adversarial", || adversarial(None)),
        trial(PREFIX, "cpu/lengths_never_panic", lengths_never_panic),
    ];
    for i in 0..cases {
        trials.push(
            trial(PREFIX, format!("gpu/props/case-{i:04}"), move || {
                gpu_case(base, i)
            })
            .with_ignored_flag(no_gpu),
        );
    }
    for (name, f) in [
        ("gpu/large_table", gpu_large_table as fn() -> R),
        ("gpu/heavy_downscale", gpu_heavy_downscale),
        ("gpu/imagenet_like", gpu_imagenet_like),
        ("gpu/adversarial", || {
            let dev = Device::get(0)?;
            adversarial(Some(&dev.stream()?))
        }),
    ] {
        trials.push(trial(PREFIX, name, f).with_ignored_flag(no_gpu));
    }
    trials
}

/// Mean 0, std 1: outputs on the input's scale.
fn plain(c: usize) -> Normalize {
    Normalize::new(&vec![0.0; c], &vec![1.0; c])
}

fn whole(h: usize, w: usize) -> CropBox {
    CropBox {
        top: 0.0,
        left: 0.0,
        height: h as f32,
        width: w as f32,
        flip: false,
        clamp_to_box: true,
    }
}

fn noise(rng: &mut SmallRng, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    rng.fill_bytes(&mut v);
    v
}

fn cpu_identity() -> R {
    let mut rng = SmallRng::seed_from_u64(1);
    for (c, h, w) in [(1, 7, 5), (3, 16, 23), (4, 3, 3)] {
        let px = noise(&mut rng, c * h * w);
        for aa in [true, false] {
            let mut spec = ResizeSpec::new(c, h, w, plain(c))
                .layouts(Layout::Nhwc, Layout::Nhwc)
                .antialias(aa);
            spec.push(0, h, w, whole(h, w));
            let out = cpu::resized_crop_exact(&px, &spec)?;
            let want: Vec<f64> = px.iter().map(|&b| f64::from(b)).collect();
            ensure(out == want, || format!("identity {c}x{h}x{w} aa {aa}"))?;
        }
    }
    Ok(())
}

fn cpu_constant() -> R {
    let mut rng = SmallRng::seed_from_u64(2);
    let mut boxes = BoxRng::new(3, 0);
    let rrc = RandomResizedCrop::default();
    for _ in 0..50 {
        let (h, w) = (rng.random_range(1..60), rng.random_range(1..60));
        let (oh, ow) = (rng.random_range(1..30), rng.random_range(1..30));
        let mut spec = ResizeSpec::new(3, oh, ow, plain(3)).antialias(rng.random());
        spec.push(0, h, w, rrc.sample(&mut boxes, h, w)?);
        let px: Vec<u8> = (0..h * w).flat_map(|_| [17u8, 200, 3]).collect();
        let out = cpu::resized_crop_exact(&px, &spec)?;
        for (i, v) in out.iter().enumerate() {
            let want = [17.0, 200.0, 3.0][i / (oh * ow)];
            ensure((v - want).abs() < 1e-9, || format!("{v} != {want} at {i}"))?;
        }
    }
    Ok(())
}

fn cpu_mirror() -> R {
    let mut rng = SmallRng::seed_from_u64(4);
    let (h, w, oh, ow) = (19, 31, 9, 13);
    let px = noise(&mut rng, 2 * h * w);
    let b = CropBox {
        top: 2.0,
        left: 3.5,
        height: 15.25,
        width: 20.0,
        flip: false,
        clamp_to_box: false,
    };
    let mut a = ResizeSpec::new(2, oh, ow, plain(2));
    a.push(0, h, w, b);
    let mut m = a.clone();
    m.samples[0].crop.flip = true;
    let (ra, rm) = (
        cpu::resized_crop_exact(&px, &a)?,
        cpu::resized_crop_exact(&px, &m)?,
    );
    for c in 0..2 {
        for y in 0..oh {
            for x in 0..ow {
                let i = |x: usize| (c * oh + y) * ow + x;
                ensure(ra[i(x)] == rm[i(ow - 1 - x)], || format!("({c},{y},{x})"))?;
            }
        }
    }
    ensure(ra != rm, || "mirror changed nothing".into())
}

fn cpu_known_weights() -> R {
    // 1 x 6 gray row, halved with antialias: output 0 is centred at 1.0 with support 2, taps
    // 0, 1, 2 with triangle weights 0.75, 0.75, 0.25 -> 3/7, 3/7, 1/7 (PIL's reduction).
    let px = [10u8, 20, 40, 80, 160, 255];
    let mut spec = ResizeSpec::new(1, 1, 3, plain(1));
    spec.push(0, 1, 6, whole(1, 6));
    let out = cpu::resized_crop_exact(&px, &spec)?;
    let want0 = (3.0 * 10.0 + 3.0 * 20.0 + 40.0) / 7.0;
    // Output 1: centre 3.0, taps 1..4 (weights .25 .75 .75 .25 over 2.0).
    let want1 = (0.25 * 20.0 + 0.75 * 40.0 + 0.75 * 80.0 + 0.25 * 160.0) / 2.0;
    // Output 2: centre 5.0, taps 3..5 (.25 .75 .75), 6 is outside: over 1.75.
    let want2 = (0.25 * 80.0 + 0.75 * 160.0 + 0.75 * 255.0) / 1.75;
    for (g, w) in out.iter().zip([want0, want1, want2]) {
        ensure((g - w).abs() < 1e-9, || format!("{out:?} != {w}"))?;
    }
    // Without antialias: plain bilinear, two taps (centre 1.0 lies halfway between pixels 0, 1).
    let spec = spec.antialias(false);
    let out = cpu::resized_crop_exact(&px, &spec)?;
    ensure(
        (out[0] - 15.0).abs() < 1e-9 && (out[2] - 207.5).abs() < 1e-9,
        || format!("{out:?}"),
    )
}

fn cpu_center_two_steps() -> R {
    // Resize(r) of the whole image, then CenterCrop(c), against CropBox::center in one step.
    let mut rng = SmallRng::seed_from_u64(5);
    for (h, w, r, c) in [(375, 500, 64, 56), (40, 33, 20, 16), (50, 50, 24, 24)] {
        let px = noise(&mut rng, h * w * 3);
        let (rh, rw) = if h <= w {
            (r, r * w / h)
        } else {
            (r * h / w, r)
        };
        let mut full = ResizeSpec::new(3, rh, rw, plain(3)).layouts(Layout::Nhwc, Layout::Nhwc);
        full.push(0, h, w, whole(h, w));
        let resized = cpu::resized_crop_exact(&px, &full)?;
        let mut one = ResizeSpec::new(3, c, c, plain(3)).layouts(Layout::Nhwc, Layout::Nhwc);
        one.push(0, h, w, CropBox::center(h, w, r, c)?);
        let got = cpu::resized_crop_exact(&px, &one)?;
        let (top, left) = (
            ((rh - c) as f64 / 2.0).round_ties_even() as usize,
            ((rw - c) as f64 / 2.0).round_ties_even() as usize,
        );
        let mut worst = 0f64;
        for y in 0..c {
            for x in 0..c {
                for ch in 0..3 {
                    let want = resized[((top + y) * rw + left + x) * 3 + ch];
                    worst = worst.max((got[(y * c + x) * 3 + ch] - want).abs());
                }
            }
        }
        // Only the f32 rounding of the box's start and size separates them.
        ensure(worst < 0.05, || {
            format!("{h}x{w} -> {r} -> {c}: worst {worst} levels")
        })?;
    }
    Ok(())
}

fn cpu_crop_then_resize() -> R {
    // A RandomResizedCrop box (whole pixels, the filter stopping at its edges) gives what cutting
    // the box out as its own image and resizing all of it gives.
    let mut rng = SmallRng::seed_from_u64(6);
    let mut boxes = BoxRng::new(6, 1);
    let rrc = RandomResizedCrop::default();
    for _ in 0..20 {
        let (h, w) = (rng.random_range(10..80), rng.random_range(10..80));
        let px = noise(&mut rng, h * w * 3);
        let b = rrc.sample(&mut boxes, h, w)?;
        let mut spec = ResizeSpec::new(3, 24, 24, plain(3));
        spec.push(0, h, w, b);
        let got = cpu::resized_crop_exact(&px, &spec)?;
        let (t, l, bh, bw) = (
            b.top as usize,
            b.left as usize,
            b.height as usize,
            b.width as usize,
        );
        let cut: Vec<u8> = (t..t + bh)
            .flat_map(|y| px[(y * w + l) * 3..(y * w + l + bw) * 3].to_vec())
            .collect();
        let mut alone = ResizeSpec::new(3, 24, 24, plain(3));
        alone.push(
            0,
            bh,
            bw,
            CropBox {
                flip: b.flip,
                ..whole(bh, bw)
            },
        );
        let want = cpu::resized_crop_exact(&cut, &alone)?;
        let worst = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        ensure(worst < 1e-9, || format!("{b:?}: worst {worst}"))?;
    }
    Ok(())
}

/// Specs that must be refused with `InvalidArgument` / `LengthMismatch`, without a panic, on
/// the CPU and (with a stream) on the GPU with the output untouched.
fn adversarial(stream: Option<&Stream>) -> R {
    let good = || {
        let mut s = ResizeSpec::new(3, 8, 8, Normalize::imagenet());
        s.push(0, 10, 12, whole(10, 12));
        s
    };
    let nan_box = |f: fn(&mut CropBox)| {
        let mut s = good();
        f(&mut s.samples[0].crop);
        s
    };
    let mut cases: Vec<(&str, ResizeSpec, usize)> = vec![
        (
            "0 channels",
            ResizeSpec {
                channels: 0,
                ..good()
            },
            360,
        ),
        (
            "5 channels",
            ResizeSpec {
                channels: 5,
                ..good()
            },
            360,
        ),
        (
            "no samples",
            ResizeSpec {
                samples: vec![],
                ..good()
            },
            360,
        ),
        ("out 0 rows", ResizeSpec { out_h: 0, ..good() }, 360),
        (
            "out too wide",
            ResizeSpec {
                out_w: kernels::MAX_OUT_SIDE + 1,
                ..good()
            },
            360,
        ),
        ("nan top", nan_box(|b| b.top = f32::NAN), 360),
        ("inf width", nan_box(|b| b.width = f32::INFINITY), 360),
        ("zero height", nan_box(|b| b.height = 0.0), 360),
        ("negative width", nan_box(|b| b.width = -3.0), 360),
        ("box below", nan_box(|b| b.top = 5.0), 360),
        ("box left of", nan_box(|b| b.left = -1.0), 360),
        (
            "tiny box underflows scale",
            nan_box(|b| b.height = 1e-44),
            360,
        ),
        (
            "mean count",
            ResizeSpec {
                norm: Normalize::new(&[0.0], &[1.0]),
                ..good()
            },
            360,
        ),
        (
            "std 0",
            ResizeSpec {
                norm: Normalize::new(&[0.0; 3], &[1.0, 0.0, 1.0]),
                ..good()
            },
            360,
        ),
        ("pad nan", good().pad_to_4(f32::NAN), 360),
        ("input too short", good(), 359),
    ];
    let mut s = good();
    s.samples[0].height = 0;
    cases.push(("empty image", s, 360));
    let mut s = good();
    s.samples[0].width = kernels::MAX_SIDE + 1;
    s.samples[0].crop.width = 1.0;
    cases.push(("image too wide", s, 360));
    let mut s = good();
    s.samples[0].offset = usize::MAX - 10;
    cases.push(("offset overflows", s, 360));
    let mut s = good();
    s.samples[0].offset = 1;
    cases.push(("offset past input", s, 360));
    let mut s = good();
    s.samples[0].height = usize::MAX / 2;
    cases.push(("huge image", s, 360));
    for (what, spec, in_len) in &cases {
        let input = vec![7u8; *in_len];
        let mut out = vec![f32::NAN; 8 * 8 * 3];
        let r = cpu::resized_crop(&input, spec, &mut out);
        ensure(
            matches!(
                r,
                Err(Error::InvalidArgument { .. } | Error::LengthMismatch { .. })
            ),
            || format!("cpu {what}: {r:?}"),
        )?;
        ensure(out.iter().all(|v| v.is_nan()), || {
            format!("cpu {what}: output touched")
        })?;
        if let Some(st) = stream {
            let mut d_in = DeviceBuffer::<u8>::new(&st.device(), *in_len)?;
            st.copy_h2d(&input[..], &mut d_in)?;
            let mut g = Guarded::<f32>::new(st, 64, 8 * 8 * 3, 64, f32::NAN)?;
            let r = kernels::resized_crop(st, &d_in, spec, &mut g.view_mut()?);
            ensure(
                matches!(
                    r,
                    Err(Error::InvalidArgument { .. } | Error::LengthMismatch { .. })
                ),
                || format!("gpu {what}: {r:?}"),
            )?;
            let v = g.read_checked(st, what)?;
            ensure(v.iter().all(|x| x.is_nan()), || {
                format!("gpu {what}: output touched")
            })?;
        }
    }
    // A wrong output length on the GPU.
    if let Some(st) = stream {
        let d_in = DeviceBuffer::<u8>::new(&st.device(), 360)?;
        let mut d_out = DeviceBuffer::<f32>::new(&st.device(), 8 * 8 * 3 + 1)?;
        let r = kernels::resized_crop(st, &d_in, &good(), &mut d_out);
        ensure(matches!(r, Err(Error::LengthMismatch { .. })), || {
            format!("output length: {r:?}")
        })?;
    }
    Ok(())
}

fn lengths_never_panic() -> R {
    let mut rng = SmallRng::seed_from_u64(9);
    for _ in 0..2000 {
        let pick = |r: &mut SmallRng| match r.random_range(0..4) {
            0 => r.random_range(0..5),
            1 => usize::MAX - r.random_range(0..3),
            2 => 1usize << r.random_range(0..64),
            _ => r.random::<u64>() as usize,
        };
        let mut s = ResizeSpec::new(pick(&mut rng) % 6, pick(&mut rng), pick(&mut rng), plain(3));
        for _ in 0..rng.random_range(0..3) {
            let crop = CropBox {
                top: rng.random::<f32>() * 1e9 - 1e3,
                left: f32::from_bits(rng.random()),
                height: rng.random::<f32>() * 1e12,
                width: f32::from_bits(rng.random()),
                flip: rng.random(),
                clamp_to_box: rng.random(),
            };
            s.push(pick(&mut rng), pick(&mut rng), pick(&mut rng), crop);
        }
        let _ = (s.output_len(), s.input_extent(), s.sample_len());
        if s.validate("t").is_ok() {
            // Anything that validates must have computable lengths.
            s.output_len()?;
            s.input_extent()?;
        }
    }
    Ok(())
}

// ---- GPU ----------------------------------------------------------------------------------

#[derive(Debug)]
struct Case {
    spec: ResizeSpec,
    arena: Vec<u8>,
    out_type: usize,
}

fn random_case(rng: &mut SmallRng) -> Case {
    let c = rng.random_range(1..=4usize);
    let (oh, ow) = (rng.random_range(1..40), rng.random_range(1..40));
    let mean: Vec<f32> = (0..c).map(|_| rng.random_range(0.0..255.0)).collect();
    let std: Vec<f32> = (0..c).map(|_| rng.random_range(0.5..80.0)).collect();
    let lay = |r: &mut SmallRng| {
        if r.random() {
            Layout::Nhwc
        } else {
            Layout::Nchw
        }
    };
    let mut spec = ResizeSpec::new(c, oh, ow, Normalize::new(&mean, &std))
        .layouts(lay(rng), lay(rng))
        .antialias(rng.random_range(0..4) > 0);
    if c < 4 && rng.random_range(0..4) == 0 {
        spec = spec.pad_to_4(rng.random_range(-2.0..2.0));
    }
    let n = rng.random_range(1..6);
    let mut arena = Vec::new();
    let mut boxes = BoxRng::new(rng.random(), 0);
    let rrc = RandomResizedCrop::default();
    for _ in 0..n {
        let (h, w) = match rng.random_range(0..5) {
            0 => (rng.random_range(1..4), rng.random_range(1..4)),
            1 => (rng.random_range(100..200), rng.random_range(100..200)),
            _ => (rng.random_range(1..70), rng.random_range(1..70)),
        };
        // A gap of random bytes before each image (odd offsets included).
        let gap = rng.random_range(0..20);
        arena.extend((0..gap).map(|_| rng.random::<u8>()));
        let offset = arena.len();
        arena.extend((0..c * h * w).map(|_| rng.random::<u8>()));
        let crop = match rng.random_range(0..4) {
            0 => rrc.sample(&mut boxes, h, w).unwrap(),
            1 if h >= 2 && w >= 2 => {
                let r = rng.random_range(h.min(w)..=h.min(w) * 2);
                let cc = rng.random_range(1..=r.min(h.min(w)));
                let mut b = CropBox::center(h, w, r, cc).unwrap_or(whole(h, w));
                b.flip = rng.random();
                b
            }
            _ => {
                // Any fractional box inside the image, either edge rule.
                let bh = rng.random_range(0.05..=1.0) * h as f32;
                let bw = rng.random_range(0.05..=1.0) * w as f32;
                CropBox {
                    top: rng.random_range(0.0..=1.0) * (h as f32 - bh),
                    left: rng.random_range(0.0..=1.0) * (w as f32 - bw),
                    height: bh,
                    width: bw,
                    flip: rng.random(),
                    clamp_to_box: rng.random(),
                }
            }
        };
        spec.push(offset, h, w, crop);
    }
    arena.extend((0..rng.random_range(0..8)).map(|_| rng.random::<u8>()));
    Case {
        spec,
        arena,
        out_type: rng.random_range(0..5),
    }
}

fn run_one<O: OutputElement + Debug>(stream: &Stream, arena: &[u8], spec: &ResizeSpec) -> R {
    let mut d_in = DeviceBuffer::<u8>::new(&stream.device(), arena.len())?;
    stream.copy_h2d(arena, &mut d_in)?;
    let len = spec.output_len()?;
    let mut g = Guarded::<O>::new(stream, 33, len, 47, O::poison())?;
    kernels::resized_crop(stream, &d_in, spec, &mut g.view_mut()?)?;
    let got = g.read_checked(stream, "resized_crop")?;
    let exact = cpu::resized_crop_exact(arena, spec)?;
    let worst = cpu::resize_worst_error(&got, &exact, spec)?;
    if let Some(w) = worst {
        ensure(w.units <= 1.0, || {
            format!(
                "{}: element {} is {:?}, reference {} ({} units, {} off)",
                O::NAME,
                w.index,
                got[w.index],
                exact[w.index],
                w.units,
                w.abs
            )
        })?;
    }
    // An element left poisoned (NaN) is infinitely wrong above; for the integer types, every
    // element is compared with its reference value, so a skipped one shows where the poison
    // (0xAB) is not what the kernel would write.
    Ok(())
}

fn run_any(stream: &Stream, arena: &[u8], spec: &ResizeSpec, t: usize) -> R {
    match t {
        0 => run_one::<f32>(stream, arena, spec),
        1 => run_one::<f16>(stream, arena, spec),
        2 => run_one::<bf16>(stream, arena, spec),
        3 => run_one::<u8>(stream, arena, spec),
        _ => run_one::<i8>(stream, arena, spec),
    }
}

fn gpu_case(base: u64, i: usize) -> R {
    let seed = base ^ (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let mut rng = SmallRng::seed_from_u64(seed);
    let case = random_case(&mut rng);
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    run_any(&stream, &case.arena, &case.spec, case.out_type).map_err(|e: Failed| {
        format!(
            "case {i} (PINSTREAM_PROP_SEED={base}): {:?}\n{case:?}",
            e.message()
        )
        .into()
    })
}

fn gpu_large_table() -> R {
    // 300 samples: more rows than the launch's parameters hold, so the table is uploaded.
    let mut rng = SmallRng::seed_from_u64(11);
    let mut boxes = BoxRng::new(11, 0);
    let rrc = RandomResizedCrop::default();
    let mut spec = ResizeSpec::new(3, 12, 10, Normalize::imagenet());
    let mut arena = Vec::new();
    for _ in 0..300 {
        let (h, w) = (rng.random_range(5..40), rng.random_range(5..40));
        let off = arena.len();
        arena.extend(noise(&mut rng, h * w * 3));
        spec.push(off, h, w, rrc.sample(&mut boxes, h, w)?);
    }
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    run_one::<f32>(&stream, &arena, &spec)?;
    run_one::<bf16>(&stream, &arena, &spec)
}

fn gpu_heavy_downscale() -> R {
    // Filters wider than the separable path's taps: the direct path, and a mix in one batch.
    let mut rng = SmallRng::seed_from_u64(12);
    let mut spec = ResizeSpec::new(3, 7, 9, plain(3));
    let mut arena = Vec::new();
    for (h, w) in [(600, 500), (40, 40), (300, 900)] {
        let off = arena.len();
        arena.extend(noise(&mut rng, h * w * 3));
        spec.push(off, h, w, whole(h, w));
    }
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    run_one::<f32>(&stream, &arena, &spec)?;
    run_one::<u8>(&stream, &arena, &spec.clone().antialias(false))
}

fn gpu_imagenet_like() -> R {
    // What a training feed launches: 64 images of 375 x 500 (and 500 x 375), 224 x 224 out.
    let mut rng = SmallRng::seed_from_u64(13);
    let mut boxes = BoxRng::new(13, 0);
    let rrc = RandomResizedCrop::default();
    let mut train = ResizeSpec::new(3, 224, 224, Normalize::imagenet());
    let mut val = train.clone();
    let mut arena = Vec::new();
    for i in 0..64 {
        let (h, w) = if i % 3 == 0 { (500, 375) } else { (375, 500) };
        let off = arena.len();
        arena.extend(noise(&mut rng, h * w * 3));
        train.push(off, h, w, rrc.sample(&mut boxes, h, w)?);
        val.push(off, h, w, CropBox::center(h, w, 256, 224)?);
    }
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    run_one::<f16>(&stream, &arena, &train)?;
    run_one::<f32>(&stream, &arena, &val.layouts(Layout::Nhwc, Layout::Nhwc))
}
