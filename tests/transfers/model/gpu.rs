//! The real backend: every op through pinstream's public API.

use std::time::Duration;

use pinstream::{
    kernels, Device, DeviceBuffer, Error, HostAlloc, HostRegister, PinnedBuffer, Registered, Stream,
};

use super::plan::{After, Dev, Host, On, Op};
use super::run::Backend;
use super::state::{data, poison};

/// Alignment of the memory a `Registered` scope pins: 64 KiB, a multiple of every page size,
/// so two threads' registrations never share a page (the runtime refuses overlapping ones).
pub const REGISTER_ALIGN: usize = 64 << 10;

/// A plain vector whose data starts on a `REGISTER_ALIGN` boundary and is followed by at least
/// that much padding of its own, so registering the data pins no one else's memory.
#[derive(Debug, Default)]
pub struct PageVec {
    buf: Vec<u32>,
    start: usize,
    len: usize,
}

impl PageVec {
    pub fn new(data: &[u32]) -> PageVec {
        let pad = REGISTER_ALIGN / 4;
        let mut buf = vec![0u32; data.len() + 2 * pad];
        let addr = buf.as_ptr() as usize;
        let start = (REGISTER_ALIGN - addr % REGISTER_ALIGN) % REGISTER_ALIGN / 4;
        buf[start..start + data.len()].copy_from_slice(data);
        PageVec {
            buf,
            start,
            len: data.len(),
        }
    }

    pub fn get(&self) -> &[u32] {
        &self.buf[self.start..self.start + self.len]
    }

    pub fn get_mut(&mut self) -> &mut [u32] {
        &mut self.buf[self.start..self.start + self.len]
    }

    /// Bytes of the allocation after the data (for the CPU check of the layout).
    pub fn tail_bytes(&self) -> usize {
        (self.buf.len() - self.start - self.len) * 4
    }
}

/// What all threads share: devices, streams and the read-only buffers.
#[derive(Debug)]
pub struct World {
    pub devices: Vec<Device>,
    /// `streams[device][i]`; the first of each device has the highest priority.
    pub streams: Vec<Vec<Stream>>,
    /// One read-only device buffer per device, all holding the same data.
    pub shared_dev: Vec<DeviceBuffer<u32>>,
    pub shared_pinned: PinnedBuffer<u32>,
}

impl World {
    pub fn new(devices: usize, streams: usize, shared: &[u32]) -> Result<World, Error> {
        let devices: Vec<Device> = (0..devices).map(Device::get).collect::<Result<_, _>>()?;
        let mut all = Vec::new();
        let mut shared_dev = Vec::new();
        for dev in &devices {
            let (_, greatest) = dev.stream_priority_range()?;
            let mut s = vec![Stream::with_priority(dev, greatest)?];
            for _ in 1..streams {
                s.push(dev.stream()?);
            }
            let mut d = DeviceBuffer::<u32>::new(dev, shared.len())?;
            s[0].copy_h2d(shared, &mut d)?;
            d.synchronize()?;
            shared_dev.push(d);
            all.push(s);
        }
        let shared_pinned = PinnedBuffer::from_slice(&devices[0], shared, HostAlloc::PORTABLE)?;
        Ok(World {
            devices,
            streams: all,
            shared_dev,
            shared_pinned,
        })
    }
}

/// One thread's buffers.
#[derive(Debug)]
pub struct Thread<'w> {
    w: &'w World,
    dev: Vec<Option<DeviceBuffer<u32>>>,
    pinned: Vec<Option<PinnedBuffer<u32>>>,
    plain: Vec<PageVec>,
}

impl<'w> Thread<'w> {
    pub fn new(w: &'w World) -> Self {
        Thread {
            w,
            dev: Vec::new(),
            pinned: Vec::new(),
            plain: Vec::new(),
        }
    }
}

/// The backend: a thread's buffers, plus the registered memory while a scope is open.
#[derive(Debug)]
pub struct Exec<'x, 'w, 'r> {
    t: &'x mut Thread<'w>,
    reg: Option<&'x mut Registered<'r, u32>>,
}

impl<'x, 'w> Exec<'x, 'w, 'static> {
    pub fn new(t: &'x mut Thread<'w>) -> Self {
        Exec { t, reg: None }
    }
}

fn put<T>(v: &mut Vec<Option<T>>, i: usize, x: T) {
    if i == v.len() {
        v.push(Some(x));
    } else {
        v[i] = Some(x);
    }
}

