//! The transfer sweep: host memory kinds x directions x sizes, each point gated, warmed up,
//! sampled at least `min_samples` times for at least `min_sample_time` each, and checked.
//! Staged copies ([`MemKind::Staged`]) are done by host threads and cannot be gated: they are
//! timed with the host clock instead, each copy followed by a stream synchronize.

use std::time::{Duration, Instant};

use pinstream::memory::{
    DeviceBuffer, HostAlloc, HostRegister, HostSlice, HostSliceMut, PinnedBuffer, Registered,
};
use pinstream::staging::{FileSource, Stager, StagerConfig};
use pinstream::timing::{self, CopyLoop};
use pinstream::{Device, Error, Result, Stream, TimingEvent};

use super::{gbps, pattern, secs, Gate, Stats};

/// Copies queued behind a closed gate at most: a stream's queue is finite, and a host blocked on
/// a full queue behind the gate could only wait for the gate's timeout.
pub(super) const GATE_DEPTH: usize = 128;

/// Pieces one copy is split into at most with `Options::chunk`.
pub const MAX_PIECES: usize = 64;

/// A kind of host memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemKind {
    /// Plain `Vec<u8>`: the runtime stages through its own pinned buffers.
    Pageable,
    /// `cudaHostAlloc` default flags.
    Pinned,
    /// `cudaHostAlloc` write-combined.
    WriteCombined,
    /// `cudaHostAlloc` portable.
    Portable,
    /// `cudaHostRegister` over a `Vec<u8>`.
    Registered,
    /// Plain `Vec<u8>` moved by a [`Stager`] (its pinned slots and worker threads). Timed with
    /// the host clock, h2d and d2h only.
    Staged,
}

impl MemKind {
    /// Every kind, in the order the sweep measures them.
    pub const ALL: [MemKind; 6] = [
        MemKind::Pageable,
        MemKind::Pinned,
        MemKind::WriteCombined,
        MemKind::Portable,
        MemKind::Registered,
        MemKind::Staged,
    ];

    /// The name used in rows and on the command line, e.g. `write-combined`.
    pub fn name(self) -> &'static str {
        match self {
            MemKind::Pageable => "pageable",
            MemKind::Pinned => "pinned",
            MemKind::WriteCombined => "write-combined",
            MemKind::Portable => "portable",
            MemKind::Registered => "registered",
            MemKind::Staged => "staged",
        }
    }

    /// The kind named `s` (as [`MemKind::name`] gives it, or `wc` for write-combined).
    pub fn parse(s: &str) -> Option<MemKind> {
        MemKind::ALL
            .into_iter()
            .find(|k| k.name() == s || (s == "wc" && *k == MemKind::WriteCombined))
    }
}

/// A copy direction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Host to device.
    H2D,
    /// Device to host.
    D2H,
    /// Device to device, reported counted once and as read + write.
    D2D,
    /// H2D and D2H started together; each direction and the sum are reported.
    Bidir,
    /// Device to device between two GPUs, every ordered pair: measured by
    /// [`super::peer::run`], not by [`run`] (which skips it). Not in the default set.
    P2P,
}

impl Direction {
    /// The directions of one device, in the order the sweep measures them: the default set.
    pub const PER_DEVICE: [Direction; 4] = [
        Direction::H2D,
        Direction::D2H,
        Direction::D2D,
        Direction::Bidir,
    ];

    /// Every direction: [`Direction::PER_DEVICE`], then [`Direction::P2P`].
    pub const ALL: [Direction; 5] = [
        Direction::H2D,
        Direction::D2H,
        Direction::D2D,
        Direction::Bidir,
        Direction::P2P,
    ];

    /// The name used in rows and on the command line: `h2d`, `d2h`, `d2d`, `bidir`, `p2p`.
    pub fn name(self) -> &'static str {
        match self {
            Direction::H2D => "h2d",
            Direction::D2H => "d2h",
            Direction::D2D => "d2d",
            Direction::Bidir => "bidir",
            Direction::P2P => "p2p",
        }
    }

    /// The direction named `s` (as [`Direction::name`] gives it).
    pub fn parse(s: &str) -> Option<Direction> {
        Direction::ALL.into_iter().find(|d| d.name() == s)
    }
}

