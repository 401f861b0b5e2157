//! The operations of the model test and their random generator.
//!
//! An `Op` names buffers by index (the thread's own device buffers, pinned buffers and plain
//! vectors, plus the read-only buffers all threads share), so the same op drives the real GPU
//! backend, the simulated one and the plain-Rust model. `Gen` draws ops one at a time against
//! the model's current shape (buffer lengths and devices), so a seed fixes the whole sequence.

use std::ops::Range;

use pinstream::{HostAlloc, HostRegister};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::state::Model;

/// The stream an op is queued on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum On {
    /// Stream `index` of `device`: the same few streams are used by every thread.
    Shared { device: usize, index: usize },
    /// A stream made for this op alone and dropped right after it, work still queued.
    Temp { device: usize },
}

impl On {
    pub fn device(self) -> usize {
        match self {
            On::Shared { device, .. } | On::Temp { device } => device,
        }
    }
}

/// Device memory an op reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dev {
    /// The thread's own device buffer `i`.
    Own(usize),
    /// The read-only buffer on `device` that every thread shares.
    Shared(usize),
}

/// Host memory, and the way it is handed to the API.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Host {
    /// Plain vector `k` (pageable), as a sub-slice.
    Plain(usize),
    /// Pinned buffer `j` itself (tracked; always the whole buffer).
    Pinned(usize),
    /// A plain sub-slice of pinned buffer `j`, from `as_slice` / `as_mut_slice`.
    PinnedSlice(usize),
    /// The `Registered` of the open scope itself (tracked; always whole).
    Reg,
    /// A plain sub-slice of the open scope's `Registered`.
    RegSlice,
    /// The shared read-only pinned buffer (whole; a source only).
    SharedPinned,
}

impl Host {
    /// Whether the API takes the buffer itself, so the range is always all of it.
    pub fn whole(self) -> bool {
        matches!(self, Host::Pinned(_) | Host::Reg | Host::SharedPinned)
    }
}

/// What happens to the `Pending` of a device-to-host copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum After {
    /// `wait()`, and the returned slice is compared with the model.
    Wait,
    /// Dropped without waiting; then the destination is read back.
    Drop,
    /// `mem::forget`; with `read`, the destination is read back at once, otherwise the copy is
    /// left in flight for later ops (and the final check) to meet.
    Forget { read: bool },
}

