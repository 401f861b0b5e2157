//! Hostile trials of issue 30 (a restructuring that must not change behaviour) against the
//! kernels' per-launch tables, which moved out of `Stream` into `kernels::table` behind the
//! stream's type-erased slot (`Stream::slot`): the device scratch is replaced while launches that
//! read the old one are queued, streams are dropped (last clone) with a table upload and its
//! launch still queued, borrowed streams (`Stream::from_raw`) of an owned stream get their own
//! slot, normalize and resized-crop tables (rows of different types) share one scratch, the
//! scratch's replacement fails for want of device memory (the slot is left empty, the ring
//! dropped) and the stream must stay usable, and many clones grow and shrink the tables from
//! threads. And the two items the layers made public for pinstream-vision: `Error::invalid` and
//! `Normalize::check` (CPU trials).
//!
//! A trial passes when the library resisted (correct output, a typed error, no hang) and fails
//! when it broke: `finding/...` would be one that broke when written, `held/...` one that held.
//! GPU trials are ignored without a device.

use std::time::Duration;

use crate::common::{ensure, rng, within, R};
use libtest_mimic::{Failed, Trial};
use pinstream::kernels::{self, cpu, Crop, CropBox, Layout, Normalize, ResizeSpec, Spec};
use pinstream::{Device, DeviceBuffer, Error, Stream};
use rand::rngs::SmallRng;
use rand::{Rng, RngCore};

use crate::common::trial;

/// Prefix of this module's trial names (its path in the binary).
const PREFIX: &str = "hostile30/";

const BOUND: Duration = Duration::from_secs(180);

/// The trials of this module, named `hostile30/...`.
pub fn trials() -> Vec<Trial> {
    let no_gpu = !pinstream::available();
    let gpu = |name: &str, f: fn() -> R| {
        let name = format!("held/gpu/{name}");
        let what = name.clone();
        trial(PREFIX, name, move || within(&what, BOUND, f)).with_ignored_flag(no_gpu)
    };
    let cpu = |name: &str, f: fn() -> R| {
        let name = format!("held/cpu/{name}");
        let what = name.clone();
        trial(PREFIX, name, move || within(&what, BOUND, f))
    };
    vec![
        cpu(
            "error_invalid_is_the_invalid_argument_variant",
            error_invalid_is_invalid_argument,
        ),
        cpu(
            "normalize_check_agrees_with_spec_validate",
            normalize_check_agrees_with_validate,
        ),
        gpu(
            "scratch_replaced_while_launches_queued_behind_a_spin",
            scratch_replaced_while_queued,
        ),
        gpu(
            "stream_dropped_with_a_table_upload_and_launch_queued",
            stream_dropped_with_table_queued,
        ),
        gpu(
            "borrowed_view_of_an_owned_stream_synchronizes_but_never_destroys",
            borrowed_view_drop,
        ),
        gpu(
            "owner_and_borrowed_views_of_one_raw_stream_from_two_threads",
            owner_and_borrowed_from_threads,
        ),
        gpu(
            "normalize_and_resize_tables_interleaved_on_one_scratch",
            normalize_and_resize_interleaved,
        ),
        gpu(
            "scratch_growth_out_of_device_memory_leaves_the_stream_usable",
            scratch_growth_oom,
        ),
        gpu(
            "clones_grow_and_shrink_tables_from_four_threads",
            clones_grow_and_shrink,
        ),
    ]
}

// ---------------------------------------------------------------------------------------
// Helpers.

fn random_u8(rng: &mut SmallRng, n: usize) -> Vec<u8> {
    let mut v = vec![0u8; n];
    rng.fill_bytes(&mut v);
    v
}

fn random_norm(rng: &mut SmallRng) -> Normalize {
    let mean: Vec<f32> = (0..3).map(|_| rng.random_range(0.0..255.0)).collect();
    let std: Vec<f32> = (0..3).map(|_| rng.random_range(1.0..90.0)).collect();
    Normalize::new(&mean, &std)
}