/// What to measure and how hard.
#[derive(Clone, Debug)]
pub struct Options {
    /// Bytes per copy, one point each (default: every power of two from 4 KiB to 1 GiB).
    pub sizes: Vec<usize>,
    /// Host memory kinds to measure (default: all).
    pub kinds: Vec<MemKind>,
    /// Directions to measure (default: [`Direction::PER_DEVICE`]; [`Direction::P2P`] is for
    /// [`super::peer::run`]).
    pub directions: Vec<Direction>,
    /// Samples per point, at least (default 5).
    pub min_samples: usize,
    /// Copies are repeated within a sample until it lasts at least this long (default 20 ms).
    pub min_sample_time: Duration,
    /// Samples taken and thrown away before the measured ones (default 1).
    pub warmup_samples: usize,
    /// How long a gate kernel holds the stream at most while copies are queued (default 1 s).
    pub gate_timeout: Duration,
    /// Issue each copy as consecutive pieces of at most this many bytes (at most
    /// `MAX_PIECES` per copy; a larger piece is used where needed). `None`: one call per copy.
    pub chunk: Option<usize>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            sizes: (12..=30).map(|p| 1usize << p).collect(),
            kinds: MemKind::ALL.to_vec(),
            directions: Direction::PER_DEVICE.to_vec(),
            min_samples: 5,
            min_sample_time: Duration::from_millis(20),
            warmup_samples: 1,
            gate_timeout: Duration::from_secs(1),
            chunk: None,
        }
    }
}

impl Options {
    /// The piece size copies of `bytes` are issued in.
    pub fn piece(&self, bytes: usize) -> usize {
        match self.chunk {
            Some(c) => c.max(bytes.div_ceil(MAX_PIECES)).max(1),
            None => bytes.max(1),
        }
    }

    /// How many rows `run` produces, for progress reporting (p2p rows not included: see
    /// [`super::peer::row_count`]).
    pub fn row_count(&self) -> usize {
        // Pageable and staged memory have no bidir rows (a pageable copy blocks the host; the
        // stager's threads cannot be gated); d2d is two rows per size, whatever the kinds.
        let per_kind = |kind: MemKind| -> usize {
            self.directions
                .iter()
                .map(|d| match d {
                    Direction::H2D | Direction::D2H => 1,
                    Direction::Bidir if !matches!(kind, MemKind::Pageable | MemKind::Staged) => 4,
                    Direction::Bidir | Direction::D2D | Direction::P2P => 0,
                })
                .sum()
        };
        let kinds: usize = self.kinds.iter().map(|&k| per_kind(k)).sum();
        let d2d = if self.directions.contains(&Direction::D2D) {
            2
        } else {
            0
        };
        self.sizes.len() * (kinds + d2d)
    }

    /// Copies per sample so that one sample lasts at least `min_sample_time`, given that one
    /// copy took `one` seconds.
    pub(super) fn reps_for(&self, one: f64) -> usize {
        ((secs(self.min_sample_time) / one.max(1e-7)).ceil() as usize).clamp(1, 100_000)
    }
}

/// One measured point.
#[derive(Clone, Debug)]
pub struct Row {
    /// "0", "1", ... or "all".
    pub device: String,
    /// Memory kind name, or "device" for device-to-device.
    pub kind: &'static str,
    /// h2d, d2h, d2d, d2d-rw, bidir-h2d, bidir-d2h, bidir-sum, bidir-pair.
    ///
    /// bidir-h2d and bidir-d2h are each direction's rate while the other direction is kept
    /// busy for the whole sample; bidir-sum is their sum per sample (what the link carries
    /// with both directions loaded); bidir-pair is `2 x bytes` over the time until both
    /// directions' copies, started together, have finished.
    pub direction: &'static str,
    /// Bytes per copy.
    pub bytes: usize,
    /// Copies timed together in one sample.
    pub copies_per_sample: usize,
    /// Decimal GB/s per sample, from CUDA events; from the host clock on staged and file rows
    /// (the host does the work there), the same samples as `host_gbps`.
    pub gbps: Stats,
    /// Decimal GB/s per sample from the host clock (pageable copies, which block the host;
    /// staged and file rows).
    pub host_gbps: Option<Stats>,
    /// Pageable rows: single-thread host memcpy GB/s (median) at the same size, what a copy
    /// staged through pinned memory by one thread cannot beat.
    pub host_memcpy_gbps: Option<f64>,
    /// The copied data matched the random pattern afterwards.
    pub verified: bool,
    /// A gate kernel gave up before the copies were queued (enqueue time is in the numbers).
    pub gate_timed_out: bool,
    /// bidir rows: in some sample one direction ran partly alone (the other was more than 1.5x
    /// faster and its extra copies ran out), so that rate is not fully under load.
    pub partly_alone: bool,
    /// How the copy was done where the kind does not say it all: on staged and file rows the
    /// engine's threads and slots (`bench::staging::describe`), or the way a file was read.
    pub note: Option<String>,
}

struct BidirSample {
    up: f64,
    down: f64,
    both: f64,
    partly_alone: bool,
}