fn own<T>(v: &[Option<T>], i: usize) -> &T {
    v[i].as_ref().expect("buffer allocated by the prologue")
}

fn own_mut<T>(v: &mut [Option<T>], i: usize) -> &mut T {
    v[i].as_mut().expect("buffer allocated by the prologue")
}

fn reg_of<'a, 'r>(reg: &'a mut Option<&mut Registered<'r, u32>>) -> &'a mut Registered<'r, u32> {
    reg.as_deref_mut()
        .expect("registered memory outside a scope")
}

/// Runs `$body` with `$d` bound to the destination: the buffer itself when `$range` is all of
/// it (so `DeviceBuffer` and `DeviceViewMut` are both exercised), else a `slice_mut` view.
macro_rules! dst_view {
    ($buf:expr, $range:expr, |$d:ident| $body:expr) => {{
        let buf: &mut DeviceBuffer<u32> = $buf;
        let range = $range;
        if range.start == 0 && range.end == buf.len() {
            let $d = buf;
            $body
        } else {
            let mut view = buf.slice_mut(range)?;
            let $d = &mut view;
            $body
        }
    }};
}

/// As `dst_view`, read-only.
macro_rules! src_view {
    ($buf:expr, $range:expr, |$d:ident| $body:expr) => {{
        let buf: &DeviceBuffer<u32> = $buf;
        let range = $range;
        if range.start == 0 && range.end == buf.len() {
            let $d = buf;
            $body
        } else {
            let view = buf.slice(range)?;
            let $d = &view;
            $body
        }
    }};
}

/// What to do with a device-to-host `Pending`: the data, when waited for.
fn finish(p: pinstream::Pending<'_, u32>, after: After) -> Result<Option<Vec<u32>>, Error> {
    match after {
        After::Wait => Ok(Some(p.wait()?.to_vec())),
        After::Drop => {
            drop(p);
            Ok(None)
        }
        After::Forget { .. } => {
            std::mem::forget(p);
            Ok(None)
        }
    }
}

