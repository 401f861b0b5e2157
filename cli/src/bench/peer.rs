//! Peer-to-peer rows for `pinstream bandwidth --directions p2p`: copies between two GPUs
//! ([`Stream::copy_peer`]'s `cudaMemcpyPeerAsync`), every ordered pair of devices, with the
//! sweep's method: a gate holds the stream while the copies are queued, CUDA events around
//! them, one calibration copy, warm-up samples, at least `min_samples` samples of at least
//! `min_sample_time`, the median, `Options::sizes`, `Options::chunk`, every copy's data
//! checked against a random pattern.
//!
//! Rows per ordered pair `a->b` (the `device` column) and size, kind `peer`:
//!
//! - `p2p`: `a` to `b` on a stream of `a`, the source pushing the data (the counterpart of
//!   nvbandwidth's `device_to_device_memcpy_write_ce`);
//! - `p2p-read`: the same copy on a stream of `b`, the destination pulling it
//!   (`device_to_device_memcpy_read_ce`);
//! - `p2p-bidir`: `a` to `b` while `b` to `a` runs at the same time, each on a stream of its
//!   source, released by one gate; each direction keeps copying after its timed copies until
//!   the other is done, so this rate is taken under load all along (as the sweep's
//!   `bidir-h2d`);
//! - `p2p-bidir-sum`: per sample, that rate plus the reverse direction's in the same run
//!   (the counterpart of nvbandwidth's `device_to_device_bidirectional_memcpy_write_ce`
//!   total). Each ordered pair runs its own bidirectional measurement, so `b->a`'s rows are a
//!   second measurement of the same pair of links.
//!
//! nvbandwidth times the same way (a kernel spinning on a host flag while the copies are
//! queued, events around a loop of copies, the median of its samples); it copies with
//! `cuMemcpyAsync` in the context of the device that drives the copy, 512 MiB by default.

use pinstream::memory::DeviceBuffer;
use pinstream::timing::CopyLoop;
use pinstream::{Device, Error, Result, Stream, TimingEvent};

use super::sweep::{empty_stats, gate_reps, matches, Measured, Options, Row};
use super::{gbps, pattern, Gate, Stats};

/// The row kind of every peer row.
pub const KIND: &str = "peer";

/// The direction names of the rows of one ordered pair and size, in the order they come.
pub const DIRECTIONS: [&str; 4] = ["p2p", "p2p-read", "p2p-bidir", "p2p-bidir-sum"];

/// What [`run`] measured, and what it could not.
#[derive(Clone, Debug, Default)]
pub struct PeerRows {
    /// The rows, pair by pair, size by size, in the order of [`DIRECTIONS`].
    pub rows: Vec<Row>,
    /// Why rows are missing, one line each: fewer than two devices, or a pair without peer
    /// access (skipped whole).
    pub notes: Vec<String>,
}

/// How many rows [`run`] produces for `devices` devices with every pair reachable, for progress
/// reporting.
pub fn row_count(devices: usize, opts: &Options) -> usize {
    devices * devices.saturating_sub(1) * opts.sizes.len() * DIRECTIONS.len()
}

/// The peer rows for every ordered pair of `devices` (see the module's description).
/// `progress` sees each row as it is measured. With fewer than two devices there is nothing to
/// measure: no rows and a note saying so. A pair that cannot reach each other directly both
/// ways ([`Device::can_access_peer`]) is skipped with a note.
pub fn run(devices: &[Device], opts: &Options, progress: &mut dyn FnMut(&Row)) -> Result<PeerRows> {
    let max = opts
        .sizes
        .iter()
        .copied()
        .max()
        .ok_or_else(|| super::invalid("bandwidth p2p", "no sizes given"))?;
    if opts.sizes.contains(&0) {
        return Err(super::invalid(
            "bandwidth p2p",
            "sizes must be at least 1 byte",
        ));
    }
    let mut out = PeerRows::default();
    if devices.len() < 2 {
        out.notes.push(format!(
            "p2p needs two devices; {} {} here: no p2p rows",
            devices.len(),
            if devices.len() == 1 {
                "device is"
            } else {
                "devices are"
            }
        ));
        return Ok(out);
    }
    let pattern = pattern(max)?;
    for &a in devices {
        for &b in devices {
            if a == b {
                continue;
            }
            match (a.enable_peer_access(&b), b.enable_peer_access(&a)) {
                (Ok(()), Ok(())) => {}
                (Err(e @ Error::NoPeerAccess { .. }), _)
                | (_, Err(e @ Error::NoPeerAccess { .. })) => {
                    out.notes.push(format!(
                        "{a}->{b}: skipped: {e}",
                        a = a.ordinal(),
                        b = b.ordinal()
                    ));
                    continue;
                }
                (Err(e), _) | (_, Err(e)) => return Err(e),
            }
            let mut pair = Pair::new(a, b, opts, &pattern, max)?;
            for &bytes in &opts.sizes {
                for row in pair.rows(bytes)? {
                    progress(&row);
                    out.rows.push(row);
                }
            }
        }
    }
    Ok(out)
}

