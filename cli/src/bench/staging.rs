//! Measurements of the staging engine against the copies it replaces, in the same call: a plain
//! `cudaMemcpyAsync` from pageable memory (what PyTorch's `.to()` does), the same from pinned
//! memory (the link), and `Stager` uploads and downloads. Host clocks (a pageable copy blocks the
//! host), each sample ends with the stream synchronised, medians of several samples after a
//! warm-up, and the process's CPU time per GB moved (user + system, all threads).

use std::time::Instant;

use super::{gbps, secs, Stats};
use pinstream::memory::{DeviceBuffer, HostAlloc, PinnedBuffer};
use pinstream::staging::{FileSource, Packer, Stager, Uploads};
use pinstream::Stream;
use pinstream::{Error, Result};

/// One measured way of moving `bytes`.
#[derive(Clone, Debug)]
pub struct Measure {
    /// What was measured, e.g. `staged h2d`.
    pub what: String,
    /// Bytes moved per sample.
    pub bytes: usize,
    /// Decimal GB/s per sample (host clock, stream synchronised).
    pub gbps: Stats,
    /// Median milliseconds per sample.
    pub ms: f64,
    /// Process CPU seconds (user + system, every thread) per GB moved.
    pub cpu_s_per_gb: f64,
    /// How it was done (threads, slot size), for the explanation column.
    pub note: String,
}

pub use pinstream::timing::cpu_seconds;

/// Times `f` (which must leave the stream synchronised) `samples` times after one warm-up.
pub fn measure(
    what: impl Into<String>,
    bytes: usize,
    samples: usize,
    note: impl Into<String>,
    mut f: impl FnMut() -> Result<()>,
) -> Result<Measure> {
    f()?;
    let samples = samples.max(3);
    let mut t = Vec::with_capacity(samples);
    let cpu0 = cpu_seconds();
    for _ in 0..samples {
        let start = Instant::now();
        f()?;
        t.push(secs(start.elapsed()));
    }
    let cpu = cpu_seconds() - cpu0;
    let rates: Vec<f64> = t.iter().map(|&s| gbps(bytes as f64, s)).collect();
    let ms = Stats::new(t).map_or(0.0, |s| s.median * 1e3);
    let gbps = Stats::new(rates).ok_or_else(|| super::invalid("bench::staging", "no samples"))?;
    let moved = bytes as f64 * samples as f64 / 1e9;
    Ok(Measure {
        what: what.into(),
        bytes,
        gbps,
        ms,
        cpu_s_per_gb: if moved > 0.0 { cpu / moved } else { 0.0 },
        note: note.into(),
    })
}

/// `threads=N slot=2M slots=M first=256K nt<=256M`, for notes.
pub fn describe(stager: &Stager) -> String {
    let c = stager.config();
    format!(
        "threads={} slot={} slots={} first={} nt<={}",
        c.threads,
        super::size_name(c.slot_bytes),
        c.slots,
        super::size_name(c.first_piece_bytes),
        super::size_name(c.streaming_max_bytes),
    )
}

/// Checks that `got` holds `want` (after a measured copy).
fn verify(what: &str, got: &[u8], want: &[u8]) -> Result<()> {
    if got != want {
        return Err(super::invalid(
            "bench::staging",
            format!("{what}: the copied data differ from the source"),
        ));
    }
    Ok(())
}

