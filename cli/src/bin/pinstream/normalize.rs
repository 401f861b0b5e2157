//! `pinstream normalize`: decode images, upload through pinned memory, run the fused kernel (or
//! the CPU reference with `--cpu`), write a `.npy` file; optionally verify and time it.

use std::io::Write as _;
use std::path::{Path, PathBuf};

use clap::Args;
use pinstream::kernels::{self, cpu, Layout, Normalize, OutputElement, Spec};
use pinstream::{
    bf16, f16, Device, DeviceBuffer, Error, HostAlloc, PinnedBuffer, Result, TimingEvent,
};
use serde::Serialize;

use crate::output::{self, Format};

#[derive(Args, Debug)]
pub struct NormalizeArgs {
    /// Image files (PNG or JPEG).
    #[arg(long, num_args = 1.., required = true)]
    input: Vec<PathBuf>,
    /// Per-channel mean on the 0..255 scale, e.g. 123.7,116.3,103.5.
    #[arg(
        long,
        value_delimiter = ',',
        requires = "std",
        conflicts_with = "preset"
    )]
    mean: Vec<f32>,
    /// Per-channel std on the 0..255 scale.
    #[arg(long, value_delimiter = ',', requires = "mean")]
    std: Vec<f32>,
    /// Named statistics.
    #[arg(long, value_parser = output::one_of(&["imagenet"]), ignore_case = true)]
    preset: Option<String>,
    /// Output layout (the decoded images are channels-last, NHWC).
    #[arg(long, value_parser = output::one_of(&["nchw", "nhwc"]), ignore_case = true, default_value = "nchw")]
    layout: String,
    /// Output element type.
    #[arg(
        long,
        value_parser = output::one_of(&["f32", "f16", "bf16", "u8", "i8"]),
        ignore_case = true,
        default_value = "f32"
    )]
    dtype: String,
    /// Pad the channels to 4 with this value (also allows images with different channel counts,
    /// which are then all converted to the largest count first).
    #[arg(long)]
    pad: Option<f32>,
    /// The .npy file to write.
    #[arg(long)]
    out: PathBuf,
    /// Check the result against the f64 reference and print the largest error, in units of
    /// rounding (integers against the rounded and saturated reference); fail above 1 unit.
    #[arg(long)]
    verify: bool,
    /// Time the kernel and compare with a device-to-device copy of the same bytes.
    #[arg(long)]
    bench: bool,
    /// Run the CPU reference instead of the GPU (works without a GPU).
    #[arg(long)]
    cpu: bool,
    /// Device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Output format of the report (what was written, --verify, --bench): csv is a header and
    /// one line, json one object.
    #[arg(long, value_enum, ignore_case = true, default_value_t = Format::Table)]
    format: Format,
}

/// What one `pinstream normalize` run did: the table's lines, the CSV's one line, the JSON
/// object. `verify_*` only with --verify, `bench_*` only with --bench.
#[derive(Debug, Default, Serialize)]
struct NormalizeReport {
    /// The .npy file written.
    out: String,
    /// Element type: f32, f16, bf16, u8 or i8.
    dtype: &'static str,
    /// nchw or nhwc.
    layout: &'static str,
    /// The array's shape, e.g. "2x3x512x512" (one dimension where the images differ in size).
    shape: String,
    images: usize,
    /// What ran it: the GPU's name and ordinal, or "cpu reference".
    ran_on: String,
    /// The largest absolute error against the f64 reference.
    verify_max_abs_error: Option<f64>,
    /// The same in units of rounding (1 or less passes).
    verify_units: Option<f64>,
    /// Median milliseconds per launch of the kernel.
    bench_kernel_ms: Option<f64>,
    /// Bytes read and written per launch.
    bench_bytes: Option<usize>,
    /// Decimal GB/s of the kernel (bench_bytes over the time).
    bench_gbps: Option<f64>,
    /// Median milliseconds of a device-to-device copy of the same bytes.
    bench_copy_ms: Option<f64>,
    /// The kernel's rate as a percentage of that copy's.
    bench_percent_of_copy: Option<f64>,
}

