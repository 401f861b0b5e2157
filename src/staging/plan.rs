//! Cutting a list of transfers into pieces that each fit one pinned slot.
//!
//! A *transfer* moves `len` bytes between a host location (an address, or an offset in a file)
//! and a device address. A *piece* is what one worker does with one slot: it copies one or more
//! *segments* between the host and the slot, and moves one or more *runs* between the slot and
//! the device (one DMA each). Consecutive transfers whose device ranges follow each other (within
//! `merge_gap` bytes) share a run, so a thousand small tensors packed together cost one DMA per
//! slot, not a thousand. Only the packed arena merges: it is one allocation whose padding is its
//! own. Separate destinations never do, even when they happen to be adjacent in the address
//! space: a DMA may not cross from one allocation into the next (the runtime refuses it).

use std::ops::Range;

/// One transfer as the caller describes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Transfer {
    /// Host address, or offset in the file.
    pub host: u64,
    /// Device address.
    pub dev: u64,
    pub len: usize,
}

/// Host side of a piece: `len` bytes at `host` go to (or come from) the slot at `slot_off`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Segment {
    pub host: u64,
    pub slot_off: usize,
    pub len: usize,
}

/// Device side of a piece: one DMA of `len` bytes between the slot at `slot_off` and `dev`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Run {
    pub slot_off: usize,
    pub dev: u64,
    pub len: usize,
}

/// The work of one slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Piece {
    pub segments: Range<usize>,
    pub runs: Range<usize>,
    /// The index of the transfer its first segment comes from: of every segment where the plan
    /// was made with [`plan_per_transfer`] (a job reading several files finds each piece's file
    /// by it).
    pub source: usize,
}

/// Every piece of one call.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Plan {
    pub pieces: Vec<Piece>,
    pub segments: Vec<Segment>,
    pub runs: Vec<Run>,
    /// Host bytes moved (the sum of the transfers).
    pub bytes: usize,
}

/// Start of each run in a slot is rounded up to this (DMA-friendly offsets).
const RUN_ALIGN: usize = 256;

/// Cuts `transfers` into pieces of at most `piece` bytes of slot space. Device ranges that
/// follow the previous run within `merge_gap` bytes extend it (the gap is moved too, so only pass
/// `Some` where all destinations lie in one allocation whose gaps belong to the caller); `None`
/// never merges two transfers.
#[cfg(test)]
pub(crate) fn plan(transfers: &[Transfer], piece: usize, merge_gap: Option<u64>) -> Plan {
    plan_ramped(transfers, piece, piece, merge_gap)
}

/// As `plan`, but the first piece holds at most `first` bytes and each next one twice the
/// previous, up to `piece`: the first DMA starts after a small fill instead of a whole slot's.
pub(crate) fn plan_ramped(
    transfers: &[Transfer],
    piece: usize,
    first: usize,
    merge_gap: Option<u64>,
) -> Plan {
    plan_inner(transfers, piece, first, merge_gap, false)
}

/// As [`plan_ramped`] without merging, and a piece never holds bytes of two transfers: each
/// transfer starts a new piece, at offset 0 of its slot, and [`Piece::source`] names the
/// transfer of every segment. For a job whose transfers read several files (one transfer
/// each), where a piece reads one file, and an `O_DIRECT` file's reads start at a block-aligned
/// offset of the slot.
#[cfg(any(test, feature = "safetensors"))]
pub(crate) fn plan_per_transfer(transfers: &[Transfer], piece: usize, first: usize) -> Plan {
    plan_inner(transfers, piece, first, None, true)
}

