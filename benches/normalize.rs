//! Criterion bench of the fused normalize kernels on the batch, 256 x 3 x 224 x 224 u8,
//! timed with CUDA events (20 launches per sample), plus a summary printed at the end: median of
//! 20 samples, effective GB/s, and the ratio to a device-to-device copy of the same bytes measured
//! in the same run. Without a device it prints one line and measures nothing.
//!
//! `cargo bench --bench normalize`, or on the GPU machine `.gpu/bench/normalize --bench`.

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use pinstream::kernels::{self, Crop, Layout, Normalize, OutputElement, Sample, Spec};
use pinstream::{bf16, f16, Device, DeviceBuffer, Stream, TimingEvent};

const N: usize = 256;
const C: usize = 3;
const H: usize = 224;
const W: usize = 224;
const LAUNCHES: u32 = 20;

fn input(stream: &Stream, n: usize) -> DeviceBuffer<u8> {
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    let host: Vec<u8> = (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 32) as u8
        })
        .collect();
    let mut d = DeviceBuffer::<u8>::new(&stream.device(), n).unwrap();
    stream.copy_h2d(&host[..], &mut d).unwrap();
    d
}

/// GPU seconds per launch of `op`, over `LAUNCHES` launches.
fn per_launch(stream: &Stream, op: impl FnMut()) -> f64 {
    per_launch_host(stream, op).0
}

/// GPU seconds per launch of `op`, and host seconds per call to queue it (when the second is
/// the larger, the host limits the rate and the GPU idles between launches).
fn per_launch_host(stream: &Stream, mut op: impl FnMut()) -> (f64, f64) {
    let dev = stream.device();
    let (a, b) = (
        TimingEvent::new(&dev).unwrap(),
        TimingEvent::new(&dev).unwrap(),
    );
    stream.record(&a).unwrap();
    let t = Instant::now();
    for _ in 0..LAUNCHES {
        op();
    }
    let host = t.elapsed().as_secs_f64() / f64::from(LAUNCHES);
    stream.record(&b).unwrap();
    b.synchronize().unwrap();
    let gpu = f64::from(a.elapsed_ms(&b).unwrap()) / 1e3 / f64::from(LAUNCHES);
    (gpu, host)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

struct Case {
    name: &'static str,
    bytes_per_elem: usize,
    run: Box<dyn FnMut()>,
}

fn case<O: OutputElement>(
    name: &'static str,
    stream: &Stream,
    d_in: &'static DeviceBuffer<u8>,
    il: Layout,
) -> Case {
    let spec = Spec::uniform(N, C, H, W, Normalize::imagenet())
        .expect("a batch of N samples")
        .layouts(il, Layout::Nchw);
    case_spec::<O>(name, stream, d_in, spec)
}

/// The training-augmentation batch: N samples of `src` x `src` x C, each cropped to H x W at a
/// random place (when `crop`) and mirrored every other sample (when `mirror`), into NCHW.
fn augment_spec(il: Layout, src: usize, crop: bool, mirror: bool) -> Spec {
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let mut rand = move |n: usize| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % n as u64) as usize
    };
    let samples = (0..N)
        .map(|i| Sample {
            h: src,
            w: src,
            crop: crop.then(|| Crop {
                x: rand(src - W + 1),
                y: rand(src - H + 1),
                w: W,
                h: H,
            }),
            mirror: mirror && i % 2 == 1,
        })
        .collect();
    Spec {
        channels: C,
        samples,
        in_layout: il,
        out_layout: Layout::Nchw,
        pad_to_4: None,
        norm: Normalize::imagenet(),
    }
}

fn case_spec<O: OutputElement>(
    name: &'static str,
    stream: &Stream,
    d_in: &'static DeviceBuffer<u8>,
    spec: Spec,
) -> Case {
    let d_in: &'static pinstream::DeviceView<'static, u8> =
        Box::leak(Box::new(d_in.slice(..spec.input_len().unwrap()).unwrap()));
    let mut out = DeviceBuffer::<O>::new(&stream.device(), spec.output_len().unwrap()).unwrap();
    let s = stream.clone();
    Case {
        name,
        bytes_per_elem: 1 + std::mem::size_of::<O>(),
        run: Box::new(move || {
            kernels::normalize::<O, _, _>(&s, d_in, &spec, &mut out, None).unwrap()
        }),
    }
}