/// One step of a thread's sequence. `spin` (microseconds, 0 for none) queues `Stream::spin` on
/// the op's stream first, so that the op lands late and races with what follows.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    H2d {
        on: On,
        spin: u32,
        src: Host,
        src_range: Range<usize>,
        dst: usize,
        dst_range: Range<usize>,
        /// `InFlight::wait()` instead of dropping it.
        wait: bool,
        /// Overwrite the source range with `data(seed)` right after the call returns.
        clobber: Option<u64>,
    },
    D2h {
        on: On,
        spin: u32,
        src: Dev,
        src_range: Range<usize>,
        dst: Host,
        dst_range: Range<usize>,
        /// Overwrite the destination range with `poison(seed)` before the copy.
        poison: Option<u64>,
        after: After,
    },
    D2d {
        on: On,
        spin: u32,
        src: Dev,
        src_range: Range<usize>,
        dst: usize,
        dst_range: Range<usize>,
    },
    /// `copy_peer` from a buffer on one device to a buffer on another, on a stream of either.
    Peer {
        on: On,
        spin: u32,
        src: Dev,
        src_range: Range<usize>,
        dst: usize,
        dst_range: Range<usize>,
    },
    Memset {
        on: On,
        spin: u32,
        dst: usize,
        range: Range<usize>,
        byte: u8,
    },
    Fill {
        on: On,
        spin: u32,
        dst: usize,
        range: Range<usize>,
        value: u32,
    },
    Iota {
        on: On,
        spin: u32,
        dst: usize,
        range: Range<usize>,
        start: u32,
        step: u32,
    },
    Spin {
        on: On,
        micros: u32,
    },
    /// Host write of `data(seed)` into `range` (pinned and registered: `as_mut_slice`).
    HostWrite {
        host: Host,
        range: Range<usize>,
        seed: u64,
    },
    /// Host read of the whole buffer (pinned and registered: `as_slice`).
    HostRead {
        host: Host,
    },
    /// Device-to-host copy of a whole device buffer into a fresh vector filled with
    /// `poison(poison)`, waited for: a check of the device contents.
    ReadDev {
        on: On,
        src: Dev,
        poison: u64,
    },
    /// Drops device buffer `index` (work may be in flight on it) and puts a new one in its place:
    /// `DeviceBuffer::new_async` on `alloc_on`, or `DeviceBuffer::new`; then `data(seed)` is
    /// copied in on `init_on`.
    NewDev {
        index: usize,
        device: usize,
        alloc_on: Option<On>,
        len: usize,
        init_on: On,
        seed: u64,
    },
    /// Drops pinned buffer `index` and allocates a new one holding `data(seed)`.
    NewPinned {
        index: usize,
        device: usize,
        flags: HostAlloc,
        len: usize,
        seed: u64,
    },
    /// Replaces plain vector `index` with a new one holding `data(seed)`.
    NewPlain {
        index: usize,
        len: usize,
        seed: u64,
    },
    /// `Registered::scope` over plain vector `plain`: the ops up to the matching `ScopeEnd` run
    /// inside it, with `Host::Reg` / `Host::RegSlice` standing for the registered memory.
    ScopeBegin {
        plain: usize,
        device: usize,
        flags: HostRegister,
    },
    ScopeEnd,
}

impl Op {
    /// A short name, for statistics.
    pub fn name(&self) -> &'static str {
        match self {
            Op::H2d { .. } => "h2d",
            Op::D2h {
                after: After::Wait, ..
            } => "d2h+wait",
            Op::D2h {
                after: After::Drop, ..
            } => "d2h+drop",
            Op::D2h {
                after: After::Forget { .. },
                ..
            } => "d2h+forget",
            Op::D2d { .. } => "d2d",
            Op::Peer { .. } => "peer",
            Op::Memset { .. } => "memset",
            Op::Fill { .. } => "fill",
            Op::Iota { .. } => "iota",
            Op::Spin { .. } => "spin",
            Op::HostWrite { .. } => "host-write",
            Op::HostRead { .. } => "host-read",
            Op::ReadDev { .. } => "read-device",
            Op::NewDev { .. } => "new-device-buffer",
            Op::NewPinned { .. } => "new-pinned",
            Op::NewPlain { .. } => "new-plain",
            Op::ScopeBegin { .. } => "registered-scope",
            Op::ScopeEnd => "scope-end",
        }
    }
}

/// The single thing wrong with an op that the generator made invalid on purpose.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Defect {
    /// A device range past the end of its buffer, or with start > end.
    OutOfRange,
    /// Source and destination ranges of different lengths.
    LengthMismatch,
    /// A stream of another device than the buffer's.
    WrongDevice,
    /// A device-to-host copy into memory registered `READ_ONLY`.
    ReadOnly,
}

/// An op and, when it was made invalid on purpose, how.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step {
    pub op: Op,
    pub defect: Option<Defect>,
}

/// What a thread works with.
#[derive(Clone, Debug)]
pub struct Cfg {
    pub devices: usize,
    /// Shared streams per device.
    pub streams: usize,
    pub dev_bufs: usize,
    pub pinned: usize,
    pub plain: usize,
    /// Elements (u32) of the largest device buffer and plain vector.
    pub max_len: usize,
    /// Whether ops may run on a stream of their own that is dropped right after.
    pub temp_streams: bool,
    /// Whether to draw copies between devices (`copy_peer`; two devices or more, which can
    /// reach each other both ways).
    pub peer: bool,
}

