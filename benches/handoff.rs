//! The cost of handing a batch to another library, per batch, host clock, median of 2 000
//! after 200 warm-up rounds: `record_stream` on a batch; a batch to two DLPack tensors handed
//! over on the consumer's stream, imported and released (`into_dlpack` + `into_versioned` +
//! `Imported::from_versioned` + both deleters); a device buffer exported and released alone.
//! Beside it, the same run's peer numbers come from `benches/peers/torch_handoff.py`
//! (`torch.from_dlpack(x)` on a CUDA tensor, `record_stream`). Without a device it prints one
//! line and measures nothing.
//!
//! `cargo bench --bench handoff`, or on the GPU machine `.gpu/bench/handoff`.

use std::sync::Arc;
use std::time::Instant;

use pinstream::dlpack::{Imported, Tensor};
use pinstream::kernels::{Normalize, Spec};
use pinstream::prefetch::{HostBatch, PrefetchConfig, Prefetcher, Source};
use pinstream::{Device, DeviceBuffer};

const ROUNDS: usize = 2000;
const WARMUP: usize = 200;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> pinstream::Result<()> {
    if !pinstream::available() {
        println!("handoff: no CUDA device, nothing measured");
        return Ok(());
    }
    let dev = Device::get(0)?;
    let s = dev.stream()?;
    let foreign = dev.stream()?;
    let total = (ROUNDS + WARMUP) as u64 * 3 + 4;
    let source = Source::new(move |i, b: &mut HostBatch<i64>| {
        if i >= total {
            return Ok(false);
        }
        b.spec = Spec::uniform(8, 3, 32, 32, Normalize::imagenet())?;
        let px = b.pageable();
        px.clear();
        px.extend((0..8 * 3 * 32 * 32).map(|k| (k as u64 ^ i) as u8));
        b.extras.clear();
        b.extras.extend(0..8);
        Ok(true)
    });
    let mut p = Prefetcher::<f32, i64>::new(&s, source, PrefetchConfig::default())?;
    let (mut plain, mut rec, mut dl) = (Vec::new(), Vec::new(), Vec::new());
    for k in 0..ROUNDS + WARMUP {
        {
            let b = p.next().expect("batch")?;
            let t = Instant::now();
            drop(b);
            if k >= WARMUP {
                plain.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
        {
            let b = p.next().expect("batch")?;
            let t = Instant::now();
            b.record_stream(&foreign)?;
            drop(b);
            if k >= WARMUP {
                rec.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
        let b = p.next().expect("batch")?;
        let t = Instant::now();
        let (px, ex) = b.into_dlpack()?;
        let px = px.into_versioned(Some(&foreign))?;
        let ex = ex.into_versioned(Some(&foreign))?;
        // SAFETY: handed over just above; ownership passes and the drops call the deleters.
        let (px, ex) = unsafe { (Imported::from_versioned(px)?, Imported::from_versioned(ex)?) };
        drop((px, ex));
        if k >= WARMUP {
            dl.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    let buf = Arc::new(DeviceBuffer::<f32>::new(&dev, 8 * 3 * 32 * 32)?);
    let mut one = Vec::new();
    for k in 0..ROUNDS + WARMUP {
        let t = Instant::now();
        let raw = Tensor::from_device(buf.clone())?
            .reshape(&[8, 3, 32, 32])?
            .into_versioned(Some(&foreign))?;
        // SAFETY: as above.
        drop(unsafe { Imported::from_versioned(raw)? });
        if k >= WARMUP {
            one.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    println!(
        "handoff, {} ({ROUNDS} rounds, median µs per batch, host clock)",
        dev.name()?
    );
    println!(
        "  DeviceBatch drop alone (the baseline)             {:8.2}",
        median(plain)
    );
    println!(
        "  DeviceBatch::record_stream + drop                 {:8.2}",
        median(rec)
    );
    println!(
        "  batch -> 2 DLPack tensors -> import -> release   {:8.2}",
        median(dl)
    );
    println!(
        "  DeviceBuffer -> DLPack -> import -> release      {:8.2}",
        median(one)
    );
    Ok(())
}
