//! A simulated GPU with pinstream's ordering rules, and switches that break one rule each.
//!
//! Streams are queues of commands that run later, in a random interleaving across streams
//! (same-stream order is kept). Each buffer has a tracker as in `memory::tracker`: the event of
//! its last write and the events of the reads queued since (at most one per stream: a later
//! read on the same stream replaces the earlier one). An op that only reads a buffer makes its
//! stream wait for the last write; one that writes it waits for the last write and every read
//! since (events of the op's own stream are skipped: stream order covers them). The op then
//! records its event: a write replaces the whole tracker, a read its stream's entry. Host reads
//! (`as_slice`) wait for the last write; host writes (`as_mut_slice`), drops and the end of a
//! registered scope wait for everything. With `Fault::None` the model test must pass on it;
//! with any other fault it must fail, which shows that the checks in `run` can fail, and which
//! broken guarantee each kind of check catches, without a GPU.

use std::collections::{HashMap, VecDeque};
use std::ops::Range;

use pinstream::{Error, HostRegister};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use super::plan::{After, Dev, Host, On, Op};
use super::run::Backend;
use super::state::{data, iota, memset_word, poison};

/// One broken guarantee.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    None,
    /// An op does not wait for the events of other streams' earlier uses of its buffers (neither
    /// the last write nor the reads since): a device-to-host copy on stream B reads before
    /// stream A's host-to-device copy lands.
    NoCrossStreamWait,
    /// A write waits only for the last write, not for the reads queued since: a kernel or copy
    /// on stream B overwrites a buffer that a copy on stream A (held back by a spin) has not
    /// read yet, or `as_mut_slice` overwrites a pinned source that a queued copy still reads.
    WriteIgnoresReads,
    /// `as_slice` / `as_mut_slice` do not wait: the host reads before a (forgotten) copy into
    /// pinned memory lands, or writes a source that a queued copy has not read yet.
    HostAccessNoWait,
    /// Dropping a buffer does not wait (for its last write or the reads since): its queued work
    /// lands in the memory of the buffer that replaces it (the allocator hands out the same
    /// address).
    DropNoWait,
    /// A host-to-device copy from a plain slice reads the slice when it runs, not when it is
    /// called (e.g. a bounce block handed back too early): overwriting the slice after the
    /// call changes what arrives.
    PageableH2dLazy,
    /// A device-to-host copy into a plain slice returns before the data has arrived.
    PageableD2hAsync,
    /// The end of a `Registered` scope unregisters without waiting for the GPU (its last write
    /// or the reads since).
    ScopeEndNoWait,
    /// A length mismatch is found only after part of the copy was queued.
    ErrorAfterQueue,
    /// A device-to-host copy into memory registered read-only is carried out.
    ReadOnlyAccepted,
}

pub const FAULTS: &[Fault] = &[
    Fault::NoCrossStreamWait,
    Fault::WriteIgnoresReads,
    Fault::HostAccessNoWait,
    Fault::DropNoWait,
    Fault::PageableH2dLazy,
    Fault::PageableD2hAsync,
    Fault::ScopeEndNoWait,
    Fault::ErrorAfterQueue,
    Fault::ReadOnlyAccepted,
];

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Loc {
    Dev(usize),
    Pinned(usize),
    Plain(usize),
    SharedDev(usize),
    SharedPinned,
    Scratch,
}

/// An event: complete when stream `.0` has run `.1` commands.
type Ev = (usize, u64);

/// A buffer's tracker: the event of its last write and those of the reads queued since, at most
/// one per stream.
#[derive(Debug, Default)]
struct Track {
    write: Option<Ev>,
    reads: Vec<Ev>,
}

impl Track {
    /// Every event that stands for a use so far.
    fn all(&self) -> Vec<Ev> {
        self.write.iter().chain(&self.reads).copied().collect()
    }
}

#[derive(Debug)]
enum Cmd {
    Wait(Ev),
    /// Keeps the stream busy for this many scheduler steps.
    Spin(u32),
    Write {
        dst: Loc,
        off: usize,
        data: Vec<u32>,
    },
    Copy {
        src: Loc,
        soff: usize,
        dst: Loc,
        doff: usize,
        len: usize,
    },
}

#[derive(Debug)]
struct Queue {
    device: usize,
    cmds: VecDeque<Cmd>,
    pushed: u64,
    done: u64,
}