impl Cfg {
    /// The largest pinned buffer, which is also the smallest device buffer, so a whole pinned
    /// buffer fits any device buffer.
    pub fn small_len(&self) -> usize {
        (self.max_len / 8).max(1)
    }

    /// Length of the shared buffers.
    pub fn shared_len(&self) -> usize {
        self.small_len()
    }
}

/// Draws ops against a model's shape.
#[derive(Debug)]
pub struct Gen {
    rng: SmallRng,
    cfg: Cfg,
    left: usize,
    in_scope: usize,
    /// The last op left a device-to-host copy into the registered memory in flight.
    reg_in_flight: bool,
}

impl Gen {
    /// `ops` random ops after the allocations that open every sequence.
    pub fn new(cfg: &Cfg, seed: u64, ops: usize) -> Gen {
        Gen {
            rng: SmallRng::seed_from_u64(seed),
            cfg: cfg.clone(),
            left: ops,
            in_scope: 0,
            reg_in_flight: false,
        }
    }

    /// All ops drawn and no scope left open.
    pub fn done(&self, m: &Model) -> bool {
        self.left == 0 && m.scope.is_none() && self.prologue(m).is_none()
    }

    /// The next op for a thread whose state `m` describes.
    pub fn next(&mut self, m: &Model) -> Step {
        if let Some(op) = self.prologue(m) {
            return Step { op, defect: None };
        }
        if m.scope.is_some() {
            self.in_scope += 1;
            // Ending the scope right after a copy into it was left in flight is what shows
            // whether the end of the scope waits for the GPU.
            let in_flight = std::mem::take(&mut self.reg_in_flight);
            if self.left == 0 || self.in_scope > 40 || in_flight || self.rng.random_ratio(1, 10) {
                return Step {
                    op: Op::ScopeEnd,
                    defect: None,
                };
            }
        }
        loop {
            let step = match self.rng.random_range(0..100) {
                0..=13 => self.h2d(m),
                14..=29 => self.d2h(m),
                30..=33 => self.d2d(m),
                34..=37 if self.peer_ok() => self.peer(m),
                34..=37 => self.d2d(m),
                38..=42 => self.memset(m),
                43..=47 => self.fill(m),
                48..=52 => self.iota(m),
                53..=56 => self.spin_op(m),
                57..=63 => self.host_write(m),
                64..=68 => self.host_read(m),
                69..=74 => self.read_dev(m),
                // Buffers are not replaced inside a scope: its ops are skipped when the
                // registration is refused, and the shape must not depend on that.
                75..=77 if m.scope.is_none() => self.new_dev(),
                78..=79 if m.scope.is_none() => self.new_pinned(),
                80 if m.scope.is_none() => self.new_plain(),
                81..=83 if m.scope.is_none() => self.scope_begin(),
                84..=99 => self.invalid(m),
                _ => None,
            };
            if let Some(step) = step {
                self.left = self.left.saturating_sub(1);
                self.reg_in_flight = step.defect.is_none()
                    && matches!(
                        step.op,
                        Op::D2h {
                            dst: Host::Reg,
                            after: After::Forget { read: false },
                            ..
                        }
                    );
                if matches!(step.op, Op::ScopeBegin { .. }) {
                    self.in_scope = 0;
                }
                return step;
            }
        }
    }

