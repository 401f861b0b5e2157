//! The transfer sweep: host memory kinds x directions x sizes, each point gated, warmed up,
//! sampled at least `min_samples` times for at least `min_sample_time` each, and checked.
//! Staged copies ([`MemKind::Staged`]) are done by host threads and cannot be gated: they are
//! timed with the host clock instead, each copy followed by a stream synchronize.
//!
//! This module holds what the measurements share: the options, the rows, the driver ([`run`]),
//! the gated event timer and the checks. Each measurement has its own file: one-way host/device
//! copies (`one_way`), both directions at once (`bidir`), device to device (`d2d`), copies by
//! the staging engine (`staged`), file sources (`file`), small-copy latency (`latency`), the
//! cost of pinning (`pinning`) and every device at once (`all_devices`).

mod all_devices;
mod bidir;
mod d2d;
mod file;
mod latency;
mod one_way;
mod pinning;
mod staged;

use std::time::{Duration, Instant};

use pinstream::memory::{
    DeviceBuffer, HostAlloc, HostRegister, HostSlice, HostSliceMut, PinnedBuffer, Registered,
};
use pinstream::staging::{Stager, StagerConfig};
use pinstream::{Device, Result, Stream, TimingEvent};

use super::{gbps, pattern, secs, Gate, Stats};

pub use all_devices::all_devices;
pub use file::file_rows;
pub use latency::{latency, Latency};
pub use pinning::{pinning_cost, PinCost};

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
