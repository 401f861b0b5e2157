//! The cost of pinning host memory: `cudaHostAlloc` and `cudaHostRegister`, and freeing them.

use pinstream::memory::{HostAlloc, HostRegister};
use pinstream::timing;
use pinstream::{Device, Result};

use super::{empty_stats, pattern, secs, Stats};

/// Cost of pinning: seconds per GiB to allocate and to free.
#[derive(Clone, Debug)]
pub struct PinCost {
    /// The call measured, e.g. `cudaHostRegister`.
    pub what: &'static str,
    /// Bytes pinned per sample.
    pub bytes: usize,
    /// Seconds per GiB to allocate or register.
    pub pin_s_per_gib: Stats,
    /// Seconds per GiB to free or unregister.
    pub unpin_s_per_gib: Stats,
}

/// `cudaHostAlloc` (default and write-combined) and `cudaHostRegister` of `bytes`.
pub fn pinning_cost(device: &Device, bytes: usize, samples: usize) -> Result<Vec<PinCost>> {
    let gib = bytes as f64 / (1u64 << 30) as f64;
    let mut out = Vec::new();
    for (what, flags) in [
        ("cudaHostAlloc", HostAlloc::DEFAULT),
        ("cudaHostAlloc write-combined", HostAlloc::WRITE_COMBINED),
    ] {
        let (mut a, mut f) = (Vec::new(), Vec::new());
        for _ in 0..samples.max(1) {
            let (alloc, free) = timing::host_alloc_cost(device, bytes, flags)?;
            a.push(secs(alloc) / gib);
            f.push(secs(free) / gib);
        }
        out.push(PinCost {
            what,
            bytes,
            pin_s_per_gib: Stats::new(a).unwrap_or_else(empty_stats),
            unpin_s_per_gib: Stats::new(f).unwrap_or_else(empty_stats),
        });
    }
    let mut data = pattern(bytes)?; // touched, as a real buffer would be
    let (mut a, mut f) = (Vec::new(), Vec::new());
    for _ in 0..samples.max(1) {
        let (reg, unreg) = timing::host_register_cost(device, &mut data, HostRegister::DEFAULT)?;
        a.push(secs(reg) / gib);
        f.push(secs(unreg) / gib);
    }
    out.push(PinCost {
        what: "cudaHostRegister",
        bytes,
        pin_s_per_gib: Stats::new(a).unwrap_or_else(empty_stats),
        unpin_s_per_gib: Stats::new(f).unwrap_or_else(empty_stats),
    });
    Ok(out)
}