fn plan_inner(
    transfers: &[Transfer],
    piece: usize,
    first: usize,
    merge_gap: Option<u64>,
    split: bool,
) -> Plan {
    let full = piece.max(RUN_ALIGN);
    let first = first.clamp(RUN_ALIGN, full);
    let limit = |index: usize| -> usize {
        u32::try_from(index)
            .ok()
            .and_then(|i| first.checked_shl(i).filter(|&l| l >> i == first))
            .map_or(full, |l| l.min(full))
    };
    let mut p = Plan::default();
    // Slot bytes used by the open piece, and where its segments and runs start.
    let mut used = 0usize;
    let mut seg_start = 0usize;
    let mut run_start = 0usize;
    // The transfer of the open piece's first segment.
    let mut source = 0usize;
    let close = |p: &mut Plan,
                 used: &mut usize,
                 seg_start: &mut usize,
                 run_start: &mut usize,
                 source: usize| {
        if p.runs.len() > *run_start {
            p.pieces.push(Piece {
                segments: *seg_start..p.segments.len(),
                runs: *run_start..p.runs.len(),
                source,
            });
        }
        *used = 0;
        *seg_start = p.segments.len();
        *run_start = p.runs.len();
    };
    for (index, t) in transfers.iter().enumerate() {
        p.bytes += t.len;
        if split && t.len > 0 {
            close(&mut p, &mut used, &mut seg_start, &mut run_start, source);
        }
        let mut off = 0usize;
        while off < t.len {
            if p.segments.len() == seg_start {
                source = index;
            }
            let piece = limit(p.pieces.len());
            let dev = t.dev + off as u64;
            // Extend the open run, or start a new one.
            let extend = match p.runs.last() {
                Some(r) if p.runs.len() > run_start => merge_gap.and_then(|gap| {
                    let end = r.dev + r.len as u64;
                    (dev >= end && dev - end <= gap).then(|| (dev - end) as usize)
                }),
                _ => None,
            };
            let slot_off = match extend {
                Some(gap) => used + gap,
                None => used.next_multiple_of(RUN_ALIGN),
            };
            if slot_off >= piece {
                close(&mut p, &mut used, &mut seg_start, &mut run_start, source);
                continue;
            }
            let n = (t.len - off).min(piece - slot_off);
            match extend {
                Some(gap) => {
                    if let Some(r) = p.runs.last_mut() {
                        r.len += gap + n;
                    }
                }
                None => p.runs.push(Run {
                    slot_off,
                    dev,
                    len: n,
                }),
            }
            p.segments.push(Segment {
                host: t.host + off as u64,
                slot_off,
                len: n,
            });
            used = slot_off + n;
            off += n;
            if used >= limit(p.pieces.len()) {
                close(&mut p, &mut used, &mut seg_start, &mut run_start, source);
            }
        }
    }
    close(&mut p, &mut used, &mut seg_start, &mut run_start, source);
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Replays a plan on byte arrays: host -> slot -> device, checking every invariant.
    fn replay(transfers: &[Transfer], piece: usize, gap: u64) {
        replay_ramped(transfers, piece, piece, gap);
    }

    /// As `replay`, with a ramp: piece `i` uses at most `first << i` bytes of its slot.
    fn replay_ramped(transfers: &[Transfer], piece: usize, first: usize, gap: u64) {
        let plan = plan_ramped(transfers, piece, first, (gap > 0).then_some(gap));
        let full = piece.max(RUN_ALIGN);
        let first = first.clamp(RUN_ALIGN, full);
        for (i, pc) in plan.pieces.iter().enumerate() {
            let limit = match first.checked_shl(i as u32) {
                Some(l) if l >> i == first => l.min(full),
                _ => full,
            };
            let used = plan.runs[pc.runs.clone()]
                .iter()
                .map(|r| r.slot_off + r.len)
                .max()
                .unwrap_or(0);
            assert!(used <= limit, "piece {i} uses {used} of {limit}");
        }
        let host_len = transfers
            .iter()
            .map(|t| t.host as usize + t.len)
            .max()
            .unwrap_or(0);
        let dev_len = transfers
            .iter()
            .map(|t| t.dev as usize + t.len)
            .max()
            .unwrap_or(0)
            + gap as usize;
        let host: Vec<u8> = (0..host_len).map(|i| (i * 7 + 3) as u8).collect();
        let mut dev = vec![0u8; dev_len];
        let mut written = vec![false; dev_len];
        let mut total = 0;
        for pc in &plan.pieces {
            let mut slot = vec![0xEEu8; piece.max(RUN_ALIGN)];
            for s in &plan.segments[pc.segments.clone()] {
                assert!(s.slot_off + s.len <= slot.len());
                slot[s.slot_off..s.slot_off + s.len]
                    .copy_from_slice(&host[s.host as usize..s.host as usize + s.len]);
                total += s.len;
            }
            for r in &plan.runs[pc.runs.clone()] {
                assert!(r.slot_off + r.len <= slot.len());
                assert_eq!(r.slot_off % RUN_ALIGN, 0);
                let d = r.dev as usize;
                dev[d..d + r.len].copy_from_slice(&slot[r.slot_off..r.slot_off + r.len]);
                written[d..d + r.len].iter_mut().for_each(|w| *w = true);
            }
        }
        assert_eq!(total, transfers.iter().map(|t| t.len).sum::<usize>());
        assert_eq!(plan.bytes, total);
        for t in transfers {
            let (h, d) = (t.host as usize, t.dev as usize);
            assert_eq!(&dev[d..d + t.len], &host[h..h + t.len], "{t:?}");
        }
        if gap == 0 {
            // Nothing outside the transfers is written.
            let mut inside = vec![false; dev_len];
            for t in transfers {
                inside[t.dev as usize..t.dev as usize + t.len]
                    .iter_mut()
                    .for_each(|w| *w = true);
            }
            assert_eq!(written, inside);
        }
    }

    #[test]
    fn one_big_transfer() {
        for len in [1, 255, 256, 4095, 4096, 10_000, 65_536, 100_001] {
            replay(
                &[Transfer {
                    host: 3,
                    dev: 0,
                    len,
                }],
                4096,
                0,
            );
        }
        let p = plan(
            &[Transfer {
                host: 0,
                dev: 0,
                len: 10_000,
            }],
            4096,
            None,
        );
        assert_eq!(p.pieces.len(), 3);
        assert_eq!(p.runs.len(), 3);
    }

    #[test]
    fn scattered_and_packed() {
        // Many small transfers to scattered destinations: one run each, many per piece.
        let scattered: Vec<Transfer> = (0..100)
            .map(|i| Transfer {
                host: i * 1000,
                dev: i * 5000 + 17,
                len: 1000,
            })
            .collect();
        replay(&scattered, 8192, 0);
        let p = plan(&scattered, 8192, None);
        assert_eq!(p.runs.len(), 100);
        assert!(p.pieces.len() < 100 / 4);
        // Packed: destinations 256-aligned with padding: one run per piece.
        let mut dev = 0u64;
        let packed: Vec<Transfer> = (0..100)
            .map(|i| {
                let t = Transfer {
                    host: i * 1000,
                    dev,
                    len: 1000,
                };
                dev += 1024;
                t
            })
            .collect();
        replay(&packed, 8192, 255);
        let p = plan(&packed, 8192, Some(255));
        assert_eq!(p.runs.len(), p.pieces.len());
    }

    #[test]
    fn random_plans() {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for _ in 0..300 {
            let n = (next() % 20) as usize;
            let piece = 256 * (1 + (next() % 40) as usize);
            let gap = if next() % 2 == 0 { 0 } else { 255 };
            let (mut h, mut d) = (0u64, 0u64);
            let ts: Vec<Transfer> = (0..n)
                .map(|_| {
                    let len = (next() % 20_000) as usize;
                    d += next() % 300;
                    let t = Transfer {
                        host: h,
                        dev: d,
                        len,
                    };
                    h += len as u64 + next() % 5;
                    d += len as u64;
                    t
                })
                .collect();
            replay(&ts, piece, gap);
            let first = 256 * (1 + (next() % 8) as usize);
            replay_ramped(&ts, piece, first, gap);
        }
    }

    #[test]
    fn ramp_starts_small_and_doubles() {
        let t = [Transfer {
            host: 0,
            dev: 0,
            len: 8 << 20,
        }];
        let p = plan_ramped(&t, 2 << 20, 256 << 10, None);
        let sizes: Vec<usize> = p.runs.iter().map(|r| r.len).collect();
        assert_eq!(&sizes[..4], &[256 << 10, 512 << 10, 1 << 20, 2 << 20]);
        assert!(sizes[4..].iter().all(|&s| s <= 2 << 20));
        assert_eq!(sizes.iter().sum::<usize>(), 8 << 20);
        replay_ramped(&t[..], 2 << 20, 256 << 10, 0);
    }

    #[test]
    fn adjacent_destinations_are_not_merged() {
        // Two allocations that happen to touch: one DMA each, never one across both.
        let ts = [
            Transfer {
                host: 0,
                dev: 4096,
                len: 1000,
            },
            Transfer {
                host: 1000,
                dev: 5096,
                len: 1000,
            },
        ];
        assert_eq!(plan(&ts, 65536, None).runs.len(), 2);
        assert_eq!(plan(&ts, 65536, Some(255)).runs.len(), 1);
        replay(&ts, 65536, 0);
    }

    /// A job over several files: each transfer reads its own file (host offsets of different
    /// transfers may be the same numbers), so a piece must hold one transfer's bytes, named by
    /// its `source`, starting at offset 0 of the slot (O_DIRECT reads are block-aligned there).
    #[test]
    fn per_transfer_pieces_read_one_file_each() {
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        for round in 0..300 {
            let n = (next() % 6) as usize;
            let piece = 4096 * (1 + (next() % 8) as usize);
            let first = 4096 * (1 + (next() % 2) as usize);
            // Files of random lengths; transfer i reads file i from a random offset into a
            // destination range 256-aligned after the previous one.
            let mut files = Vec::new();
            let mut ts = Vec::new();
            let mut d = 0u64;
            for i in 0..n {
                let len = (next() % 30_000) as usize;
                let start = next() % 5000;
                let file: Vec<u8> = (0..start as usize + len)
                    .map(|j| (j as u64 * 13 + i as u64 * 101 + round) as u8)
                    .collect();
                files.push(file);
                ts.push(Transfer {
                    host: start,
                    dev: d,
                    len,
                });
                d = (d + len as u64).next_multiple_of(256);
            }
            let plan = plan_per_transfer(&ts, piece, first);
            let mut dev = vec![0u8; d as usize];
            for (i, pc) in plan.pieces.iter().enumerate() {
                let t = ts[pc.source];
                assert!(t.len > 0, "round {round}: a piece of an empty transfer");
                let segs = &plan.segments[pc.segments.clone()];
                let runs = &plan.runs[pc.runs.clone()];
                assert_eq!((segs.len(), runs.len()), (1, 1), "round {round} piece {i}");
                let (s, r) = (segs[0], runs[0]);
                assert_eq!(
                    (s.slot_off, r.slot_off, s.len),
                    (0, 0, r.len),
                    "round {round}"
                );
                assert!(
                    s.host >= t.host && s.host + s.len as u64 <= t.host + t.len as u64,
                    "round {round} piece {i}: {s:?} outside {t:?}"
                );
                // Each piece after the first of a transfer starts where the previous ended, at
                // a multiple of the (4096-multiple) piece sizes from the transfer's start.
                assert_eq!((s.host - t.host) % 4096, 0, "round {round} piece {i}");
                let h = s.host as usize;
                let to = r.dev as usize;
                dev[to..to + r.len].copy_from_slice(&files[pc.source][h..h + s.len]);
            }
            for (i, t) in ts.iter().enumerate() {
                let (h, to) = (t.host as usize, t.dev as usize);
                assert_eq!(
                    &dev[to..to + t.len],
                    &files[i][h..h + t.len],
                    "round {round}: transfer {i}"
                );
            }
            assert_eq!(plan.bytes, ts.iter().map(|t| t.len).sum::<usize>());
        }
    }

    #[test]
    fn empty() {
        assert!(plan(&[], 4096, None).pieces.is_empty());
        let p = plan(
            &[Transfer {
                host: 0,
                dev: 0,
                len: 0,
            }],
            4096,
            None,
        );
        assert!(p.pieces.is_empty());
    }
}
