//! Copies by the staging engine ([`Stager`]) from and to plain memory (staged h2d and d2h),
//! timed with the host clock.

use std::time::Instant;

use pinstream::staging::Stager;
use pinstream::Result;

use super::{matches, secs, Ctx, Direction, Measured, MemKind, Options, Row};
use crate::bench;

impl Ctx<'_> {
    /// Staged rows: `stager` moves `src` (plain memory) to `dev_a` and `dev_b` to `dst`
    /// (plain memory). The engine's threads do the host side of each copy, so a gate cannot
    /// hold them back; they are timed with the host clock. Only h2d and d2h: the engine has no
    /// bidirectional mode that a gate could release together (no bidir rows), and d2d involves
    /// no host memory (its rows come once per size, not per kind).
    pub(super) fn run_staged(
        &mut self,
        stager: &Stager,
        src: &[u8],
        dst: &mut [u8],
        rows: &mut Vec<Row>,
        progress: &mut dyn FnMut(&Row),
    ) -> Result<()> {
        let how = bench::staging::describe(stager);
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
                        bench::size_name(min_bytes)
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
            .ok_or_else(|| bench::invalid("bandwidth", "staged source shorter than the size"))?;
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
            bench::invalid("bandwidth", "staged destination shorter than the size")
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
}

/// Host-clock samples of a copy the host drives (staged): `op` is one copy that leaves the
/// stream synchronised (upload + synchronize, or download). After one untimed call and one
/// timed call (which sets how many copies make a sample of at least `min_sample_time`), the
/// samples are taken by [`bench::staging::measure`], each `reps` calls of `op`.
fn host_timed(
    opts: &Options,
    bytes: usize,
    mut op: impl FnMut() -> Result<()>,
) -> Result<Measured> {
    op()?;
    let t = Instant::now();
    op()?;
    let reps = opts.reps_for(secs(t.elapsed()));
    let m = bench::staging::measure("", bytes.saturating_mul(reps), opts.min_samples, "", || {
        (0..reps).try_for_each(|_| op())
    })?;
    Ok(Measured {
        host_gbps: Some(m.gbps.clone()),
        gbps: m.gbps,
        reps,
        timed_out: false,
    })
}
