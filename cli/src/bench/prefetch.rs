//! `pinstream prefetch`: a training loop's time per batch with a calibrated busy kernel as the
//! step, three ways, from the same synthetic pageable batches:
//! - `serial`: load, plain pageable copy, fused normalize, compute, one after another;
//! - `apex`: APEX's `data_prefetcher` — one batch ahead on a side stream, a pageable copy that
//!   blocks the host, and three passes for the normalize (`float()`, `sub_`, `div_`: a cast,
//!   then two passes of the same 8 bytes per element as the in-place `sub_` and `div_`);
//! - `pinstream`: the [`Prefetcher`] (loader threads, upload, fused normalize, depth K), its
//!   loaders writing pageable memory, page-locked memory, or naming ranges of a file
//!   ([`PixelSource`]).
//!
//! Next to them, the parts measured alone (host clock, median of 7): the staged, pinned and
//! pageable upload of one batch, the fused normalize, and the ideal time per batch
//! `max(compute, upload + normalize)`, the upload being the pinned copy for page-locked pixels
//! and the staged one otherwise.

use std::fmt;
use std::io::Write;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use super::{median_ms, secs};
use pinstream::kernels::{self, Layout, Normalize, Spec};
use pinstream::memory::{DeviceBuffer, HostAlloc, PinnedBuffer};
use pinstream::prefetch::{HostBatch, LoaderStats, PrefetchConfig, Prefetcher, Source};
use pinstream::staging::{FileSource, Stager, StagerConfig};
use pinstream::Device;
use pinstream::Stream;
use pinstream::{Error, Result};

/// Where the prefetcher's loaders put a batch's pixels (see
/// [`Pixels`](pinstream::prefetch::Pixels)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum PixelSource {
    /// Written into a `Vec<u8>`, uploaded through the staging engine.
    #[default]
    Pageable,
    /// Written into page-locked memory (`HostBatch::pinned`), one DMA each.
    Pinned,
    /// Ranges of a file written before the run, read by the staging engine with `pread`.
    File,
    /// Ranges of one portable pinned buffer written before the run (a dataset held in pinned
    /// memory, shared by every device), one DMA each and nothing written per batch.
    Resident,
}

impl PixelSource {
    /// Every source, in order.
    pub const ALL: [PixelSource; 4] = [
        PixelSource::Pageable,
        PixelSource::Pinned,
        PixelSource::File,
        PixelSource::Resident,
    ];

    /// `pageable`, `pinned`, `file` or `resident`.
    pub fn name(self) -> &'static str {
        match self {
            PixelSource::Pageable => "pageable",
            PixelSource::Pinned => "pinned",
            PixelSource::File => "file",
            PixelSource::Resident => "resident",
        }
    }
}

impl fmt::Display for PixelSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for PixelSource {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        PixelSource::ALL
            .into_iter()
            .find(|p| p.name().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| format!("unknown pixel source {s:?} (pageable, pinned, file, resident)"))
    }
}

/// What to run.
#[derive(Clone, Debug)]
pub struct Setup {
    /// Samples per batch.
    pub batch: usize,
    /// Channels, height, width of a sample.
    pub chw: (usize, usize, usize),
    /// Input layout (the output is NCHW f32).
    pub layout: Layout,
    /// GPU time of the training step.
    pub compute: Duration,
    /// Measured batches (after `warmup`).
    pub batches: usize,
    /// Batches run before the clock starts.
    pub warmup: usize,
    /// Prefetcher depth (device slots).
    pub depth: usize,
    /// Loader threads of the prefetcher, and the loader workers of `apex`.
    pub threads: usize,
    /// `PrefetchConfig::ahead` (0: the default, adaptive).
    pub ahead: usize,
    /// Where the prefetcher's loaders put the pixels (`serial` and `apex` always use pageable
    /// memory).
    pub source: PixelSource,
    /// `PrefetchConfig::numa_local` for the prefetcher.
    pub numa_local: bool,
}

impl Setup {
    /// The batch's spec.
    pub fn spec(&self) -> Result<Spec> {
        let (c, h, w) = self.chw;
        Ok(Spec::uniform(self.batch, c, h, w, Normalize::imagenet())?
            .layouts(self.layout, Layout::Nchw))
    }