/// What the timed samples of one ordered pair `a -> b` need: its devices, streams, gate and
/// events.
struct Links<'o> {
    a: Device,
    b: Device,
    opts: &'o Options,
    /// Streams of `a` and `b`.
    sa: Stream,
    sb: Stream,
    gate: Gate,
    /// Start, end of the timed copies, end of the extra ones: on `a`, on `b`.
    ev_a: [TimingEvent; 3],
    ev_b: [TimingEvent; 3],
}

/// Everything one ordered pair `a -> b` is measured with.
struct Pair<'o> {
    l: Links<'o>,
    pattern: &'o [u8],
    /// The forward copy's source (holds the pattern) and destination.
    a_src: DeviceBuffer<u8>,
    b_dst: DeviceBuffer<u8>,
    /// The reverse copy's (bidirectional rows).
    b_src: DeviceBuffer<u8>,
    a_dst: DeviceBuffer<u8>,
    check: Vec<u8>,
}

/// One bidirectional sample: seconds of the forward and of the reverse copies, and whether
/// one of them ran partly alone (the other's extra copies ran out first).
struct BidirSample {
    fwd: f64,
    rev: f64,
    partly_alone: bool,
}

fn events(device: &Device) -> Result<[TimingEvent; 3]> {
    Ok([
        TimingEvent::new(device)?,
        TimingEvent::new(device)?,
        TimingEvent::new(device)?,
    ])
}

fn ms(a: &TimingEvent, b: &TimingEvent) -> Result<f64> {
    Ok(f64::from(a.elapsed_ms(b)?) / 1e3)
}

