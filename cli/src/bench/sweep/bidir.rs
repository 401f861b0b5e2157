//! Both directions at once: H2D and D2H of one host memory kind on two streams released by one
//! gate (bidir-h2d, bidir-d2h, bidir-sum, bidir-pair).

use pinstream::memory::{HostSlice, HostSliceMut};
use pinstream::timing::CopyLoop;
use pinstream::{Result, TimingEvent};

use super::{empty_stats, gbps, matches, Ctx, HostAccess, Measured, MemKind, Row, Stats, Timer};

struct BidirSample {
    up: f64,
    down: f64,
    both: f64,
    partly_alone: bool,
}

impl Timer<'_> {
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
    /// H2D and D2H of `b` bytes on two streams released by one gate. Two passes: in the first
    /// each stream keeps copying after its timed copies until the other is done, so each
    /// direction's rate is taken under load all along (bidir-h2d, bidir-d2h, bidir-sum); the
    /// second is plain, both directions the same copies, timed to the later end (bidir-pair).
    pub(super) fn bidir<S, D>(
        &mut self,
        kind: MemKind,
        src: &S,
        dst: &mut D,
        b: usize,
    ) -> Result<Vec<Row>>
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
}
