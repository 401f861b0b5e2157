//! Latency of single small copies (4 bytes) and their synchronisation, host-observed.

use std::time::Instant;

use pinstream::memory::{DeviceBuffer, HostAlloc, PinnedBuffer};
use pinstream::{Device, Result};

use super::{empty_stats, Stats};

/// Host-observed latency of one 4-byte copy and its synchronisation, in microseconds.
#[derive(Clone, Debug)]
pub struct Latency {
    /// Memory and direction, e.g. `pinned h2d 4 B`.
    pub what: String,
    /// Microseconds per copy and synchronize.
    pub micros: Stats,
}

/// Latency of single small copies: pageable and pinned, both directions.
pub fn latency(device: &Device, iters: usize) -> Result<Vec<Latency>> {
    let s = device.stream()?;
    let mut d = DeviceBuffer::<u32>::new(device, 1)?;
    let mut pinned = PinnedBuffer::<u32>::from_slice(device, &[0xA5A5_A5A5], HostAlloc::DEFAULT)?;
    let mut pageable = [0x5A5A_5A5Au32];
    let mut out = Vec::new();
    for (what, pinned_mem) in [("pageable", false), ("pinned", true)] {
        for dir in ["h2d", "d2h"] {
            let mut us = Vec::new();
            for i in 0..iters + 10 {
                let t = Instant::now();
                match (pinned_mem, dir) {
                    (true, "h2d") => drop(s.copy_h2d(&pinned, &mut d)?),
                    (false, "h2d") => drop(s.copy_h2d(&pageable[..], &mut d)?),
                    (true, _) => drop(s.copy_d2h(&d, &mut pinned)?.wait()?),
                    (false, _) => drop(s.copy_d2h(&d, &mut pageable[..])?.wait()?),
                }
                s.synchronize()?;
                if i >= 10 {
                    us.push(t.elapsed().as_secs_f64() * 1e6);
                }
            }
            out.push(Latency {
                what: format!("{what} {dir} 4 B"),
                micros: Stats::new(us).unwrap_or_else(empty_stats),
            });
        }
    }
    Ok(out)
}
