//! Image files into a normalized training batch: decode (the `image` crate), centre-crop each
//! to a common square inside the kernel's per-sample crop, upload through pinned memory, and
//! normalize with the ImageNet statistics into one NCHW f32 batch in one launch; then check
//! the batch against the CPU reference.
//!
//! ```sh
//! cargo run --example normalize_images                  # the sample images (see below)
//! cargo run --example normalize_images -- a.png b.jpg   # your own
//! ```
//!
//! Without arguments it reads every PNG and JPEG in `../shared/data/images` (beside the
//! repository) or else `tests/data/images`, found from `CARGO_MANIFEST_DIR` (which `cargo run`
//! sets) or from the working directory. Without a CUDA device it prints
//! `no CUDA device: <error>` and exits with status 0.

mod common;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use pinstream::kernels::{self, cpu, Crop, Layout, Normalize, Spec};
use pinstream::{Device, DeviceBuffer, HostAlloc, PinnedBuffer};

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// The side of the square each image is cropped to (less where an image is smaller).
const SIDE: usize = 224;

fn main() -> ExitCode {
    common::exit_status("normalize_images", run())
}

/// The sample images' folder: `../shared/data/images` beside the repository, else the copy in
/// `tests/data/images`, looked for from `CARGO_MANIFEST_DIR` and from the working directory.
fn sample_dir() -> Option<PathBuf> {
    let roots = [
        std::env::var_os("CARGO_MANIFEST_DIR").map(PathBuf::from),
        std::env::current_dir().ok(),
    ];
    roots.into_iter().flatten().find_map(|root| {
        ["../shared/data/images", "tests/data/images"]
            .into_iter()
            .map(|rel| root.join(rel))
            .find(|d| d.is_dir())
    })
}

fn inputs() -> Result<Vec<PathBuf>> {
    let args: Vec<PathBuf> = std::env::args_os().skip(1).map(PathBuf::from).collect();
    if !args.is_empty() {
        return Ok(args);
    }
    let dir = sample_dir().ok_or(
        "no images given and no ../shared/data/images or tests/data/images found \
         (run from the repository, or name image files)",
    )?;
    let is_image = |p: &Path| {
        p.extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| matches!(e.to_ascii_lowercase().as_str(), "png" | "jpg" | "jpeg"))
    };
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| is_image(p))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(format!("no PNG or JPEG files in {}", dir.display()).into());
    }
    Ok(files)
}

fn run() -> Result<()> {
    let dev = Device::get(0)?; // first, so a machine without a GPU stops before decoding
    let stream = dev.stream()?;
    let files = inputs()?;

    // Decode to RGB (gray images are widened, alpha dropped), packed back to back (NHWC).
    let mut pixels = Vec::new();
    let mut sizes = Vec::new();
    for f in &files {
        let img = image::open(f).map_err(|e| format!("{}: {e}", f.display()))?;
        sizes.push((img.height() as usize, img.width() as usize));
        pixels.extend_from_slice(&img.to_rgb8().into_raw());
    }

    // One sample per image, each centre-cropped to the same square: a uniform output batch
    // from inputs of any size, with the crop done by the kernel as it reads.
    let side = sizes.iter().map(|&(h, w)| h.min(w)).fold(SIDE, usize::min);
    let mut spec =
        Spec::variable(3, &sizes, Normalize::imagenet()).layouts(Layout::Nhwc, Layout::Nchw);
    for s in &mut spec.samples {
        s.crop = Some(Crop {
            x: (s.w - side) / 2,
            y: (s.h - side) / 2,
            w: side,
            h: side,
        });
    }
    spec.validate("normalize_images")?;

    // Upload through pinned memory, normalize in one launch, download the batch.
    let host_in = PinnedBuffer::from_slice(&dev, &pixels, HostAlloc::DEFAULT)?;
    let mut d_in = DeviceBuffer::<u8>::new(&dev, pixels.len())?;
    stream.copy_h2d(&host_in, &mut d_in)?;
    let mut d_out = DeviceBuffer::<f32>::new(&dev, spec.output_len()?)?;
    kernels::normalize::<f32, _, _>(&stream, &d_in, &spec, &mut d_out, None)?;
    let mut host_out = PinnedBuffer::<f32>::new(&dev, d_out.len(), HostAlloc::DEFAULT)?;
    let batch = stream.copy_d2h(&d_out, &mut host_out)?.wait()?;

    // The same batch from the f64 reference: at most one unit of f32 rounding apart.
    let exact = cpu::normalize_exact(&pixels, &spec, None)?;
    let worst = cpu::worst_error(batch, &exact, spec.norm.shift)?;
    let units = worst.map_or(0.0, |w| w.units);
    if units > 1.0 {
        return Err(
            format!("the GPU batch is {units:.2} units of rounding off the reference").into(),
        );
    }

    println!(
        "batch [{}, 3, {side}, {side}] f32 NCHW from {} images on {}, {units:.2} units of rounding from the CPU reference",
        files.len(),
        files.len(),
        dev.name()?
    );
    let plane = side * side;
    for ((f, &(h, w)), sample) in files.iter().zip(&sizes).zip(batch.chunks(3 * plane)) {
        let means: Vec<String> = sample
            .chunks(plane)
            .map(|c| format!("{:+.3}", c.iter().sum::<f32>() / plane as f32))
            .collect();
        let name = f.file_name().map_or_else(
            || f.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
        println!("  {name:<16} {w}x{h} -> channel means {}", means.join(" "));
    }
    Ok(())
}
