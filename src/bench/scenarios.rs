//! The experiments of PyTorch's "A guide on good usage of non_blocking and pin_memory()",
//! reproduced with pinstream: what pinning buys, when async copies help, and when copies overlap
//! with compute.

use std::time::{Duration, Instant};

use super::{pattern, secs, Stats};
use crate::device::Device;
use crate::error::Result;
use crate::memory::{DeviceBuffer, HostAlloc, PinnedBuffer};

/// One measured case of one scenario.
#[derive(Clone, Debug)]
pub struct Case {
    pub scenario: &'static str,
    pub case: String,
    /// Median wall time in milliseconds (host clock, everything synchronised).
    pub ms: f64,
    pub note: String,
}

const REPEAT: usize = 7;

fn median_ms(mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?; // warm-up
    let mut t = Vec::new();
    for _ in 0..REPEAT {
        let start = Instant::now();
        f()?;
        t.push(secs(start.elapsed()) * 1e3);
    }
    Ok(Stats::new(t).map_or(0.0, |s| s.median))
}

/// Runs scenarios (a) to (d) on `device`.
pub fn run(device: &Device) -> Result<Vec<Case>> {
    let mut out = Vec::new();
    let s = device.stream()?;
    let case = |scenario, case: &str, ms, note: String| Case {
        scenario,
        case: case.to_string(),
        ms,
        note,
    };

    // (a) One 4 MB tensor.
    let n = 4 << 20;
    let data = pattern(n)?;
    let pinned = PinnedBuffer::from_slice(device, &data, HostAlloc::DEFAULT)?;
    let mut d = DeviceBuffer::<u8>::new(device, n)?;
    let a1 = median_ms(|| {
        s.copy_h2d(&data[..], &mut d)?;
        s.synchronize()
    })?;
    let a2 = median_ms(|| {
        s.copy_h2d(&pinned, &mut d)?;
        s.synchronize()
    })?;
    let a3 = median_ms(|| {
        let p = PinnedBuffer::from_slice(device, &data, HostAlloc::DEFAULT)?;
        s.copy_h2d(&p, &mut d)?;
        s.synchronize()
    })?;
    out.push(case("a", "4 MB pageable copy", a1, String::new()));
    out.push(case(
        "a",
        "4 MB pinned copy",
        a2,
        format!("{:.1}x faster than pageable", a1 / a2),
    ));
    out.push(case(
        "a",
        "4 MB pin (cudaHostAlloc + memcpy + free) then copy",
        a3,
        format!(
            "{:.1}x the pageable copy: pinning only pays when reused",
            a3 / a1
        ),
    ));

    // (b) 1000 tensors of 4 KB.
    let k = 1000;
    let small = 4 << 10;
    let host: Vec<Vec<u8>> = (0..k).map(|_| pattern(small)).collect::<Result<_>>()?;
    let pinned_small: Vec<PinnedBuffer<u8>> = host
        .iter()
        .map(|h| PinnedBuffer::from_slice(device, h, HostAlloc::DEFAULT))
        .collect::<Result<_>>()?;
    let mut dst = DeviceBuffer::<u8>::new(device, k * small)?;
    let packed = PinnedBuffer::from_slice(device, &host.concat(), HostAlloc::DEFAULT)?;
    let b1 = median_ms(|| {
        for (i, h) in host.iter().enumerate() {
            s.copy_h2d(&h[..], &mut dst.slice_mut(i * small..(i + 1) * small)?)?;
            s.synchronize()?;
        }
        Ok(())
    })?;
    let b2 = median_ms(|| {
        for (i, p) in pinned_small.iter().enumerate() {
            s.copy_h2d(p, &mut dst.slice_mut(i * small..(i + 1) * small)?)?;
        }
        s.synchronize()
    })?;
    let b3 = median_ms(|| {
        s.copy_h2d(&packed, &mut dst)?;
        s.synchronize()
    })?;
    out.push(case(
        "b",
        "1000 x 4 KB, blocking copy each",
        b1,
        String::new(),
    ));
    out.push(case(
        "b",
        "1000 x 4 KB pinned, async, one sync",
        b2,
        format!("{:.1}x faster", b1 / b2),
    ));
    out.push(case(
        "b",
        "1000 x 4 KB packed into one 4 MB transfer",
        b3,
        format!("{:.1}x faster", b1 / b3),
    ));

    // (c) 200 tensors of 4 MB.
    let k = 200;
    let big: Vec<u8> = pattern(k * n)?;
    let pinned_big: Vec<PinnedBuffer<u8>> = big
        .chunks(n)
        .map(|c| PinnedBuffer::from_slice(device, c, HostAlloc::DEFAULT))
        .collect::<Result<_>>()?;
    let mut dst = DeviceBuffer::<u8>::new(device, k * n)?;
    for (label, pinned_mem, blocking) in [
        ("pageable, blocking", false, true),
        ("pageable, async", false, false),
        ("pinned, blocking", true, true),
        ("pinned, async", true, false),
    ] {
        let ms = median_ms(|| {
            for i in 0..k {
                let mut view = dst.slice_mut(i * n..(i + 1) * n)?;
                if pinned_mem {
                    s.copy_h2d(&pinned_big[i], &mut view)?;
                } else {
                    s.copy_h2d(&big[i * n..(i + 1) * n], &mut view)?;
                }
                if blocking {
                    s.synchronize()?;
                }
            }
            s.synchronize()
        })?;
        let gb = (k * n) as f64 / ms / 1e6;
        out.push(case(
            "c",
            &format!("200 x 4 MB {label}"),
            ms,
            format!("{gb:.1} GB/s"),
        ));
    }
    drop(pinned_big);

    // (d) Copy/compute overlap: a kernel on one stream, a 256 MB H2D copy on the same or another.
    let n = 256 << 20;
    let data = pattern(n)?;
    let pinned = PinnedBuffer::from_slice(device, &data, HostAlloc::DEFAULT)?;
    let mut d = DeviceBuffer::<u8>::new(device, n)?;
    let other = device.stream()?;
    for pinned_mem in [false, true] {
        let copy = |st: &crate::Stream, d: &mut DeviceBuffer<u8>| -> Result<()> {
            if pinned_mem {
                drop(st.copy_h2d(&pinned, d)?);
            } else {
                drop(st.copy_h2d(&data[..], d)?);
            }
            Ok(())
        };
        let copy_ms = median_ms(|| {
            copy(&s, &mut d)?;
            s.synchronize()
        })?;
        let kernel = Duration::from_secs_f64(copy_ms / 1e3);
        let kernel_ms = median_ms(|| {
            s.spin(kernel)?;
            s.synchronize()
        })?;
        let mem = if pinned_mem { "pinned" } else { "pageable" };
        for separate in [false, true] {
            let wall = median_ms(|| {
                s.spin(kernel)?;
                copy(if separate { &other } else { &s }, &mut d)?;
                s.synchronize()?;
                other.synchronize()
            })?;
            let (sum, max) = (copy_ms + kernel_ms, copy_ms.max(kernel_ms));
            let overlap = ((sum - wall) / (sum - max)).clamp(0.0, 1.0) * 100.0;
            out.push(case(
                "d",
                &format!("{mem} copy, {} stream", if separate { "separate" } else { "same" }),
                wall,
                format!("copy {copy_ms:.2} + kernel {kernel_ms:.2}: sum {sum:.2}, max {max:.2} ms; {overlap:.0}% overlapped"),
            ));
        }
    }
    Ok(out)
}
