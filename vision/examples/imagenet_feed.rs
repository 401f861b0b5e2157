//! An ImageNet-style training feed: a folder of class directories of JPEGs / PNGs, decoded on
//! the GPU's JPEG engines (or on loader threads, `--decode cpu`), `RandomResizedCrop(224)` +
//! flip + normalize on the GPU, labels beside them, epoch after epoch. Prints images/s, CPU
//! milliseconds per image and the per-batch latency (p50, p99, max) for each epoch.
//!
//! ```sh
//! cargo run --release --example imagenet_feed -- /data/imagenet/train
//! cargo run --release --example imagenet_feed                 # the shared sample photographs
//! cargo run --release --example imagenet_feed -- DIR --threads 8 --batch 256 --epochs 3 \
//!     [--decode auto|gpu|cpu] [--decodes-at-once N] [--val] [--check] [--json]
//! ```
//!
//! `--check` compares every batch with the kernel's CPU reference on the same host batch
//! (slow: f64 on the CPU); with GPU decoding, the decoders may differ by a few levels, so the
//! mean difference is bounded instead. `--val` runs the validation transform (`Resize(256)` +
//! `CenterCrop(224)`, in order). Without a folder it feeds the photographs in
//! `../shared/data/images` (one class each). Without a CUDA device it runs the same pipeline in
//! a `DryRun` (the CPU reference instead of the kernel) for one epoch. `--decodes-at-once N`
//! caps the loaders decoding on the GPU at once (0, the default: automatic; `none`: no cap).
//! With `--json`, each epoch prints a `FEED_JSON` line, and the run ends with a `FEED_STEADY`
//! line: the same figures over every epoch but the first (the warm-up).

use std::path::PathBuf;
use std::time::Instant;

use pinstream::kernels::cpu;
use pinstream::prefetch::{DryRun, HostBatch};
use pinstream::timing::cpu_seconds;
use pinstream::{bf16, Device};
use pinstream_vision::dataset::ImageList;
use pinstream_vision::{Augment, BadFiles, Decoding, ImageFeed, ImageFeedConfig, ImageSource};

struct Args {
    root: Option<PathBuf>,
    threads: usize,
    batch: usize,
    epochs: u64,
    val: bool,
    check: bool,
    json: bool,
    decoding: Decoding,
    at_once: usize,
}

fn args() -> Result<Args, String> {
    let mut a = Args {
        root: None,
        threads: 8,
        batch: 256,
        epochs: 3,
        val: false,
        check: false,
        json: false,
        decoding: Decoding::Auto,
        at_once: 0,
    };
    let mut it = std::env::args().skip(1);
    while let Some(x) = it.next() {
        let mut num = |name: &str| -> Result<usize, String> {
            it.next()
                .and_then(|v| v.parse().ok())
                .ok_or(format!("{name} needs a number"))
        };
        match x.as_str() {
            "--threads" => a.threads = num("--threads")?,
            "--batch" => a.batch = num("--batch")?,
            "--epochs" => a.epochs = num("--epochs")? as u64,
            "--val" => a.val = true,
            "--check" => a.check = true,
            "--json" => a.json = true,
            "--decodes-at-once" => {
                a.at_once = match it.next().as_deref() {
                    Some("none") => usize::MAX,
                    Some(v) => v
                        .parse()
                        .map_err(|_| "--decodes-at-once needs a number or none".to_string())?,
                    None => return Err("--decodes-at-once needs a number or none".into()),
                }
            }
            "--decode" => {
                a.decoding = match it.next().as_deref() {
                    Some("auto") => Decoding::Auto,
                    Some("gpu") => Decoding::Gpu,
                    Some("cpu") => Decoding::Cpu,
                    _ => return Err("--decode takes auto, gpu or cpu".into()),
                }
            }
            s if !s.starts_with("--") => a.root = Some(PathBuf::from(s)),
            s => return Err(format!("unknown argument {s}")),
        }
    }
    Ok(a)
}