#[derive(Debug)]
pub struct Sim {
    fault: Fault,
    rng: SmallRng,
    streams: usize,
    queues: Vec<Queue>,
    mem: HashMap<Loc, Vec<u32>>,
    /// The trackers: each buffer's last write and the reads since.
    track: HashMap<Loc, Track>,
    dev_device: Vec<usize>,
    reg: Option<(usize, HostRegister)>,
    refuse_read_only: bool,
}

fn invalid(op: &'static str, reason: String) -> Error {
    Error::InvalidArgument { op, reason }
}

fn check_range(r: &Range<usize>, len: usize) -> Result<(), Error> {
    if r.start > r.end || r.end > len {
        return Err(invalid(
            "DeviceBuffer::slice (simulated)",
            format!("range {r:?} is outside 0..{len}"),
        ));
    }
    Ok(())
}

fn same_device(op: &'static str, expected: usize, found: usize) -> Result<(), Error> {
    if expected != found {
        return Err(Error::WrongDevice {
            op,
            expected: expected as i32,
            found: found as i32,
        });
    }
    Ok(())
}

/// Each buffer an op touches, once, and whether it writes it (a `Loc` both read and written
/// counts as written).
fn accesses(reads: &[Loc], writes: &[Loc]) -> Vec<(Loc, bool)> {
    let mut out: Vec<(Loc, bool)> = writes.iter().map(|&l| (l, true)).collect();
    for &l in reads {
        if !out.iter().any(|&(o, _)| o == l) {
            out.push((l, false));
        }
    }
    out
}

impl Sim {
    pub fn new(
        devices: usize,
        streams: usize,
        shared: &[u32],
        seed: u64,
        fault: Fault,
        refuse_read_only: bool,
    ) -> Sim {
        let mut mem = HashMap::new();
        for d in 0..devices {
            mem.insert(Loc::SharedDev(d), shared.to_vec());
        }
        mem.insert(Loc::SharedPinned, shared.to_vec());
        let queues = (0..devices * streams)
            .map(|i| Queue {
                device: i / streams,
                cmds: VecDeque::new(),
                pushed: 0,
                done: 0,
            })
            .collect();
        Sim {
            fault,
            rng: SmallRng::seed_from_u64(seed ^ 0x51A1_0000),
            streams,
            queues,
            mem,
            track: HashMap::new(),
            dev_device: Vec::new(),
            reg: None,
            refuse_read_only,
        }
    }

    fn queue(&mut self, on: On) -> usize {
        match on {
            On::Shared { device, index } => device * self.streams + index,
            On::Temp { device } => {
                // Dropped by the caller right away; its commands still run.
                self.queues.push(Queue {
                    device,
                    cmds: VecDeque::new(),
                    pushed: 0,
                    done: 0,
                });
                self.queues.len() - 1
            }
        }
    }

    fn push(&mut self, q: usize, cmd: Cmd) -> Ev {
        let queue = &mut self.queues[q];
        queue.cmds.push_back(cmd);
        queue.pushed += 1;
        (q, queue.pushed)
    }

    /// `tracker::ordered_rw`: wait for the uses `cmd` conflicts with (a buffer read: its last
    /// write; a buffer written: its last write and every read since), queue, record. A `Loc` in
    /// both `reads` and `writes` counts as written.
    fn ordered(&mut self, q: usize, reads: &[Loc], writes: &[Loc], cmd: Cmd) -> Ev {
        let mut waits: Vec<Ev> = Vec::new();
        for (loc, written) in accesses(reads, writes) {
            let Some(t) = self.track.get(&loc) else {
                continue;
            };
            waits.extend(t.write);
            if written && self.fault != Fault::WriteIgnoresReads {
                waits.extend(&t.reads);
            }
        }
        if self.fault != Fault::NoCrossStreamWait {
            waits.sort_unstable();
            waits.dedup();
            for ev in waits {
                if ev.0 != q {
                    self.push(q, Cmd::Wait(ev));
                }
            }
        }
        let ev = self.push(q, cmd);
        for (loc, written) in accesses(reads, writes) {
            let t = self.track.entry(loc).or_default();
            if written {
                // It waited for every earlier use (or should have): it stands for them now.
                t.write = Some(ev);
                t.reads.clear();
            } else if let Some(r) = t.reads.iter_mut().find(|r| r.0 == q) {
                *r = ev;
            } else {
                t.reads.push(ev);
            }
        }
        ev
    }

