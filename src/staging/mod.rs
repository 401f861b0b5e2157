//! Transfers from ordinary (pageable) memory and files at link speed: the [`Stager`].
//!
//! A plain `cudaMemcpyAsync` from pageable memory goes through the driver's single staging
//! thread, which one CPU core's memcpy caps (6–8 GB/s on a 55 GB/s link). A `Stager` owns a ring
//! of pinned slots and a few worker threads: the workers copy pieces of the source into free
//! slots while the copy engine moves earlier slots to the device, each slot guarded by an event.
//! Downloads run the other way round. Files are read with `pread` straight into the slots.
//!
//! ```no_run
//! use pinstream::{Device, DeviceBuffer, Stager, StagerConfig};
//! # fn main() -> pinstream::Result<()> {
//! let dev = Device::get(0)?;
//! let stream = dev.stream()?;
//! let stager = Stager::new(&dev, StagerConfig::default())?;   // once; reuse it
//! let host: Vec<f32> = vec![1.5; 64 << 20];
//! let mut d = DeviceBuffer::<f32>::new(&dev, host.len())?;
//! stager.upload(&stream, &host, &mut d)?;    // `host` is free again when this returns
//! let mut back = vec![0f32; host.len()];
//! stager.download(&stream, &d, &mut back)?; // the data is there when this returns
//! assert_eq!(back, host);
//! # Ok(()) }
//! ```
//!
//! Every call finishes its host side before it returns: no worker reads or writes the
//! caller's memory afterwards, so nothing depends on a guard's `Drop` (which `mem::forget`
//! could skip). The device side of an upload stays asynchronous — it reads the engine's own
//! slots — and is ordered on the caller's stream and tracked like every other copy.

mod engine;
mod file;
mod nt;
mod packed;
pub(crate) mod plan;

#[cfg(feature = "safetensors")]
pub(crate) use file::open_without_blocking;
pub use file::FileSource;
pub use nt::copy_streaming;
pub use packed::{ArenaBatch, Packed, PackedArena, PackedBatch, Packer};

use std::marker::PhantomData;

use bytemuck::Pod;

use crate::device::Device;
use crate::error::{byte_len, Error, Result};
use crate::memory::sealed::DeviceRegion;
use crate::memory::tracker::{self, Access, Tracker};
use crate::memory::{DeviceSlice, DeviceSliceMut, PinnedPool, PoolConfig};
use crate::stream::Stream;
use engine::{Direction, Engine, Host, Job};
use plan::Transfer;

/// How a [`Stager`] is built. `Default` gives the values measured best on an H100 host
/// (BENCHMARKS.md says how); [`StagerConfig::from_env`] reads overrides from the environment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StagerConfig {
    /// Host threads that copy, counting the caller of each call (so `threads - 1` workers are
    /// started). At least 1.
    pub threads: usize,
    /// Bytes per pinned slot: the largest piece one thread copies at a time. A multiple of
    /// 64 KiB, at least 64 KiB.
    pub slot_bytes: usize,
    /// Pinned slots in the ring. At least 1; more than `threads` lets DMAs queue up behind
    /// the host copies.
    pub slots: usize,
    /// Copies smaller than this skip the engine and go through [`Stream::copy_h2d`] /
    /// [`Stream::copy_d2h`].
    pub min_bytes: usize,
    /// Move the many small runs of one slot (lists of small tensors) with one
    /// `cudaMemcpyBatchAsync` instead of one `cudaMemcpyAsync` each.
    pub batch_copies: bool,
    /// A call gets one thread per this many bytes (up to `threads`): more threads on a
    /// mid-sized copy only contend. At least 64 KiB.
    pub bytes_per_thread: usize,
    /// Pieces each of those threads takes in a mid-sized call (pieces never exceed a slot).
    /// At least 1.
    pub pieces_per_thread: usize,
    /// The first piece of a call holds at most this many bytes and each next one twice the
    /// previous, up to the piece size: the first DMA starts after a small fill. A value at or
    /// above `slot_bytes` turns the ramp off. At least 64 KiB.
    pub first_piece_bytes: usize,
    /// Uploads up to this many bytes fill the slots with streaming stores, which skip reading
    /// the slot's cache lines first (a third less host memory traffic): 4 MiB uploads twice as
    /// fast on the H100 host, 64 MiB 15 % faster, but 1 GiB 9 % slower, and downloads slower
    /// (BENCHMARKS.md). 0 turns them off.
    pub streaming_max_bytes: usize,
}

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
/// Slot sizes are multiples of this.
const MIN_PIECE: usize = 64 * KIB;
/// Mid-sized copies are cut into pieces smaller than a slot to spread them over the threads,
/// but not below this: every piece costs two or three runtime calls, which the runtime
/// serialises across threads.
const MIN_SPLIT: usize = 256 * KIB;