    /// Allocation of every buffer at the start.
    fn prologue(&self, m: &Model) -> Option<Op> {
        // Deterministic seeds for the prologue: derived from the slot, not drawn.
        let seed = |kind: u64, i: usize| kind << 32 | i as u64 | 0x5EED_0000_0000_0000;
        let c = &self.cfg;
        if m.dev.len() < c.dev_bufs {
            let i = m.dev.len();
            let device = i % c.devices;
            return Some(Op::NewDev {
                index: i,
                device,
                alloc_on: (i % 2 == 1).then_some(On::Shared {
                    device,
                    index: i % c.streams,
                }),
                len: c.max_len - i * (c.max_len / 8) / c.dev_bufs.max(1),
                init_on: On::Shared {
                    device,
                    index: (i + 1) % c.streams,
                },
                seed: seed(1, i),
            });
        }
        if m.pinned.len() < c.pinned {
            let j = m.pinned.len();
            let flags = [
                HostAlloc::DEFAULT,
                HostAlloc::WRITE_COMBINED,
                HostAlloc::MAPPED | HostAlloc::PORTABLE,
            ][j % 3];
            return Some(Op::NewPinned {
                index: j,
                device: j % c.devices,
                flags,
                len: c.small_len().saturating_sub(j).max(1),
                seed: seed(2, j),
            });
        }
        if m.plain.len() < c.plain {
            let k = m.plain.len();
            return Some(Op::NewPlain {
                index: k,
                len: c.max_len.saturating_sub(3 * k).max(1),
                seed: seed(3, k),
            });
        }
        None
    }

    fn coin(&mut self) -> bool {
        self.rng.random()
    }

    fn seed(&mut self) -> u64 {
        self.rng.random()
    }

    /// A length in 0..=max: sometimes 0, 1-4 or max, otherwise log-uniform.
    fn len_upto(&mut self, max: usize) -> usize {
        if max == 0 {
            return 0;
        }
        match self.rng.random_range(0..32) {
            0 => 0,
            1..=4 => max,
            5..=8 => self.rng.random_range(1..=max.min(4)),
            _ => {
                let e = self.rng.random_range(0.0..=(max as f64).ln());
                (e.exp() as usize).clamp(1, max)
            }
        }
    }

    /// A range of `n` elements inside `0..len`, often at either edge.
    fn range_in(&mut self, len: usize, n: usize) -> Range<usize> {
        let start = match self.rng.random_range(0..4) {
            0 => 0,
            1 => len - n,
            _ => self.rng.random_range(0..=len - n),
        };
        start..start + n
    }

    /// Spin time to queue before an op: none most of the time, else 10 us to 1 ms.
    fn spin(&mut self) -> u32 {
        if self.rng.random_ratio(1, 4) {
            self.micros()
        } else {
            0
        }
    }

    fn micros(&mut self) -> u32 {
        let e = self.rng.random_range(10f64.ln()..=1000f64.ln());
        e.exp() as u32
    }

    fn on(&mut self, device: usize) -> On {
        if self.cfg.temp_streams && self.rng.random_ratio(1, 25) {
            On::Temp { device }
        } else {
            On::Shared {
                device,
                index: self.rng.random_range(0..self.cfg.streams),
            }
        }
    }

    fn pick<T: Copy>(&mut self, from: &[T]) -> Option<T> {
        if from.is_empty() {
            None
        } else {
            Some(from[self.rng.random_range(0..from.len())])
        }
    }

    fn registered_plain(m: &Model) -> Option<usize> {
        m.scope.map(|(k, _)| k)
    }

    /// Host memory a copy may read (`source`) or write.
    fn host(&mut self, m: &Model, source: bool) -> Host {
        let mut hosts = Vec::new();
        for k in 0..m.plain.len() {
            if Some(k) != Self::registered_plain(m) {
                hosts.push(Host::Plain(k));
            }
        }
        for j in 0..m.pinned.len() {
            hosts.extend([Host::Pinned(j), Host::PinnedSlice(j)]);
        }
        if m.scope.is_some() {
            // Weighted up: the scope is short.
            for _ in 0..3 {
                hosts.extend([Host::Reg, Host::RegSlice]);
            }
        }
        if source {
            hosts.push(Host::SharedPinned);
        }
        self.pick(&hosts).expect("host buffers")
    }

    /// One of the thread's device buffers with a length `ok` accepts.
    fn own_dev(&mut self, m: &Model, ok: impl Fn(usize) -> bool) -> Option<usize> {
        let ids: Vec<usize> = (0..m.dev.len()).filter(|&i| ok(m.dev[i].len())).collect();
        self.pick(&ids)
    }

