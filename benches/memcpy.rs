//! Criterion bench: host <-> device copies of 64 MiB, pinned vs pageable, timed with GPU events
//! (pinned) or the host clock (pageable, whose copies block the host). Without a device it
//! prints one line and measures nothing.
//!
//! `cargo bench --bench memcpy`, or on the GPU machine `.gpu/bench/memcpy --bench`.

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use pinstream::{Device, DeviceBuffer, HostAlloc, PinnedBuffer, Stream, TimingEvent};

const BYTES: usize = 64 << 20;

fn pattern(n: usize) -> Vec<u8> {
    // Never zeros: a cheap xorshift stream.
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8 | 1
        })
        .collect()
}

/// GPU time of `iters` repetitions of `op` between two events.
fn timed(stream: &Stream, iters: u64, mut op: impl FnMut()) -> Duration {
    let dev = stream.device();
    let (start, end) = (
        TimingEvent::new(&dev).unwrap(),
        TimingEvent::new(&dev).unwrap(),
    );
    stream.record(&start).unwrap();
    for _ in 0..iters {
        op();
    }
    stream.record(&end).unwrap();
    end.synchronize().unwrap();
    start.elapsed(&end).unwrap()
}

fn memcpy(c: &mut Criterion) {
    let dev = match Device::get(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("memcpy bench skipped: {e}");
            return;
        }
    };
    let stream = dev.stream().unwrap();
    let data = pattern(BYTES);
    let pinned = PinnedBuffer::from_slice(&dev, &data, HostAlloc::DEFAULT).unwrap();
    let mut pinned_dst = PinnedBuffer::<u8>::new(&dev, BYTES, HostAlloc::DEFAULT).unwrap();
    let mut pageable_dst = vec![0u8; BYTES];
    let mut d = DeviceBuffer::<u8>::new(&dev, BYTES).unwrap();

    let mut g = c.benchmark_group("memcpy_64MiB");
    g.throughput(Throughput::Bytes(BYTES as u64));
    g.sample_size(20);
    g.bench_function("h2d_pinned", |b| {
        b.iter_custom(|iters| {
            timed(&stream, iters, || {
                stream.copy_h2d(&pinned, &mut d).unwrap();
            })
        })
    });
    g.bench_function("d2h_pinned", |b| {
        b.iter_custom(|iters| {
            timed(&stream, iters, || {
                let p = stream.copy_d2h(&d, &mut pinned_dst).unwrap();
                std::mem::forget(p); // the pinned buffer's own event still guards it
            })
        })
    });
    g.bench_function("h2d_pageable", |b| {
        b.iter_custom(|iters| {
            let t = Instant::now();
            for _ in 0..iters {
                stream.copy_h2d(&data[..], &mut d).unwrap();
            }
            stream.synchronize().unwrap();
            t.elapsed()
        })
    });
    g.bench_function("d2h_pageable", |b| {
        b.iter_custom(|iters| {
            let t = Instant::now();
            for _ in 0..iters {
                stream
                    .copy_d2h(&d, &mut pageable_dst[..])
                    .unwrap()
                    .wait()
                    .unwrap();
            }
            t.elapsed()
        })
    });
    g.finish();
}

/// Small host-to-device copies from plain memory, each followed by a stream synchronize (the
/// latency a caller sees): pinstream's bounce blocks against the driver's own staging
/// (`cudaMemcpyAsync` straight from the pageable slice, what pinstream did before and what
/// PyTorch does; not safe to rely on in general, which is why pinstream stopped).
fn small_pageable(c: &mut Criterion) {
    let Ok(dev) = Device::get(0) else {
        return;
    };
    let stream = dev.stream().unwrap();
    let mut g = c.benchmark_group("pageable_h2d_small");
    g.sample_size(30);
    for bytes in [4usize << 10, 64 << 10, 1 << 20] {
        let data = pattern(bytes);
        let mut d = DeviceBuffer::<u8>::new(&dev, bytes).unwrap();
        g.throughput(Throughput::Bytes(bytes as u64));
        g.bench_function(format!("pinstream_{}KiB", bytes >> 10), |b| {
            b.iter(|| {
                stream.copy_h2d(&data[..], &mut d).unwrap();
                stream.synchronize().unwrap();
            })
        });
        let dst = d.as_device_mut_ptr();
        g.bench_function(format!("driver_{}KiB", bytes >> 10), |b| {
            b.iter(|| {
                // SAFETY: `dst` is `bytes` of live device memory and `data` `bytes` of host
                // memory; the synchronize below finishes the copy before either is touched.
                let err = unsafe {
                    pinstream::sys::cudaMemcpyAsync(
                        dst.cast(),
                        data.as_ptr().cast(),
                        bytes,
                        pinstream::sys::cudaMemcpyKind::cudaMemcpyHostToDevice,
                        stream.as_raw(),
                    )
                };
                assert_eq!(err, pinstream::sys::cudaError::cudaSuccess);
                stream.synchronize().unwrap();
            })
        });
    }
    g.finish();
}

criterion_group!(benches, memcpy, small_pageable);
criterion_main!(benches);
