//! The fused resized crop on an ImageNet-like batch: 256 decoded RGB images of the sizes
//! ImageNet's JPEGs mostly have (500 x 375, 375 x 500, 500 x 333, ...; random pixels), packed
//! in one arena, to 224 x 224 with torchvision's `RandomResizedCrop` boxes (train) and
//! `Resize(256)` + `CenterCrop(224)` (val), ImageNet normalization, every output type.
//!
//! Timed with CUDA events: 3 warm-up launches, then the median of 15 samples of 10 launches.
//! Beside each, in the same run, a device-to-device copy of the same traffic: the bytes the
//! kernel must read (every sample's filter window, once) plus the bytes it writes, copied as
//! (read + written) / 2 bytes (a copy reads and writes each). `ratio` = copy time / kernel
//! time: 1.0 is copy speed.
//!
//! `cargo bench --bench resize`, or on the GPU machine `.gpu/bench/resize --bench`. Prints a
//! table and one `RESIZE_JSON {...}` line (python/bench/rrc_torchvision.py reads it). With
//! `PINSTREAM_RESIZE_DUMP=dir` it also writes a 16-image batch, its boxes and the kernel's f32
//! results there, for the torchvision comparison of the same script.

#[path = "../tests/kernels/boxes.rs"]
mod boxes;

use boxes::{BoxRng as Rng, RandomResizedCrop};
use pinstream::kernels::CropBox;
use pinstream::kernels::{self, Layout, Normalize, OutputElement, ResizeSpec};
use pinstream::{bf16, f16, Device, DeviceBuffer, Stream, TimingEvent};

const N: usize = 256;
const SIZES: [(usize, usize); 6] = [
    (375, 500),
    (500, 375),
    (333, 500),
    (500, 333),
    (400, 400),
    (480, 640),
];

fn noise(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 32) as u8
        })
        .collect()
}

/// The arena and the train / val specs of `n` images.
fn batch(n: usize, norm: Normalize) -> (Vec<u8>, ResizeSpec, ResizeSpec) {
    let mut train = ResizeSpec::new(3, 224, 224, norm);
    let mut val = train.clone();
    let rrc = RandomResizedCrop::default();
    let mut rng = Rng::new(2026, 0);
    let mut sizes = Vec::new();
    let mut len = 0;
    for i in 0..n {
        let (h, w) = SIZES[(i * 7 + i / 3) % SIZES.len()];
        sizes.push((len, h, w));
        len += h * w * 3;
    }
    let arena = noise(len, 0x9e37_79b9_7f4a_7c15);
    for &(off, h, w) in &sizes {
        train.push(off, h, w, rrc.sample(&mut rng, h, w).unwrap());
        val.push(off, h, w, CropBox::center(h, w, 256, 224).unwrap());
    }
    (arena, train, val)
}