    fn complete(&self, ev: Ev) -> bool {
        self.queues[ev.0].done >= ev.1
    }

    fn runnable(&self) -> Vec<usize> {
        (0..self.queues.len())
            .filter(|&q| match self.queues[q].cmds.front() {
                None => false,
                Some(Cmd::Wait(ev)) => self.complete(*ev),
                Some(_) => true,
            })
            .collect()
    }

    /// Runs the head command of queue `q`.
    fn step(&mut self, q: usize) {
        if let Some(Cmd::Spin(n)) = self.queues[q].cmds.front_mut() {
            if *n > 0 {
                *n -= 1;
                return;
            }
        }
        let Some(cmd) = self.queues[q].cmds.pop_front() else {
            return;
        };
        self.queues[q].done += 1;
        match cmd {
            Cmd::Wait(_) | Cmd::Spin(_) => {}
            Cmd::Write { dst, off, data } => self.write(dst, off, &data),
            Cmd::Copy {
                src,
                soff,
                dst,
                doff,
                len,
            } => self.copy_now(src, soff, dst, doff, len),
        }
    }

    /// Memory writes out of bounds are dropped: the buffer was replaced by a shorter one.
    fn write(&mut self, dst: Loc, off: usize, data: &[u32]) {
        if let Some(m) = self.mem.get_mut(&dst) {
            if let Some(t) = m.get_mut(off..off + data.len()) {
                t.copy_from_slice(data);
            }
        }
    }

    fn copy_now(&mut self, src: Loc, soff: usize, dst: Loc, doff: usize, len: usize) {
        let part = self
            .mem
            .get(&src)
            .and_then(|m| m.get(soff..soff + len))
            .map(<[u32]>::to_vec);
        if let Some(part) = part {
            self.write(dst, doff, &part);
        }
    }

    /// Lets the "GPU" run a few commands, in a random order across streams.
    fn progress(&mut self) {
        for _ in 0..self.rng.random_range(0..=3) {
            let ready = self.runnable();
            if ready.is_empty() {
                return;
            }
            let q = ready[self.rng.random_range(0..ready.len())];
            self.step(q);
        }
    }

    /// `cudaEventSynchronize`: runs commands (of any stream, in random order) until `ev`.
    fn sync(&mut self, ev: Ev) {
        while !self.complete(ev) {
            let ready = self.runnable();
            assert!(!ready.is_empty(), "simulated deadlock waiting for {ev:?}");
            let q = ready[self.rng.random_range(0..ready.len())];
            self.step(q);
        }
    }

    /// Waits for every use of `loc` so far: a tracker's `synchronize`, as drops and the end of a
    /// scope do it.
    fn sync_all(&mut self, loc: Loc) {
        let evs = self.track.get(&loc).map(Track::all).unwrap_or_default();
        for ev in evs {
            self.sync(ev);
        }
    }

    /// Host access through the tracker: `as_slice` (`write` false) waits for the last write
    /// (`synchronize_writes`), `as_mut_slice` for everything (`synchronize`).
    fn host_wait(&mut self, loc: Loc, write: bool) {
        if self.fault == Fault::HostAccessNoWait {
            return;
        }
        if write && self.fault != Fault::WriteIgnoresReads {
            self.sync_all(loc);
        } else if let Some(ev) = self.track.get(&loc).and_then(|t| t.write) {
            self.sync(ev);
        }
    }

    fn reg_plain(&self) -> usize {
        self.reg.expect("registered memory outside a scope").0
    }

    /// Where host memory lives, and whether the API tracks it (pinned / registered passed as
    /// themselves) or treats it as pageable.
    fn host_loc(&self, h: Host) -> (Loc, bool) {
        match h {
            Host::Plain(k) => (Loc::Plain(k), false),
            Host::Pinned(j) => (Loc::Pinned(j), true),
            Host::PinnedSlice(j) => (Loc::Pinned(j), false),
            Host::Reg => (Loc::Plain(self.reg_plain()), true),
            Host::RegSlice => (Loc::Plain(self.reg_plain()), false),
            Host::SharedPinned => (Loc::SharedPinned, true),
        }
    }