pub(super) struct Measured {
    pub(super) gbps: Stats,
    pub(super) host_gbps: Option<Stats>,
    pub(super) reps: usize,
    pub(super) timed_out: bool,
}

/// Whole copies of `bytes` (issued in `opts.piece(bytes)` pieces) that fit behind a closed gate.
pub(super) fn gate_reps(opts: &Options, bytes: usize) -> usize {
    (GATE_DEPTH / bytes.div_ceil(opts.piece(bytes))).max(1)
}

/// Host memory the sweep copies into and checks: host access after the GPU's last use.
pub(super) trait HostAccess {
    /// Read access.
    fn read(&self) -> Result<&[u8]>;
    /// Write access.
    fn write(&mut self) -> Result<&mut [u8]>;
}

impl HostAccess for [u8] {
    fn read(&self) -> Result<&[u8]> {
        Ok(self)
    }
    fn write(&mut self) -> Result<&mut [u8]> {
        Ok(self)
    }
}

impl HostAccess for PinnedBuffer<u8> {
    fn read(&self) -> Result<&[u8]> {
        self.as_slice()
    }
    fn write(&mut self) -> Result<&mut [u8]> {
        self.as_mut_slice()
    }
}

impl HostAccess for Registered<'_, u8> {
    fn read(&self) -> Result<&[u8]> {
        self.as_slice()
    }
    fn write(&mut self) -> Result<&mut [u8]> {
        self.as_mut_slice()
    }
}

/// What the timed samples need: streams, the gate, events, the options.
struct Timer<'o> {
    device: Device,
    opts: &'o Options,
    up: Stream,
    down: Stream,
    gate: Gate,
    ev: [TimingEvent; 6],
}

/// The timer and the memory the sweep copies between (the device side and the check buffer).
struct Ctx<'o> {
    t: Timer<'o>,
    pattern: Vec<u8>,
    dev_a: DeviceBuffer<u8>,
    dev_b: DeviceBuffer<u8>,
    check: Vec<u8>,
}

/// Runs the sweep on `device`; `progress` sees each row as it is measured. Nothing is allocated
/// or measured when `opts` asks for no rows of one device (e.g. only [`Direction::P2P`]).
pub fn run(device: &Device, opts: &Options, progress: &mut dyn FnMut(&Row)) -> Result<Vec<Row>> {
    let max = opts
        .sizes
        .iter()
        .copied()
        .max()
        .ok_or_else(|| super::invalid("bandwidth", "no sizes given"))?;
    if opts.sizes.contains(&0) {
        return Err(super::invalid("bandwidth", "sizes must be at least 1 byte"));
    }
    if opts.row_count() == 0 {
        return Ok(Vec::new());
    }
    let up = device.stream()?;
    let pattern = pattern(max)?;
    let mut dev_b = DeviceBuffer::<u8>::new(device, max)?;
    up.copy_h2d(&pattern[..], &mut dev_b)?;
    let mut ctx = Ctx {
        t: Timer {
            device: *device,
            opts,
            down: device.stream()?,
            gate: Gate::new(device, opts.gate_timeout)?,
            ev: [
                TimingEvent::new(device)?,
                TimingEvent::new(device)?,
                TimingEvent::new(device)?,
                TimingEvent::new(device)?,
                TimingEvent::new(device)?,
                TimingEvent::new(device)?,
            ],
            up,
        },
        dev_a: DeviceBuffer::<u8>::new(device, max)?,
        dev_b,
        check: vec![0u8; max],
        pattern,
    };
    // One engine for the whole sweep, reused for every size (it pins its slots and starts its
    // threads once, as a program using it would).
    let stager = if opts.kinds.contains(&MemKind::Staged) {
        Some(Stager::new(device, StagerConfig::from_env()?)?)
    } else {
        None
    };
    let mut rows = Vec::new();
    for &kind in &opts.kinds {
        let flags = match kind {
            MemKind::WriteCombined => HostAlloc::WRITE_COMBINED,
            MemKind::Portable => HostAlloc::PORTABLE,
            _ => HostAlloc::DEFAULT,
        };
        match kind {
            MemKind::Pageable => {
                let src = ctx.pattern.clone();
                let mut dst = vec![0u8; max];
                ctx.run_kind(kind, &src[..], &mut dst[..], &mut rows, progress)?;
            }
            MemKind::Pinned | MemKind::WriteCombined | MemKind::Portable => {
                let src = PinnedBuffer::from_slice(device, &ctx.pattern, flags)?;
                let mut dst = PinnedBuffer::<u8>::new(device, max, flags)?;
                ctx.run_kind(kind, &src, &mut dst, &mut rows, progress)?;
            }
            MemKind::Registered => {
                let mut src = ctx.pattern.clone();
                let mut dst = vec![0u8; max];
                let ctx = &mut ctx;
                let rows = &mut rows;
                let progress = &mut *progress;
                Registered::scope(device, &mut src, HostRegister::DEFAULT, |rs| {
                    Registered::scope(device, &mut dst, HostRegister::DEFAULT, |rd| {
                        ctx.run_kind(kind, &*rs, rd, rows, progress)
                    })
                })???;
            }
            MemKind::Staged => {
                if let Some(stager) = &stager {
                    let src = ctx.pattern.clone();
                    let mut dst = vec![0u8; max];
                    ctx.run_staged(stager, &src, &mut dst, &mut rows, progress)?;
                }
            }
        }
    }
    if opts.directions.contains(&Direction::D2D) {
        for &b in &opts.sizes {
            ctx.d2d(b, &mut rows, progress)?;
        }
    }
    Ok(rows)
}

