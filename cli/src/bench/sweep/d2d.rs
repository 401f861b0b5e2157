//! Device to device on one GPU: reported counted once (d2d) and as read + write (d2d-rw).

use pinstream::timing::CopyLoop;
use pinstream::Result;

use super::{empty_stats, Ctx, Row, Stats};

impl Ctx<'_> {
    pub(super) fn d2d(
        &mut self,
        b: usize,
        rows: &mut Vec<Row>,
        progress: &mut dyn FnMut(&Row),
    ) -> Result<()> {
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