    /// A device buffer to read: own or (less often) shared.
    fn src_dev(&mut self, m: &Model, ok: impl Fn(usize) -> bool) -> Option<Dev> {
        let mut ids: Vec<Dev> = (0..m.dev.len())
            .filter(|&i| ok(m.dev[i].len()))
            .map(Dev::Own)
            .collect();
        if ok(m.shared.len()) && self.rng.random_ratio(1, 5) {
            ids = (0..self.cfg.devices).map(Dev::Shared).collect();
        }
        self.pick(&ids)
    }

    fn h2d(&mut self, m: &Model) -> Option<Step> {
        let src = self.host(m, true);
        let hlen = m.host(src).len();
        let (dst, src_range, dst_range) = if src.whole() {
            let dst = self.own_dev(m, |len| len >= hlen)?;
            let r = self.range_in(m.dev[dst].len(), hlen);
            (dst, 0..hlen, r)
        } else {
            let dst = self.own_dev(m, |_| true)?;
            let dlen = m.dev[dst].len();
            let n = self.len_upto(hlen.min(dlen));
            (dst, self.range_in(hlen, n), self.range_in(dlen, n))
        };
        let on = self.on(m.dev_device[dst]);
        let spin = self.spin();
        let wait = self.rng.random_ratio(1, 8);
        let clobber =
            (src != Host::SharedPinned && self.rng.random_ratio(1, 3)).then(|| self.seed());
        Some(Step {
            op: Op::H2d {
                on,
                spin,
                src,
                src_range,
                dst,
                dst_range,
                wait,
                clobber,
            },
            defect: None,
        })
    }

    fn d2h(&mut self, m: &Model) -> Option<Step> {
        let dst = self.host(m, false);
        let hlen = m.host(dst).len();
        let (src, src_range, dst_range) = if dst.whole() {
            let src = self.src_dev(m, |len| len >= hlen)?;
            let r = self.range_in(m.dev_len(src), hlen);
            (src, r, 0..hlen)
        } else {
            let src = self.src_dev(m, |_| true)?;
            let dlen = m.dev_len(src);
            let n = self.len_upto(hlen.min(dlen));
            (src, self.range_in(dlen, n), self.range_in(hlen, n))
        };
        // An empty plain slice writes nothing: pinstream refuses only destinations that
        // overlap read-only memory by at least one byte.
        let read_only = matches!(dst, Host::Reg | Host::RegSlice)
            && !(matches!(dst, Host::RegSlice) && dst_range.is_empty())
            && m.scope
                .is_some_and(|(_, f)| f.contains(HostRegister::READ_ONLY));
        let defect = read_only.then_some(Defect::ReadOnly);
        let on = self.on(m.dev_device(src));
        let spin = self.spin();
        // Poisoning a tracked buffer waits for the GPU (as_mut_slice), which would close the
        // window a copy in flight leaves open, so whole pinned / registered destinations are
        // poisoned only half of the time. Plain slices are always poisoned.
        let poison = (defect.is_none() && (!dst.whole() || self.coin())).then(|| self.seed());
        let after = match self.rng.random_range(0..5) {
            0 | 1 => After::Wait,
            2 => After::Drop,
            3 => After::Forget { read: true },
            _ => After::Forget { read: false },
        };
        Some(Step {
            op: Op::D2h {
                on,
                spin,
                src,
                src_range,
                dst,
                dst_range,
                poison,
                after,
            },
            defect,
        })
    }

    fn d2d(&mut self, m: &Model) -> Option<Step> {
        let dst = self.own_dev(m, |_| true)?;
        let device = m.dev_device[dst];
        let mut srcs: Vec<Dev> = (0..m.dev.len())
            .filter(|&i| i != dst && m.dev_device[i] == device)
            .map(Dev::Own)
            .collect();
        if srcs.is_empty() || self.rng.random_ratio(1, 5) {
            srcs = vec![Dev::Shared(device)];
        }
        let src = self.pick(&srcs)?;
        let (slen, dlen) = (m.dev_len(src), m.dev[dst].len());
        let n = self.len_upto(slen.min(dlen));
        let (src_range, dst_range) = (self.range_in(slen, n), self.range_in(dlen, n));
        let on = self.on(device);
        let spin = self.spin();
        Some(Step {
            op: Op::D2d {
                on,
                spin,
                src,
                src_range,
                dst,
                dst_range,
            },
            defect: None,
        })
    }

