//! One-way copies between host memory of one kind and the device (h2d, d2h): gated, timed
//! with CUDA events (pageable copies, which block the host, ungated, with the host clock too).

use pinstream::memory::{HostSlice, HostSliceMut};
use pinstream::timing::CopyLoop;
use pinstream::Result;

use super::{matches, Ctx, HostAccess, MemKind, Row};

impl Ctx<'_> {
    pub(super) fn h2d<S: HostSlice<u8> + ?Sized>(
        &mut self,
        kind: MemKind,
        src: &S,
        b: usize,
    ) -> Result<Row> {
        let gated = kind != MemKind::Pageable;
        let m = {
            let t = &self.t;
            let op = CopyLoop::h2d(&t.up, src, &mut self.dev_a, b)?.pieces(t.opts.piece(b));
            t.measure(gated, b, &|n| op.queue(n))?
        };
        let verified = self.check_device(true, b)?;
        Ok(self.t.row(kind.name(), "h2d", b, &m, verified))
    }

    pub(super) fn d2h<D: HostSliceMut<u8> + HostAccess + ?Sized>(
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
}
