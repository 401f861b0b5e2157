//! A training loop fed by the prefetcher: loader threads "decode" batches into page-locked
//! memory, the prefetcher copies them to the GPU and normalizes them (u8 NHWC -> f32 NCHW, random crops
//! and mirrors, ImageNet mean/std) while the previous step runs, and each step gets its batch
//! ready on its own stream. Copy this shape into your own loop.
//!
//! ```sh
//! cargo run --release --example prefetch            # 50 batches
//! cargo run --release --example prefetch -- 200
//! ```
//!
//! Without a CUDA device this prints `no CUDA device: <error>` and exits with status 0.

mod common;

use std::process::ExitCode;
use std::time::{Duration, Instant};

use pinstream::kernels::{Crop, Layout, Normalize, Sample, Spec};
use pinstream::prefetch::{HostBatch, PrefetchConfig, Prefetcher, Source};
use pinstream::Device;

const BATCH: usize = 64;
const SRC: usize = 256; // stored images are 256x256x3
const CROP: usize = 224; // the network sees 224x224

fn main() -> ExitCode {
    let batches: u64 = match std::env::args().nth(1).map(|a| a.parse()) {
        None => 50,
        Some(Ok(n)) if n > 0 => n,
        Some(_) => {
            eprintln!("usage: prefetch [BATCHES]");
            return ExitCode::FAILURE;
        }
    };
    common::exit_status("prefetch", train(batches))
}

/// What a data loader does per batch: decode into the batch's pixels (here: a pattern), choose
/// each sample's crop and mirror, set the labels. Runs on the loader threads, several at once.
fn load(i: u64, b: &mut HostBatch<i64>) -> pinstream::Result<()> {
    let mut x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut rand = move |n: usize| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % n as u64) as usize
    };
    let samples = (0..BATCH)
        .map(|_| Sample {
            h: SRC,
            w: SRC,
            crop: Some(Crop {
                x: rand(SRC - CROP + 1),
                y: rand(SRC - CROP + 1),
                w: CROP,
                h: CROP,
            }),
            mirror: rand(2) == 1,
        })
        .collect();
    b.spec = Spec {
        channels: 3,
        samples,
        in_layout: Layout::Nhwc,
        out_layout: Layout::Nchw,
        pad_to_4: None,
        norm: Normalize::imagenet(),
    };
    // Page-locked memory (recycled, so write every byte): the upload is then one DMA, with no
    // staging copy through host memory.
    let pixels = b.pinned(BATCH * SRC * SRC * 3)?;
    // Your JPEG decoder writes here; we write a pattern that changes with the batch.
    for (row, px) in pixels.chunks_mut(SRC * 3).enumerate() {
        px.fill((row as u64 ^ i) as u8);
    }
    b.extras.clear();
    b.extras
        .extend((0..BATCH).map(|k| ((i as usize * BATCH + k) % 1000) as i64));
    Ok(())
}

fn train(batches: u64) -> Result<(), Box<dyn std::error::Error>> {
    let dev = Device::get(0)?;
    println!("device 0: {}", dev.name()?);
    let stream = dev.stream()?; // the training step's stream

    let source = Source::new(move |i, b: &mut HostBatch<i64>| {
        if i >= batches {
            return Ok(false); // end of the epoch
        }
        load(i, b)?;
        Ok(true)
    });
    let config = PrefetchConfig {
        depth: 2,          // one batch in the step, one being prepared
        loader_threads: 4, // decoders
        ..PrefetchConfig::default()
    };
    let mut loader = Prefetcher::<f32, i64>::new(&stream, source, config)?;

    let start = Instant::now();
    let mut seen = 0;
    while let Some(batch) = loader.next() {
        let batch = batch?; // a loader error names its batch
        let (images, labels) = (batch.pixels()?, batch.extras()?);
        // Your step goes here, queued on `stream`, reading `images.as_device_ptr()`
        // ([64, 3, 224, 224] f32) and `labels.as_device_ptr()` ([64] i64). We stand in a
        // 2 ms busy kernel.
        stream.spin(Duration::from_millis(2))?;
        if seen == 0 {
            println!("batch dims {:?}, {} labels", batch.dims(), labels.len());
            let _ = images;
        }
        seen += 1;
        // Dropping `batch` records an event on `stream`: its slot is refilled after the step.
    }
    stream.synchronize()?;
    let el = start.elapsed().as_secs_f64();
    println!(
        "{seen} batches in {el:.3} s: {:.2} ms per batch (the step alone is 2 ms)",
        el * 1e3 / seen.max(1) as f64
    );
    // Many waits would mean the loaders are the bottleneck: add loader threads.
    let l = loader.loader_stats();
    println!(
        "loaders: {} of {} uploads waited for a batch; window {} batches ahead",
        l.waits, l.uploads, l.ahead
    );
    Ok(())
}
