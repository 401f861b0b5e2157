//! The plain-Rust model: what every buffer of a thread must hold after each op, if every op ran
//! in program order. Nothing here knows about streams or the GPU.

use std::ops::Range;
use std::sync::Arc;

use pinstream::{Error, HostRegister};
use rand::rngs::SmallRng;
use rand::{RngCore, SeedableRng};

use super::plan::{After, Defect, Dev, Host, On, Op};

/// `len` pseudo-random words from `seed`, none of them zero (zeroed memory never passes for
/// data).
pub fn data(seed: u64, len: usize) -> Vec<u32> {
    let mut rng = SmallRng::seed_from_u64(seed);
    (0..len).map(|_| rng.next_u32().max(1)).collect()
}

/// What a host destination is overwritten with before a device-to-host copy: data of another
/// seed, so an element the copy did not write is told apart from one it wrote.
pub fn poison(seed: u64, len: usize) -> Vec<u32> {
    data(seed ^ 0xD1E5_EA5E_D1E5_EA5E, len)
}

/// The word every element holds after `memset(byte)`.
pub fn memset_word(byte: u8) -> u32 {
    u32::from_ne_bytes([byte; 4])
}

/// `kernels::iota`: `start + i * step`, wrapping.
pub fn iota(start: u32, step: u32, len: usize) -> Vec<u32> {
    (0..len)
        .map(|i| start.wrapping_add(step.wrapping_mul(i as u32)))
        .collect()
}

/// The error the API must return for an invalid op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expect {
    /// `DeviceBuffer::slice` / `slice_mut` refuses the range: `InvalidArgument`.
    OutOfRange,
    LengthMismatch {
        src: usize,
        dst: usize,
    },
    WrongDevice {
        expected: usize,
        found: usize,
    },
    /// A device-to-host copy into read-only registered memory: `InvalidArgument`.
    ReadOnly,
}

impl Expect {
    pub fn defect(self) -> Defect {
        match self {
            Expect::OutOfRange => Defect::OutOfRange,
            Expect::LengthMismatch { .. } => Defect::LengthMismatch,
            Expect::WrongDevice { .. } => Defect::WrongDevice,
            Expect::ReadOnly => Defect::ReadOnly,
        }
    }

    /// Whether `e` is this error. Operation names are matched loosely, the variant and its
    /// numbers exactly.
    pub fn matches(self, e: &Error) -> bool {
        match (self, e) {
            (Expect::OutOfRange, Error::InvalidArgument { op, .. }) => op.contains("slice"),
            (Expect::ReadOnly, Error::InvalidArgument { op, .. }) => op.contains("copy_d2h"),
            (Expect::LengthMismatch { src, dst }, Error::LengthMismatch { src: s, dst: d, .. }) => {
                (src, dst) == (*s, *d)
            }
            (
                Expect::WrongDevice { expected, found },
                Error::WrongDevice {
                    expected: x,
                    found: f,
                    ..
                },
            ) => (expected as i32, found as i32) == (*x, *f),
            _ => false,
        }
    }
}

/// A thread's buffers as they must be.
#[derive(Clone, Debug)]
pub struct Model {
    pub dev: Vec<Vec<u32>>,
    pub dev_device: Vec<usize>,
    pub pinned: Vec<Vec<u32>>,
    pub plain: Vec<Vec<u32>>,
    /// Contents of the shared read-only buffers (the same on every device, and in pinned
    /// memory).
    pub shared: Arc<Vec<u32>>,
    /// The plain vector registered by the open scope, and its flags.
    pub scope: Option<(usize, HostRegister)>,
    pub devices: usize,
}

fn bad(r: &Range<usize>, len: usize) -> bool {
    r.start > r.end || r.end > len
}

impl Model {
    pub fn new(shared: Arc<Vec<u32>>, devices: usize) -> Model {
        Model {
            dev: Vec::new(),
            dev_device: Vec::new(),
            pinned: Vec::new(),
            plain: Vec::new(),
            shared,
            scope: None,
            devices,
        }
    }

    fn reg(&self) -> usize {
        self.scope.expect("a registered buffer outside a scope").0
    }

    pub fn host(&self, h: Host) -> &[u32] {
        match h {
            Host::Plain(k) => &self.plain[k],
            Host::Pinned(j) | Host::PinnedSlice(j) => &self.pinned[j],
            Host::Reg | Host::RegSlice => &self.plain[self.reg()],
            Host::SharedPinned => &self.shared,
        }
    }

    fn host_mut(&mut self, h: Host) -> &mut [u32] {
        match h {
            Host::Plain(k) => &mut self.plain[k],
            Host::Pinned(j) | Host::PinnedSlice(j) => &mut self.pinned[j],
            Host::Reg | Host::RegSlice => {
                let k = self.reg();
                &mut self.plain[k]
            }
            Host::SharedPinned => panic!("the shared pinned buffer is read-only"),
        }
    }