impl NormalizeReport {
    fn bench_line(&self) -> Option<String> {
        let (kernel, gbps, bytes, copy, pct) = (
            self.bench_kernel_ms?,
            self.bench_gbps?,
            self.bench_bytes?,
            self.bench_copy_ms?,
            self.bench_percent_of_copy?,
        );
        Some(format!(
            "bench: {kernel:.4} ms per launch, {gbps:.1} GB/s ({bytes} bytes read + written); d2d copy of the same bytes {copy:.4} ms: {pct:.1} % of copy bandwidth"
        ))
    }

    fn verify_line(&self) -> Option<String> {
        let (abs, units) = (self.verify_max_abs_error?, self.verify_units?);
        Some(format!(
            "verify: max abs error {abs:.3e} ({units:.2} units of rounding) against the f64 reference{}",
            if self.dtype == "u8" || self.dtype == "i8" {
                " (rounded and saturated)"
            } else {
                ""
            }
        ))
    }
}

fn bad(reason: impl Into<String>) -> Error {
    Error::InvalidArgument {
        op: "normalize",
        reason: reason.into(),
    }
}

struct Decoded {
    pixels: Vec<u8>,
    sizes: Vec<(usize, usize)>,
    channels: usize,
}

fn decode(files: &[PathBuf], pad: bool) -> Result<Decoded> {
    let mut images = Vec::new();
    for f in files {
        if !f.is_file() {
            return Err(bad(format!("{}: no such file", f.display())));
        }
        let img =
            image::open(f).map_err(|e| bad(format!("{}: cannot decode: {e}", f.display())))?;
        let c = usize::from(img.color().channel_count());
        images.push((f, img, c));
    }
    let counts: Vec<usize> = images.iter().map(|(_, _, c)| *c).collect();
    let max_c = counts.iter().copied().max().unwrap_or(3);
    if !pad && counts.iter().any(|&c| c != max_c) {
        let list: Vec<String> = images
            .iter()
            .map(|(f, _, c)| format!("{} has {c}", f.display()))
            .collect();
        return Err(bad(format!(
            "mixed channel counts ({}); use --pad FILL to convert and pad them",
            list.join(", ")
        )));
    }
    let mut pixels = Vec::new();
    let mut sizes = Vec::new();
    for (_, img, _) in images {
        let raw = match max_c {
            1 => img.to_luma8().into_raw(),
            2 => img.to_luma_alpha8().into_raw(),
            3 => img.to_rgb8().into_raw(),
            _ => img.to_rgba8().into_raw(),
        };
        sizes.push((img.height() as usize, img.width() as usize));
        pixels.extend_from_slice(&raw);
    }
    Ok(Decoded {
        pixels,
        sizes,
        channels: max_c,
    })
}

fn stats(args: &NormalizeArgs, c: usize) -> Result<Normalize> {
    if !args.mean.is_empty() {
        let widen = |v: &[f32]| {
            if v.len() == 1 {
                vec![v[0]; c]
            } else {
                v.to_vec()
            }
        };
        let (m, s) = (widen(&args.mean), widen(&args.std));
        if m.len() != c || s.len() != c {
            return Err(bad(format!(
                "{} means / {} stds for {c}-channel images",
                m.len(),
                s.len()
            )));
        }
        return Ok(Normalize::new(&m, &s));
    }
    let inet = Normalize::imagenet();
    Ok(match c {
        3 => inet,
        4 => Normalize::new(
            &[inet.mean[0], inet.mean[1], inet.mean[2], 127.5],
            &[inet.std[0], inet.std[1], inet.std[2], 127.5],
        ),
        1 => Normalize::new(
            &[inet.mean.iter().sum::<f32>() / 3.0],
            &[inet.std.iter().sum::<f32>() / 3.0],
        ),
        _ => Normalize::new(&[inet.mean[0], 127.5], &[inet.std[0], 127.5]),
    })
}