impl Links<'_> {
    fn row(
        &self,
        direction: &'static str,
        bytes: usize,
        m: &Measured,
        verified: bool,
        note: String,
    ) -> Row {
        Row {
            device: format!("{}->{}", self.a.ordinal(), self.b.ordinal()),
            kind: KIND,
            direction,
            bytes,
            copies_per_sample: m.reps,
            gbps: m.gbps.clone(),
            host_gbps: None,
            host_memcpy_gbps: None,
            verified,
            gate_timed_out: m.timed_out,
            partly_alone: false,
            note: Some(note),
        }
    }

    /// One sample of `reps` copies on `stream`, timed by `ev[0]`, `ev[1]` (events of the
    /// stream's device): (seconds, gate timed out).
    fn sample(
        &self,
        stream: &Stream,
        ev: &[TimingEvent; 3],
        gated: bool,
        op: &dyn Fn(usize) -> Result<()>,
        reps: usize,
        bytes: usize,
    ) -> Result<(f64, bool)> {
        let [t0, t1, _] = ev;
        if gated {
            self.gate.close(stream)?;
        }
        stream.record(t0)?;
        let mut timed_out = false;
        if gated {
            let first = reps.min(gate_reps(self.opts, bytes));
            op(first)?;
            timed_out = !self.gate.open();
            op(reps - first)?;
        } else {
            op(reps)?;
        }
        stream.record(t1)?;
        t1.synchronize()?;
        Ok((ms(t0, t1)?, timed_out))
    }

    /// One ungated copy to set the copies per sample, warm-up samples, then the samples.
    fn measure(
        &self,
        stream: &Stream,
        ev: &[TimingEvent; 3],
        bytes: usize,
        op: &dyn Fn(usize) -> Result<()>,
    ) -> Result<Measured> {
        let (one, _) = self.sample(stream, ev, false, op, 1, bytes)?;
        let reps = self.opts.reps_for(one);
        for _ in 0..self.opts.warmup_samples {
            self.sample(stream, ev, true, op, reps, bytes)?;
        }
        let (mut samples, mut timed_out) = (Vec::new(), false);
        for _ in 0..self.opts.min_samples.max(1) {
            let (t, out) = self.sample(stream, ev, true, op, reps, bytes)?;
            samples.push(gbps((bytes * reps) as f64, t));
            timed_out |= out;
        }
        Ok(Measured {
            gbps: Stats::new(samples).unwrap_or_else(empty_stats),
            host_gbps: None,
            reps,
            timed_out,
        })
    }

    /// Warm-up plus samples, and whether the gate timed out.
    fn bidir_pass(
        &self,
        fwd: &dyn Fn(usize) -> Result<()>,
        rev: &dyn Fn(usize) -> Result<()>,
        reps: usize,
        bytes: usize,
    ) -> Result<(Vec<BidirSample>, bool)> {
        let [t0a, t1a, t2a] = &self.ev_a;
        let [t0b, t1b, t2b] = &self.ev_b;
        let both = |n: usize| -> Result<()> {
            fwd(n)?;
            rev(n)
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
        let first = reps.min(gate_reps(self.opts, bytes));
        let extra = reps.div_ceil(2);
        let mut out = Vec::new();
        let mut timed_out = false;
        for i in 0..self.opts.warmup_samples + self.opts.min_samples.max(1) {
            self.gate.close(&self.sa)?;
            self.gate.close(&self.sb)?;
            self.sa.record(t0a)?;
            self.sb.record(t0b)?;
            both(first)?;
            timed_out |= !self.gate.open();
            in_batches(reps - first)?;
            self.sa.record(t1a)?;
            self.sb.record(t1b)?;
            in_batches(extra)?;
            self.sa.record(t2a)?;
            self.sb.record(t2b)?;
            t2a.synchronize()?;
            t2b.synchronize()?;
            if i >= self.opts.warmup_samples {
                let (f, r) = (ms(t0a, t1a)?, ms(t0b, t1b)?);
                let (f_all, r_all) = (ms(t0a, t2a)?, ms(t0b, t2b)?);
                out.push(BidirSample {
                    fwd: f,
                    rev: r,
                    partly_alone: r_all < f || f_all < r,
                });
            }
        }
        Ok((out, timed_out))
    }
}

impl<'o> Pair<'o> {
    fn new(a: Device, b: Device, opts: &'o Options, pattern: &'o [u8], max: usize) -> Result<Self> {
        let (sa, sb) = (a.stream()?, b.stream()?);
        let mut a_src = DeviceBuffer::<u8>::new(&a, max)?;
        let mut b_src = DeviceBuffer::<u8>::new(&b, max)?;
        sa.copy_h2d(pattern, &mut a_src)?;
        sb.copy_h2d(pattern, &mut b_src)?;
        Ok(Pair {
            l: Links {
                a,
                b,
                opts,
                gate: Gate::new(&a, opts.gate_timeout)?,
                ev_a: events(&a)?,
                ev_b: events(&b)?,
                sa,
                sb,
            },
            pattern,
            a_src,
            b_src,
            a_dst: DeviceBuffer::<u8>::new(&a, max)?,
            b_dst: DeviceBuffer::<u8>::new(&b, max)?,
            check: vec![0u8; max],
        })
    }

    /// The four rows of one size.
    fn rows(&mut self, bytes: usize) -> Result<Vec<Row>> {
        let (a, b) = (self.l.a.ordinal(), self.l.b.ordinal());
        let mut rows = Vec::with_capacity(DIRECTIONS.len());
        for (on_source, direction, note) in [
            (true, DIRECTIONS[0], format!("on {a} (push)")),
            (false, DIRECTIONS[1], format!("on {b} (pull)")),
        ] {
            self.clear(bytes)?;
            let m = {
                let l = &self.l;
                let stream = if on_source { &l.sa } else { &l.sb };
                let op = CopyLoop::peer(stream, &self.a_src, &mut self.b_dst, bytes)?
                    .pieces(l.opts.piece(bytes));
                let ev = if on_source { &l.ev_a } else { &l.ev_b };
                l.measure(stream, ev, bytes, &|n| op.queue(n))?
            };
            let verified = self.check(false, bytes)?;
            rows.push(self.l.row(direction, bytes, &m, verified, note));
        }
        rows.extend(self.bidir(bytes)?);
        Ok(rows)
    }