    /// Host access: pinned and registered memory (whole or as slices) through the tracker.
    fn host_access(&mut self, h: Host, write: bool) -> Loc {
        let loc = self.host_loc(h).0;
        if !matches!(h, Host::Plain(_)) {
            self.host_wait(loc, write);
        }
        loc
    }

    fn host_write(&mut self, h: Host, range: Range<usize>, values: &[u32]) {
        let loc = self.host_access(h, true);
        self.write(loc, range.start, values);
    }

    fn host_read(&mut self, h: Host, range: Option<Range<usize>>) -> Vec<u32> {
        let loc = self.host_access(h, false);
        let m = &self.mem[&loc];
        m[range.unwrap_or(0..m.len())].to_vec()
    }

    fn dev_loc(&self, d: Dev) -> (Loc, usize) {
        match d {
            Dev::Own(i) => (Loc::Dev(i), self.dev_device[i]),
            Dev::Shared(device) => (Loc::SharedDev(device), device),
        }
    }

    fn len(&self, loc: Loc) -> usize {
        self.mem[&loc].len()
    }

    /// A length check; with `ErrorAfterQueue` the overlapping part is copied anyway.
    fn same_len(
        &mut self,
        op: &'static str,
        src: Loc,
        sr: &Range<usize>,
        dst: Loc,
        dr: &Range<usize>,
    ) -> Result<(), Error> {
        if sr.len() == dr.len() {
            return Ok(());
        }
        if self.fault == Fault::ErrorAfterQueue {
            let n = sr.len().min(dr.len());
            self.copy_now(src, sr.start, dst, dr.start, n);
        }
        Err(Error::LengthMismatch {
            op,
            src: sr.len(),
            dst: dr.len(),
        })
    }

    fn spin(&mut self, q: usize, micros: u32) {
        if micros > 0 {
            self.push(q, Cmd::Spin(micros / 100 + 1));
        }
    }
}