/// Whether `got` equals the start of `want`; above 256 MiB (or for write-combined memory, which
/// the host reads slowly) every 4093rd byte and the last page are compared.
pub(super) fn matches(got: &[u8], want: &[u8], sparse: bool) -> bool {
    if got.len() > want.len() {
        return false;
    }
    let want = &want[..got.len()];
    if !sparse {
        return got == want;
    }
    let tail = got.len().saturating_sub(4096);
    (0..got.len()).step_by(4093).all(|i| got[i] == want[i]) && got[tail..] == want[tail..]
}

impl Timer<'_> {
    fn row(
        &self,
        kind: &'static str,
        direction: &'static str,
        bytes: usize,
        m: &Measured,
        verified: bool,
    ) -> Row {
        Row {
            device: self.device.ordinal().to_string(),
            kind,
            direction,
            bytes,
            copies_per_sample: m.reps,
            gbps: m.gbps.clone(),
            host_gbps: m.host_gbps.clone(),
            host_memcpy_gbps: None,
            verified,
            gate_timed_out: m.timed_out,
            partly_alone: false,
            note: None,
        }
    }

    /// Copies per sample so that one sample lasts at least `min_sample_time`, given that one
    /// copy took `one` seconds.
    fn reps_for(&self, one: f64) -> usize {
        self.opts.reps_for(one)
    }

    /// Whole copies that fit behind a closed gate.
    fn gate_reps(&self, bytes: usize) -> usize {
        gate_reps(self.opts, bytes)
    }

    /// One sample: (seconds by events, seconds by host clock, gate timed out).
    fn sample(
        &self,
        gated: bool,
        op: &dyn Fn(usize) -> Result<()>,
        reps: usize,
        bytes: usize,
    ) -> Result<(f64, f64, bool)> {
        let [t0, t1, ..] = &self.ev;
        if gated {
            self.gate.close(&self.up)?;
        }
        let host = Instant::now();
        self.up.record(t0)?;
        let mut timed_out = false;
        if gated {
            // Pre-queue what the stream's queue holds, then let the GPU go while the rest is
            // queued: more than that would block the host on a full queue behind the gate.
            let first = reps.min(self.gate_reps(bytes));
            op(first)?;
            timed_out = !self.gate.open();
            op(reps - first)?;
        } else {
            op(reps)?;
        }
        self.up.record(t1)?;
        t1.synchronize()?;
        let host = secs(host.elapsed());
        Ok((f64::from(t0.elapsed_ms(t1)?) / 1e3, host, timed_out))
    }

    fn measure(
        &self,
        gated: bool,
        bytes: usize,
        op: &dyn Fn(usize) -> Result<()>,
    ) -> Result<Measured> {
        let (one, _, _) = self.sample(false, op, 1, bytes)?;
        let reps = self.reps_for(one);
        for _ in 0..self.opts.warmup_samples {
            self.sample(gated, op, reps, bytes)?;
        }
        let (mut ev, mut host, mut timed_out) = (Vec::new(), Vec::new(), false);
        for _ in 0..self.opts.min_samples.max(1) {
            let (e, h, t) = self.sample(gated, op, reps, bytes)?;
            let moved = (bytes * reps) as f64;
            ev.push(gbps(moved, e));
            host.push(gbps(moved, h));
            timed_out |= t;
        }
        Ok(Measured {
            gbps: Stats::new(ev).unwrap_or_else(empty_stats),
            host_gbps: if gated { None } else { Stats::new(host) },
            reps,
            timed_out,
        })
    }

    /// Warm-up plus samples of `reps` copies each way, released together by the gate; then
    /// `extra` more copies each way, untimed, to keep the link loaded while the slower
    /// direction finishes. Returns the samples and whether the gate timed out.
    fn bidir_pass(
        &self,
        up_op: &dyn Fn(usize) -> Result<()>,
        down_op: &dyn Fn(usize) -> Result<()>,
        reps: usize,
        bytes: usize,
        extra: usize,
    ) -> Result<(Vec<BidirSample>, bool)> {
        let [t0u, t1u, t2u, t0d, t1d, t2d] = &self.ev;
        let both = |n: usize| -> Result<()> {
            up_op(n)?;
            down_op(n)
        };
        // Once the gate is open, alternate the directions 32 copies at a time so that neither
        // stream runs dry while the other is being fed.
        let in_batches = |mut left: usize| -> Result<()> {
            while left > 0 {
                let n = left.min(32);
                both(n)?;
                left -= n;
            }
            Ok(())
        };
        let first = reps.min(self.gate_reps(bytes));
        let ms = |a: &TimingEvent, b: &TimingEvent| -> Result<f64> {
            Ok(f64::from(a.elapsed_ms(b)?) / 1e3)
        };
        let mut out = Vec::new();
        let mut timed_out = false;
        for i in 0..self.opts.warmup_samples + self.opts.min_samples.max(1) {
            self.gate.close(&self.up)?;
            self.gate.close(&self.down)?;
            self.up.record(t0u)?;
            self.down.record(t0d)?;
            both(first)?;
            timed_out |= !self.gate.open();
            in_batches(reps - first)?;
            self.up.record(t1u)?;
            self.down.record(t1d)?;
            in_batches(extra)?;
            self.up.record(t2u)?;
            self.down.record(t2d)?;
            t2u.synchronize()?;
            t2d.synchronize()?;
            if i >= self.opts.warmup_samples {
                // Both streams left the gate together: time everything from t0u.
                let (up, down) = (ms(t0u, t1u)?, ms(t0u, t1d)?);
                let (up_all, down_all) = (ms(t0u, t2u)?, ms(t0u, t2d)?);
                out.push(BidirSample {
                    up,
                    down,
                    both: up.max(down),
                    partly_alone: extra > 0 && (down_all < up || up_all < down),
                });
            }
        }
        Ok((out, timed_out))
    }
}

