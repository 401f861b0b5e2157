//! Criterion bench: the staging engine against the copies it replaces, timed with the host clock
//! (the engine's threads do the host side; every sample ends with the data on the device, or
//! back in host memory):
//!
//! - `staged_h2d`, `staged_d2h`: 4 MiB and 64 MiB, `Stager::upload` + synchronize /
//!   `Stager::download` against a plain copy from / to pageable memory and one from / to pinned
//!   memory (throughput in bytes);
//! - `many_small`: 1000 tensors of 4 KB (1024 f32): a loop of `copy_h2d` with one synchronize,
//!   one `upload_all`, one `upload_packed`.
//!
//! The engine is built once from `StagerConfig::from_env` (`PINSTREAM_STAGING_*`). Without a
//! device it prints one line and measures nothing.
//!
//! `cargo bench --bench staging`.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use pinstream::{
    Device, DeviceBuffer, HostAlloc, Packer, PinnedBuffer, Stager, StagerConfig, Uploads,
};

const SIZES: [usize; 2] = [4 << 20, 64 << 20];

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

/// Device 0 and an engine for it, or `None` on a machine without a device (with a note when
/// `note`: one line for the whole bench, as in benches/memcpy.rs).
fn setup(note: bool) -> Option<(Device, Stager)> {
    let dev = match Device::get(0) {
        Ok(d) => d,
        Err(e) => {
            if note {
                eprintln!("staging bench skipped: {e}");
            }
            return None;
        }
    };
    let stager = Stager::new(&dev, StagerConfig::from_env().unwrap()).unwrap();
    Some((dev, stager))
}

fn name(bytes: usize) -> String {
    format!("{}MiB", bytes >> 20)
}

fn staged(c: &mut Criterion) {
    let Some((dev, stager)) = setup(true) else {
        return;
    };
    let stream = dev.stream().unwrap();
    let cfg = stager.config();
    eprintln!(
        "stager: threads={} slot={} KiB slots={}",
        cfg.threads,
        cfg.slot_bytes >> 10,
        cfg.slots
    );

    let mut g = c.benchmark_group("staged_h2d");
    g.sample_size(20);
    for bytes in SIZES {
        let data = pattern(bytes);
        let pinned = PinnedBuffer::from_slice(&dev, &data, HostAlloc::DEFAULT).unwrap();
        let mut d = DeviceBuffer::<u8>::new(&dev, bytes).unwrap();
        g.throughput(Throughput::Bytes(bytes as u64));
        g.bench_function(format!("stager_{}", name(bytes)), |b| {
            b.iter(|| {
                stager.upload(&stream, &data, &mut d).unwrap();
                stream.synchronize().unwrap();
            })
        });
        g.bench_function(format!("pageable_{}", name(bytes)), |b| {
            b.iter(|| {
                stream.copy_h2d(&data[..], &mut d).unwrap();
                stream.synchronize().unwrap();
            })
        });
        g.bench_function(format!("pinned_{}", name(bytes)), |b| {
            b.iter(|| {
                stream.copy_h2d(&pinned, &mut d).unwrap();
                stream.synchronize().unwrap();
            })
        });
        let mut back = vec![0u8; bytes];
        stream.copy_d2h(&d, &mut back[..]).unwrap().wait().unwrap();
        assert!(back == data, "staged_h2d: the device data differ");
    }
    g.finish();

    let mut g = c.benchmark_group("staged_d2h");
    g.sample_size(20);
    for bytes in SIZES {
        let data = pattern(bytes);
        let mut d = DeviceBuffer::<u8>::new(&dev, bytes).unwrap();
        stream.copy_h2d(&data[..], &mut d).unwrap();
        stream.synchronize().unwrap();
        let mut pageable = vec![0u8; bytes];
        let mut pinned = PinnedBuffer::<u8>::new(&dev, bytes, HostAlloc::DEFAULT).unwrap();
        g.throughput(Throughput::Bytes(bytes as u64));
        g.bench_function(format!("stager_{}", name(bytes)), |b| {
            b.iter(|| stager.download(&stream, &d, &mut pageable).unwrap())
        });
        assert!(pageable == data, "staged_d2h: the host data differ");
        g.bench_function(format!("pageable_{}", name(bytes)), |b| {
            b.iter(|| {
                stream
                    .copy_d2h(&d, &mut pageable[..])
                    .unwrap()
                    .wait()
                    .unwrap();
            })
        });
        g.bench_function(format!("pinned_{}", name(bytes)), |b| {
            b.iter(|| {
                stream.copy_d2h(&d, &mut pinned).unwrap().wait().unwrap();
            })
        });
    }
    g.finish();
}

fn many_small(c: &mut Criterion) {
    const COUNT: usize = 1000;
    const ELEMS: usize = 1024; // 4 KB of f32
    let Some((dev, stager)) = setup(false) else {
        return;
    };
    let stream = dev.stream().unwrap();
    let srcs: Vec<Vec<f32>> = (0..COUNT)
        .map(|i| (0..ELEMS).map(|j| (i * ELEMS + j) as f32 + 0.5).collect())
        .collect();
    let mut dsts: Vec<DeviceBuffer<f32>> = (0..COUNT)
        .map(|_| DeviceBuffer::new(&dev, ELEMS).unwrap())
        .collect();

    let mut g = c.benchmark_group("many_small");
    g.throughput(Throughput::Bytes((COUNT * ELEMS * 4) as u64));
    g.sample_size(20);
    g.bench_function("loop_copy_h2d", |b| {
        b.iter(|| {
            for (s, d) in srcs.iter().zip(dsts.iter_mut()) {
                stream.copy_h2d(&s[..], d).unwrap();
            }
            stream.synchronize().unwrap();
        })
    });
    g.bench_function("upload_all", |b| {
        b.iter(|| {
            let mut list = Uploads::new();
            for (s, d) in srcs.iter().zip(dsts.iter_mut()) {
                list.push(&s[..], d).unwrap();
            }
            stager.upload_all(&stream, list).unwrap();
            stream.synchronize().unwrap();
        })
    });
    g.bench_function("upload_packed", |b| {
        b.iter(|| {
            let mut packer = Packer::new();
            for s in &srcs {
                packer.push(&s[..]).unwrap();
            }
            let batch = stager.upload_packed(&stream, &packer).unwrap();
            stream.synchronize().unwrap();
            drop(batch); // frees the arena (stream-ordered), as a training step would
        })
    });
    g.finish();

    let mut back = vec![0f32; ELEMS];
    for i in [0, COUNT / 2, COUNT - 1] {
        stream
            .copy_d2h(&dsts[i], &mut back[..])
            .unwrap()
            .wait()
            .unwrap();
        assert!(back == srcs[i], "many_small: tensor {i} differs");
    }
}

criterion_group!(benches, staged, many_small);
criterion_main!(benches);