impl Exec<'_, '_, '_> {
    fn stream(&self, on: On) -> Result<Stream, Error> {
        match on {
            On::Shared { device, index } => Ok(self.t.w.streams[device][index].clone()),
            On::Temp { device } => self.t.w.devices[device].stream(),
        }
    }

    fn spin(s: &Stream, micros: u32) -> Result<(), Error> {
        if micros > 0 {
            s.spin(Duration::from_micros(micros.into()))?;
        }
        Ok(())
    }

    fn dev(&self, d: Dev) -> &DeviceBuffer<u32> {
        match d {
            Dev::Own(i) => own(&self.t.dev, i),
            Dev::Shared(device) => &self.t.w.shared_dev[device],
        }
    }

    /// Host write: pinned and registered memory through `as_mut_slice`, which waits for the GPU.
    fn host_write(
        &mut self,
        h: Host,
        range: std::ops::Range<usize>,
        values: &[u32],
    ) -> Result<(), Error> {
        let slice: &mut [u32] = match h {
            Host::Plain(k) => self.t.plain[k].get_mut(),
            Host::Pinned(j) | Host::PinnedSlice(j) => {
                own_mut(&mut self.t.pinned, j).as_mut_slice()?
            }
            Host::Reg | Host::RegSlice => reg_of(&mut self.reg).as_mut_slice()?,
            Host::SharedPinned => panic!("the shared pinned buffer is read-only"),
        };
        slice[range].copy_from_slice(values);
        Ok(())
    }

    /// Host read: pinned and registered memory through `as_slice`, which waits for the GPU.
    fn host_read(&mut self, h: Host) -> Result<Vec<u32>, Error> {
        Ok(match h {
            Host::Plain(k) => self.t.plain[k].get().to_vec(),
            Host::Pinned(j) | Host::PinnedSlice(j) => own(&self.t.pinned, j).as_slice()?.to_vec(),
            Host::Reg | Host::RegSlice => reg_of(&mut self.reg).as_slice()?.to_vec(),
            Host::SharedPinned => self.t.w.shared_pinned.as_slice()?.to_vec(),
        })
    }

    fn h2d(&mut self, op: &Op) -> Result<(), Error> {
        let Op::H2d {
            on,
            spin,
            src,
            src_range,
            dst,
            dst_range,
            wait,
            clobber,
        } = op
        else {
            unreachable!()
        };
        let s = self.stream(*on)?;
        Self::spin(&s, *spin)?;
        let (t, reg) = (&mut *self.t, &mut self.reg);
        let w = t.w;
        let sr = src_range.clone();
        let flight = dst_view!(
            own_mut(&mut t.dev, *dst),
            dst_range.clone(),
            |d| match *src {
                Host::Plain(k) => s.copy_h2d(&t.plain[k].get()[sr], d)?,
                Host::Pinned(j) => s.copy_h2d(own(&t.pinned, j), d)?,
                Host::PinnedSlice(j) => s.copy_h2d(&own(&t.pinned, j).as_slice()?[sr], d)?,
                Host::Reg => s.copy_h2d(&*reg_of(reg), d)?,
                Host::RegSlice => s.copy_h2d(&reg_of(reg).as_slice()?[sr], d)?,
                Host::SharedPinned => s.copy_h2d(&w.shared_pinned, d)?,
            }
        );
        if *wait {
            flight.wait()?;
        }
        // Reusing the source at once: a plain slice must have been staged (or copied) by the
        // time the call returned; pinned and registered memory wait in `as_mut_slice`.
        if let Some(seed) = clobber {
            self.host_write(*src, src_range.clone(), &data(*seed, src_range.len()))?;
        }
        Ok(())
    }

    fn d2h(&mut self, op: &Op) -> Result<Option<Vec<u32>>, Error> {
        let Op::D2h {
            on,
            spin,
            src,
            src_range,
            dst,
            dst_range,
            poison: poison_seed,
            after,
        } = op
        else {
            unreachable!()
        };
        let s = self.stream(*on)?;
        Self::spin(&s, *spin)?;
        if let Some(seed) = poison_seed {
            self.host_write(*dst, dst_range.clone(), &poison(*seed, dst_range.len()))?;
        }
        let (t, reg) = (&mut *self.t, &mut self.reg);
        let w = t.w;
        let source = match *src {
            Dev::Own(i) => own(&t.dev, i),
            Dev::Shared(device) => &w.shared_dev[device],
        };
        let dr = dst_range.clone();
        let got = src_view!(source, src_range.clone(), |v| match *dst {
            Host::Plain(k) => finish(s.copy_d2h(v, &mut t.plain[k].get_mut()[dr])?, *after)?,
            Host::Pinned(j) => finish(s.copy_d2h(v, own_mut(&mut t.pinned, j))?, *after)?,
            Host::PinnedSlice(j) => finish(
                s.copy_d2h(v, &mut own_mut(&mut t.pinned, j).as_mut_slice()?[dr])?,
                *after,
            )?,
            Host::Reg => finish(s.copy_d2h(v, reg_of(reg))?, *after)?,
            Host::RegSlice => {
                finish(s.copy_d2h(v, &mut reg_of(reg).as_mut_slice()?[dr])?, *after)?
            }
            Host::SharedPinned => panic!("the shared pinned buffer is read-only"),
        });
        match (got, after) {
            (Some(v), _) => Ok(Some(v)),
            (None, After::Drop | After::Forget { read: true }) => {
                // For pinned and registered memory this read waits on the buffer's own event,
                // which is what keeps a forgotten `Pending` safe.
                Ok(Some(self.host_read(*dst)?[dst_range.clone()].to_vec()))
            }
            (None, _) => Ok(None),
        }
    }

    /// `copy_d2d`, or `copy_peer` for `Op::Peer`.
    fn d2d(&mut self, op: &Op) -> Result<(), Error> {
        let (on, spin, src, src_range, dst, dst_range, peer) = match op {
            Op::D2d {
                on,
                spin,
                src,
                src_range,
                dst,
                dst_range,
            } => (on, spin, src, src_range, dst, dst_range, false),
            Op::Peer {
                on,
                spin,
                src,
                src_range,
                dst,
                dst_range,
            } => (on, spin, src, src_range, dst, dst_range, true),
            _ => unreachable!(),
        };
        let s = self.stream(*on)?;
        Self::spin(&s, *spin)?;
        let t = &mut *self.t;
        let (source, target): (&DeviceBuffer<u32>, &mut DeviceBuffer<u32>) = match *src {
            Dev::Shared(device) => (&t.w.shared_dev[device], own_mut(&mut t.dev, *dst)),
            Dev::Own(i) => {
                assert_ne!(i, *dst, "d2d within one buffer");
                let (lo, hi) = t.dev.split_at_mut(i.max(*dst));
                let (a, b) = (&mut lo[i.min(*dst)], &mut hi[0]);
                let (a, b) = (a.as_mut().expect("buffer"), b.as_mut().expect("buffer"));
                if i < *dst {
                    (&*a, b)
                } else {
                    (&*b, a)
                }
            }
        };
        src_view!(source, src_range.clone(), |sv| dst_view!(
            target,
            dst_range.clone(),
            |dv| if peer {
                s.copy_peer(sv, dv)
            } else {
                s.copy_d2d(sv, dv)
            }
        ))
    }

    fn kernel(&mut self, op: &Op) -> Result<(), Error> {
        let (on, spin, dst, range) = match op {
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
            } => (*on, *spin, *dst, range.clone()),
            _ => unreachable!(),
        };
        let s = self.stream(on)?;
        Self::spin(&s, spin)?;
        dst_view!(own_mut(&mut self.t.dev, dst), range, |d| match *op {
            Op::Memset { byte, .. } => s.memset(d, byte),
            Op::Fill { value, .. } => kernels::fill(&s, d, value),
            Op::Iota { start, step, .. } => kernels::iota(&s, d, start, step),
            _ => unreachable!(),
        })
    }
}