    pub fn dev(&self, d: Dev) -> &[u32] {
        match d {
            Dev::Own(i) => &self.dev[i],
            Dev::Shared(_) => &self.shared,
        }
    }

    pub fn dev_len(&self, d: Dev) -> usize {
        self.dev(d).len()
    }

    pub fn dev_device(&self, d: Dev) -> usize {
        match d {
            Dev::Own(i) => self.dev_device[i],
            Dev::Shared(device) => device,
        }
    }

    fn wrong(on: On, device: usize) -> Option<Expect> {
        (on.device() != device).then_some(Expect::WrongDevice {
            expected: on.device(),
            found: device,
        })
    }

    /// The error `op` must fail with, in the order pinstream checks: views first (they are made
    /// before the call), then lengths, devices, and read-only destinations.
    pub fn expect(&self, op: &Op) -> Option<Expect> {
        let mismatch =
            |src: usize, dst: usize| (src != dst).then_some(Expect::LengthMismatch { src, dst });
        match op {
            Op::H2d {
                on,
                src_range,
                dst,
                dst_range,
                ..
            } => {
                if bad(dst_range, self.dev[*dst].len()) {
                    return Some(Expect::OutOfRange);
                }
                mismatch(src_range.len(), dst_range.len())
                    .or_else(|| Self::wrong(*on, self.dev_device[*dst]))
            }
            Op::D2h {
                on,
                src,
                src_range,
                dst,
                dst_range,
                ..
            } => {
                if bad(src_range, self.dev_len(*src)) {
                    return Some(Expect::OutOfRange);
                }
                // An empty plain slice writes nothing: pinstream refuses only destinations that
                // overlap read-only memory by at least one byte.
                let read_only = matches!(dst, Host::Reg | Host::RegSlice)
                    && !(matches!(dst, Host::RegSlice) && dst_range.is_empty())
                    && self
                        .scope
                        .is_some_and(|(_, f)| f.contains(HostRegister::READ_ONLY));
                mismatch(src_range.len(), dst_range.len())
                    .or_else(|| Self::wrong(*on, self.dev_device(*src)))
                    .or(read_only.then_some(Expect::ReadOnly))
            }
            Op::D2d {
                on,
                src,
                src_range,
                dst,
                dst_range,
                ..
            } => {
                if bad(src_range, self.dev_len(*src)) || bad(dst_range, self.dev[*dst].len()) {
                    return Some(Expect::OutOfRange);
                }
                mismatch(src_range.len(), dst_range.len())
                    .or_else(|| Self::wrong(*on, self.dev_device(*src)))
                    .or_else(|| Self::wrong(*on, self.dev_device[*dst]))
            }
            // `copy_peer`: between devices the stream may be on either; on one device it is
            // `copy_d2d`.
            Op::Peer {
                on,
                src,
                src_range,
                dst,
                dst_range,
                ..
            } => {
                if bad(src_range, self.dev_len(*src)) || bad(dst_range, self.dev[*dst].len()) {
                    return Some(Expect::OutOfRange);
                }
                let (sd, dd) = (self.dev_device(*src), self.dev_device[*dst]);
                mismatch(src_range.len(), dst_range.len()).or_else(|| {
                    if sd == dd {
                        Self::wrong(*on, sd)
                    } else {
                        (on.device() != sd && on.device() != dd).then_some(Expect::WrongDevice {
                            expected: on.device(),
                            found: sd,
                        })
                    }
                })
            }
            Op::Memset { on, dst, range, .. }
            | Op::Fill { on, dst, range, .. }
            | Op::Iota { on, dst, range, .. } => {
                if bad(range, self.dev[*dst].len()) {
                    return Some(Expect::OutOfRange);
                }
                Self::wrong(*on, self.dev_device[*dst])
            }
            Op::ReadDev { on, src, .. } => Self::wrong(*on, self.dev_device(*src)),
            _ => None,
        }
    }

    /// After a refused op: the read that shows its destination unchanged.
    pub fn check_after_refusal(&self, op: &Op, poison: u64) -> Op {
        let read_dev = |i: usize| Op::ReadDev {
            on: On::Shared {
                device: self.dev_device[i],
                index: 0,
            },
            src: Dev::Own(i),
            poison,
        };
        match op {
            Op::D2h { dst, .. } => Op::HostRead {
                host: match *dst {
                    Host::PinnedSlice(j) => Host::Pinned(j),
                    Host::RegSlice => Host::Reg,
                    h => h,
                },
            },
            Op::H2d { dst, .. }
            | Op::D2d { dst, .. }
            | Op::Peer { dst, .. }
            | Op::Memset { dst, .. }
            | Op::Fill { dst, .. }
            | Op::Iota { dst, .. } => read_dev(*dst),
            other => panic!("no check for {other:?}"),
        }
    }