    fn peer_ok(&self) -> bool {
        self.cfg.peer && self.cfg.devices >= 2
    }

    /// A copy from a buffer on another device than the destination's, on a stream of the
    /// source's device (push) or the destination's (pull).
    fn peer(&mut self, m: &Model) -> Option<Step> {
        let dst = self.own_dev(m, |_| true)?;
        let device = m.dev_device[dst];
        let mut srcs: Vec<Dev> = (0..m.dev.len())
            .filter(|&i| m.dev_device[i] != device)
            .map(Dev::Own)
            .collect();
        if srcs.is_empty() || self.rng.random_ratio(1, 5) {
            srcs = (0..self.cfg.devices)
                .filter(|&d| d != device)
                .map(Dev::Shared)
                .collect();
        }
        let src = self.pick(&srcs)?;
        let (slen, dlen) = (m.dev_len(src), m.dev[dst].len());
        let n = self.len_upto(slen.min(dlen));
        let (src_range, dst_range) = (self.range_in(slen, n), self.range_in(dlen, n));
        let on = if self.coin() {
            self.on(m.dev_device(src))
        } else {
            self.on(device)
        };
        let spin = self.spin();
        Some(Step {
            op: Op::Peer {
                on,
                spin,
                src,
                src_range,
                dst,
                dst_range,
            },
            defect: None,
        })
    }

    /// Buffer, stream, spin and range for memset / fill / iota.
    fn kernel_target(&mut self, m: &Model) -> Option<(On, u32, usize, Range<usize>)> {
        let dst = self.own_dev(m, |_| true)?;
        let len = m.dev[dst].len();
        let n = self.len_upto(len);
        let range = self.range_in(len, n);
        Some((self.on(m.dev_device[dst]), self.spin(), dst, range))
    }

    fn memset(&mut self, m: &Model) -> Option<Step> {
        let (on, spin, dst, range) = self.kernel_target(m)?;
        let byte = self.rng.random_range(1..=255);
        let op = Op::Memset {
            on,
            spin,
            dst,
            range,
            byte,
        };
        Some(Step { op, defect: None })
    }

    fn fill(&mut self, m: &Model) -> Option<Step> {
        let (on, spin, dst, range) = self.kernel_target(m)?;
        let value = self.rng.random_range(1..=u32::MAX);
        let op = Op::Fill {
            on,
            spin,
            dst,
            range,
            value,
        };
        Some(Step { op, defect: None })
    }

    fn iota(&mut self, m: &Model) -> Option<Step> {
        let (on, spin, dst, range) = self.kernel_target(m)?;
        // Starts near the top now and then, so the values wrap.
        let start = if self.coin() {
            u32::MAX - self.rng.random_range(0..1000)
        } else {
            self.rng.random()
        };
        let step = self.rng.random_range(1..=u32::MAX);
        let op = Op::Iota {
            on,
            spin,
            dst,
            range,
            start,
            step,
        };
        Some(Step { op, defect: None })
    }

    fn spin_op(&mut self, _m: &Model) -> Option<Step> {
        let device = self.rng.random_range(0..self.cfg.devices);
        let on = self.on(device);
        let micros = self.micros();
        Some(Step {
            op: Op::Spin { on, micros },
            defect: None,
        })
    }

    /// Host memory the host may write: plain, pinned or the registered buffer.
    fn writable_host(&mut self, m: &Model) -> Host {
        match self.host(m, false) {
            Host::PinnedSlice(j) => Host::Pinned(j),
            Host::RegSlice => Host::Reg,
            h => h,
        }
    }

