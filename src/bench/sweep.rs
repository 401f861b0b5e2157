//! The transfer sweep: host memory kinds x directions x sizes, each point gated, warmed up,
//! sampled at least `min_samples` times for at least `min_sample_time` each, and checked.

use std::time::{Duration, Instant};

use super::{gbps, pattern, secs, Gate, Stats};
use crate::copy::{memcpy, trackers};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::event::TimingEvent;
use crate::memory::sealed::DeviceMem;
use crate::memory::{
    tracker, DeviceBuffer, HostAlloc, HostRegister, HostSlice, HostSliceMut, PinnedBuffer,
    Registered,
};
use crate::stream::Stream;
use crate::sys::cudaMemcpyKind as Kind;

/// Copies queued behind a closed gate at most: a stream's queue is finite, and a host blocked on
/// a full queue behind the gate could only wait for the gate's timeout.
const GATE_DEPTH: usize = 128;

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
}

impl MemKind {
    pub const ALL: [MemKind; 5] = [
        MemKind::Pageable,
        MemKind::Pinned,
        MemKind::WriteCombined,
        MemKind::Portable,
        MemKind::Registered,
    ];

    pub fn name(self) -> &'static str {
        match self {
            MemKind::Pageable => "pageable",
            MemKind::Pinned => "pinned",
            MemKind::WriteCombined => "write-combined",
            MemKind::Portable => "portable",
            MemKind::Registered => "registered",
        }
    }

    pub fn parse(s: &str) -> Option<MemKind> {
        MemKind::ALL
            .into_iter()
            .find(|k| k.name() == s || (s == "wc" && *k == MemKind::WriteCombined))
    }
}

/// A copy direction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Direction {
    H2D,
    D2H,
    /// Device to device, reported counted once and as read + write.
    D2D,
    /// H2D and D2H started together; each direction and the sum are reported.
    Bidir,
}

impl Direction {
    pub const ALL: [Direction; 4] = [
        Direction::H2D,
        Direction::D2H,
        Direction::D2D,
        Direction::Bidir,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Direction::H2D => "h2d",
            Direction::D2H => "d2h",
            Direction::D2D => "d2d",
            Direction::Bidir => "bidir",
        }
    }

    pub fn parse(s: &str) -> Option<Direction> {
        Direction::ALL.into_iter().find(|d| d.name() == s)
    }
}

/// What to measure and how hard.
#[derive(Clone, Debug)]
pub struct Options {
    pub sizes: Vec<usize>,
    pub kinds: Vec<MemKind>,
    pub directions: Vec<Direction>,
    pub min_samples: usize,
    pub min_sample_time: Duration,
    pub warmup_samples: usize,
    pub gate_timeout: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            sizes: (12..=30).map(|p| 1usize << p).collect(),
            kinds: MemKind::ALL.to_vec(),
            directions: Direction::ALL.to_vec(),
            min_samples: 5,
            min_sample_time: Duration::from_millis(20),
            warmup_samples: 1,
            gate_timeout: Duration::from_secs(1),
        }
    }
}

impl Options {
    /// How many rows `run` produces, for progress reporting.
    pub fn row_count(&self) -> usize {
        let per_size_kind: usize = self
            .directions
            .iter()
            .map(|d| match d {
                Direction::H2D | Direction::D2H => 1,
                Direction::Bidir => 3,
                Direction::D2D => 0,
            })
            .sum();
        let bidir_pageable =
            self.directions.contains(&Direction::Bidir) && self.kinds.contains(&MemKind::Pageable);
        let d2d = if self.directions.contains(&Direction::D2D) {
            2
        } else {
            0
        };
        self.sizes.len() * (self.kinds.len() * per_size_kind + d2d)
            - if bidir_pageable {
                3 * self.sizes.len()
            } else {
                0
            }
    }
}

/// One measured point.
#[derive(Clone, Debug)]
pub struct Row {
    /// "0", "1", ... or "all".
    pub device: String,
    /// Memory kind name, or "device" for device-to-device.
    pub kind: &'static str,
    /// h2d, d2h, d2d, d2d-rw, bidir-h2d, bidir-d2h, bidir-sum.
    pub direction: &'static str,
    pub bytes: usize,
    pub copies_per_sample: usize,
    /// Decimal GB/s per sample, from CUDA events.
    pub gbps: Stats,
    /// Decimal GB/s per sample from the host clock (pageable copies, which block the host).
    pub host_gbps: Option<Stats>,
    /// The copied data matched the random pattern afterwards.
    pub verified: bool,
    /// A gate kernel gave up before the copies were queued (enqueue time is in the numbers).
    pub gate_timed_out: bool,
}