impl Default for StagerConfig {
    fn default() -> Self {
        // Three quarters of the cores, at most 12: on the 16-core H100 host 12 threads gave the
        // best downloads and file reads, 8 the same uploads for less CPU (BENCHMARKS.md).
        let cores = std::thread::available_parallelism().map_or(4, |n| n.get());
        let threads = (cores * 3 / 4).clamp(1, 12);
        StagerConfig {
            threads,
            slot_bytes: 2 * MIB,
            slots: 2 * threads,
            min_bytes: 4 * MIB,
            batch_copies: true,
            bytes_per_thread: 512 * KIB,
            pieces_per_thread: 1,
            first_piece_bytes: 256 * KIB,
            streaming_max_bytes: 256 * MIB,
        }
    }
}

impl StagerConfig {
    /// The defaults, with each field overridden by its environment variable where set:
    /// `PINSTREAM_STAGING_THREADS`, `PINSTREAM_STAGING_SLOT_BYTES`, `PINSTREAM_STAGING_SLOTS`,
    /// `PINSTREAM_STAGING_MIN_BYTES`, `PINSTREAM_STAGING_BYTES_PER_THREAD`,
    /// `PINSTREAM_STAGING_PIECES_PER_THREAD`, `PINSTREAM_STAGING_FIRST_PIECE`,
    /// `PINSTREAM_STAGING_STREAMING_MAX` (sizes accept `K`/`M`/`G` suffixes, powers of 1024),
    /// and `PINSTREAM_STAGING_BATCH=0` to turn `batch_copies` off.
    pub fn from_env() -> Result<StagerConfig> {
        let mut c = StagerConfig::default();
        let read = |name: &'static str, field: &mut usize| -> Result<()> {
            if let Ok(v) = std::env::var(name) {
                *field = parse_size(&v).ok_or_else(|| {
                    Error::invalid(
                        "StagerConfig::from_env",
                        format!("{name}={v:?} is not a size"),
                    )
                })?;
            }
            Ok(())
        };
        read("PINSTREAM_STAGING_THREADS", &mut c.threads)?;
        read("PINSTREAM_STAGING_SLOT_BYTES", &mut c.slot_bytes)?;
        read("PINSTREAM_STAGING_SLOTS", &mut c.slots)?;
        read("PINSTREAM_STAGING_MIN_BYTES", &mut c.min_bytes)?;
        read(
            "PINSTREAM_STAGING_BYTES_PER_THREAD",
            &mut c.bytes_per_thread,
        )?;
        read(
            "PINSTREAM_STAGING_PIECES_PER_THREAD",
            &mut c.pieces_per_thread,
        )?;
        read("PINSTREAM_STAGING_FIRST_PIECE", &mut c.first_piece_bytes)?;
        read(
            "PINSTREAM_STAGING_STREAMING_MAX",
            &mut c.streaming_max_bytes,
        )?;
        if let Ok(v) = std::env::var("PINSTREAM_STAGING_BATCH") {
            c.batch_copies = !matches!(v.trim(), "0" | "false" | "no" | "off");
        }
        c.validate()?;
        Ok(c)
    }

    /// Checks every field; a bad value is an `Error::InvalidArgument` that names it.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| Err(Error::invalid("StagerConfig", reason));
        if self.threads == 0 || self.threads > 256 {
            return bad(format!("threads = {} is not in 1..=256", self.threads));
        }
        if self.slot_bytes < MIN_PIECE || self.slot_bytes % MIN_PIECE != 0 {
            return bad(format!(
                "slot_bytes = {} is not a multiple of 64 KiB (at least 64 KiB)",
                self.slot_bytes
            ));
        }
        if self.bytes_per_thread < MIN_PIECE {
            return bad(format!(
                "bytes_per_thread = {} is below 64 KiB",
                self.bytes_per_thread
            ));
        }
        if self.first_piece_bytes < MIN_PIECE {
            return bad(format!(
                "first_piece_bytes = {} is below 64 KiB",
                self.first_piece_bytes
            ));
        }
        if self.pieces_per_thread == 0 || self.pieces_per_thread > 1024 {
            return bad(format!(
                "pieces_per_thread = {} is not in 1..=1024",
                self.pieces_per_thread
            ));
        }
        if self.slots == 0 || self.slots > 4096 {
            return bad(format!("slots = {} is not in 1..=4096", self.slots));
        }
        if self
            .slot_bytes
            .checked_mul(self.slots)
            .is_none_or(|b| b > 1 << 40)
        {
            return bad(format!(
                "{} slots of {} bytes is more than 1 TiB",
                self.slots, self.slot_bytes
            ));
        }
        Ok(())
    }
}