    fn host_write(&mut self, m: &Model) -> Option<Step> {
        let host = self.writable_host(m);
        let len = m.host(host).len();
        let n = self.len_upto(len);
        let range = self.range_in(len, n);
        let seed = self.seed();
        Some(Step {
            op: Op::HostWrite { host, range, seed },
            defect: None,
        })
    }

    fn host_read(&mut self, m: &Model) -> Option<Step> {
        let host = if self.rng.random_ratio(1, 8) {
            Host::SharedPinned
        } else {
            self.writable_host(m)
        };
        Some(Step {
            op: Op::HostRead { host },
            defect: None,
        })
    }

    fn read_dev(&mut self, m: &Model) -> Option<Step> {
        let src = self.src_dev(m, |_| true)?;
        let on = self.on(m.dev_device(src));
        let poison = self.seed();
        Some(Step {
            op: Op::ReadDev { on, src, poison },
            defect: None,
        })
    }

    fn new_dev(&mut self) -> Option<Step> {
        let c = self.cfg.clone();
        let device = self.rng.random_range(0..c.devices);
        let alloc_on = self.coin().then(|| self.on(device));
        let op = Op::NewDev {
            index: self.rng.random_range(0..c.dev_bufs),
            device,
            alloc_on,
            len: self.rng.random_range(c.small_len()..=c.max_len),
            init_on: self.on(device),
            seed: self.seed(),
        };
        Some(Step { op, defect: None })
    }

    fn new_pinned(&mut self) -> Option<Step> {
        let c = self.cfg.clone();
        let mut flags = HostAlloc::DEFAULT;
        for f in [
            HostAlloc::PORTABLE,
            HostAlloc::MAPPED,
            HostAlloc::WRITE_COMBINED,
        ] {
            if self.rng.random_ratio(1, 3) {
                flags = flags | f;
            }
        }
        let op = Op::NewPinned {
            index: self.rng.random_range(0..c.pinned),
            device: self.rng.random_range(0..c.devices),
            flags,
            len: self.rng.random_range(1..=c.small_len()),
            seed: self.seed(),
        };
        Some(Step { op, defect: None })
    }

    fn new_plain(&mut self) -> Option<Step> {
        let c = self.cfg.clone();
        let op = Op::NewPlain {
            index: self.rng.random_range(0..c.plain),
            len: self.rng.random_range(1..=c.max_len),
            seed: self.seed(),
        };
        Some(Step { op, defect: None })
    }

    fn scope_begin(&mut self) -> Option<Step> {
        let mut flags = HostRegister::DEFAULT;
        if self.rng.random_ratio(1, 3) {
            flags = flags | HostRegister::PORTABLE;
        }
        if self.rng.random_ratio(1, 3) {
            flags = flags | HostRegister::MAPPED;
        }
        if self.rng.random_ratio(1, 4) {
            flags = flags | HostRegister::READ_ONLY;
        }
        let op = Op::ScopeBegin {
            plain: self.rng.random_range(0..self.cfg.plain),
            device: self.rng.random_range(0..self.cfg.devices),
            flags,
        };
        Some(Step { op, defect: None })
    }

    /// A range of `len` elements that `slice` must refuse.
    fn bad_range(&mut self, len: usize) -> Range<usize> {
        if self.coin() {
            let start = self.rng.random_range(0..=len);
            start..len + self.rng.random_range(1..=8)
        } else {
            let end = self.rng.random_range(0..=len);
            end + self.rng.random_range(1..=4)..end
        }
    }

    /// An in-bounds range of `0..len` whose length differs from `r`'s.
    fn other_len(&mut self, r: &Range<usize>, len: usize) -> Range<usize> {
        let cur = r.len();
        loop {
            let n = self.len_upto(len);
            if n != cur {
                return self.range_in(len, n);
            }
            if len == 0 {
                // Only 0 fits; cannot happen (device buffers are never empty).
                return self.range_in(len, 0);
            }
        }
    }

