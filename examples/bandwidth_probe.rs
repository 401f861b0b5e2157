//! A custom bandwidth probe with the library's timing API (`pinstream::timing`): pinned
//! host-to-device copies at a few sizes, queued behind a gate, timed with CUDA events,
//! summarized as median / min / max GB/s. Without a CUDA device it prints
//! `no CUDA device: <error>` and exits with status 0.
//! `pinstream bandwidth` (the `pinstream-cli` crate) is the full benchmark: every memory kind,
//! both directions, checks.

mod common;

use std::time::Duration;

use pinstream::timing::{gbps, CopyLoop, Gate, Stats};
use pinstream::{Device, DeviceBuffer, HostAlloc, PinnedBuffer, TimingEvent};

fn main() -> std::process::ExitCode {
    common::exit_status("bandwidth_probe", probe())
}

fn probe() -> Result<(), Box<dyn std::error::Error>> {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let gate = Gate::new(&dev, Duration::from_secs(5))?;
    let (start, end) = (TimingEvent::new(&dev)?, TimingEvent::new(&dev)?);
    for mib in [1, 16, 256] {
        let bytes = mib << 20;
        let host = PinnedBuffer::from_slice(&dev, &vec![7u8; bytes], HostAlloc::DEFAULT)?;
        let mut d = DeviceBuffer::<u8>::new(&dev, bytes)?;
        let copies = CopyLoop::h2d(&stream, &host, &mut d, bytes)?;
        let reps = (1024 / mib).clamp(4, 64); // about 1 GiB per sample
        let mut samples = Vec::new();
        for _ in 0..10 {
            gate.close(&stream)?; // the copies wait until all are queued
            stream.record(&start)?;
            copies.queue(reps)?;
            stream.record(&end)?;
            gate.open();
            end.synchronize()?;
            let secs = start.elapsed(&end)?.as_secs_f64();
            samples.push(gbps((bytes * reps) as f64, secs));
        }
        if let Some(s) = Stats::new(samples) {
            println!(
                "pinned h2d {mib:>4} MiB: {:6.2} GB/s median, {:.2} to {:.2}, cv {:.1} %",
                s.median,
                s.min,
                s.max,
                s.cv * 100.0
            );
        }
    }
    Ok(())
}
