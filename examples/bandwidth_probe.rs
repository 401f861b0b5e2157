//! A custom bandwidth probe with the crate's `bench` helpers: pinned host-to-device copies at a
//! few sizes, timed with CUDA events, summarized as median / min / max GB/s. Without a CUDA
//! device it prints `no CUDA device: <error>` and exits with status 0.
//! `pinstream bandwidth` is the full benchmark (gated copies, every memory kind, checks).

mod common;

use pinstream::bench::{gbps, pattern, size_name, Stats};
use pinstream::{Device, DeviceBuffer, HostAlloc, PinnedBuffer, TimingEvent};

fn main() -> std::process::ExitCode {
    common::exit_status("bandwidth_probe", probe())
}

fn probe() -> Result<(), Box<dyn std::error::Error>> {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let (start, end) = (TimingEvent::new(&dev)?, TimingEvent::new(&dev)?);
    for bytes in [64 << 10, 1 << 20, 16 << 20, 256 << 20] {
        let host = PinnedBuffer::from_slice(&dev, &pattern(bytes)?, HostAlloc::DEFAULT)?;
        let mut d = DeviceBuffer::<u8>::new(&dev, bytes)?;
        let mut samples = Vec::new();
        for _ in 0..10 {
            stream.record(&start)?;
            stream.copy_h2d(&host, &mut d)?;
            stream.record(&end)?;
            end.synchronize()?;
            samples.push(gbps(bytes as f64, start.elapsed(&end)?.as_secs_f64()));
        }
        if let Some(s) = Stats::new(samples) {
            let (name, cv) = (size_name(bytes), s.cv * 100.0);
            println!(
                "pinned h2d {name:>5}: {:6.2} GB/s median, {:.2} to {:.2}, cv {cv:.1} %",
                s.median, s.min, s.max
            );
        }
    }
    Ok(())
}