    /// A valid op made invalid in exactly one way.
    fn invalid(&mut self, m: &Model) -> Option<Step> {
        let mut step = match self.rng.random_range(0..6) {
            0 => self.h2d(m),
            1 => self.d2h(m),
            2 if self.peer_ok() && self.coin() => self.peer(m),
            2 => self.d2d(m),
            3 => self.memset(m),
            4 => self.fill(m),
            _ => self.iota(m),
        }?;
        if step.defect.is_some() {
            return Some(step);
        }
        let copy = matches!(
            step.op,
            Op::H2d { .. } | Op::D2h { .. } | Op::D2d { .. } | Op::Peer { .. }
        );
        let mut defects = vec![Defect::OutOfRange];
        if copy {
            defects.push(Defect::LengthMismatch);
        }
        // A peer copy on the wrong device needs a third device: its stream may be on either.
        let peer = matches!(step.op, Op::Peer { .. });
        if self.cfg.devices >= if peer { 3 } else { 2 } {
            defects.push(Defect::WrongDevice);
        }
        let defect = self.pick(&defects)?;
        let devices = self.cfg.devices;
        let other_device = move |d: usize| (d + 1) % devices;
        let wrong = defect == Defect::WrongDevice;
        let coin = self.coin();
        // Nothing that changes host memory around a refused call: the check after it compares
        // the destination with the unchanged model.
        match &mut step.op {
            Op::H2d {
                dst,
                dst_range,
                on,
                clobber,
                ..
            } => {
                *clobber = None;
                let len = m.dev[*dst].len();
                match defect {
                    Defect::OutOfRange => *dst_range = self.bad_range(len),
                    Defect::LengthMismatch => *dst_range = self.other_len(dst_range, len),
                    _ => *on = self.on(other_device(m.dev_device[*dst])),
                }
            }
            Op::D2h {
                src,
                src_range,
                on,
                poison,
                ..
            } => {
                *poison = None;
                let len = m.dev_len(*src);
                match defect {
                    Defect::OutOfRange => *src_range = self.bad_range(len),
                    Defect::LengthMismatch => *src_range = self.other_len(src_range, len),
                    _ => *on = self.on(other_device(m.dev_device(*src))),
                }
            }
            Op::D2d {
                src,
                src_range,
                dst,
                dst_range,
                on,
                ..
            } => {
                let (slen, dlen) = (m.dev_len(*src), m.dev[*dst].len());
                match (defect, coin) {
                    (Defect::OutOfRange, true) => *src_range = self.bad_range(slen),
                    (Defect::OutOfRange, false) => *dst_range = self.bad_range(dlen),
                    (Defect::LengthMismatch, _) => *dst_range = self.other_len(dst_range, dlen),
                    _ => *on = self.on(other_device(m.dev_device(*src))),
                }
            }
            Op::Peer {
                src,
                src_range,
                dst,
                dst_range,
                on,
                ..
            } => {
                let (slen, dlen) = (m.dev_len(*src), m.dev[*dst].len());
                let (sd, dd) = (m.dev_device(*src), m.dev_device[*dst]);
                match (defect, coin) {
                    (Defect::OutOfRange, true) => *src_range = self.bad_range(slen),
                    (Defect::OutOfRange, false) => *dst_range = self.bad_range(dlen),
                    (Defect::LengthMismatch, _) => *dst_range = self.other_len(dst_range, dlen),
                    _ => {
                        let third = (0..devices).find(|&d| d != sd && d != dd)?;
                        *on = self.on(third);
                    }
                }
            }
            Op::Memset { dst, range, on, .. }
            | Op::Fill { dst, range, on, .. }
            | Op::Iota { dst, range, on, .. } => {
                if wrong {
                    *on = self.on(other_device(m.dev_device[*dst]));
                } else {
                    *range = self.bad_range(m.dev[*dst].len());
                }
            }
            _ => return None,
        }
        step.defect = Some(defect);
        Some(step)
    }
}