    /// Bytes of one batch's pixels.
    pub fn bytes(&self) -> usize {
        let (c, h, w) = self.chw;
        self.batch * c * h * w
    }
}

/// Synthetic pixels of batch `i` in `out` (resized to `len`); see [`synth_into`].
pub fn synth(i: u64, out: &mut Vec<u8>, len: usize) {
    out.resize(len, 0);
    synth_into(i, out);
}

/// Synthetic pixels of batch `i`: every byte of `out` written (as a decoder would), varying
/// with `i`, never all zero.
pub fn synth_into(i: u64, out: &mut [u8]) {
    out.fill((i % 251) as u8 + 1);
    for (k, b) in out.iter_mut().step_by(4096).enumerate() {
        *b = (k as u64).wrapping_add(i) as u8;
    }
}

/// The parts of one batch, each measured alone (ms).
#[derive(Clone, Debug, PartialEq)]
pub struct Parts {
    /// The training step as measured (the busy kernel alone).
    pub compute_ms: f64,
    /// Upload of one batch through a `Stager` (host side and DMA).
    pub staged_ms: f64,
    /// A plain copy of one batch from pinned memory (the link's time).
    pub pinned_ms: f64,
    /// A plain copy of one batch from pageable memory.
    pub pageable_ms: f64,
    /// The fused normalize of one batch to f32.
    pub normalize_ms: f64,
    /// Writing one synthetic batch on one thread.
    pub synth_ms: f64,
}

impl Parts {
    /// `max(compute, upload + normalize)` for pixels from `source`: the upload is the plain
    /// copy from pinned memory for page-locked pixels (one DMA, no staging), and the staged
    /// upload otherwise (a file range read from the page cache costs about what the staging
    /// copy from memory does).
    pub fn ideal_ms(&self, source: PixelSource) -> f64 {
        self.compute_ms
            .max(self.upload_ms(source) + self.normalize_ms)
    }

    /// The issue's formula, `max(host + transfer + normalize, compute)`, with `host` the
    /// loaders' time per batch (writing one batch alone, divided among `loaders` threads; 0 for
    /// file ranges and resident pixels, which no loader writes) and `transfer` the upload of
    /// [`ideal_ms`](Self::ideal_ms). At least `ideal_ms`: it charges the loaders, which that
    /// one assumes free.
    pub fn issue_ideal_ms(&self, source: PixelSource, loaders: usize) -> f64 {
        let host = match source {
            PixelSource::Pageable | PixelSource::Pinned => self.synth_ms / loaders.max(1) as f64,
            PixelSource::File | PixelSource::Resident => 0.0,
        };
        self.compute_ms
            .max(host + self.upload_ms(source) + self.normalize_ms)
    }

    /// One batch's upload from `source`.
    fn upload_ms(&self, source: PixelSource) -> f64 {
        match source {
            PixelSource::Pinned | PixelSource::Resident => self.pinned_ms,
            PixelSource::Pageable | PixelSource::File => self.staged_ms,
        }
    }
}

/// Measures the parts on `device`.
pub fn parts(device: &Device, s: &Setup) -> Result<Parts> {
    let stream = device.stream()?;
    let spec = s.spec()?;
    let n = s.bytes();
    let mut host = Vec::new();
    synth(1, &mut host, n);
    let mut d_in = DeviceBuffer::<u8>::new(device, n)?;
    let mut d_out = DeviceBuffer::<f32>::new(device, spec.output_len()?)?;
    let stager = Stager::new(device, StagerConfig::from_env()?)?;
    let staged_ms = median_ms(|| {
        stager.upload(&stream, &host, &mut d_in)?;
        stream.synchronize()
    })?;
    let mut pinned = PinnedBuffer::<u8>::new(device, n, HostAlloc::DEFAULT)?;
    pinned.as_mut_slice()?.copy_from_slice(&host);
    let pinned_ms = median_ms(|| stream.copy_h2d(&pinned, &mut d_in)?.wait())?;
    let pageable_ms = median_ms(|| stream.copy_h2d(&host[..], &mut d_in)?.wait())?;
    let normalize_ms = median_ms(|| {
        kernels::normalize::<f32, _, _>(&stream, &d_in, &spec, &mut d_out, None)?;
        stream.synchronize()
    })?;
    let compute_ms = median_ms(|| {
        stream.spin(s.compute)?;
        stream.synchronize()
    })?;
    let mut i = 0;
    let synth_ms = median_ms(|| {
        i += 1;
        synth(i, &mut host, n);
        Ok(())
    })?;
    Ok(Parts {
        compute_ms,
        staged_ms,
        pinned_ms,
        pageable_ms,
        normalize_ms,
        synth_ms,
    })
}