/// Parses `123`, `64K`, `2M`, `1G` (powers of 1024).
pub(crate) fn parse_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let (num, mul) = match s.char_indices().last()? {
        (i, 'k' | 'K') => (&s[..i], KIB),
        (i, 'm' | 'M') => (&s[..i], MIB),
        (i, 'g' | 'G') => (&s[..i], 1 << 30),
        _ => (s, 1),
    };
    num.trim().parse::<usize>().ok()?.checked_mul(mul)
}

/// A staging engine for one device: pinned slots, worker threads, reused across calls.
/// Create it once (it pins `slots * slot_bytes` of host memory and starts threads) and share it:
/// it is `Send + Sync`, and calls from several threads at once share its workers and slots.
///
/// Dropping it waits for the DMAs still reading its slots before it frees them.
///
/// ```no_run
/// use pinstream::{Device, DeviceBuffer, Stager, StagerConfig, Uploads};
/// # fn main() -> pinstream::Result<()> {
/// let dev = Device::get(0)?;
/// let stream = dev.stream()?;
/// // Threads and slots from PINSTREAM_STAGING_* where set, else the defaults.
/// let stager = Stager::new(&dev, StagerConfig::from_env()?)?;
/// let (images, labels) = (vec![0u8; 32 << 20], vec![0i64; 256]);
/// let mut d_images = DeviceBuffer::<u8>::new(&dev, images.len())?;
/// let mut d_labels = DeviceBuffer::<i64>::new(&dev, labels.len())?;
/// let mut list = Uploads::new();
/// list.push(&images, &mut d_images)?.push(&labels, &mut d_labels)?;
/// stager.upload_all(&stream, list)?; // one call; both sources are free again on return
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Stager {
    engine: Engine,
    config: StagerConfig,
}

impl Stager {
    /// Pins the slots (from a pool of its own) and starts the workers on `device`.
    pub fn new(device: &Device, config: StagerConfig) -> Result<Stager> {
        config.validate()?;
        let pool = PinnedPool::new(device, PoolConfig::default())?;
        Stager::with_pool(&pool, config)
    }

    /// As `new`, with the slots taken from `pool` (they go back to it, after their last DMA,
    /// when the stager is dropped).
    ///
    /// A pool registered [`HostRegister::READ_ONLY`](crate::HostRegister::READ_ONLY) is refused
    /// with `Error::InvalidArgument`, as `Stream::copy_d2h` refuses a read-only destination:
    /// downloads land in the slots.
    pub fn with_pool(pool: &PinnedPool, config: StagerConfig) -> Result<Stager> {
        const OP: &str = "Stager::with_pool";
        config.validate()?;
        if pool.is_read_only() {
            return Err(Error::invalid(
                OP,
                "the pool is registered read-only, and downloads write the stager's slots: the \
                 destination is registered read-only",
            ));
        }
        let engine = Engine::new(pool, config.threads - 1, config.slots, config.slot_bytes)?;
        Ok(Stager { engine, config })
    }

