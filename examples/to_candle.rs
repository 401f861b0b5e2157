//! Prefetched batches as candle tensors on the GPU, never through host memory: the prefetcher
//! runs on candle's stream, and each batch's pixels are copied device to device into memory
//! candle owns. Build: docs/toolkit.md, "Sharing the toolkit with cudarc / candle".
use candle_core::{op::BackpropOp, CudaStorage, Device, Storage, Tensor};
use pinstream::cudarc::lend;
use pinstream::kernels::{Layout, Normalize, Sample, Spec};
use pinstream::prefetch::{HostBatch, PrefetchConfig, Prefetcher, Source};

const N: usize = 16;
const HW: usize = 224;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let candle = Device::new_cuda_with_stream(0)?;
    let cuda = candle.as_cuda_device()?.clone();
    let cu_stream = cuda.cuda_stream();
    // candle's stream, for pinstream: the prefetcher's batches are ready on it.
    let stream = pinstream::Stream::from_cudarc(&cu_stream)?;
    let source = Source::new(|i, b: &mut HostBatch<i64>| {
        b.spec = Spec {
            channels: 3,
            samples: vec![Sample::new(HW, HW); N],
            in_layout: Layout::Nhwc,
            out_layout: Layout::Nchw,
            pad_to_4: None,
            norm: Normalize::imagenet(),
        };
        b.pinned(N * HW * HW * 3)?.fill(40 * i as u8); // your decoder writes here
        Ok(i < 4)
    });
    let mut loader = Prefetcher::<f32, i64>::new(&stream, source, PrefetchConfig::default())?;
    while let Some(batch) = loader.next() {
        let batch = batch?;
        let pixels = batch.pixels()?;
        let mut owned = cuda.alloc_zeros::<f32>(pixels.len())?;
        // The batch's pixels lent to cudarc (zero copy) and copied into memory candle owns.
        lend(&pixels, &stream, |px| cuda.memcpy_dtod(&px, &mut owned))??;
        let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(owned, cuda.clone()));
        let dims = batch.dims().ok_or("the batch has no spec")?.to_vec();
        let t = Tensor::from_storage(storage, dims, BackpropOp::none(), false);
        let got = t.mean_all()?.to_scalar::<f32>()?; // candle's reduction kernel, on the GPU
        let (n, v) = (Normalize::imagenet(), 40.0 * batch.index() as f32);
        let want = (0..3).map(|c| (v - n.mean[c]) / n.std[c]).sum::<f32>() / 3.0;
        let (i, at) = (batch.index(), t.device().location());
        println!("batch {i}: {t:?} on {at:?}, mean {got:.5} (want {want:.5})");
    }
    Ok(())
}