    /// Zeroes the first `bytes` of both destinations (the pattern has no zero byte), each on
    /// its own device's stream; the copies are ordered after it by the trackers.
    fn clear(&mut self, bytes: usize) -> Result<()> {
        self.l.sb.memset(&mut self.b_dst.slice_mut(..bytes)?, 0)?;
        self.l.sa.memset(&mut self.a_dst.slice_mut(..bytes)?, 0)
    }

    /// Checks the first `bytes` of `a_dst` (`true`) or `b_dst` against the pattern.
    fn check(&mut self, on_a: bool, bytes: usize) -> Result<bool> {
        self.check[..bytes].fill(0);
        let (stream, src) = if on_a {
            (&self.l.sa, self.a_dst.slice(..bytes)?)
        } else {
            (&self.l.sb, self.b_dst.slice(..bytes)?)
        };
        let got = stream.copy_d2h(&src, &mut self.check[..bytes])?.wait()?;
        Ok(matches(got, self.pattern, bytes > (256 << 20)))
    }

    /// `a -> b` on `a`'s stream and `b -> a` on `b`'s, released together by the gate; each
    /// keeps copying (`reps / 2` more, untimed) after its timed copies, so that neither runs
    /// alone while the other is timed. Each direction is timed from its own stream's start
    /// event (events of two devices cannot be compared); both start when the gate opens.
    fn bidir(&mut self, bytes: usize) -> Result<Vec<Row>> {
        self.clear(bytes)?;
        let (samples, reps, timed_out) = {
            let l = &self.l;
            let piece = l.opts.piece(bytes);
            let fwd = CopyLoop::peer(&l.sa, &self.a_src, &mut self.b_dst, bytes)?.pieces(piece);
            let rev = CopyLoop::peer(&l.sb, &self.b_src, &mut self.a_dst, bytes)?.pieces(piece);
            let (fwd, rev) = (|n| fwd.queue(n), |n| rev.queue(n));
            let (one, _) = l.sample(&l.sa, &l.ev_a, false, &fwd, 1, bytes)?;
            let reps = l.opts.reps_for(one);
            let (samples, timed_out) = l.bidir_pass(&fwd, &rev, reps, bytes)?;
            (samples, reps, timed_out)
        };
        let moved = (bytes * reps) as f64;
        let fwd: Vec<f64> = samples.iter().map(|s| gbps(moved, s.fwd)).collect();
        let rev: Vec<f64> = samples.iter().map(|s| gbps(moved, s.rev)).collect();
        let sum: Vec<f64> = fwd.iter().zip(&rev).map(|(f, r)| f + r).collect();
        let alone = samples.iter().any(|s| s.partly_alone);
        let ok = self.check(false, bytes)? && self.check(true, bytes)?;
        let stats = |v: Vec<f64>| Stats::new(v).unwrap_or_else(empty_stats);
        let mk = |s: Stats| Measured {
            gbps: s,
            host_gbps: None,
            reps,
            timed_out,
        };
        let (a, b) = (self.l.a.ordinal(), self.l.b.ordinal());
        let mut rows = vec![
            self.l.row(
                DIRECTIONS[2],
                bytes,
                &mk(stats(fwd)),
                ok,
                format!("with {b}->{a} at once, each on its source"),
            ),
            self.l.row(
                DIRECTIONS[3],
                bytes,
                &mk(stats(sum)),
                ok,
                format!("{a}->{b} + {b}->{a}"),
            ),
        ];
        for r in &mut rows {
            r.partly_alone = alone;
        }
        Ok(rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn four_rows_per_ordered_pair_and_size() {
        let opts = Options {
            sizes: vec![4096, 1 << 20, 3],
            ..Options::default()
        };
        assert_eq!(row_count(0, &opts), 0);
        assert_eq!(row_count(1, &opts), 0);
        assert_eq!(row_count(2, &opts), 2 * 3 * 4);
        assert_eq!(row_count(4, &opts), 12 * 3 * 4);
    }
}
