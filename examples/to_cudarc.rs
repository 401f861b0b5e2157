//! A prefetcher feeding a cudarc program: the prefetcher consumes on a cudarc stream, and each
//! batch's pixels are lent to cudarc as a `CudaView` (zero copy), ordered both ways on the GPU.
//! Here cudarc copies each batch into its model input and the last one is summed.
//!
//! ```sh
//! cargo run --release --features cudarc --example to_cudarc
//! ```
//!
//! Without a CUDA device this prints `no CUDA device: <error>` and exits with status 0.

mod common;

use std::process::ExitCode;

use cudarc::driver::CudaContext;
use pinstream::kernels::{Normalize, Spec};
use pinstream::prefetch::{HostBatch, PrefetchConfig, Prefetcher, Source};
use pinstream::{cudarc::lend, Device, Stream};

const BATCHES: u64 = 20;
const PIXELS: usize = 32 * 3 * 64 * 64; // 32 images, 3 x 64 x 64

fn main() -> ExitCode {
    common::exit_status("to_cudarc", run())
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let dev = Device::get(0)?; // first: says so if there is no GPU or driver
    let cs = CudaContext::new(dev.ordinal())?.new_stream()?; // cudarc's stream
    let stream = Stream::from_cudarc(&cs)?; // the same stream, for pinstream
    let source = Source::new(|i, b: &mut HostBatch<i64>| {
        if i >= BATCHES {
            return Ok(false);
        }
        b.spec = Spec::uniform(32, 3, 64, 64, Normalize::imagenet())?;
        let px = b.pageable(); // your decoder writes here
        px.clear();
        px.extend((0..PIXELS).map(|k| (k as u64 ^ i.wrapping_mul(7)) as u8));
        Ok(true)
    });
    let mut loader = Prefetcher::<f32, i64>::new(&stream, source, PrefetchConfig::default())?;
    let mut input = cs.alloc_zeros::<f32>(PIXELS)?; // the model's input, cudarc memory
    while let Some(batch) = loader.next() {
        let batch = batch?;
        // Your cudarc kernels and cuBLAS calls take `px` as it is; this one copies it.
        lend(&batch.pixels()?, &stream, |px| {
            cs.memcpy_dtod(&px, &mut input)
        })??;
        // Dropping `batch` lets its slot be refilled, after the work queued above.
    }
    let last = cs.clone_dtoh(&input)?;
    println!(
        "{BATCHES} batches through cudarc; the last one sums to {:.1}",
        last.iter().map(|&x| f64::from(x)).sum::<f64>()
    );
    Ok(())
}