fn normalize(c: &mut Criterion) {
    let dev = match Device::get(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("normalize bench skipped: {e}");
            return;
        }
    };
    let stream = dev.stream().unwrap();
    // Big enough for 256 x 256 x 3 sources (the crops); the uniform cases use its start.
    let d_in: &'static DeviceBuffer<u8> = Box::leak(Box::new(input(&stream, N * C * 256 * 256)));
    let elems = N * C * H * W;
    let (nhwc, nchw) = (Layout::Nhwc, Layout::Nchw);
    let mut cases = [
        case::<f32>("nchw_to_nchw_f32", &stream, d_in, Layout::Nchw),
        case::<f16>("nchw_to_nchw_f16", &stream, d_in, Layout::Nchw),
        case::<bf16>("nchw_to_nchw_bf16", &stream, d_in, Layout::Nchw),
        case::<f32>("nhwc_to_nchw_f32", &stream, d_in, Layout::Nhwc),
        case::<f16>("nhwc_to_nchw_f16", &stream, d_in, Layout::Nhwc),
        // Augmentation: random 224 crops of 256 x 256 sources and/or every other sample
        // mirrored (the per-sample path).
        case_spec::<f32>(
            "crop_mirror_nhwc_f32",
            &stream,
            d_in,
            augment_spec(nhwc, 256, true, true),
        ),
        case_spec::<f16>(
            "crop_mirror_nhwc_f16",
            &stream,
            d_in,
            augment_spec(nhwc, 256, true, true),
        ),
        case_spec::<bf16>(
            "crop_mirror_nhwc_bf16",
            &stream,
            d_in,
            augment_spec(nhwc, 256, true, true),
        ),
        case_spec::<f32>(
            "crop_mirror_nchw_f32",
            &stream,
            d_in,
            augment_spec(nchw, 256, true, true),
        ),
        case_spec::<f16>(
            "crop_mirror_nchw_f16",
            &stream,
            d_in,
            augment_spec(nchw, 256, true, true),
        ),
        case_spec::<f32>(
            "crop_nhwc_f32",
            &stream,
            d_in,
            augment_spec(nhwc, 256, true, false),
        ),
        case_spec::<f32>(
            "mirror_nhwc_f32",
            &stream,
            d_in,
            augment_spec(nhwc, 224, false, true),
        ),
        case_spec::<f16>(
            "mirror_nhwc_f16",
            &stream,
            d_in,
            augment_spec(nhwc, 224, false, true),
        ),
    ];

    let mut g = c.benchmark_group("normalize_256x3x224x224");
    g.sample_size(20);
    g.measurement_time(Duration::from_secs(3));
    for cs in cases.iter_mut() {
        g.throughput(Throughput::Bytes((elems * cs.bytes_per_elem) as u64));
        g.bench_function(cs.name, |b| {
            b.iter_custom(|iters| {
                let batches = iters.div_ceil(u64::from(LAUNCHES));
                let per: f64 = (0..batches)
                    .map(|_| per_launch(&stream, &mut cs.run))
                    .sum::<f64>()
                    / batches as f64;
                Duration::from_secs_f64(per * iters as f64)
            })
        });
    }
    g.finish();

    // Summary against a device-to-device copy moving the same bytes (read + write).
    let copy_bytes = |bpe: usize| elems * bpe / 2;
    let mut copy_src = DeviceBuffer::<u8>::new(&dev, copy_bytes(5)).unwrap();
    let mut copy_dst = DeviceBuffer::<u8>::new(&dev, copy_bytes(5)).unwrap();
    kernels::fill(&stream, &mut copy_src, 0x5Au8).unwrap();
    // The non-uniform cases (crops, mirrors) upload a per-sample table each launch, from the
    // stream's pinned ring: by a kernel, or with PINSTREAM_TABLE_UPLOAD=dma by a copy engine.
    let upload = std::env::var("PINSTREAM_TABLE_UPLOAD").unwrap_or_else(|_| "kernel".into());
    println!(
        "\nsummary: {N}x{C}x{H}x{W} u8, median of 20 samples x {LAUNCHES} launches, CUDA events; \
         table upload: {upload}"
    );
    for cs in cases.iter_mut() {
        let bytes = elems * cs.bytes_per_elem;
        let half = copy_bytes(cs.bytes_per_elem);
        let src = copy_src.slice(..half).unwrap();
        let copy: Vec<f64> = (0..20)
            .map(|_| {
                per_launch(&stream, || {
                    let mut dst = copy_dst.slice_mut(..half).unwrap();
                    stream.copy_d2d(&src, &mut dst).unwrap();
                })
            })
            .collect();
        for _ in 0..3 {
            per_launch(&stream, &mut cs.run);
        }
        let (gpu, host): (Vec<f64>, Vec<f64>) = (0..20)
            .map(|_| per_launch_host(&stream, &mut cs.run))
            .unzip();
        let (t, th) = (median(gpu), median(host));
        let tc = median(copy);
        println!(
            "  {:<20} {:>8.4} ms  {:>7.1} GB/s   d2d copy of the same {} MB: {:>8.4} ms {:>7.1} GB/s   {:>5.1} %   host {:>5.1} us/call",
            cs.name,
            t * 1e3,
            bytes as f64 / t / 1e9,
            bytes / 1_000_000,
            tc * 1e3,
            bytes as f64 / tc / 1e9,
            100.0 * tc / t,
            th * 1e6
        );
    }
    // Host time per call of the table launches while the stream is held by a spin (the GPU
    // work of the launches runs after it): a call that waited for the stream would take about
    // the spin's 20 ms.
    println!(
        "host time per call behind a busy stream (20 ms spin, {LAUNCHES} calls, median of 5):"
    );
    for cs in cases.iter_mut().filter(|c| c.name.starts_with("crop")) {
        let host: Vec<f64> = (0..5)
            .map(|_| {
                stream.synchronize().unwrap();
                stream.spin(Duration::from_millis(20)).unwrap();
                let t = Instant::now();
                for _ in 0..LAUNCHES {
                    (cs.run)();
                }
                let h = t.elapsed().as_secs_f64() / f64::from(LAUNCHES);
                stream.synchronize().unwrap();
                h
            })
            .collect();
        println!("  {:<20} host {:>7.1} us/call", cs.name, median(host) * 1e6);
    }
}

criterion_group!(benches, normalize);
criterion_main!(benches);