    /// The configuration it was built with.
    pub fn config(&self) -> &StagerConfig {
        &self.config
    }

    /// The device it serves.
    pub fn device(&self) -> Device {
        self.engine.shared.device
    }

    /// Copies `src` (ordinary memory) into `dst` on `stream`. Returns once every byte of `src`
    /// has been copied into the engine's pinned slots and the DMAs are queued: `src` is free
    /// again, the device side completes asynchronously, ordered after earlier work on `stream`
    /// and on `dst`, and later uses of `dst` wait for it.
    pub fn upload<T, D>(&self, stream: &Stream, src: &[T], dst: &mut D) -> Result<()>
    where
        T: Pod,
        D: DeviceSliceMut<T> + ?Sized,
    {
        const OP: &str = "Stager::upload";
        stream.same_device(OP, self.device())?;
        let bytes = byte_len::<T>(OP, src.len())?;
        if bytes < self.config.min_bytes {
            return stream.copy_h2d(src, dst).map(drop);
        }
        let d = dst.device_region();
        self.check(OP, stream, &d, src.len())?;
        let t = Transfer {
            host: src.as_ptr() as usize as u64,
            dev: d.ptr as usize as u64,
            len: bytes,
        };
        self.run(
            OP,
            stream,
            Direction::Upload,
            Host::Memory,
            &[t],
            &[d.tracker],
            None,
        )
    }

    /// Copies `src` into `dst` (ordinary memory) on `stream`, after earlier work on `stream`
    /// and on `src`. Returns when every byte has arrived in `dst`.
    pub fn download<T, S>(&self, stream: &Stream, src: &S, dst: &mut [T]) -> Result<()>
    where
        T: Pod,
        S: DeviceSlice<T> + ?Sized,
    {
        const OP: &str = "Stager::download";
        stream.same_device(OP, self.device())?;
        let bytes = byte_len::<T>(OP, dst.len())?;
        if bytes < self.config.min_bytes {
            return stream.copy_d2h(src, dst)?.wait().map(drop);
        }
        let s = src.device_region();
        self.check(OP, stream, &s, dst.len())?;
        let t = Transfer {
            host: dst.as_mut_ptr() as usize as u64,
            dev: s.ptr as usize as u64,
            len: bytes,
        };
        self.run(
            OP,
            stream,
            Direction::Download,
            Host::Memory,
            &[t],
            &[s.tracker],
            None,
        )
    }

    /// Reads `dst.len()` elements' worth of bytes of `file` from `offset` straight into the
    /// pinned slots and on to `dst` (one host copy fewer than reading into memory first).
    /// A file that ends before the range is an [`Error::Io`] naming the file, offset and length.
    pub fn upload_file<T, D>(
        &self,
        stream: &Stream,
        file: &FileSource,
        offset: u64,
        dst: &mut D,
    ) -> Result<()>
    where
        T: Pod,
        D: DeviceSliceMut<T> + ?Sized,
    {
        const OP: &str = "Stager::upload_file";
        let d = dst.device_region();
        self.check(OP, stream, &d, d.len)?;
        let bytes = byte_len::<T>(OP, d.len)?;
        file.check_range(OP, offset, bytes)?;
        let t = Transfer {
            host: offset,
            dev: d.ptr as usize as u64,
            len: bytes,
        };
        self.run(
            OP,
            stream,
            Direction::Upload,
            file.host(),
            &[t],
            &[d.tracker],
            None,
        )
    }