    /// Reads of every buffer, for the end of a sequence.
    pub fn final_checks(&self, poison: u64) -> Vec<Op> {
        let mut ops = Vec::new();
        for i in 0..self.dev.len() {
            ops.push(Op::ReadDev {
                on: On::Shared {
                    device: self.dev_device[i],
                    index: 0,
                },
                src: Dev::Own(i),
                poison: poison ^ i as u64,
            });
        }
        for d in 0..self.devices {
            ops.push(Op::ReadDev {
                on: On::Shared {
                    device: d,
                    index: 0,
                },
                src: Dev::Shared(d),
                poison,
            });
        }
        for j in 0..self.pinned.len() {
            ops.push(Op::HostRead {
                host: Host::Pinned(j),
            });
        }
        for k in 0..self.plain.len() {
            ops.push(Op::HostRead {
                host: Host::Plain(k),
            });
        }
        ops.push(Op::HostRead {
            host: Host::SharedPinned,
        });
        ops
    }

    pub fn begin_scope(&mut self, plain: usize, flags: HostRegister) {
        self.scope = Some((plain, flags));
    }

    pub fn end_scope(&mut self) {
        self.scope = None;
    }

    /// Applies a valid op.
    pub fn apply(&mut self, op: &Op) {
        fn put(v: &mut Vec<Vec<u32>>, i: usize, data: Vec<u32>) {
            if i == v.len() {
                v.push(data);
            } else {
                v[i] = data;
            }
        }
        match op {
            Op::H2d {
                src,
                src_range,
                dst,
                dst_range,
                clobber,
                ..
            } => {
                let part = self.host(*src)[src_range.clone()].to_vec();
                self.dev[*dst][dst_range.clone()].copy_from_slice(&part);
                if let Some(seed) = clobber {
                    self.host_mut(*src)[src_range.clone()]
                        .copy_from_slice(&data(*seed, src_range.len()));
                }
            }
            Op::D2h {
                src,
                src_range,
                dst,
                dst_range,
                ..
            } => {
                let part = self.dev(*src)[src_range.clone()].to_vec();
                self.host_mut(*dst)[dst_range.clone()].copy_from_slice(&part);
            }
            Op::D2d {
                src,
                src_range,
                dst,
                dst_range,
                ..
            }
            | Op::Peer {
                src,
                src_range,
                dst,
                dst_range,
                ..
            } => {
                let part = self.dev(*src)[src_range.clone()].to_vec();
                self.dev[*dst][dst_range.clone()].copy_from_slice(&part);
            }
            Op::Memset {
                dst, range, byte, ..
            } => self.dev[*dst][range.clone()].fill(memset_word(*byte)),
            Op::Fill {
                dst, range, value, ..
            } => self.dev[*dst][range.clone()].fill(*value),
            Op::Iota {
                dst,
                range,
                start,
                step,
                ..
            } => self.dev[*dst][range.clone()].copy_from_slice(&iota(*start, *step, range.len())),
            Op::HostWrite { host, range, seed } => {
                self.host_mut(*host)[range.clone()].copy_from_slice(&data(*seed, range.len()))
            }
            Op::NewDev {
                index,
                device,
                len,
                seed,
                ..
            } => {
                put(&mut self.dev, *index, data(*seed, *len));
                if *index == self.dev_device.len() {
                    self.dev_device.push(*device);
                } else {
                    self.dev_device[*index] = *device;
                }
            }
            Op::NewPinned {
                index, len, seed, ..
            } => put(&mut self.pinned, *index, data(*seed, *len)),
            Op::NewPlain { index, len, seed } => put(&mut self.plain, *index, data(*seed, *len)),
            Op::Spin { .. }
            | Op::HostRead { .. }
            | Op::ReadDev { .. }
            | Op::ScopeBegin { .. }
            | Op::ScopeEnd => {}
        }
    }

    /// What the backend must have read back for `op` (after `apply`), if it reads anything.
    pub fn observe(&self, op: &Op) -> Option<Vec<u32>> {
        match op {
            Op::D2h {
                dst,
                dst_range,
                after,
                ..
            } => match after {
                After::Forget { read: false } => None,
                _ => Some(self.host(*dst)[dst_range.clone()].to_vec()),
            },
            Op::HostRead { host } => Some(self.host(*host).to_vec()),
            Op::ReadDev { src, .. } => Some(self.dev(*src).to_vec()),
            _ => None,
        }
    }

    /// The poison the backend wrote where `op` reads back, to tell "never arrived" apart.
    pub fn poison_of(&self, op: &Op) -> Option<Vec<u32>> {
        match op {
            Op::D2h {
                poison: Some(seed),
                dst_range,
                ..
            } => Some(poison(*seed, dst_range.len())),
            Op::ReadDev {
                src, poison: seed, ..
            } => Some(poison(*seed, self.dev_len(*src))),
            _ => None,
        }
    }
}