struct Measured {
    gbps: Stats,
    host_gbps: Option<Stats>,
    reps: usize,
    timed_out: bool,
}

struct Ctx<'o> {
    device: Device,
    opts: &'o Options,
    up: Stream,
    down: Stream,
    gate: Gate,
    pattern: Vec<u8>,
    dev_a: DeviceBuffer<u8>,
    dev_b: DeviceBuffer<u8>,
    check: Vec<u8>,
    ev: [TimingEvent; 4],
}

/// Runs the sweep on `device`; `progress` sees each row as it is measured.
pub fn run(device: &Device, opts: &Options, progress: &mut dyn FnMut(&Row)) -> Result<Vec<Row>> {
    let max = opts
        .sizes
        .iter()
        .copied()
        .max()
        .ok_or_else(|| Error::invalid("bandwidth", "no sizes given"))?;
    if opts.sizes.contains(&0) {
        return Err(Error::invalid("bandwidth", "sizes must be at least 1 byte"));
    }
    let up = device.stream()?;
    let pattern = pattern(max);
    let mut dev_b = DeviceBuffer::<u8>::new(device, max)?;
    up.copy_h2d(&pattern[..], &mut dev_b)?;
    let mut ctx = Ctx {
        device: *device,
        opts,
        down: device.stream()?,
        gate: Gate::new(device, opts.gate_timeout)?,
        dev_a: DeviceBuffer::<u8>::new(device, max)?,
        dev_b,
        check: vec![0u8; max],
        ev: [
            TimingEvent::new(device)?,
            TimingEvent::new(device)?,
            TimingEvent::new(device)?,
            TimingEvent::new(device)?,
        ],
        pattern,
        up,
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
fn matches(got: &[u8], want: &[u8], sparse: bool) -> bool {
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
        D: HostSliceMut<u8> + ?Sized,
    {
        let dirs = self.opts.directions.clone();
        for &b in &self.opts.sizes.clone() {
            for &dir in &dirs {
                let new: Vec<Row> = match dir {
                    Direction::H2D => vec![self.h2d(kind, src, b)?],
                    Direction::D2H => vec![self.d2h(kind, dst, b)?],
                    Direction::Bidir if kind != MemKind::Pageable => {
                        self.bidir(kind, src, dst, b)?
                    }
                    _ => Vec::new(),
                };
                for r in new {
                    progress(&r);
                    rows.push(r);
                }
            }
        }
        Ok(())
    }

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
            verified,
            gate_timed_out: m.timed_out,
        }
    }

    /// Queues `reps` copies of `bytes` on `stream` (one tracked batch: one wait, one record).
    fn queue(
        stream: &Stream,
        trackers: &[&tracker::Tracker],
        dst: *mut std::os::raw::c_void,
        src: *const std::os::raw::c_void,
        bytes: usize,
        kind: Kind,
        reps: usize,
    ) -> Result<()> {
        tracker::ordered(stream, trackers, || {
            for _ in 0..reps {
                memcpy(stream, dst, src, bytes, kind, "bandwidth")?;
            }
            Ok(())
        })
        .map(|_| ())
    }

    /// One sample: (seconds by events, seconds by host clock, gate timed out).
    fn sample(
        &self,
        gated: bool,
        op: &dyn Fn(usize) -> Result<()>,
        reps: usize,
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
            let first = reps.min(GATE_DEPTH);
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
        let (one, _, _) = self.sample(false, op, 1)?;
        let want = secs(self.opts.min_sample_time);
        let reps = ((want / one.max(1e-7)).ceil() as usize).clamp(1, 100_000);
        for _ in 0..self.opts.warmup_samples {
            self.sample(gated, op, reps)?;
        }
        let (mut ev, mut host, mut timed_out) = (Vec::new(), Vec::new(), false);
        for _ in 0..self.opts.min_samples.max(1) {
            let (e, h, t) = self.sample(gated, op, reps)?;
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

    fn h2d<S: HostSlice<u8> + ?Sized>(&mut self, kind: MemKind, src: &S, b: usize) -> Result<Row> {
        let gated = kind != MemKind::Pageable;
        let m = {
            let (h, d) = (src.host_region(), self.dev_a.device_region());
            let trackers = trackers(d.tracker, h.tracker);
            let op = |reps| {
                Self::queue(
                    &self.up,
                    &trackers,
                    d.ptr,
                    h.ptr,
                    b,
                    Kind::cudaMemcpyHostToDevice,
                    reps,
                )
            };
            self.measure(gated, b, &op)?
        };
        let verified = self.check_device(true, b)?;
        Ok(self.row(kind.name(), "h2d", b, &m, verified))
    }

    fn d2h<D: HostSliceMut<u8> + ?Sized>(
        &mut self,
        kind: MemKind,
        dst: &mut D,
        b: usize,
    ) -> Result<Row> {
        let gated = kind != MemKind::Pageable;
        dst.host_write()?[..b].fill(0);
        let m = {
            let (d, h) = (self.dev_b.device_region(), dst.host_region());
            let trackers = trackers(d.tracker, h.tracker);
            let op = |reps| {
                Self::queue(
                    &self.up,
                    &trackers,
                    h.ptr,
                    d.ptr,
                    b,
                    Kind::cudaMemcpyDeviceToHost,
                    reps,
                )
            };
            self.measure(gated, b, &op)?
        };
        let sparse = b > (256 << 20) || kind == MemKind::WriteCombined;
        let verified = matches(&dst.host_read()?[..b], &self.pattern, sparse);
        Ok(self.row(kind.name(), "d2h", b, &m, verified))
    }

    /// Checks the first `b` bytes of `dev_a` (`true`) or `dev_b` against the pattern.
    fn check_device(&mut self, a: bool, b: usize) -> Result<bool> {
        self.check[..b].fill(0);
        let src = if a {
            self.dev_a.slice(..b)?
        } else {
            self.dev_b.slice(..b)?
        };
        let got = self.up.copy_d2h(&src, &mut self.check[..b])?.wait()?;
        Ok(matches(got, &self.pattern, b > (256 << 20)))
    }

    fn bidir<S, D>(&mut self, kind: MemKind, src: &S, dst: &mut D, b: usize) -> Result<Vec<Row>>
    where
        S: HostSlice<u8> + ?Sized,
        D: HostSliceMut<u8> + ?Sized,
    {
        dst.host_write()?[..b].fill(0);
        let (times, reps, timed_out) = {
            let (h_src, d_a) = (src.host_region(), self.dev_a.device_region());
            let (d_b, h_dst) = (self.dev_b.device_region(), dst.host_region());
            let up_tr = trackers(d_a.tracker, h_src.tracker);
            let down_tr = trackers(d_b.tracker, h_dst.tracker);
            let up_op = |reps| {
                Self::queue(
                    &self.up,
                    &up_tr,
                    d_a.ptr,
                    h_src.ptr,
                    b,
                    Kind::cudaMemcpyHostToDevice,
                    reps,
                )
            };
            // Calibrate on one direction alone.
            let (one, _, _) = self.sample(false, &up_op, 1)?;
            let reps = ((secs(self.opts.min_sample_time) / one.max(1e-7)).ceil() as usize)
                .clamp(1, 100_000);
            let [t0u, t1u, t0d, t1d] = &self.ev;
            let rounds = |n: usize| -> Result<()> {
                up_op(n)?;
                Self::queue(
                    &self.down,
                    &down_tr,
                    h_dst.ptr,
                    d_b.ptr,
                    b,
                    Kind::cudaMemcpyDeviceToHost,
                    n,
                )
            };
            let first = reps.min(GATE_DEPTH);
            let mut times = Vec::new();
            let mut timed_out = false;
            for i in 0..self.opts.warmup_samples + self.opts.min_samples.max(1) {
                self.gate.close(&self.up)?;
                self.gate.close(&self.down)?;
                self.up.record(t0u)?;
                self.down.record(t0d)?;
                rounds(first)?;
                timed_out |= !self.gate.open();
                let mut left = reps - first;
                while left > 0 {
                    let n = left.min(32);
                    rounds(n)?;
                    left -= n;
                }
                self.up.record(t1u)?;
                self.down.record(t1d)?;
                t1u.synchronize()?;
                t1d.synchronize()?;
                if i >= self.opts.warmup_samples {
                    let up_s = f64::from(t0u.elapsed_ms(t1u)?) / 1e3;
                    let down_s = f64::from(t0d.elapsed_ms(t1d)?) / 1e3;
                    // The pair started when the gate opened: the sum runs to the later end.
                    let all_s = f64::from(t0u.elapsed_ms(t1u)?.max(t0u.elapsed_ms(t1d)?)) / 1e3;
                    times.push((up_s, down_s, all_s));
                }
            }
            (times, reps, timed_out)
        };
        let moved = (b * reps) as f64;
        let stats = |f: &dyn Fn(&(f64, f64, f64)) -> f64, k: f64| {
            Stats::new(times.iter().map(|t| gbps(k * moved, f(t))).collect())
                .unwrap_or_else(empty_stats)
        };
        let mk = |s: Stats| Measured {
            gbps: s,
            host_gbps: None,
            reps,
            timed_out,
        };
        let ok_up = self.check_device(true, b)?;
        let sparse = b > (256 << 20) || kind == MemKind::WriteCombined;
        let ok_down = matches(&dst.host_read()?[..b], &self.pattern, sparse);
        Ok(vec![
            self.row(
                kind.name(),
                "bidir-h2d",
                b,
                &mk(stats(&|t| t.0, 1.0)),
                ok_up,
            ),
            self.row(
                kind.name(),
                "bidir-d2h",
                b,
                &mk(stats(&|t| t.1, 1.0)),
                ok_down,
            ),
            self.row(
                kind.name(),
                "bidir-sum",
                b,
                &mk(stats(&|t| t.2, 2.0)),
                ok_up && ok_down,
            ),
        ])
    }

    fn d2d(&mut self, b: usize, rows: &mut Vec<Row>, progress: &mut dyn FnMut(&Row)) -> Result<()> {
        let m = {
            let (s, d) = (self.dev_b.device_region(), self.dev_a.device_region());
            let trackers = [s.tracker, d.tracker];
            let op = |reps| {
                Self::queue(
                    &self.up,
                    &trackers,
                    d.ptr,
                    s.ptr,
                    b,
                    Kind::cudaMemcpyDeviceToDevice,
                    reps,
                )
            };
            self.measure(true, b, &op)?
        };
        let verified = self.check_device(true, b)?;
        let once = self.row("device", "d2d", b, &m, verified);
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

fn empty_stats() -> Stats {
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
    pub what: String,
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
    pub what: &'static str,
    pub bytes: usize,
    pub pin_s_per_gib: Stats,
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
            let (alloc, free) = crate::memory::time_alloc_free(device, bytes, flags)?;
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
    let mut data = pattern(bytes); // touched, as a real buffer would be
    let (mut a, mut f) = (Vec::new(), Vec::new());
    for _ in 0..samples.max(1) {
        let (reg, unreg) = crate::memory::time_register(device, &mut data, HostRegister::DEFAULT)?;
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
        .ok_or_else(|| Error::invalid("bandwidth", "no devices"))?;
    let gate = Gate::new(first, opts.gate_timeout)?;
    let pattern = pattern(bytes);
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
    let src = PinnedBuffer::from_slice(first, &pattern, HostAlloc::PORTABLE)?;
    let mut dsts = Vec::new();
    for _ in devices {
        dsts.push(PinnedBuffer::<u8>::new(first, bytes, HostAlloc::PORTABLE)?);
    }
    let mut rows = Vec::new();
    for dir in ["h2d", "d2h"] {
        let reps = ((secs(opts.min_sample_time) * 50e9 / bytes as f64).ceil() as usize)
            .clamp(1, GATE_DEPTH);
        let mut samples = Vec::new();
        let mut timed_out = false;
        for i in 0..opts.warmup_samples + opts.min_samples.max(1) {
            for (p, dst) in per.iter_mut().zip(dsts.iter_mut()) {
                gate.close(&p.s)?;
                p.s.record(&p.t0)?;
                for _ in 0..reps {
                    if dir == "h2d" {
                        drop(p.s.copy_h2d(&src, &mut p.d)?);
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
            verified,
            gate_timed_out: timed_out,
        });
    }
    Ok(rows)
}