/// `n` RGB samples of small random sizes, each cropped and mirrored at random: a table of `n`
/// rows (48 bytes each), uploaded through the stream's ring into its scratch when `n > 256`.
fn table_spec(rng: &mut SmallRng, n: usize) -> Spec {
    let sizes: Vec<(usize, usize)> = (0..n)
        .map(|_| (rng.random_range(2..7), rng.random_range(2..7)))
        .collect();
    let mut spec = Spec::variable(3, &sizes, random_norm(rng)).layouts(Layout::Nhwc, Layout::Nchw);
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

/// One non-uniform normalize with its input on the device and a poisoned output.
struct Launch {
    spec: Spec,
    input: Vec<u8>,
    d_in: DeviceBuffer<u8>,
    d_out: DeviceBuffer<f32>,
}

impl Launch {
    fn new(stream: &Stream, rng: &mut SmallRng, n: usize) -> Result<Launch, Failed> {
        let dev = stream.device();
        let spec = table_spec(rng, n);
        let input = random_u8(rng, spec.input_len()?);
        let mut d_in = DeviceBuffer::<u8>::new(&dev, input.len())?;
        stream.copy_h2d(&input[..], &mut d_in)?.wait()?;
        let mut d_out = DeviceBuffer::<f32>::new(&dev, spec.output_len()?)?;
        stream.memset(&mut d_out, 0xFF)?;
        stream.synchronize()?;
        Ok(Launch {
            spec,
            input,
            d_in,
            d_out,
        })
    }

    fn launch(&mut self, stream: &Stream) -> Result<(), Error> {
        kernels::normalize::<f32, _, _>(stream, &self.d_in, &self.spec, &mut self.d_out, None)
    }

    /// Against the CPU reference, read back on `stream` (ordered after the launch by the
    /// output's tracker, whatever stream ran it).
    fn check(&self, stream: &Stream, what: &str, seed: u64) -> R {
        let mut got = vec![0f32; self.spec.output_len()?];
        stream.copy_d2h(&self.d_out, &mut got[..])?.wait()?;
        let exact = cpu::normalize_exact(&self.input, &self.spec, None)?;
        let worst = cpu::worst_error(&got, &exact, self.spec.norm.shift)?;
        ensure(worst.is_none_or(|w| w.units <= 1.0), || {
            format!(
                "{what} ({} samples): {worst:?} (seed {seed})",
                self.spec.samples.len()
            )
        })
    }
}

/// Fills `bytes` of fresh device memory with 0xFF on `stream` and keeps it: memory the driver
/// hands out again right after a free lands here, so a stale reader sees garbage.
fn scribble(stream: &Stream, bytes: usize) -> Result<Vec<DeviceBuffer<u8>>, Failed> {
    let mut out = Vec::new();
    for _ in 0..8 {
        let mut b = DeviceBuffer::<u8>::new(&stream.device(), bytes)?;
        stream.memset(&mut b, 0xFF)?;
        out.push(b);
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------
// CPU.

/// `Error::invalid` (public since issue 30, for pinstream-vision) is exactly the
/// `InvalidArgument` variant the core returns, with the op and the reason given.
fn error_invalid_is_invalid_argument() -> R {
    let e = Error::invalid("hostile30::op", "because");
    match &e {
        Error::InvalidArgument { op, reason } => {
            ensure(*op == "hostile30::op" && reason == "because", || {
                format!("{e:?}")
            })?;
        }
        other => return Err(format!("Error::invalid gave {other:?}").into()),
    }
    ensure(e.cuda().is_none(), || format!("{e:?} claims a CUDA code"))
}

/// `Normalize::check` (public since issue 30; pinstream-vision's feed checks its statistics
/// with it before any batch) refuses exactly the statistics that the kernels' own spec check
/// refuses, under the op it is given.
fn normalize_check_agrees_with_validate() -> R {
    let good = Normalize::new(&[120.0, 110.0, 100.0], &[60.0, 55.0, 50.0]);
    let mut cases: Vec<(String, Normalize)> = vec![("good".into(), good.clone())];
    for (c, bad) in [
        (0usize, f32::NAN),
        (1, f32::INFINITY),
        (2, f32::NEG_INFINITY),
    ] {
        let mut m = good.mean.clone();
        m[c] = bad;
        cases.push((format!("mean[{c}]={bad}"), Normalize::new(&m, &good.std)));
        let mut s = good.std.clone();
        s[c] = bad;
        cases.push((format!("std[{c}]={bad}"), Normalize::new(&good.mean, &s)));
    }
    for z in [0.0f32, -0.0, f32::MIN_POSITIVE / 1e10] {
        let mut s = good.std.clone();
        s[1] = z;
        cases.push((format!("std[1]={z:e}"), Normalize::new(&good.mean, &s)));
    }
    cases.push((
        "scale=inf".into(),
        good.clone().with_scale_shift(f32::INFINITY, 0.0),
    ));
    cases.push((
        "shift=nan".into(),
        good.clone().with_scale_shift(1.0, f32::NAN),
    ));
    cases.push((
        "scale/std overflows".into(),
        Normalize::new(&good.mean, &[1e-30, 1.0, 1.0]).with_scale_shift(1e10, 0.0),
    ));
    cases.push(("two means".into(), Normalize::new(&[1.0, 2.0], &[1.0, 1.0])));
    for (what, n) in cases {
        let checked = n.check("hostile30::check", 3);
        let spec = Spec::uniform(2, 3, 4, 4, n.clone())?;
        let validated = spec.validate("hostile30::validate");
        ensure(checked.is_err() == validated.is_err(), || {
            format!("{what}: check {checked:?}, validate {validated:?}")
        })?;
        if let Err(e) = checked {
            match e {
                Error::InvalidArgument { op, .. } => {
                    ensure(op == "hostile30::check", || format!("{what}: op {op}"))?
                }
                other => return Err(format!("{what}: {other:?} is not InvalidArgument").into()),
            }
        }
        // The CPU path refuses it too (the launcher checks before it launches).
        let input = vec![7u8; 2 * 3 * 16];
        let mut out = vec![0f32; 2 * 3 * 16];
        let cpu_run = cpu::normalize(&input, &spec, None, &mut out);
        ensure(cpu_run.is_err() == validated.is_err(), || {
            format!("{what}: cpu::normalize {cpu_run:?}")
        })?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// GPU.

/// Launches whose tables need ever larger scratch buffers, queued behind a spin: every launch
/// after the first replaces the scratch (`kernels::table::tables` takes the old one out of the
/// slot, waits for the stream, drops it, allocates a larger one) while the earlier launches
/// have not run yet when the host gets there; the freed scratch is scribbled over at once. Then
/// smaller tables again (the large scratch is kept). Every output is checked at the end.
fn scratch_replaced_while_queued() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let (mut rng, seed) = rng();
    let sizes = [
        257usize, 420, 700, 1200, 2000, 3400, 5800, 300, 9900, 260, 16000,
    ];
    let mut launches = sizes
        .iter()
        .map(|&n| Launch::new(&stream, &mut rng, n))
        .collect::<Result<Vec<_>, _>>()?;
    let mut junk = Vec::new();
    stream.spin(Duration::from_millis(200))?;
    for l in launches.iter_mut() {
        l.launch(&stream)?;
        // Freshly freed device memory (the old scratch) goes to a buffer the stream writes.
        junk.extend(scribble(&stream, 64 << 10)?);
    }
    stream.synchronize()?;
    for (k, l) in launches.iter().enumerate() {
        l.check(&stream, &format!("launch {k}"), seed)?;
    }
    Ok(())
}

/// The last clone of a stream is dropped right after a table upload and the launch reading it
/// were queued behind a 300 ms spin: the drop must let them finish before the scratch and ring
/// are freed (the slot is occupied). Device memory allocated and scribbled over right after the
/// drop must not reach the launch. The output is read on another stream.
fn stream_dropped_with_table_queued() -> R {
    let dev = Device::get(0)?;
    let reader = dev.stream()?;
    let (mut rng, seed) = rng();
    for n in [300usize, 4000] {
        let stream = dev.stream()?;
        // Warm the scratch and ring with a table of the same size (no growth below).
        let mut warm = Launch::new(&stream, &mut rng, n)?;
        warm.launch(&stream)?;
        stream.synchronize()?;
        let mut l = Launch::new(&stream, &mut rng, n)?;
        stream.spin(Duration::from_millis(300))?;
        l.launch(&stream)?;
        drop(stream);
        let _junk = scribble(&reader, (n * 48 * 2).max(1 << 20))?;
        warm.check(&reader, "warm-up", seed)?;
        l.check(&reader, "launch queued at the drop", seed)?;
    }
    Ok(())
}

/// A `Stream::from_raw` view of a stream pinstream owns has its own slot: table launches on it
/// behind a spin on the owner, then the view is dropped. Its drop must wait for them (the slot
/// is occupied) and must not destroy the owner's stream, which keeps working afterwards.
fn borrowed_view_drop() -> R {
    let dev = Device::get(0)?;
    let owner = dev.stream()?;
    let (mut rng, seed) = rng();
    let mut a = Launch::new(&owner, &mut rng, 1500)?;
    let mut b = Launch::new(&owner, &mut rng, 700)?;
    // SAFETY: `owner` keeps the raw stream alive until after the view (and its clones) drop.
    let view = unsafe { Stream::from_raw(&dev, owner.as_raw())? };
    ensure(!view.is_owned(), || {
        "a from_raw stream says it is owned".into()
    })?;
    owner.spin(Duration::from_millis(200))?;
    a.launch(&view)?;
    let view2 = view.clone();
    b.launch(&view2)?;
    drop(view);
    let _junk = scribble(&owner, 1 << 20)?;
    drop(view2);
    // The raw stream still exists: the owner queues and waits on it.
    owner.spin(Duration::from_millis(5))?;
    owner.synchronize()?;
    a.check(&owner, "launch on the view", seed)?;
    b.check(&owner, "launch on the view's clone", seed)?;
    // And the owner's own tables work afterwards.
    let mut c = Launch::new(&owner, &mut rng, 900)?;
    c.launch(&owner)?;
    c.check(&owner, "launch on the owner after the view dropped", seed)
}

/// Two `Stream`s for one raw stream (the owner and a `from_raw` view) each keep a scratch;
/// two threads queue different tables on them at once, interleaved on the one raw stream, with
/// growth on both sides. Every output must be its own table's.
fn owner_and_borrowed_from_threads() -> R {
    let dev = Device::get(0)?;
    let owner = dev.stream()?;
    // SAFETY: `owner` outlives the view (dropped at the end of this function, after it).
    let view = unsafe { Stream::from_raw(&dev, owner.as_raw())? };
    let (mut rng, seed) = rng();
    let mut mk = |s: &Stream| -> Result<Vec<Launch>, Failed> {
        (0..12)
            .map(|k| Launch::new(s, &mut rng, 260 + k * 350))
            .collect()
    };
    let mine = mk(&owner)?;
    let theirs = mk(&view)?;
    owner.spin(Duration::from_millis(150))?;
    let (mine, theirs) = std::thread::scope(|scope| {
        let h1 = scope.spawn(|| -> Result<Vec<Launch>, Failed> {
            let mut v = mine;
            for l in v.iter_mut() {
                l.launch(&owner)?;
            }
            Ok(v)
        });
        let h2 = scope.spawn(|| -> Result<Vec<Launch>, Failed> {
            let mut v = theirs;
            for l in v.iter_mut().rev() {
                l.launch(&view)?;
            }
            Ok(v)
        });
        (
            h1.join()
                .unwrap_or_else(|_| Err("owner thread panicked".into())),
            h2.join()
                .unwrap_or_else(|_| Err("view thread panicked".into())),
        )
    });
    owner.synchronize()?;
    for (k, l) in mine?.iter().enumerate() {
        l.check(&owner, &format!("owner launch {k}"), seed)?;
    }
    for (k, l) in theirs?.iter().enumerate() {
        l.check(&owner, &format!("view launch {k}"), seed)?;
    }
    drop(view);
    Ok(())
}

/// A resized crop of `n` samples (8x8 .. 20x20 RGB sources, random boxes) to 4x4.
struct Resize {
    spec: ResizeSpec,
    input: Vec<u8>,
    d_in: DeviceBuffer<u8>,
    d_out: DeviceBuffer<f32>,
}

impl Resize {
    fn new(stream: &Stream, rng: &mut SmallRng, n: usize) -> Result<Resize, Failed> {
        let dev = stream.device();
        let mut spec = ResizeSpec::new(3, 4, 4, random_norm(rng));
        let mut offset = 0;
        for _ in 0..n {
            let (h, w) = (rng.random_range(8..21), rng.random_range(8..21));
            let bh = rng.random_range(2.0..h as f32);
            let bw = rng.random_range(2.0..w as f32);
            let crop = CropBox {
                top: rng.random_range(0.0..(h as f32 - bh)),
                left: rng.random_range(0.0..(w as f32 - bw)),
                height: bh,
                width: bw,
                flip: rng.random_bool(0.5),
                clamp_to_box: rng.random_bool(0.5),
            };
            spec.push(offset, h, w, crop);
            offset += h * w * 3;
        }
        let input = random_u8(rng, offset);
        let mut d_in = DeviceBuffer::<u8>::new(&dev, input.len())?;
        stream.copy_h2d(&input[..], &mut d_in)?.wait()?;
        let mut d_out = DeviceBuffer::<f32>::new(&dev, spec.output_len()?)?;
        stream.memset(&mut d_out, 0xFF)?;
        stream.synchronize()?;
        Ok(Resize {
            spec,
            input,
            d_in,
            d_out,
        })
    }

    fn launch(&mut self, stream: &Stream) -> Result<(), Error> {
        kernels::resized_crop::<f32, _, _>(stream, &self.d_in, &self.spec, &mut self.d_out)
    }

    fn check(&self, stream: &Stream, what: &str, seed: u64) -> R {
        let mut got = vec![0f32; self.spec.output_len()?];
        stream.copy_d2h(&self.d_out, &mut got[..])?.wait()?;
        let exact = cpu::resized_crop_exact(&self.input, &self.spec)?;
        let worst = cpu::resize_worst_error(&got, &exact, &self.spec)?;
        ensure(worst.is_none_or(|w| w.units <= 1.0), || {
            format!(
                "{what} ({} samples): {worst:?} (seed {seed})",
                self.spec.samples.len()
            )
        })
    }
}

/// Normalize tables (48-byte rows) and resized-crop tables (rows of another type and size)
/// share the stream's one scratch and ring, queued alternately behind a spin without a wait:
/// each launch must read its own table, not the other kernel's upload that followed it.
fn normalize_and_resize_interleaved() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let (mut rng, seed) = rng();
    let mut norms = Vec::new();
    let mut resizes = Vec::new();
    for k in 0..8 {
        norms.push(Launch::new(&stream, &mut rng, 300 + k * 500)?);
        resizes.push(Resize::new(&stream, &mut rng, 260 + k * 300)?);
    }
    stream.spin(Duration::from_millis(200))?;
    for (n, r) in norms.iter_mut().zip(resizes.iter_mut()) {
        n.launch(&stream)?;
        r.launch(&stream)?;
    }
    stream.synchronize()?;
    for (k, (n, r)) in norms.iter().zip(&resizes).enumerate() {
        n.check(&stream, &format!("normalize {k}"), seed)?;
        r.check(&stream, &format!("resized crop {k}"), seed)?;
    }
    Ok(())
}

/// Takes device memory in ever smaller buffers until none is left (kept in the result).
fn exhaust(dev: &Device) -> Vec<DeviceBuffer<u8>> {
    let mut held = Vec::new();
    let mut chunk = 1usize << 30;
    while chunk >= 64 << 10 {
        match DeviceBuffer::<u8>::new(dev, chunk) {
            Ok(b) => held.push(b),
            Err(_) => chunk /= 2,
        }
    }
    held
}

/// The scratch must grow while the device has no memory left: the table call fails (typed),
/// the slot is left without tables (the ring is dropped, after its uploads), and the stream
/// must stay usable: a launch queued before the failure is correct, the same large launch
/// works once memory is back, and so does a small one after it; dropping the stream is clean.
fn scratch_growth_oom() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let (mut rng, seed) = rng();
    let mut small = Launch::new(&stream, &mut rng, 300)?;
    let mut big = Launch::new(&stream, &mut rng, 40_000)?;
    let mut after = Launch::new(&stream, &mut rng, 280)?;
    stream.spin(Duration::from_millis(100))?;
    small.launch(&stream)?;
    let filler = exhaust(&dev);
    let failed = big.launch(&stream);
    drop(filler);
    match &failed {
        Err(Error::OutOfMemory { .. }) => {}
        Err(other) => {
            return Err(format!("scratch growth without memory: {other:?}, not OutOfMemory").into())
        }
        // The launch found room after all (the driver kept a reserve): it must be right.
        Ok(()) => {
            big.check(&stream, "large launch (memory was found)", seed)?;
        }
    }
    small.check(&stream, "launch queued before the failed growth", seed)?;
    big.launch(&stream)?;
    big.check(&stream, "large launch once memory is back", seed)?;
    after.launch(&stream)?;
    after.check(&stream, "small launch after the regrowth", seed)?;
    // No error left behind on the stream.
    stream.synchronize()?;
    drop(stream);
    ensure(failed.is_err(), || {
        "SETUP: the device could not be filled; the failure path was not reached".into()
    })
}

/// Four threads on clones of one stream queue tables of random sizes (growing and shrinking
/// the one scratch, wrapping the ring) behind a spin; every output is checked at the end.
fn clones_grow_and_shrink() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let (mut rng, seed) = rng();
    let mut work = Vec::new();
    for _ in 0..4 {
        let mut mine = Vec::new();
        for _ in 0..10 {
            let n = if rng.random_bool(0.3) {
                rng.random_range(1..256)
            } else {
                rng.random_range(257..9000)
            };
            mine.push(Launch::new(&stream, &mut rng, n)?);
        }
        work.push(mine);
    }
    stream.spin(Duration::from_millis(150))?;
    let done: Vec<Result<Vec<Launch>, Failed>> = std::thread::scope(|scope| {
        let handles: Vec<_> = work
            .into_iter()
            .map(|mut mine| {
                let s = stream.clone();
                scope.spawn(move || -> Result<Vec<Launch>, Failed> {
                    for l in mine.iter_mut() {
                        l.launch(&s)?;
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
        for (k, l) in mine?.iter().enumerate() {
            l.check(&stream, &format!("thread {t}, launch {k}"), seed)?;
        }
    }
    Ok(())
}