/// Host-to-device and device-to-host at `bytes`: pageable (plain), pinned, and staged, all in
/// one call. The data is checked after each way.
pub fn compare(
    stager: &Stager,
    stream: &Stream,
    bytes: usize,
    samples: usize,
) -> Result<Vec<Measure>> {
    let device = stager.device();
    let src = super::pattern(bytes)?;
    let mut d = DeviceBuffer::<u8>::new(&device, bytes)?;
    let mut back = super::pattern(bytes)?;
    back.iter_mut().for_each(|b| *b = b.wrapping_add(1));
    let pinned = PinnedBuffer::from_slice(&device, &src, HostAlloc::DEFAULT)?;
    let mut pinned_back = PinnedBuffer::<u8>::new(&device, bytes, HostAlloc::DEFAULT)?;
    let note = describe(stager);
    let mut out = Vec::new();

    out.push(measure(
        "pageable h2d",
        bytes,
        samples,
        "cudaMemcpyAsync",
        || {
            stream.copy_h2d(&src[..], &mut d)?;
            stream.synchronize()
        },
    )?);
    out.push(measure(
        "pinned h2d",
        bytes,
        samples,
        "cudaMemcpyAsync",
        || {
            stream.copy_h2d(&pinned, &mut d)?;
            stream.synchronize()
        },
    )?);
    out.push(measure("staged h2d", bytes, samples, note.clone(), || {
        stager.upload(stream, &src, &mut d)?;
        stream.synchronize()
    })?);
    stream.copy_d2h(&d, &mut back[..])?.wait()?;
    verify("staged h2d", &back, &src)?;

    // The same source in transparent huge pages (MADV_HUGEPAGE), for both ways.
    let mut thp = super::thp::HugePageBuf::new(bytes, stager.config().threads)?;
    thp.as_mut_slice()[..bytes].copy_from_slice(&src);
    let thp_src = &thp.as_slice()[..bytes];
    out.push(measure(
        "pageable h2d, THP source",
        bytes,
        samples,
        "MADV_HUGEPAGE",
        || {
            stream.copy_h2d(thp_src, &mut d)?;
            stream.synchronize()
        },
    )?);
    out.push(measure(
        "staged h2d, THP source",
        bytes,
        samples,
        format!("MADV_HUGEPAGE; {}", describe(stager)),
        || {
            stager.upload(stream, thp_src, &mut d)?;
            stream.synchronize()
        },
    )?);
    stream.copy_d2h(&d, &mut back[..])?.wait()?;
    verify("staged h2d, THP source", &back, &src)?;
    drop(thp);

    out.push(measure(
        "pageable d2h",
        bytes,
        samples,
        "cudaMemcpyAsync",
        || stream.copy_d2h(&d, &mut back[..])?.wait().map(drop),
    )?);
    out.push(measure(
        "pinned d2h",
        bytes,
        samples,
        "cudaMemcpyAsync",
        || stream.copy_d2h(&d, &mut pinned_back)?.wait().map(drop),
    )?);
    back.iter_mut().for_each(|b| *b = b.wrapping_add(1));
    out.push(measure("staged d2h", bytes, samples, note, || {
        stager.download(stream, &d, &mut back)
    })?);
    verify("staged d2h", &back, &src)?;
    Ok(out)
}