impl Backend for Exec<'_, '_, '_> {
    fn exec(&mut self, op: &Op) -> Result<Option<Vec<u32>>, Error> {
        match op {
            Op::H2d { .. } => self.h2d(op).map(|()| None),
            Op::D2h { .. } => self.d2h(op),
            Op::D2d { .. } | Op::Peer { .. } => self.d2d(op).map(|()| None),
            Op::Memset { .. } | Op::Fill { .. } | Op::Iota { .. } => self.kernel(op).map(|()| None),
            Op::Spin { on, micros } => {
                let s = self.stream(*on)?;
                Self::spin(&s, *micros).map(|()| None)
            }
            Op::HostWrite { host, range, seed } => self
                .host_write(*host, range.clone(), &data(*seed, range.len()))
                .map(|()| None),
            Op::HostRead { host } => self.host_read(*host).map(Some),
            Op::ReadDev {
                on,
                src,
                poison: seed,
            } => {
                let s = self.stream(*on)?;
                let d = self.dev(*src);
                let mut out = poison(*seed, d.len());
                s.copy_d2h(d, &mut out[..])?.wait()?;
                Ok(Some(out))
            }
            Op::NewDev {
                index,
                device,
                alloc_on,
                len,
                init_on,
                seed,
            } => {
                // The old buffer goes first, possibly with work still queued on it: its drop
                // must wait for that work (or free stream-ordered) before the memory is reused.
                if let Some(old) = self.t.dev.get_mut(*index) {
                    *old = None;
                }
                let mut buf = match alloc_on {
                    Some(on) => DeviceBuffer::<u32>::new_async(&self.stream(*on)?, *len)?,
                    None => DeviceBuffer::<u32>::new(&self.t.w.devices[*device], *len)?,
                };
                let init = data(*seed, *len);
                self.stream(*init_on)?.copy_h2d(&init[..], &mut buf)?;
                put(&mut self.t.dev, *index, buf);
                Ok(None)
            }
            Op::NewPinned {
                index,
                device,
                flags,
                len,
                seed,
            } => {
                if let Some(old) = self.t.pinned.get_mut(*index) {
                    *old = None;
                }
                let buf = PinnedBuffer::from_slice(
                    &self.t.w.devices[*device],
                    &data(*seed, *len),
                    *flags,
                )?;
                put(&mut self.t.pinned, *index, buf);
                Ok(None)
            }
            Op::NewPlain { index, len, seed } => {
                let v = PageVec::new(&data(*seed, *len));
                if *index == self.t.plain.len() {
                    self.t.plain.push(v);
                } else {
                    self.t.plain[*index] = v;
                }
                Ok(None)
            }
            Op::ScopeBegin { .. } | Op::ScopeEnd => panic!("scopes go through Backend::scope"),
        }
    }

    fn scope(
        &mut self,
        plain: usize,
        device: usize,
        flags: HostRegister,
        body: &mut dyn FnMut(&mut dyn Backend),
    ) -> Result<(), Error> {
        assert!(self.reg.is_none(), "nested scope");
        let dev = self.t.w.devices[device];
        let mut page = std::mem::take(&mut self.t.plain[plain]);
        let t = &mut *self.t;
        let out = Registered::scope(&dev, page.get_mut(), flags, |r| {
            let mut inner = Exec { t, reg: Some(r) };
            body(&mut inner);
        });
        self.t.plain[plain] = page;
        out
    }
}