/// Milliseconds per batch over `s.batches` after `s.warmup`: `step(i)` runs batch `i`, and the
/// stream is synchronised before the clock stops.
fn timed(s: &Setup, stream: &Stream, mut step: impl FnMut(u64) -> Result<()>) -> Result<f64> {
    let mut i = 0u64;
    for _ in 0..s.warmup {
        step(i)?;
        i += 1;
    }
    stream.synchronize()?;
    let start = Instant::now();
    for _ in 0..s.batches {
        step(i)?;
        i += 1;
    }
    stream.synchronize()?;
    Ok(secs(start.elapsed()) * 1e3 / s.batches.max(1) as f64)
}

/// No prefetch: load, pageable copy, fused normalize, compute, in turn.
pub fn serial(device: &Device, s: &Setup) -> Result<f64> {
    let stream = device.stream()?;
    let spec = s.spec()?;
    let n = s.bytes();
    let mut host = Vec::new();
    let mut d_in = DeviceBuffer::<u8>::new(device, n)?;
    let mut d_out = DeviceBuffer::<f32>::new(device, spec.output_len()?)?;
    timed(s, &stream, |i| {
        synth(i, &mut host, n);
        stream.copy_h2d(&host[..], &mut d_in)?.wait()?;
        kernels::normalize::<f32, _, _>(&stream, &d_in, &spec, &mut d_out, None)?;
        stream.spin(s.compute)
    })
}

/// APEX's `data_prefetcher` over a loader with `s.threads` workers: one batch ahead.
pub fn apex(device: &Device, s: &Setup) -> Result<f64> {
    let stream = device.stream()?;
    let side = device.stream()?;
    let spec = s.spec()?;
    let cast = Spec {
        norm: Normalize::new(&[0.0; 4][..s.chw.0], &[1.0; 4][..s.chw.0]),
        ..spec.clone()
    };
    let n = s.bytes();
    let out_len = spec.output_len()?;
    // Loader workers: batches in order through a bounded channel (DataLoader's prefetch).
    let total = (s.warmup + s.batches + 1) as u64;
    let threads = s.threads.max(1) as u64;
    let (tx, rx) = mpsc::sync_channel::<(u64, Vec<u8>)>(2 * threads as usize);
    let (back_tx, back_rx) = mpsc::channel::<Vec<u8>>();
    let back_rx = std::sync::Arc::new(std::sync::Mutex::new(back_rx));
    let mut workers = Vec::new();
    for t in 0..threads {
        let (tx, back) = (tx.clone(), back_rx.clone());
        workers.push(std::thread::spawn(move || {
            let mut i = t;
            while i < total {
                let mut v = back
                    .lock()
                    .ok()
                    .and_then(|r| r.try_recv().ok())
                    .unwrap_or_default();
                synth(i, &mut v, n);
                if tx.send((i, v)).is_err() {
                    return;
                }
                i += threads;
            }
        }));
    }
    drop(tx);
    let mut pending = std::collections::BTreeMap::new();
    let mut next_batch = |want: u64| -> Option<Vec<u8>> {
        loop {
            if let Some(v) = pending.remove(&want) {
                return Some(v);
            }
            let (i, v) = rx.recv().ok()?;
            pending.insert(i, v);
        }
    };
    // Two sets of device buffers: the one the step reads and the one being filled.
    let mut d_in = [
        DeviceBuffer::<u8>::new(device, n)?,
        DeviceBuffer::<u8>::new(device, n)?,
    ];
    let mut d_out = [
        DeviceBuffer::<f32>::new(device, out_len)?,
        DeviceBuffer::<f32>::new(device, out_len)?,
    ];
    let mut scratch = DeviceBuffer::<f32>::new(device, out_len)?;
    let ready = [
        pinstream::Event::new(device)?,
        pinstream::Event::new(device)?,
    ];
    let used = [
        pinstream::Event::new(device)?,
        pinstream::Event::new(device)?,
    ];
    let mut preload = |i: u64| -> Result<()> {
        let k = (i % 2) as usize;
        let Some(host) = next_batch(i) else {
            return Ok(());
        };
        side.wait(&used[k])?;
        side.copy_h2d(&host[..], &mut d_in[k])?.wait()?;
        let _ = back_tx.send(host);
        kernels::normalize::<f32, _, _>(&side, &d_in[k], &cast, &mut d_out[k], None)?;
        side.copy_d2d(&d_out[k], &mut scratch)?; // sub_
        side.copy_d2d(&scratch, &mut d_out[k])?; // div_
        side.record(&ready[k])
    };
    preload(0)?;
    let result = timed(s, &stream, |i| {
        let k = (i % 2) as usize;
        stream.wait(&ready[k])?;
        preload(i + 1)?;
        stream.spin(s.compute)?;
        stream.record(&used[k])
    });
    drop(rx);
    for w in workers {
        let _ = w.join();
    }
    side.synchronize()?;
    result
}