    /// Reads several files into byte ranges of one destination in one call (the shards of a
    /// checkpoint into one arena): part `i` moves `parts[i].len` bytes of `parts[i].file` from
    /// `parts[i].offset` to bytes `parts[i].at..` of `dst`. Every thread of the stager takes
    /// pieces of every file (a piece holds one file's bytes, so `O_DIRECT` files keep their
    /// block-aligned reads), and the destination's tracker is taken once for the whole call.
    /// As [`upload_file`](Self::upload_file) otherwise: returns once every byte has been read
    /// and its DMA queued; the device side is ordered on `stream` and tracked.
    ///
    /// Errors: a range outside its file ([`Error::Io`]), misaligned for an `O_DIRECT` file, or
    /// outside `dst`, or parts whose destination ranges are not in increasing order without
    /// overlap (`Error::InvalidArgument`); a failed read names its file.
    #[cfg(feature = "safetensors")]
    pub(crate) fn upload_files<D>(
        &self,
        stream: &Stream,
        parts: &[FilePart<'_>],
        dst: &mut D,
    ) -> Result<()>
    where
        D: DeviceSliceMut<u8> + ?Sized,
    {
        const OP: &str = "Stager::upload_files";
        let d = dst.device_region();
        self.check(OP, stream, &d, d.len)?;
        let mut end = 0usize;
        let mut transfers = Vec::with_capacity(parts.len());
        let mut files = Vec::with_capacity(parts.len());
        for p in parts {
            p.file.check_range(OP, p.offset, p.len)?;
            let last = p.at.checked_add(p.len).filter(|&e| e <= d.len);
            let Some(last) = last.filter(|_| p.at >= end) else {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "{}: bytes {}..+{} of a destination of {} bytes, after bytes up to {end} \
                         of the parts before (the ranges must be in order, inside, apart)",
                        p.file.path(),
                        p.at,
                        p.len,
                        d.len
                    ),
                ));
            };
            end = last;
            // Within the destination, whose address range the runtime gave: no overflow.
            transfers.push(Transfer {
                host: p.offset,
                dev: d.ptr as usize as u64 + p.at as u64,
                len: p.len,
            });
            files.push(p.file.host_file());
        }
        self.run_per_transfer(OP, stream, Host::Files(files), &transfers, d.tracker)
    }

    /// Uploads every pair of an [`Uploads`] list in one call, many small tensors sharing each
    /// slot (the TensorDict case), without a thread per tensor.
    pub fn upload_all(&self, stream: &Stream, list: Uploads<'_>) -> Result<()> {
        const OP: &str = "Stager::upload_all";
        self.check_list(OP, stream, list.device)?;
        self.run(
            OP,
            stream,
            Direction::Upload,
            Host::Memory,
            &list.transfers,
            &list.trackers,
            None,
        )
    }

    /// Downloads every pair of a [`Downloads`] list in one call; returns when all have arrived.
    pub fn download_all(&self, stream: &Stream, list: Downloads<'_>) -> Result<()> {
        const OP: &str = "Stager::download_all";
        self.check_list(OP, stream, list.device)?;
        self.run(
            OP,
            stream,
            Direction::Download,
            Host::Memory,
            &list.transfers,
            &list.trackers,
            None,
        )
    }

    fn check(
        &self,
        op: &'static str,
        stream: &Stream,
        d: &DeviceRegion<'_>,
        len: usize,
    ) -> Result<()> {
        if d.len != len {
            return Err(Error::LengthMismatch {
                op,
                src: len,
                dst: d.len,
            });
        }
        stream.same_device(op, self.device())?;
        stream.same_device(op, d.device)
    }

    fn check_list(&self, op: &'static str, stream: &Stream, device: Option<Device>) -> Result<()> {
        stream.same_device(op, self.device())?;
        match device {
            Some(d) => stream.same_device(op, d),
            None => Ok(()),
        }
    }

    /// Threads that work on a call of `bytes`: one per `bytes_per_thread`, at most all. More
    /// threads on a mid-sized copy only contend (BENCHMARKS.md).
    fn threads_for(&self, bytes: usize) -> usize {
        bytes
            .div_ceil(self.config.bytes_per_thread)
            .clamp(1, self.config.threads)
    }

    /// Piece size for a call of `bytes`: about two pieces per thread, so the first DMA starts
    /// early and the copy engine never waits for a whole thread's share; between 256 KiB and a
    /// slot.
    fn piece_bytes(&self, bytes: usize) -> usize {
        bytes
            .div_ceil(
                self.threads_for(bytes)
                    .saturating_mul(self.config.pieces_per_thread),
            )
            .next_multiple_of(MIN_PIECE)
            .clamp(
                MIN_SPLIT.min(self.config.slot_bytes),
                self.config.slot_bytes,
            )
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn run(
        &self,
        op: &'static str,
        stream: &Stream,
        direction: Direction,
        host: Host,
        transfers: &[Transfer],
        trackers: &[&Tracker],
        merge_gap: Option<u64>,
    ) -> Result<()> {
        let total = total_len(op, transfers)?;
        if total == 0 {
            return Ok(());
        }
        let plan = plan::plan_ramped(
            transfers,
            self.piece_bytes(total),
            self.config.first_piece_bytes,
            merge_gap,
        );
        self.run_plan(op, stream, direction, host, plan, total, trackers)
    }

    /// An upload whose pieces each hold one transfer's bytes ([`plan::plan_per_transfer`]):
    /// transfer `i` reads the `i`-th file of `host`.
    #[cfg(feature = "safetensors")]
    fn run_per_transfer(
        &self,
        op: &'static str,
        stream: &Stream,
        host: Host,
        transfers: &[Transfer],
        tracker: &Tracker,
    ) -> Result<()> {
        let total = total_len(op, transfers)?;
        if total == 0 {
            return Ok(());
        }
        let plan = plan::plan_per_transfer(
            transfers,
            self.piece_bytes(total),
            self.config.first_piece_bytes,
        );
        self.run_plan(op, stream, Direction::Upload, host, plan, total, &[tracker])
    }

    #[allow(clippy::too_many_arguments)]
    fn run_plan(
        &self,
        op: &'static str,
        stream: &Stream,
        direction: Direction,
        host: Host,
        plan: plan::Plan,
        total: usize,
        trackers: &[&Tracker],
    ) -> Result<()> {
        stream.enter()?;
        let mut job = Job::new(op, direction, host, stream.clone(), plan);
        job.batch = self.config.batch_copies && crate::copy::BATCH_COPIES;
        job.streaming =
            matches!(direction, Direction::Upload) && total <= self.config.streaming_max_bytes;
        job.helpers = self.threads_for(total) - 1;
        let mut outcome = Ok(());
        // The device side: read by a download, written by an upload.
        let access = match direction {
            Direction::Upload => Access::Write,
            Direction::Download => Access::Read,
        };
        let uses: Vec<(&Tracker, Access)> = trackers.iter().map(|t| (*t, access)).collect();
        tracker::ordered_rw(stream, &uses, || {
            let job = self.engine.execute(job);
            if let Some(t) = &job.trace {
                t.print(op, total);
            }
            outcome = job.result();
            // Once a DMA was queued, the device side must be tracked even if a piece failed.
            if job.queued_any() {
                Ok(())
            } else {
                outcome.clone()
            }
        })?;
        outcome
    }
}