impl Backend for Sim {
    fn exec(&mut self, op: &Op) -> Result<Option<Vec<u32>>, Error> {
        self.progress();
        match op {
            Op::H2d {
                on,
                spin,
                src,
                src_range,
                dst,
                dst_range,
                wait,
                clobber,
            } => {
                let q = self.queue(*on);
                self.spin(q, *spin);
                let dloc = Loc::Dev(*dst);
                check_range(dst_range, self.len(dloc))?;
                let (hloc, tracked) = self.host_loc(*src);
                self.same_len("Stream::copy_h2d", hloc, src_range, dloc, dst_range)?;
                same_device(
                    "Stream::copy_h2d",
                    self.queues[q].device,
                    self.dev_device[*dst],
                )?;
                if matches!(src, Host::PinnedSlice(_) | Host::RegSlice) {
                    self.host_wait(hloc, false); // as_slice
                }
                if !src_range.is_empty() {
                    // Reads the host source (tracked only when passed as itself), writes the
                    // device destination.
                    let reads = if tracked { vec![hloc] } else { vec![] };
                    let cmd = if tracked || self.fault == Fault::PageableH2dLazy {
                        Cmd::Copy {
                            src: hloc,
                            soff: src_range.start,
                            dst: dloc,
                            doff: dst_range.start,
                            len: src_range.len(),
                        }
                    } else {
                        // Pageable: staged when the call returns.
                        let data = self.mem[&hloc][src_range.clone()].to_vec();
                        Cmd::Write {
                            dst: dloc,
                            off: dst_range.start,
                            data,
                        }
                    };
                    let ev = self.ordered(q, &reads, &[dloc], cmd);
                    if *wait {
                        self.sync(ev);
                    }
                }
                if let Some(seed) = clobber {
                    self.host_write(*src, src_range.clone(), &data(*seed, src_range.len()));
                }
                Ok(None)
            }
            Op::D2h {
                on,
                spin,
                src,
                src_range,
                dst,
                dst_range,
                poison: poison_seed,
                after,
            } => {
                let q = self.queue(*on);
                self.spin(q, *spin);
                if let Some(seed) = poison_seed {
                    self.host_write(*dst, dst_range.clone(), &poison(*seed, dst_range.len()));
                }
                let (sloc, device) = self.dev_loc(*src);
                check_range(src_range, self.len(sloc))?;
                let (hloc, tracked) = self.host_loc(*dst);
                if matches!(dst, Host::PinnedSlice(_) | Host::RegSlice) {
                    self.host_wait(hloc, true); // as_mut_slice
                }
                self.same_len("Stream::copy_d2h", sloc, src_range, hloc, dst_range)?;
                same_device("Stream::copy_d2h", self.queues[q].device, device)?;
                // An empty plain slice writes nothing: pinstream refuses only destinations that
                // overlap read-only memory by at least one byte.
                let read_only = matches!(dst, Host::Reg | Host::RegSlice)
                    && !(matches!(dst, Host::RegSlice) && dst_range.is_empty())
                    && self
                        .reg
                        .is_some_and(|(_, f)| f.contains(HostRegister::READ_ONLY));
                if read_only && self.fault != Fault::ReadOnlyAccepted {
                    return Err(invalid(
                        "Stream::copy_d2h (simulated)",
                        "the destination is registered read-only".into(),
                    ));
                }
                let mut pending = None;
                if !src_range.is_empty() {
                    let cmd = Cmd::Copy {
                        src: sloc,
                        soff: src_range.start,
                        dst: hloc,
                        doff: dst_range.start,
                        len: src_range.len(),
                    };
                    // Reads the device source, writes the host destination (tracked only when
                    // passed as itself).
                    let writes = if tracked { vec![hloc] } else { vec![] };
                    let ev = self.ordered(q, &[sloc], &writes, cmd);
                    if tracked {
                        pending = Some(ev);
                    } else if self.fault != Fault::PageableD2hAsync {
                        self.sync(ev); // pageable: done when the call returns
                    }
                }
                match after {
                    After::Wait => {
                        if let Some(ev) = pending {
                            self.sync(ev);
                        }
                        Ok(Some(self.mem[&hloc][dst_range.clone()].to_vec()))
                    }
                    After::Drop => {
                        if let Some(ev) = pending {
                            self.sync(ev);
                        }
                        Ok(Some(self.host_read(*dst, Some(dst_range.clone()))))
                    }
                    After::Forget { read: true } => {
                        Ok(Some(self.host_read(*dst, Some(dst_range.clone()))))
                    }
                    After::Forget { read: false } => Ok(None),
                }
            }
            Op::D2d {
                on,
                spin,
                src,
                src_range,
                dst,
                dst_range,
            } => {
                let q = self.queue(*on);
                self.spin(q, *spin);
                let (sloc, sdev) = self.dev_loc(*src);
                let dloc = Loc::Dev(*dst);
                check_range(src_range, self.len(sloc))?;
                check_range(dst_range, self.len(dloc))?;
                self.same_len("Stream::copy_d2d", sloc, src_range, dloc, dst_range)?;
                let device = self.queues[q].device;
                same_device("Stream::copy_d2d", device, sdev)?;
                same_device("Stream::copy_d2d", device, self.dev_device[*dst])?;
                if !src_range.is_empty() {
                    let cmd = Cmd::Copy {
                        src: sloc,
                        soff: src_range.start,
                        dst: dloc,
                        doff: dst_range.start,
                        len: src_range.len(),
                    };
                    self.ordered(q, &[sloc], &[dloc], cmd);
                }
                Ok(None)
            }
            Op::Peer {
                on,
                spin,
                src,
                src_range,
                dst,
                dst_range,
            } => {
                const OP: &str = "Stream::copy_peer";
                let q = self.queue(*on);
                self.spin(q, *spin);
                let (sloc, sdev) = self.dev_loc(*src);
                let (dloc, ddev) = (Loc::Dev(*dst), self.dev_device[*dst]);
                check_range(src_range, self.len(sloc))?;
                check_range(dst_range, self.len(dloc))?;
                self.same_len(OP, sloc, src_range, dloc, dst_range)?;
                let device = self.queues[q].device;
                if sdev == ddev || (device != sdev && device != ddev) {
                    same_device(OP, device, sdev)?;
                    same_device(OP, device, ddev)?;
                }
                if !src_range.is_empty() {
                    let cmd = Cmd::Copy {
                        src: sloc,
                        soff: src_range.start,
                        dst: dloc,
                        doff: dst_range.start,
                        len: src_range.len(),
                    };
                    self.ordered(q, &[sloc], &[dloc], cmd);
                }
                Ok(None)
            }
            Op::Memset {
                on,
                spin,
                dst,
                range,
                ..
            }
            | Op::Fill {
                on,
                spin,
                dst,
                range,
                ..
            }
            | Op::Iota {
                on,
                spin,
                dst,
                range,
                ..
            } => {
                let q = self.queue(*on);
                self.spin(q, *spin);
                let dloc = Loc::Dev(*dst);
                check_range(range, self.len(dloc))?;
                same_device("kernel", self.queues[q].device, self.dev_device[*dst])?;
                let n = range.len();
                let values = match op {
                    Op::Memset { byte, .. } => vec![memset_word(*byte); n],
                    Op::Fill { value, .. } => vec![*value; n],
                    Op::Iota { start, step, .. } => iota(*start, *step, n),
                    _ => unreachable!(),
                };
                if n > 0 {
                    let cmd = Cmd::Write {
                        dst: dloc,
                        off: range.start,
                        data: values,
                    };
                    self.ordered(q, &[], &[dloc], cmd);
                }
                Ok(None)
            }
            Op::Spin { on, micros } => {
                let q = self.queue(*on);
                self.spin(q, *micros);
                Ok(None)
            }
            Op::HostWrite { host, range, seed } => {
                self.host_write(*host, range.clone(), &data(*seed, range.len()));
                Ok(None)
            }
            Op::HostRead { host } => Ok(Some(self.host_read(*host, None))),
            Op::ReadDev {
                on,
                src,
                poison: seed,
            } => {
                let q = self.queue(*on);
                let (sloc, device) = self.dev_loc(*src);
                same_device("Stream::copy_d2h", self.queues[q].device, device)?;
                let len = self.len(sloc);
                self.mem.insert(Loc::Scratch, poison(*seed, len));
                let cmd = Cmd::Copy {
                    src: sloc,
                    soff: 0,
                    dst: Loc::Scratch,
                    doff: 0,
                    len,
                };
                // The destination is a fresh plain vector: untracked.
                let ev = self.ordered(q, &[sloc], &[], cmd);
                if self.fault != Fault::PageableD2hAsync {
                    self.sync(ev);
                }
                Ok(Some(self.mem[&Loc::Scratch].clone()))
            }
            Op::NewDev {
                index,
                device,
                alloc_on,
                len,
                init_on,
                seed,
            } => {
                let loc = Loc::Dev(*index);
                if self.fault != Fault::DropNoWait {
                    self.sync_all(loc);
                }
                // The new buffer: same address, fresh tracker, undefined contents.
                self.track.remove(&loc);
                self.mem.insert(loc, vec![0xBAD0_BAD0; *len]);
                if *index == self.dev_device.len() {
                    self.dev_device.push(*device);
                } else {
                    self.dev_device[*index] = *device;
                }
                if let Some(on) = alloc_on {
                    let q = self.queue(*on);
                    // A stream-ordered allocation counts as a write.
                    self.ordered(q, &[], &[loc], Cmd::Spin(0));
                }
                let q = self.queue(*init_on);
                let cmd = Cmd::Write {
                    dst: loc,
                    off: 0,
                    data: data(*seed, *len),
                };
                self.ordered(q, &[], &[loc], cmd);
                Ok(None)
            }
            Op::NewPinned {
                index, len, seed, ..
            } => {
                let loc = Loc::Pinned(*index);
                if self.fault != Fault::DropNoWait {
                    self.sync_all(loc);
                }
                self.track.remove(&loc);
                self.mem.insert(loc, data(*seed, *len));
                Ok(None)
            }
            Op::NewPlain { index, len, seed } => {
                self.mem.insert(Loc::Plain(*index), data(*seed, *len));
                Ok(None)
            }
            Op::ScopeBegin { .. } | Op::ScopeEnd => panic!("scopes go through Backend::scope"),
        }
    }

    fn scope(
        &mut self,
        plain: usize,
        _device: usize,
        flags: HostRegister,
        body: &mut dyn FnMut(&mut dyn Backend),
    ) -> Result<(), Error> {
        self.progress();
        if self.refuse_read_only && flags.contains(HostRegister::READ_ONLY) {
            return Err(invalid(
                "Registered::scope (simulated)",
                "read-only registration is not supported here".into(),
            ));
        }
        self.reg = Some((plain, flags));
        body(self);
        let loc = Loc::Plain(plain);
        if self.fault != Fault::ScopeEndNoWait {
            self.sync_all(loc);
        }
        self.track.remove(&loc);
        self.reg = None;
        Ok(())
    }
}
