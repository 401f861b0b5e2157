//! Pinned (portable) H2D and D2H on every device at once, started together from one gate.

use pinstream::memory::{DeviceBuffer, HostAlloc, PinnedBuffer};
use pinstream::{Device, Result, Stream, TimingEvent};

use super::{empty_stats, gbps, pattern, secs, Gate, MemKind, Options, Row, Stats, GATE_DEPTH};
use crate::bench;

/// Pinned (portable) H2D and D2H of `bytes` on every device at once, started together from one
/// gate. GB/s is all bytes over the slowest device's time.
pub fn all_devices(devices: &[Device], bytes: usize, opts: &Options) -> Result<Vec<Row>> {
    let first = devices
        .first()
        .ok_or_else(|| bench::invalid("bandwidth", "no devices"))?;
    let gate = Gate::new(first, opts.gate_timeout)?;
    let pattern = pattern(bytes)?;
    struct Per {
        s: Stream,
        d: DeviceBuffer<u8>,
        t0: TimingEvent,
        t1: TimingEvent,
    }
    let mut per = Vec::new();
    for dev in devices {
        per.push(Per {
            s: dev.stream()?,
            d: DeviceBuffer::<u8>::new(dev, bytes)?,
            t0: TimingEvent::new(dev)?,
            t1: TimingEvent::new(dev)?,
        });
    }
    // One source and one destination per device, as when each GPU gets its own shard.
    let mut srcs = Vec::new();
    let mut dsts = Vec::new();
    for _ in devices {
        srcs.push(PinnedBuffer::from_slice(
            first,
            &pattern,
            HostAlloc::PORTABLE,
        )?);
        dsts.push(PinnedBuffer::<u8>::new(first, bytes, HostAlloc::PORTABLE)?);
    }
    let mut rows = Vec::new();
    for dir in ["h2d", "d2h"] {
        let reps = ((secs(opts.min_sample_time) * 50e9 / bytes as f64).ceil() as usize)
            .clamp(1, GATE_DEPTH);
        let mut samples = Vec::new();
        let mut timed_out = false;
        for i in 0..opts.warmup_samples + opts.min_samples.max(1) {
            for ((p, dst), src) in per.iter_mut().zip(dsts.iter_mut()).zip(&srcs) {
                gate.close(&p.s)?;
                p.s.record(&p.t0)?;
                for _ in 0..reps {
                    if dir == "h2d" {
                        drop(p.s.copy_h2d(src, &mut p.d)?);
                    } else {
                        std::mem::forget(p.s.copy_d2h(&p.d, dst)?);
                    }
                }
                p.s.record(&p.t1)?;
            }
            timed_out |= !gate.open();
            let mut slowest = 0f64;
            for p in &per {
                p.t1.synchronize()?;
                slowest = slowest.max(f64::from(p.t0.elapsed_ms(&p.t1)?) / 1e3);
            }
            if i >= opts.warmup_samples {
                samples.push(gbps((bytes * reps * devices.len()) as f64, slowest));
            }
        }
        let verified = if dir == "h2d" {
            let mut ok = true;
            for p in &per {
                let mut back = vec![0u8; bytes];
                ok &= p.s.copy_d2h(&p.d, &mut back[..])?.wait()? == &pattern[..];
            }
            ok
        } else {
            let mut ok = true;
            for d in &dsts {
                ok &= d.as_slice()? == &pattern[..];
            }
            ok
        };
        rows.push(Row {
            device: "all".into(),
            kind: MemKind::Portable.name(),
            direction: dir,
            bytes,
            copies_per_sample: reps,
            gbps: Stats::new(samples).unwrap_or_else(empty_stats),
            host_gbps: None,
            host_memcpy_gbps: None,
            verified,
            gate_timed_out: timed_out,
            partly_alone: false,
            note: None,
        });
    }
    Ok(rows)
}