impl Ctx<'_> {
    fn run_kind<S, D>(
        &mut self,
        kind: MemKind,
        src: &S,
        dst: &mut D,
        rows: &mut Vec<Row>,
        progress: &mut dyn FnMut(&Row),
    ) -> Result<()>
    where
        S: HostSlice<u8> + ?Sized,
        D: HostSliceMut<u8> + HostAccess + ?Sized,
    {
        let dirs = self.t.opts.directions.clone();
        for &b in &self.t.opts.sizes.clone() {
            let memcpy = match kind {
                MemKind::Pageable => super::host_memcpy_gbps(b, 3).map(|m| m.median),
                _ => None,
            };
            for &dir in &dirs {
                let mut new: Vec<Row> = match dir {
                    Direction::H2D => vec![self.h2d(kind, src, b)?],
                    Direction::D2H => vec![self.d2h(kind, dst, b)?],
                    Direction::Bidir if kind != MemKind::Pageable => {
                        self.bidir(kind, src, dst, b)?
                    }
                    _ => Vec::new(),
                };
                for r in &mut new {
                    r.host_memcpy_gbps = memcpy;
                }
                for r in new {
                    progress(&r);
                    rows.push(r);
                }
            }
        }
        Ok(())
    }

    /// Staged rows: `stager` moves `src` (plain memory) to `dev_a` and `dev_b` to `dst`
    /// (plain memory). The engine's threads do the host side of each copy, so a gate cannot
    /// hold them back; they are timed with the host clock. Only h2d and d2h: the engine has no
    /// bidirectional mode that a gate could release together (no bidir rows), and d2d involves
    /// no host memory (its rows come once per size, not per kind).
    fn run_staged(
        &mut self,
        stager: &Stager,
        src: &[u8],
        dst: &mut [u8],
        rows: &mut Vec<Row>,
        progress: &mut dyn FnMut(&Row),
    ) -> Result<()> {
        let how = super::staging::describe(stager);
        let min_bytes = stager.config().min_bytes;
        for &b in &self.t.opts.sizes.clone() {
            for &dir in &self.t.opts.directions.clone() {
                let mut row = match dir {
                    Direction::H2D => self.staged_h2d(stager, src, b)?,
                    Direction::D2H => self.staged_d2h(stager, dst, b)?,
                    // Skipped for staged memory: see above (p2p: `peer::run`).
                    Direction::D2D | Direction::Bidir | Direction::P2P => continue,
                };
                row.note = Some(if b < min_bytes {
                    format!(
                        "{how}; under min_bytes={}: plain copy",
                        super::size_name(min_bytes)
                    )
                } else {
                    how.clone()
                });
                progress(&row);
                rows.push(row);
            }
        }
        Ok(())
    }

    fn staged_h2d(&mut self, stager: &Stager, src: &[u8], b: usize) -> Result<Row> {
        let src = src
            .get(..b)
            .ok_or_else(|| super::invalid("bandwidth", "staged source shorter than the size"))?;
        let m = {
            let (opts, up) = (self.t.opts, &self.t.up);
            let mut d = self.dev_a.slice_mut(..b)?;
            host_timed(opts, b, || {
                stager.upload(up, src, &mut d)?;
                up.synchronize()
            })?
        };
        let verified = self.check_device(true, b)?;
        Ok(self.t.row(MemKind::Staged.name(), "h2d", b, &m, verified))
    }

    fn staged_d2h(&mut self, stager: &Stager, dst: &mut [u8], b: usize) -> Result<Row> {
        let dst = dst.get_mut(..b).ok_or_else(|| {
            super::invalid("bandwidth", "staged destination shorter than the size")
        })?;
        dst.fill(0);
        let m = {
            let (opts, up) = (self.t.opts, &self.t.up);
            let s = self.dev_b.slice(..b)?;
            host_timed(opts, b, || stager.download(up, &s, dst))?
        };
        let verified = matches(dst, &self.pattern, b > (256 << 20));
        Ok(self.t.row(MemKind::Staged.name(), "d2h", b, &m, verified))
    }

    fn h2d<S: HostSlice<u8> + ?Sized>(&mut self, kind: MemKind, src: &S, b: usize) -> Result<Row> {
        let gated = kind != MemKind::Pageable;
        let m = {
            let t = &self.t;
            let op = CopyLoop::h2d(&t.up, src, &mut self.dev_a, b)?.pieces(t.opts.piece(b));
            t.measure(gated, b, &|n| op.queue(n))?
        };
        let verified = self.check_device(true, b)?;
        Ok(self.t.row(kind.name(), "h2d", b, &m, verified))
    }

    fn d2h<D: HostSliceMut<u8> + HostAccess + ?Sized>(
        &mut self,
        kind: MemKind,
        dst: &mut D,
        b: usize,
    ) -> Result<Row> {
        let gated = kind != MemKind::Pageable;
        dst.write()?[..b].fill(0);
        let m = {
            let t = &self.t;
            let op = CopyLoop::d2h(&t.up, &self.dev_b, dst, b)?.pieces(t.opts.piece(b));
            t.measure(gated, b, &|n| op.queue(n))?
        };
        let sparse = b > (256 << 20) || kind == MemKind::WriteCombined;
        let verified = matches(&dst.read()?[..b], &self.pattern, sparse);
        Ok(self.t.row(kind.name(), "d2h", b, &m, verified))
    }

    /// Checks the first `b` bytes of `dev_a` (`true`) or `dev_b` against the pattern.
    fn check_device(&mut self, a: bool, b: usize) -> Result<bool> {
        self.check[..b].fill(0);
        let src = if a {
            self.dev_a.slice(..b)?
        } else {
            self.dev_b.slice(..b)?
        };
        let got = self.t.up.copy_d2h(&src, &mut self.check[..b])?.wait()?;
        Ok(matches(got, &self.pattern, b > (256 << 20)))
    }

    /// H2D and D2H of `b` bytes on two streams released by one gate. Two passes: in the first
    /// each stream keeps copying after its timed copies until the other is done, so each
    /// direction's rate is taken under load all along (bidir-h2d, bidir-d2h, bidir-sum); the
    /// second is plain, both directions the same copies, timed to the later end (bidir-pair).
    fn bidir<S, D>(&mut self, kind: MemKind, src: &S, dst: &mut D, b: usize) -> Result<Vec<Row>>
    where
        S: HostSlice<u8> + ?Sized,
        D: HostSliceMut<u8> + HostAccess + ?Sized,
    {
        dst.write()?[..b].fill(0);
        let (loaded, pair, reps, timed_out) = {
            let t = &self.t;
            let piece = t.opts.piece(b);
            let up = CopyLoop::h2d(&t.up, src, &mut self.dev_a, b)?.pieces(piece);
            let down = CopyLoop::d2h(&t.down, &self.dev_b, &mut *dst, b)?.pieces(piece);
            let (up_op, down_op) = (|n| up.queue(n), |n| down.queue(n));
            // Calibrate on one direction alone.
            let (one, _, _) = t.sample(false, &up_op, 1, b)?;
            let reps = t.reps_for(one);
            let (loaded, t1) = t.bidir_pass(&up_op, &down_op, reps, b, reps.div_ceil(2))?;
            let (pair, t2) = t.bidir_pass(&up_op, &down_op, reps, b, 0)?;
            (loaded, pair, reps, t1 || t2)
        };
        let moved = (b * reps) as f64;
        let stats = |v: Vec<f64>| Stats::new(v).unwrap_or_else(empty_stats);
        let mk = |s: Stats| Measured {
            gbps: s,
            host_gbps: None,
            reps,
            timed_out,
        };
        let up: Vec<f64> = loaded.iter().map(|t| gbps(moved, t.up)).collect();
        let down: Vec<f64> = loaded.iter().map(|t| gbps(moved, t.down)).collect();
        let sum = up.iter().zip(&down).map(|(u, d)| u + d).collect();
        let pair = pair.iter().map(|t| gbps(2.0 * moved, t.both)).collect();
        let alone = loaded.iter().any(|t| t.partly_alone);
        let ok_up = self.check_device(true, b)?;
        let sparse = b > (256 << 20) || kind == MemKind::WriteCombined;
        let ok_down = matches(&dst.read()?[..b], &self.pattern, sparse);
        let name = kind.name();
        let mut rows = vec![
            self.t.row(name, "bidir-h2d", b, &mk(stats(up)), ok_up),
            self.t.row(name, "bidir-d2h", b, &mk(stats(down)), ok_down),
            self.t
                .row(name, "bidir-sum", b, &mk(stats(sum)), ok_up && ok_down),
            self.t
                .row(name, "bidir-pair", b, &mk(stats(pair)), ok_up && ok_down),
        ];
        for r in &mut rows[..3] {
            r.partly_alone = alone;
        }
        Ok(rows)
    }

    fn d2d(&mut self, b: usize, rows: &mut Vec<Row>, progress: &mut dyn FnMut(&Row)) -> Result<()> {
        let m = {
            let t = &self.t;
            let op = CopyLoop::d2d(&t.up, &self.dev_b, &mut self.dev_a, b)?;
            t.measure(true, b, &|n| op.queue(n))?
        };
        let verified = self.check_device(true, b)?;
        let once = self.t.row("device", "d2d", b, &m, verified);
        let mut rw = once.clone();
        rw.direction = "d2d-rw";
        rw.gbps = Stats::new(m.gbps.samples.iter().map(|g| 2.0 * g).collect())
            .unwrap_or_else(empty_stats);
        for r in [once, rw] {
            progress(&r);
            rows.push(r);
        }
        Ok(())
    }
}