/// `count` tensors of `elems` f32 each, to the device: a loop of plain copies (what PyTorch
/// does per tensor), one `upload_all` into separate buffers, and one `upload_packed` arena.
pub fn many(
    stager: &Stager,
    stream: &Stream,
    count: usize,
    elems: usize,
    samples: usize,
) -> Result<Vec<Measure>> {
    let device = stager.device();
    let bytes = count
        .checked_mul(elems)
        .and_then(|n| n.checked_mul(4))
        .ok_or_else(|| super::invalid("bench::staging::many", "size overflows"))?;
    let srcs: Vec<Vec<f32>> = (0..count)
        .map(|i| (0..elems).map(|j| (i * elems + j) as f32 + 0.5).collect())
        .collect();
    let mut dsts: Vec<DeviceBuffer<f32>> = (0..count)
        .map(|_| DeviceBuffer::new(&device, elems))
        .collect::<Result<_>>()?;
    let note = format!("{count} x {elems} f32, batch copies; {}", describe(stager));
    let mut out = Vec::new();
    out.push(measure(
        "many: loop of copies",
        bytes,
        samples,
        "one copy_h2d per tensor",
        || {
            for (s, d) in srcs.iter().zip(dsts.iter_mut()) {
                stream.copy_h2d(&s[..], d)?;
            }
            stream.synchronize()
        },
    )?);
    out.push(measure(
        "many: upload_all",
        bytes,
        samples,
        note.clone(),
        || {
            let mut list = Uploads::new();
            for (s, d) in srcs.iter().zip(dsts.iter_mut()) {
                list.push(s, d)?;
            }
            stager.upload_all(stream, list)?;
            stream.synchronize()
        },
    )?);
    let plain = Stager::new(
        &device,
        pinstream::staging::StagerConfig {
            batch_copies: false,
            ..stager.config().clone()
        },
    )?;
    out.push(measure(
        "many: upload_all, no batch",
        bytes,
        samples,
        format!("one cudaMemcpyAsync per tensor; {}", describe(&plain)),
        || {
            let mut list = Uploads::new();
            for (s, d) in srcs.iter().zip(dsts.iter_mut()) {
                list.push(s, d)?;
            }
            plain.upload_all(stream, list)?;
            stream.synchronize()
        },
    )?);
    drop(plain);
    let mut raw: Vec<DeviceBuffer<u8>> = (0..count)
        .map(|_| DeviceBuffer::new(&device, elems * 4))
        .collect::<Result<_>>()?;
    let byte_srcs: Vec<&[u8]> = srcs.iter().map(|s| bytemuck::cast_slice(s)).collect();
    out.push(measure(
        "many: cudaMemcpyBatchAsync",
        bytes,
        samples,
        "one batch straight from the pageable tensors (source read during the call)",
        || pinstream::timing::batch_h2d_pageable(stream, &byte_srcs, &mut raw),
    )?);
    for i in [0, count / 2, count - 1] {
        let mut back = vec![0u8; elems * 4];
        stream.copy_d2h(&raw[i], &mut back[..])?.wait()?;
        verify("cudaMemcpyBatchAsync", &back, byte_srcs[i])?;
    }
    let mut last = None;
    out.push(measure(
        "many: upload_packed",
        bytes,
        samples,
        note,
        || {
            let mut packer = Packer::new();
            let handles = srcs
                .iter()
                .map(|s| packer.push(s))
                .collect::<Result<Vec<_>>>()?;
            let batch = stager.upload_packed(stream, &packer)?;
            stream.synchronize()?;
            last = Some((batch, handles));
            Ok(())
        },
    )?);
    // Check a few tensors of the last packed batch and of the separate buffers.
    if let Some((batch, handles)) = &last {
        for i in [0, count / 2, count - 1] {
            let mut back = vec![0f32; elems];
            stream
                .copy_d2h(&batch.get(handles[i])?, &mut back[..])?
                .wait()?;
            verify(
                "packed",
                bytemuck::cast_slice(&back),
                bytemuck::cast_slice(&srcs[i]),
            )?;
            stream.copy_d2h(&dsts[i], &mut back[..])?.wait()?;
            verify(
                "upload_all",
                bytemuck::cast_slice(&back),
                bytemuck::cast_slice(&srcs[i]),
            )?;
        }
    }
    Ok(out)
}

/// A file range to the device: read into pageable memory then a plain copy (the usual way),
/// and `upload_file` (page cache warm: the file is read once first). With `direct`, also
/// `upload_file` through `O_DIRECT` where the filesystem allows it.
pub fn file(
    stager: &Stager,
    stream: &Stream,
    path: &std::path::Path,
    bytes: usize,
    samples: usize,
    direct: bool,
) -> Result<Vec<Measure>> {
    use std::io::Read;
    let device = stager.device();
    let source = FileSource::open(path)?;
    let bytes = bytes.min(usize::try_from(source.len()).unwrap_or(usize::MAX));
    let mut d = DeviceBuffer::<u8>::new(&device, bytes)?;
    let mut host = super::pattern(bytes)?;
    let io = |e: std::io::Error| Error::Io {
        op: "bench::staging::file",
        path: path.display().to_string(),
        offset: 0,
        len: bytes,
        message: e.to_string(),
    };
    let mut out = Vec::new();
    out.push(measure(
        "file: read + copy",
        bytes,
        samples,
        "read() then cudaMemcpyAsync",
        || {
            let mut f = std::fs::File::open(path).map_err(io)?;
            f.read_exact(&mut host).map_err(io)?;
            stream.copy_h2d(&host[..], &mut d)?;
            stream.synchronize()
        },
    )?);
    out.push(measure(
        "file: upload_file",
        bytes,
        samples,
        describe(stager),
        || {
            stager.upload_file(stream, &source, 0, &mut d)?;
            stream.synchronize()
        },
    )?);
    let mut back = vec![0u8; bytes];
    stream.copy_d2h(&d, &mut back[..])?.wait()?;
    verify("upload_file", &back, &host)?;
    if direct {
        match FileSource::open_direct(path) {
            Ok(src) => out.push(measure(
                "file: upload_file O_DIRECT",
                bytes,
                samples,
                describe(stager),
                || {
                    stager.upload_file(stream, &src, 0, &mut d)?;
                    stream.synchronize()
                },
            )?),
            Err(e) => eprintln!("pinstream: O_DIRECT skipped: {e}"),
        }
    }
    Ok(out)
}