/// The folder given, or the shared photographs (found at run time: next to the crate, or from
/// the current directory), one class each.
fn images(root: &Option<PathBuf>) -> Result<ImageList, Box<dyn std::error::Error>> {
    match root {
        Some(r) => Ok(ImageList::folder(r)?),
        None => {
            let base = std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| ".".into());
            let dir = [
                format!("{base}/../shared/data/images"),
                "../shared/data/images".into(),
            ]
            .into_iter()
            .map(PathBuf::from)
            .find(|d| d.is_dir())
            .ok_or("no folder given and ../shared/data/images not found")?;
            let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)?
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "jpg" || x == "png"))
                .collect();
            files.sort();
            Ok(ImageList::from_pairs(
                files.into_iter().enumerate().map(|(i, p)| (p, i)).collect(),
            )?)
        }
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a = args()?;
    let list = images(&a.root)?;
    let mut cfg = ImageFeedConfig {
        batch: a.batch.min(list.len()),
        bad_files: BadFiles::Skip,
        decoding: a.decoding,
        gpu_decodes_at_once: a.at_once,
        ..ImageFeedConfig::default()
    };
    cfg.prefetch.loader_threads = a.threads;
    if a.val {
        cfg.augment = Augment::Val { resize: 256 };
        cfg.shuffle = false;
    }
    eprintln!(
        "{} images of {} classes, batch {}, {} loader threads (0: by where it decodes), {}",
        list.len(),
        list.num_classes(),
        cfg.batch,
        a.threads,
        if a.val { "val" } else { "train" }
    );
    if !pinstream::available() {
        // The same pipeline on the CPU: loaders, decoding, crops, the kernel's reference.
        let src = ImageSource::new(list, &cfg)?;
        let mut run = DryRun::<f32, i64>::new(src.source(), cfg.prefetch_config(false))?;
        for _ in 0..src.batches_per_epoch() {
            let b = run.next().ok_or("ended")??;
            println!(
                "dry run: batch {} of {:?}, labels {:?}",
                b.index(),
                b.dims(),
                b.extras()
            );
        }
        return Ok(());
    }
    let stream = Device::get(0)?.stream()?;
    let n_images = list.len();
    let mut feed = ImageFeed::<bf16>::new(&stream, list, cfg.clone())?;
    let source = feed.source().clone();
    let on_gpu = feed.decoding() == Decoding::Gpu;
    eprintln!(
        "decoding on the {} ({} JPEG engines)",
        if on_gpu { "GPU" } else { "CPU" },
        feed.hardware_engines()
    );
    let mut index = 0u64;
    // Every epoch but the first (the warm-up): images, seconds, CPU seconds, batch latencies.
    let (mut s_images, mut s_secs, mut s_cpu, mut s_latency) = (0usize, 0f64, 0f64, Vec::new());
    for epoch in 0..a.epochs {
        let (t0, c0) = (Instant::now(), cpu_seconds());
        let (mut seen, mut worst, mut mean_diff) = (0usize, 0f64, 0f64);
        let mut latency = Vec::new();
        let mut asked = Instant::now();
        while let Some(batch) = feed.next() {
            let batch = batch?;
            let (x, y) = (batch.pixels()?, batch.labels()?);
            seen += y.len();
            if a.check {
                let mut host = HostBatch::<i64>::default();
                source.load(index, &mut host)?;
                let spec = host.resize.clone().ok_or("no resize spec")?;
                let exact = cpu::resized_crop_exact(&host.pixels.read()?, &spec)?;
                let mut got = vec![bf16::ZERO; x.len()];
                stream.copy_d2h(&x, &mut got[..])?.wait()?;
                let w = cpu::resize_worst_error(&got, &exact, &spec)?.map_or(0.0, |w| w.units);
                let diff = got
                    .iter()
                    .zip(&exact)
                    .map(|(g, e)| (g.to_f64() - e).abs())
                    .sum::<f64>()
                    / got.len().max(1) as f64;
                // The CPU decoder made the reference: the same decoder is within a unit; a GPU
                // decoder's pixels differ by a few levels (of 255) here and there.
                if (!on_gpu && w > 1.0) || diff > 0.05 {
                    return Err(format!(
                        "batch {index}: {w} units from the reference, mean difference {diff}"
                    )
                    .into());
                }
                worst = worst.max(w);
                mean_diff = mean_diff.max(diff);
            }
            stream.synchronize()?; // stands for the training step
            latency.push(asked.elapsed().as_secs_f64() * 1e3);
            drop(batch);
            asked = Instant::now();
            index += 1;
        }
        let (p50, p99, max) = percentiles(&mut latency);
        let routes = feed.routes();
        let (secs, cpu) = (t0.elapsed().as_secs_f64(), cpu_seconds() - c0);
        if epoch > 0 || a.epochs == 1 {
            s_images += seen;
            s_secs += secs;
            s_cpu += cpu;
            s_latency.extend_from_slice(&latency);
        }
        let skipped = feed.skipped().count;
        if a.json {
            println!(
                "FEED_JSON {{\"epoch\":{epoch},\"images\":{seen},\"secs\":{secs:.4},\"cpu\":{cpu:.4},\"threads\":{},\"decodes_at_once\":\"{}\",\"skipped\":{skipped},\"checked\":{},\"worst_units\":{worst:.3},\"mean_diff\":{mean_diff:.5},\"dataset\":{n_images},\"decoding\":\"{}\",\"engines\":{},\"routes\":{{\"hardware\":{},\"cuda\":{},\"cpu\":{}}},\"batch_ms\":{{\"p50\":{p50:.3},\"p99\":{p99:.3},\"max\":{max:.3}}}}}",
                feed.loader_threads(),
                match a.at_once {
                    0 => "auto".to_string(),
                    usize::MAX => "none".to_string(),
                    n => n.to_string(),
                },
                a.check, if on_gpu { "gpu" } else { "cpu" }, feed.hardware_engines(),
                routes.hardware, routes.cuda, routes.cpu
            );
        }
        println!(
            "epoch {epoch}: {seen} images in {secs:.2} s = {:.0} images/s, {:.2} CPU ms per image, \
             batch ms p50 {p50:.1} p99 {p99:.1} max {max:.1}{}",
            seen as f64 / secs,
            cpu / seen as f64 * 1e3,
            if a.check {
                format!(", every batch within {worst:.2} units of the reference")
            } else {
                String::new()
            }
        );
    }
    if a.json && s_images > 0 {
        let (p50, p99, max) = percentiles(&mut s_latency);
        println!(
            "FEED_STEADY {{\"epochs\":{},\"images\":{s_images},\"images_per_s\":{:.1},\"cpu_ms_per_image\":{:.4},\"batch_ms\":{{\"p50\":{p50:.3},\"p99\":{p99:.3},\"max\":{max:.3}}}}}",
            a.epochs.saturating_sub(1).max(1),
            s_images as f64 / s_secs,
            s_cpu / s_images as f64 * 1e3
        );
    }
    Ok(())
}

/// p50, p99 and max of `ms` (sorted here); zeros when empty.
fn percentiles(ms: &mut [f64]) -> (f64, f64, f64) {
    if ms.is_empty() {
        return (0.0, 0.0, 0.0);
    }
    ms.sort_by(f64::total_cmp);
    let at = |p: f64| ms[((ms.len() - 1) as f64 * p).round() as usize];
    (at(0.5), at(0.99), at(1.0))
}