/// A list of (plain source slice, device destination) pairs for [`Stager::upload_all`]. The
/// sources stay borrowed and the destinations mutably borrowed until the list is used.
#[derive(Debug, Default)]
pub struct Uploads<'a> {
    transfers: Vec<Transfer>,
    trackers: Vec<&'a Tracker>,
    device: Option<Device>,
    _borrows: PhantomData<&'a ()>,
}

/// A list of (device source, plain destination slice) pairs for [`Stager::download_all`].
#[derive(Debug, Default)]
pub struct Downloads<'a> {
    transfers: Vec<Transfer>,
    trackers: Vec<&'a Tracker>,
    device: Option<Device>,
    _borrows: PhantomData<&'a mut ()>,
}

/// The sum of the transfers' lengths, or an error where it overflows.
fn total_len(op: &'static str, transfers: &[Transfer]) -> Result<usize> {
    transfers
        .iter()
        .try_fold(0usize, |a, t| a.checked_add(t.len))
        .ok_or_else(|| Error::invalid(op, "the transfers' total size overflows usize"))
}

/// One file's part of a [`Stager::upload_files`] call: `len` bytes of `file` from `offset` to
/// bytes `at..at + len` of the destination.
#[cfg(feature = "safetensors")]
#[derive(Clone, Copy, Debug)]
pub(crate) struct FilePart<'a> {
    pub file: &'a FileSource,
    pub offset: u64,
    pub len: usize,
    pub at: usize,
}