pub fn run(args: NormalizeArgs) -> Result<()> {
    let dec = decode(&args.input, args.pad.is_some())?;
    let layout = if args.layout == "nhwc" {
        Layout::Nhwc
    } else {
        Layout::Nchw
    };
    let mut spec = Spec::variable(dec.channels, &dec.sizes, stats(&args, dec.channels)?)
        .layouts(Layout::Nhwc, layout);
    if let Some(fill) = args.pad {
        spec = spec.pad_to_4(fill);
    }
    spec.validate("normalize")?;
    match args.dtype.as_str() {
        "f16" => run_typed::<f16>(&args, &dec, &spec, "<f2"),
        "bf16" => run_typed::<bf16>(&args, &dec, &spec, "<u2"),
        "u8" => run_typed::<u8>(&args, &dec, &spec, "|u1"),
        "i8" => run_typed::<i8>(&args, &dec, &spec, "|i1"),
        _ => run_typed::<f32>(&args, &dec, &spec, "<f4"),
    }
}

fn run_typed<O: OutputElement>(
    args: &NormalizeArgs,
    dec: &Decoded,
    spec: &Spec,
    descr: &str,
) -> Result<()> {
    let n_out = spec.output_len()?;
    let mut out = vec![O::poison(); n_out];
    let table = args.format == Format::Table;
    let mut report = NormalizeReport {
        out: args.out.display().to_string(),
        dtype: O::NAME,
        layout: match spec.out_layout {
            Layout::Nchw => "nchw",
            Layout::Nhwc => "nhwc",
        },
        images: spec.samples.len(),
        ..NormalizeReport::default()
    };
    if args.cpu {
        cpu::normalize(&dec.pixels, spec, None, &mut out)?;
        report.ran_on = "cpu reference".to_string();
    } else {
        let dev = Device::get(args.device)?;
        let stream = dev.stream()?;
        let host_in = PinnedBuffer::from_slice(&dev, &dec.pixels, HostAlloc::WRITE_COMBINED)?;
        let mut d_in = DeviceBuffer::<u8>::new(&dev, dec.pixels.len())?;
        stream.copy_h2d(&host_in, &mut d_in)?;
        let mut d_out = DeviceBuffer::<O>::new(&dev, n_out)?;
        kernels::fill(&stream, &mut d_out, O::poison())?;
        kernels::normalize::<O, _, _>(&stream, &d_in, spec, &mut d_out, None)?;
        let mut host_out = PinnedBuffer::<O>::new(&dev, n_out, HostAlloc::DEFAULT)?;
        out.copy_from_slice(stream.copy_d2h(&d_out, &mut host_out)?.wait()?);
        report.ran_on = format!("{} (GPU {})", dev.name()?, dev.ordinal());
        if args.bench {
            bench::<O>(&stream, &d_in, spec, &mut d_out, &mut report)?;
            if let Some(line) = report.bench_line().filter(|_| table) {
                println!("{line}");
            }
        }
    }
    if args.verify {
        let exact = cpu::normalize_exact(&dec.pixels, spec, None)?;
        // The library's one error measure: integers against the rounded and saturated
        // reference, floats against the exact value.
        let worst = cpu::worst_error(&out, &exact, spec.norm.shift)?;
        let (abs, units) = worst.map_or((0.0, 0.0), |w| (w.abs, w.units));
        report.verify_max_abs_error = Some(abs);
        report.verify_units = Some(units);
        if let Some(line) = report.verify_line().filter(|_| table) {
            println!("{line}");
        }
        if let Some(w) = worst.filter(|w| w.units > 1.0) {
            return Err(bad(format!(
                "verification failed: error of {:.2} units of rounding at element {}: got {}, exact {}",
                w.units,
                w.index,
                out[w.index].to_f64(),
                exact[w.index]
            )));
        }
    }
    let uniform = spec.is_uniform();
    let shape: Vec<usize> = if uniform {
        let (h, w) = (spec.samples[0].h, spec.samples[0].w);
        let (n, c) = (spec.samples.len(), spec.out_channels());
        match spec.out_layout {
            Layout::Nchw => vec![n, c, h, w],
            Layout::Nhwc => vec![n, h, w, c],
        }
    } else {
        vec![n_out]
    };
    write_npy(&args.out, descr, &shape, bytemuck::cast_slice(&out))
        .map_err(|e| bad(format!("{}: {e}", args.out.display())))?;
    let dims: Vec<String> = shape.iter().map(usize::to_string).collect();
    report.shape = dims.join("x");
    match args.format {
        Format::Table => {
            println!(
                "wrote {} ({} {:?}, shape {:?}{}) with the {}",
                report.out,
                report.dtype,
                spec.out_layout,
                shape,
                if uniform {
                    ""
                } else {
                    "; images differ in size, so the samples are concatenated"
                },
                report.ran_on
            );
            if O::NAME == "bf16" {
                println!("note: numpy has no bfloat16; the file holds the raw bf16 bits as <u2 (view as ml_dtypes.bfloat16)");
            }
        }
        Format::Csv => print!("{}", output::csv(std::slice::from_ref(&report))?),
        Format::Json => print!("{}", output::json(&report)?),
    }
    Ok(())
}

