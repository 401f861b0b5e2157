//! The experiments of PyTorch's "A guide on good usage of non_blocking and pin_memory()",
//! reproduced with pinstream: what pinning buys, when async copies help, and when copies overlap
//! with compute. Scenarios (a) to (c) also run the same copies through a [`Stager`] (the
//! engine's defaults, overridden by the `PINSTREAM_STAGING_*` variables): from the same pageable
//! memory, one call per tensor, one call per list, one packed batch.

use std::time::Duration;

use super::staging::describe;
use super::{median_ms, pattern};
use pinstream::memory::{DeviceBuffer, HostAlloc, PinnedBuffer};
use pinstream::staging::{Packer, Stager, StagerConfig, Uploads};
use pinstream::Device;
use pinstream::Result;

/// One measured case of one scenario.
#[derive(Clone, Debug)]
pub struct Case {
    /// The guide's scenario letter, `a` to `d`.
    pub scenario: &'static str,
    /// What was done, e.g. `4 MB pinned tensor, non_blocking`.
    pub case: String,
    /// Median wall time in milliseconds (host clock, everything synchronised).
    pub ms: f64,
    /// What the case shows, or how it was done (empty where there is nothing to add).
    pub note: String,
}

/// Runs scenarios (a) to (d) on `device`, with the staged cases of (a) to (c) moved by one
/// [`Stager`] built from [`StagerConfig::from_env`].
pub fn run(device: &Device) -> Result<Vec<Case>> {
    let mut out = Vec::new();
    let s = device.stream()?;
    let stager = Stager::new(device, StagerConfig::from_env()?)?;
    let how = describe(&stager);
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
    // The same pageable tensor through the engine's pinned slots and threads.
    let a4 = median_ms(|| {
        stager.upload(&s, &data, &mut d)?;
        s.synchronize()
    })?;
    out.push(case(
        "a",
        "4 MB staged upload (same pageable tensor)",
        a4,
        format!("{:.1}x faster than pageable; {how}", a1 / a4),
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
    // The same pageable tensors, staged: one call for the list (each into its own buffer, as
    // separate tensors would be), and one packed batch (a new device arena each time).
    let mut dsts: Vec<DeviceBuffer<u8>> = (0..k)
        .map(|_| DeviceBuffer::new(device, small))
        .collect::<Result<_>>()?;
    let b4 = median_ms(|| {
        let mut list = Uploads::new();
        for (h, d) in host.iter().zip(dsts.iter_mut()) {
            list.push(&h[..], d)?;
        }
        stager.upload_all(&s, list)?;
        s.synchronize()
    })?;
    let b5 = median_ms(|| {
        let mut packer = Packer::new();
        for h in &host {
            packer.push(&h[..])?;
        }
        let batch = stager.upload_packed(&s, &packer)?;
        s.synchronize()?;
        drop(batch);
        Ok(())
    })?;
    out.push(case(
        "b",
        "1000 x 4 KB pageable, staged upload_all (one call)",
        b4,
        format!("{:.1}x faster; {how}", b1 / b4),
    ));
    out.push(case(
        "b",
        "1000 x 4 KB pageable, staged upload_packed",
        b5,
        format!("{:.1}x faster; {how}", b1 / b5),
    ));
    drop(dsts);

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
    // The pageable tensors staged: one upload per tensor (each returns once its host side is
    // done, like an async copy; one synchronize at the end), then all of them in one call.
    let staged_each = median_ms(|| {
        for (i, src) in big.chunks(n).enumerate() {
            let mut view = dst.slice_mut(i * n..(i + 1) * n)?;
            stager.upload(&s, src, &mut view)?;
        }
        s.synchronize()
    })?;
    drop(dst);
    let mut dsts: Vec<DeviceBuffer<u8>> = (0..k)
        .map(|_| DeviceBuffer::new(device, n))
        .collect::<Result<_>>()?;
    let staged_all = median_ms(|| {
        let mut list = Uploads::new();
        for (src, d) in big.chunks(n).zip(dsts.iter_mut()) {
            list.push(src, d)?;
        }
        stager.upload_all(&s, list)?;
        s.synchronize()
    })?;
    drop(dsts);
    for (label, ms) in [
        ("pageable, staged upload each", staged_each),
        ("pageable, staged upload_all", staged_all),
    ] {
        let gb = (k * n) as f64 / ms / 1e6;
        out.push(case(
            "c",
            &format!("200 x 4 MB {label}"),
            ms,
            format!("{gb:.1} GB/s; {how}"),
        ));
    }
    drop(big);

    // (d) Copy/compute overlap: a kernel on one stream, a 256 MB H2D copy on the same or another.
    let n = 256 << 20;
    let data = pattern(n)?;
    let pinned = PinnedBuffer::from_slice(device, &data, HostAlloc::DEFAULT)?;
    let mut d = DeviceBuffer::<u8>::new(device, n)?;
    let other = device.stream()?;
    for pinned_mem in [false, true] {
        let copy = |st: &pinstream::Stream, d: &mut DeviceBuffer<u8>| -> Result<()> {
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