fn same_list_device(op: &'static str, list: &mut Option<Device>, d: Device) -> Result<()> {
    match *list {
        Some(first) if first != d => Err(Error::WrongDevice {
            op,
            expected: first.raw(),
            found: d.raw(),
        }),
        _ => {
            *list = Some(d);
            Ok(())
        }
    }
}

impl<'a> Uploads<'a> {
    /// An empty list.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `src -> dst`. Lengths must match; every destination must be on one device.
    pub fn push<T, D>(&mut self, src: &'a [T], dst: &'a mut D) -> Result<&mut Self>
    where
        T: Pod,
        D: DeviceSliceMut<T> + ?Sized,
    {
        const OP: &str = "Uploads::push";
        let dst: &'a D = dst;
        let d = dst.device_region();
        if d.len != src.len() {
            return Err(Error::LengthMismatch {
                op: OP,
                src: src.len(),
                dst: d.len,
            });
        }
        same_list_device(OP, &mut self.device, d.device)?;
        self.transfers.push(Transfer {
            host: src.as_ptr() as usize as u64,
            dev: d.ptr as usize as u64,
            len: byte_len::<T>(OP, src.len())?,
        });
        self.trackers.push(d.tracker);
        Ok(self)
    }

    /// Pairs in the list.
    pub fn len(&self) -> usize {
        self.transfers.len()
    }

    /// Whether the list is empty.
    pub fn is_empty(&self) -> bool {
        self.transfers.is_empty()
    }
}

impl<'a> Downloads<'a> {
    /// An empty list.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `src -> dst`. Lengths must match; every source must be on one device.
    pub fn push<T, S>(&mut self, src: &'a S, dst: &'a mut [T]) -> Result<&mut Self>
    where
        T: Pod,
        S: DeviceSlice<T> + ?Sized,
    {
        const OP: &str = "Downloads::push";
        let s = src.device_region();
        if s.len != dst.len() {
            return Err(Error::LengthMismatch {
                op: OP,
                src: s.len,
                dst: dst.len(),
            });
        }
        same_list_device(OP, &mut self.device, s.device)?;
        self.transfers.push(Transfer {
            host: dst.as_mut_ptr() as usize as u64,
            dev: s.ptr as usize as u64,
            len: byte_len::<T>(OP, dst.len())?,
        });
        self.trackers.push(s.tracker);
        Ok(self)
    }

    /// Pairs in the list.
    pub fn len(&self) -> usize {
        self.transfers.len()
    }

    /// Whether the list is empty.
    pub fn is_empty(&self) -> bool {
        self.transfers.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("123"), Some(123));
        assert_eq!(parse_size("64K"), Some(65536));
        assert_eq!(parse_size("2m"), Some(2 << 20));
        assert_eq!(parse_size("1G"), Some(1 << 30));
        assert_eq!(parse_size("x"), None);
        assert_eq!(parse_size(""), None);
        assert_eq!(parse_size("99999999999999999999G"), None);
    }

    #[test]
    fn config_validation() {
        assert!(StagerConfig::default().validate().is_ok());
        for bad in [
            StagerConfig {
                threads: 0,
                ..Default::default()
            },
            StagerConfig {
                slot_bytes: 1000,
                ..Default::default()
            },
            StagerConfig {
                slots: 0,
                ..Default::default()
            },
            StagerConfig {
                slots: 4096,
                slot_bytes: 1 << 30,
                ..Default::default()
            },
        ] {
            assert!(
                matches!(bad.validate(), Err(Error::InvalidArgument { .. })),
                "{bad:?}"
            );
        }
    }
}