/// A file of synthetic batches in the temporary directory, removed when this drops (also when
/// the run fails).
#[derive(Debug)]
pub struct TempBatches {
    path: PathBuf,
    /// Batches in the file.
    pub count: u64,
    /// Bytes per batch.
    pub bytes: usize,
}

/// At most this many distinct batches go into the file of a `File` run.
const FILE_BATCHES: u64 = 8;
/// And at most this many bytes (but always at least one batch).
const FILE_BYTES: u64 = 2 << 30;

/// How many distinct batches of `n` bytes a `File` or `Resident` run holds.
fn distinct_batches(n: usize) -> u64 {
    (FILE_BYTES / (n.max(1) as u64)).clamp(1, FILE_BATCHES)
}

impl TempBatches {
    /// Writes `count` batches of `bytes` (`synth_into(k)` for batch `k`) into a new file.
    pub fn write(count: u64, bytes: usize) -> Result<TempBatches> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let path = std::env::temp_dir().join(format!(
            "pinstream-prefetch-{}-{}.bin",
            std::process::id(),
            NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        let io = |e: std::io::Error| Error::Io {
            op: "bench::prefetch",
            path: path.display().to_string(),
            offset: 0,
            len: bytes,
            message: e.to_string(),
        };
        let mut file = std::fs::File::create_new(&path).map_err(io)?;
        // From here on the file is removed on every way out.
        let me = TempBatches {
            path: path.clone(),
            count,
            bytes,
        };
        let mut buf = vec![0u8; bytes];
        for k in 0..count {
            synth_into(k, &mut buf);
            file.write_all(&buf).map_err(io)?;
        }
        file.flush().map_err(io)?;
        Ok(me)
    }

    /// Where it is.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }
}

impl Drop for TempBatches {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// The prefetcher on each of `devices` (one shard and one consumer thread per device); time per
/// batch of all devices together. With `PixelSource::File` the batches are ranges of a file of
/// at most 8 distinct batches (2 GiB at most) written to the temporary directory first and
/// removed afterwards; with `PixelSource::Resident` ranges of one portable pinned buffer of as
/// many batches, filled first.
pub fn pinstream(devices: &[Device], s: &Setup) -> Result<(f64, Vec<LoaderStats>)> {
    let spec = s.spec()?;
    let n = s.bytes();
    let per = (s.warmup + s.batches) as u64;
    let total = per * devices.len() as u64;
    let file = match s.source {
        PixelSource::File => {
            let count = distinct_batches(n);
            let batches = TempBatches::write(count, n)?;
            let source = Arc::new(FileSource::open(batches.path())?);
            Some((batches, source))
        }
        PixelSource::Pageable | PixelSource::Pinned | PixelSource::Resident => None,
    };
    let ranges = file.as_ref().map(|(b, f)| (b.count, f.clone()));
    let resident = match (s.source, devices.first()) {
        (PixelSource::Resident, Some(d)) => {
            let count = distinct_batches(n);
            let len = usize::try_from(count)
                .ok()
                .and_then(|c| c.checked_mul(n))
                .ok_or_else(|| super::invalid("bench::prefetch", "resident batches overflow"))?;
            let mut buf = PinnedBuffer::<u8>::new(d, len, HostAlloc::PORTABLE)?;
            let host = buf.as_mut_slice()?;
            for (k, chunk) in host.chunks_mut(n.max(1)).enumerate() {
                synth_into(k as u64, chunk);
            }
            Some((count, Arc::new(buf)))
        }
        _ => None,
    };
    let kind = s.source;
    let source = Source::new(move |i, b: &mut HostBatch<i64>| {
        if i >= total {
            return Ok(false);
        }
        b.spec.clone_from(&spec);
        match (kind, &ranges, &resident) {
            (PixelSource::Pinned, ..) => synth_into(i, b.pinned(n)?),
            (PixelSource::Resident, _, Some((count, buf))) => {
                b.set_resident(buf.clone(), (i % count) as usize * n, n)
            }
            (PixelSource::File, Some((count, f)), _) => {
                b.set_file(f.clone(), (i % count) * n as u64, n)
            }
            _ => synth(i, b.pageable(), n),
        }
        b.extras.clear();
        Ok(true)
    });
    let streams = devices
        .iter()
        .map(|d| d.stream())
        .collect::<Result<Vec<_>>>()?;
    let config = PrefetchConfig {
        depth: s.depth,
        loader_threads: s.threads,
        ahead: s.ahead,
        stager: StagerConfig::from_env()?,
        numa_local: s.numa_local,
        ..PrefetchConfig::default()
    };
    let prefetchers = Prefetcher::<f32, i64>::sharded(&streams, source, config)?;
    let barrier = std::sync::Barrier::new(devices.len());
    let (warmup, compute) = (s.warmup, s.compute);
    let times = std::thread::scope(|scope| {
        let handles: Vec<_> = prefetchers
            .into_iter()
            .map(|mut p| {
                let barrier = &barrier;
                scope.spawn(move || -> Result<(Instant, Instant, u64, LoaderStats)> {
                    let stream = p.stream().clone();
                    let mut done = 0u64;
                    let mut start = Instant::now();
                    loop {
                        if done == warmup as u64 {
                            stream.synchronize()?;
                            barrier.wait();
                            start = Instant::now();
                        }
                        let Some(b) = p.next() else { break };
                        let b = b?;
                        stream.spin(compute)?;
                        drop(b);
                        done += 1;
                    }
                    stream.synchronize()?;
                    let end = Instant::now();
                    Ok((
                        start,
                        end,
                        done.saturating_sub(warmup as u64),
                        p.loader_stats(),
                    ))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(pinstream::Error::Panicked {
                        op: "bench::prefetch",
                        message: "a consumer thread panicked".into(),
                    })
                })
            })
            .collect::<Result<Vec<_>>>()
    })?;
    // The file goes only now, when no loader can read it any more.
    drop(file);
    let start = times.iter().map(|t| t.0).min();
    let end = times.iter().map(|t| t.1).max();
    let batches: u64 = times.iter().map(|t| t.2).sum();
    let stats = times.iter().map(|t| t.3).collect();
    match (start, end) {
        (Some(a), Some(b)) if batches > 0 => Ok((secs(b - a) * 1e3 / batches as f64, stats)),
        _ => Ok((f64::NAN, stats)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pixel_source_names() {
        for p in PixelSource::ALL {
            assert_eq!(p.to_string().parse::<PixelSource>(), Ok(p));
        }
        assert_eq!(" Pinned ".parse::<PixelSource>(), Ok(PixelSource::Pinned));
        assert!("mmap".parse::<PixelSource>().is_err());
        assert_eq!(PixelSource::default(), PixelSource::Pageable);
    }

    #[test]
    fn synth_writes_every_byte() {
        let mut a = vec![0u8; 10_000];
        synth_into(3, &mut a);
        assert!(a.iter().all(|&b| b != 0));
        let mut v = Vec::new();
        synth(3, &mut v, 10_000);
        assert_eq!(v, a);
        synth_into(4, &mut a);
        assert_ne!(v, a);
    }

    #[test]
    fn temp_batches_hold_the_batches_and_go_away() {
        let t = TempBatches::write(3, 5000).unwrap();
        let path = t.path().to_path_buf();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(bytes.len(), 3 * 5000);
        for (k, chunk) in bytes.chunks(5000).enumerate() {
            let mut want = vec![0u8; 5000];
            synth_into(k as u64, &mut want);
            assert_eq!(chunk, &want[..], "batch {k}");
        }
        drop(t);
        assert!(!path.exists());
    }
}