/// Host-clock samples of a copy the host drives (staged): `op` is one copy that leaves the
/// stream synchronised (upload + synchronize, or download). After one untimed call and one
/// timed call (which sets how many copies make a sample of at least `min_sample_time`), the
/// samples are taken by [`super::staging::measure`], each `reps` calls of `op`.
fn host_timed(
    opts: &Options,
    bytes: usize,
    mut op: impl FnMut() -> Result<()>,
) -> Result<Measured> {
    op()?;
    let t = Instant::now();
    op()?;
    let reps = opts.reps_for(secs(t.elapsed()));
    let m = super::staging::measure("", bytes.saturating_mul(reps), opts.min_samples, "", || {
        (0..reps).try_for_each(|_| op())
    })?;
    Ok(Measured {
        host_gbps: Some(m.gbps.clone()),
        gbps: m.gbps,
        reps,
        timed_out: false,
    })
}

/// File source rows (h2d) for `pinstream bandwidth --file`: the first `bytes` of `path` (at most
/// the whole file) to the device, read into pageable memory then copied plainly
/// (`file read+copy`), through `stager.upload_file` with the page cache warm
/// (`file upload_file`), and through `upload_file` with `O_DIRECT` (`file O_DIRECT`) where the
/// filesystem allows it (otherwise skipped, with a note on stderr). Host clock, each sample one
/// read and copy with the stream synchronised ([`super::staging::file`]).
///
/// The first two are checked by `bench::staging::file` (the device data from `upload_file`
/// against what `read` gave); the `O_DIRECT` row by one more `O_DIRECT` upload compared with
/// the file.
pub fn file_rows(
    stager: &Stager,
    stream: &Stream,
    path: &std::path::Path,
    bytes: usize,
    samples: usize,
) -> Result<Vec<Row>> {
    let how = super::staging::describe(stager);
    let measured = super::staging::file(stager, stream, path, bytes, samples.max(1), true)?;
    let mut rows = Vec::new();
    for m in measured {
        let (kind, note, verified) = match m.what.as_str() {
            "file: read + copy" => ("file read+copy", m.note.clone(), true),
            "file: upload_file" => ("file upload_file", format!("page cache warm; {how}"), true),
            "file: upload_file O_DIRECT" => (
                "file O_DIRECT",
                format!("O_DIRECT; {how}"),
                check_direct(stager, stream, path, m.bytes)?,
            ),
            _ => ("file", m.note.clone(), true),
        };
        rows.push(Row {
            device: stager.device().ordinal().to_string(),
            kind,
            direction: "h2d",
            bytes: m.bytes,
            copies_per_sample: 1,
            gbps: m.gbps.clone(),
            host_gbps: Some(m.gbps),
            host_memcpy_gbps: None,
            verified,
            gate_timed_out: false,
            partly_alone: false,
            note: Some(note),
        });
    }
    Ok(rows)
}