fn bench<O: OutputElement>(
    stream: &pinstream::Stream,
    d_in: &DeviceBuffer<u8>,
    spec: &Spec,
    d_out: &mut DeviceBuffer<O>,
    report: &mut NormalizeReport,
) -> Result<()> {
    let dev = stream.device();
    let (a, b) = (TimingEvent::new(&dev)?, TimingEvent::new(&dev)?);
    let bytes = d_in.len() + d_out.len() * std::mem::size_of::<O>();
    let mut copy_src = DeviceBuffer::<u8>::new(&dev, bytes / 2)?;
    let mut copy_dst = DeviceBuffer::<u8>::new(&dev, bytes / 2)?;
    kernels::fill(stream, &mut copy_src, 0x5Au8)?;
    let time = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        for _ in 0..3 {
            f()?;
        }
        let mut samples = Vec::new();
        for _ in 0..15 {
            stream.record(&a)?;
            for _ in 0..10 {
                f()?;
            }
            stream.record(&b)?;
            b.synchronize()?;
            samples.push(f64::from(a.elapsed_ms(&b)?) / 10.0);
        }
        samples.sort_by(f64::total_cmp);
        Ok(samples[samples.len() / 2])
    };
    let kernel = time(&mut || kernels::normalize::<O, _, _>(stream, d_in, spec, d_out, None))?;
    let copy = time(&mut || stream.copy_d2d(&copy_src, &mut copy_dst))?;
    report.bench_kernel_ms = Some(kernel);
    report.bench_bytes = Some(bytes);
    report.bench_gbps = Some(bytes as f64 / kernel / 1e6);
    report.bench_copy_ms = Some(copy);
    report.bench_percent_of_copy = Some(100.0 * copy / kernel);
    Ok(())
}

/// Writes a version 1.0 `.npy` file through a temporary file renamed at the end, so a failure
/// leaves nothing half-written.
pub fn write_npy(path: &Path, descr: &str, shape: &[usize], data: &[u8]) -> std::io::Result<()> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_str = if dims.len() == 1 {
        format!("({},)", dims[0])
    } else {
        format!("({})", dims.join(", "))
    };
    let mut header =
        format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape_str}, }}");
    // magic (6) + version (2) + header length (2) + header + '\n' is a multiple of 64.
    let total = 10 + header.len() + 1;
    header.push_str(&" ".repeat((64 - total % 64) % 64));
    header.push('\n');
    let tmp = path.with_extension(format!("npy.tmp-{}", std::process::id()));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(b"\x93NUMPY\x01\x00")?;
        f.write_all(&(header.len() as u16).to_le_bytes())?;
        f.write_all(header.as_bytes())?;
        f.write_all(data)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}