/// Bytes under every sample's filter window (what the kernel must read at least once).
fn window_bytes(spec: &ResizeSpec) -> usize {
    spec.samples
        .iter()
        .map(|s| {
            let c = &s.crop;
            if c.clamp_to_box {
                let h = ((c.top + c.height).ceil() - c.top.floor()) as usize;
                let w = ((c.left + c.width).ceil() - c.left.floor()) as usize;
                h * w * spec.channels
            } else {
                // The box plus the filter's reach beyond it (about one scale on each side).
                let sy = f64::from(c.height) / spec.out_h as f64;
                let sx = f64::from(c.width) / spec.out_w as f64;
                let h = (f64::from(c.height) + 2.0 * sy).min(s.height as f64);
                let w = (f64::from(c.width) + 2.0 * sx).min(s.width as f64);
                (h * w) as usize * spec.channels
            }
        })
        .sum()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median GPU seconds per call of `op`.
fn time(stream: &Stream, mut op: impl FnMut()) -> f64 {
    let dev = stream.device();
    for _ in 0..3 {
        op();
    }
    let (a, b) = (
        TimingEvent::new(&dev).unwrap(),
        TimingEvent::new(&dev).unwrap(),
    );
    let mut samples = Vec::new();
    for _ in 0..15 {
        stream.record(&a).unwrap();
        for _ in 0..10 {
            op();
        }
        stream.record(&b).unwrap();
        b.synchronize().unwrap();
        samples.push(f64::from(a.elapsed_ms(&b).unwrap()) / 1e3 / 10.0);
    }
    median(samples)
}

struct Row {
    mode: &'static str,
    dtype: &'static str,
    layout: &'static str,
    kernel_ms: f64,
    copy_ms: f64,
    traffic: usize,
}

fn measure<O: OutputElement>(
    stream: &Stream,
    d_in: &DeviceBuffer<u8>,
    spec: &ResizeSpec,
    mode: &'static str,
) -> Row {
    let dev = stream.device();
    let mut out = DeviceBuffer::<O>::new(&dev, spec.output_len().unwrap()).unwrap();
    let kernel = time(stream, || {
        kernels::resized_crop(stream, d_in, spec, &mut out).unwrap();
    });
    let traffic = window_bytes(spec) + spec.output_len().unwrap() * std::mem::size_of::<O>();
    let half = traffic / 2;
    let src = DeviceBuffer::<u8>::new(&dev, half).unwrap();
    let mut dst = DeviceBuffer::<u8>::new(&dev, half).unwrap();
    let copy = time(stream, || {
        stream.copy_d2d(&src, &mut dst).unwrap();
    });
    Row {
        mode,
        dtype: O::NAME,
        layout: match spec.out_layout {
            Layout::Nchw => "NCHW",
            Layout::Nhwc => "NHWC",
        },
        kernel_ms: kernel * 1e3,
        copy_ms: copy * 1e3,
        traffic,
    }
}

fn dump(stream: &Stream, dir: &str) {
    let (arena, train, val) = batch(16, Normalize::new(&[0.0; 3], &[1.0; 3]));
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(format!("{dir}/arena.u8"), &arena).unwrap();
    let dev = stream.device();
    let mut d_in = DeviceBuffer::<u8>::new(&dev, arena.len()).unwrap();
    stream.copy_h2d(&arena[..], &mut d_in).unwrap();
    let mut meta = String::from("[");
    for (i, s) in train.samples.iter().enumerate() {
        let (t, v) = (&s.crop, &val.samples[i].crop);
        meta += &format!(
            "{}{{\"offset\":{},\"h\":{},\"w\":{},\"train\":[{},{},{},{},{}],\"val\":[{},{},{},{}]}}",
            if i > 0 { "," } else { "" },
            s.offset,
            s.height,
            s.width,
            t.top,
            t.left,
            t.height,
            t.width,
            u8::from(t.flip),
            v.top,
            v.left,
            v.height,
            v.width
        );
    }
    meta += "]";
    std::fs::write(format!("{dir}/boxes.json"), meta).unwrap();
    for (name, spec) in [("train", &train), ("val", &val)] {
        let mut out = DeviceBuffer::<f32>::new(&dev, spec.output_len().unwrap()).unwrap();
        kernels::resized_crop(stream, &d_in, spec, &mut out).unwrap();
        let mut host = vec![0f32; out.len()];
        stream
            .copy_d2h(&out, &mut host[..])
            .unwrap()
            .wait()
            .unwrap();
        let bytes: Vec<u8> = host.iter().flat_map(|v| v.to_le_bytes()).collect();
        std::fs::write(format!("{dir}/{name}.f32"), bytes).unwrap();
    }
    eprintln!("resize: wrote the comparison batch to {dir}");
}

fn main() {
    if !pinstream::available() {
        println!("resize bench: no CUDA device; nothing measured");
        return;
    }
    let dev = Device::get(0).unwrap();
    let stream = dev.stream().unwrap();
    if let Ok(dir) = std::env::var("PINSTREAM_RESIZE_DUMP") {
        dump(&stream, &dir);
    }
    let (arena, train, val) = batch(N, Normalize::imagenet());
    let mut d_in = DeviceBuffer::<u8>::new(&dev, arena.len()).unwrap();
    stream.copy_h2d(&arena[..], &mut d_in).unwrap();
    let mut rows = Vec::new();
    for (mode, spec) in [("train", &train), ("val", &val)] {
        rows.push(measure::<f32>(&stream, &d_in, spec, mode));
        rows.push(measure::<f16>(&stream, &d_in, spec, mode));
        rows.push(measure::<bf16>(&stream, &d_in, spec, mode));
        rows.push(measure::<u8>(&stream, &d_in, spec, mode));
        let nhwc = spec.clone().layouts(Layout::Nhwc, Layout::Nhwc);
        rows.push(measure::<f16>(&stream, &d_in, &nhwc, mode));
    }
    println!(
        "{} x RGB ({} MB decoded) -> 224 x 224, {}",
        N,
        arena.len() / 1_000_000,
        dev.name().unwrap_or_default()
    );
    println!("| mode | out | layout | kernel ms | GB/s | D2D copy ms | ratio | images/s |");
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    let mut json = Vec::new();
    for r in &rows {
        let ratio = r.copy_ms / r.kernel_ms;
        println!(
            "| {} | {} | {} | {:.3} | {:.0} | {:.3} | {:.2} | {:.0} |",
            r.mode,
            r.dtype,
            r.layout,
            r.kernel_ms,
            r.traffic as f64 / r.kernel_ms / 1e6,
            r.copy_ms,
            ratio,
            N as f64 / r.kernel_ms * 1e3
        );
        json.push(format!(
            "{{\"mode\":\"{}\",\"dtype\":\"{}\",\"layout\":\"{}\",\"kernel_ms\":{:.5},\"copy_ms\":{:.5},\"traffic\":{}}}",
            r.mode, r.dtype, r.layout, r.kernel_ms, r.copy_ms, r.traffic
        ));
    }
    println!("RESIZE_JSON {{\"n\":{N},\"rows\":[{}]}}", json.join(","));
}