/// One `O_DIRECT` `upload_file` of the first `bytes` of `path`, compared with a plain read.
fn check_direct(
    stager: &Stager,
    stream: &Stream,
    path: &std::path::Path,
    bytes: usize,
) -> Result<bool> {
    use std::io::Read;
    let source = FileSource::open_direct(path)?;
    let mut d = DeviceBuffer::<u8>::new(&stager.device(), bytes)?;
    stager.upload_file(stream, &source, 0, &mut d)?;
    let mut want = pattern(bytes)?;
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut want))
        .map_err(|e| Error::Io {
            op: "bench::sweep::file_rows",
            path: path.display().to_string(),
            offset: 0,
            len: bytes,
            message: e.to_string(),
        })?;
    let mut got = pattern(bytes)?;
    stream.copy_d2h(&d, &mut got[..])?.wait()?;
    Ok(got == want)
}

pub(super) fn empty_stats() -> Stats {
    Stats {
        samples: Vec::new(),
        median: 0.0,
        min: 0.0,
        max: 0.0,
        cv: 0.0,
    }
}

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

/// Pinned (portable) H2D and D2H of `bytes` on every device at once, started together from one
/// gate. GB/s is all bytes over the slowest device's time.
pub fn all_devices(devices: &[Device], bytes: usize, opts: &Options) -> Result<Vec<Row>> {
    let first = devices
        .first()
        .ok_or_else(|| super::invalid("bandwidth", "no devices"))?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces() {
        let whole = Options::default();
        assert_eq!(whole.piece(256 << 20), 256 << 20);
        assert_eq!(whole.piece(0), 1);
        let chunked = Options {
            chunk: Some(16 << 20),
            ..Options::default()
        };
        assert_eq!(chunked.piece(256 << 20), 16 << 20);
        assert_eq!(chunked.piece(4096), 16 << 20);
        // Never more than MAX_PIECES pieces per copy.
        let tiny = Options {
            chunk: Some(4096),
            ..Options::default()
        };
        assert_eq!(tiny.piece(1 << 30), (1 << 30) / MAX_PIECES);
        assert_eq!((1usize << 30).div_ceil(tiny.piece(1 << 30)), MAX_PIECES);
        assert!(((1usize << 30) + 1).div_ceil(tiny.piece((1 << 30) + 1)) <= MAX_PIECES);
    }

    #[test]
    fn row_count_counts_four_bidir_rows() {
        let opts = Options {
            sizes: vec![4096],
            kinds: vec![MemKind::Pinned, MemKind::Pageable],
            directions: vec![Direction::Bidir],
            ..Options::default()
        };
        assert_eq!(opts.row_count(), 4);
    }

    #[test]
    fn staged_rows_are_h2d_and_d2h_only() {
        let opts = Options {
            sizes: vec![4096, 1 << 20],
            kinds: vec![MemKind::Staged],
            ..Options::default()
        };
        // h2d + d2h per size, no bidir; d2d's two rows per size come whatever the kinds.
        assert_eq!(opts.row_count(), 2 * (2 + 2));
        let all = Options {
            sizes: vec![4096],
            ..Options::default()
        };
        // Pinned, write-combined, portable, registered: 2 + 4; pageable and staged: 2; d2d 2.
        assert_eq!(all.row_count(), 4 * 6 + 2 * 2 + 2);
        assert!(Options::default().kinds.contains(&MemKind::Staged));
        assert_eq!(MemKind::parse("staged"), Some(MemKind::Staged));
        assert_eq!(MemKind::Staged.name(), "staged");
        assert_eq!(MemKind::parse("wc"), Some(MemKind::WriteCombined));
    }
}
