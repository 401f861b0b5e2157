//! Which samples each epoch visits, in which order, on which rank: a per-epoch shuffle from a
//! seed (the same seed and epoch give the same order on every machine), sharding by rank and
//! world size with `torch.utils.data.DistributedSampler`'s semantics (disjoint shares of equal
//! length, padded by wrapping around or cut with `drop_last`), then batches (the last one
//! short, or dropped), with a resumable position for checkpoints.
//!
//! ```
//! use pinstream_vision::sampler::Sampler;
//! // 10 samples, 2 ranks, shuffled with seed 7; rank 1's batches of 2 in epoch 3, from batch 1.
//! let s = Sampler::new(10).shuffle(7).shard(1, 2).unwrap();
//! let batches: Vec<Vec<usize>> = s.batches(3, 2, false).unwrap().skip(1).collect();
//! assert_eq!(batches.len(), 2); // 5 samples per rank: [2, 2, 1], from the second batch
//! ```

use crate::augment::Rng;
use pinstream::{Error, Result};

/// The samples of a dataset of `len` items an epoch visits on one rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sampler {
    len: usize,
    seed: Option<u64>,
    rank: usize,
    world: usize,
    drop_uneven: bool,
}

impl Sampler {
    /// All `len` samples in order, one rank.
    pub fn new(len: usize) -> Sampler {
        Sampler {
            len,
            seed: None,
            rank: 0,
            world: 1,
            drop_uneven: false,
        }
    }

    /// Shuffled each epoch: the order is a function of `seed` and the epoch only.
    pub fn shuffle(mut self, seed: u64) -> Sampler {
        self.seed = Some(seed);
        self
    }

    /// This rank's share of `world` (DistributedSampler's `rank`, `num_replicas`): every rank
    /// gets as many samples; the shares are disjoint where `len` divides evenly, else padded
    /// with the first samples again. `Error::InvalidArgument` when `rank >= world` or
    /// `world == 0`.
    pub fn shard(mut self, rank: usize, world: usize) -> Result<Sampler> {
        if world == 0 || rank >= world {
            return Err(Error::invalid(
                "sampler::Sampler::shard",
                format!("rank {rank} of world {world}"),
            ));
        }
        self.rank = rank;
        self.world = world;
        Ok(self)
    }

    /// DistributedSampler's `drop_last`: cut the tail that does not divide by the world size
    /// instead of padding it.
    pub fn drop_uneven(mut self, drop: bool) -> Sampler {
        self.drop_uneven = drop;
        self
    }

    /// Samples per rank and epoch (DistributedSampler's `num_samples`).
    pub fn per_rank(&self) -> usize {
        if self.drop_uneven && self.len % self.world != 0 {
            self.len / self.world
        } else {
            self.len.div_ceil(self.world)
        }
    }

    /// This rank's sample indices in epoch `epoch`, in order. `Error::InvalidArgument` where
    /// the host cannot hold the list.
    pub fn indices(&self, epoch: u64) -> Result<Vec<usize>> {
        let n = self.len;
        let per = self.per_rank();
        let total = per
            .checked_mul(self.world)
            .ok_or_else(|| Error::invalid("sampler::Sampler::indices", "size overflows"))?;
        let mut all = crate::util::try_vec::<usize>("sampler::Sampler::indices", n)?;
        all.extend(0..n);
        if let Some(seed) = self.seed {
            // Fisher-Yates from the end, one draw per position.
            let mut rng = Rng::new(seed, epoch);
            for i in (1..n).rev() {
                let j = rng.below(i as u64 + 1) as usize;
                all.swap(i, j);
            }
        }
        let mut out = crate::util::try_vec::<usize>("sampler::Sampler::indices", per)?;
        // Position k of the padded (or cut) list is all[k % n]; this rank takes k = rank,
        // rank + world, ... below total.
        if n > 0 {
            out.extend((self.rank..total).step_by(self.world).map(|k| all[k % n]));
        }
        Ok(out)
    }

    /// This rank's batches of `batch` samples in epoch `epoch`; the last one short, or left
    /// out with `drop_last`. An iterator: `.skip(k)` resumes at batch `k` (a checkpoint's
    /// position). `Error::InvalidArgument` for `batch == 0`.
    pub fn batches(&self, epoch: u64, batch: usize, drop_last: bool) -> Result<Batches> {
        if batch == 0 {
            return Err(Error::invalid(
                "sampler::Sampler::batches",
                "a batch of 0 samples",
            ));
        }
        let idx = self.indices(epoch)?;
        let count = if drop_last {
            idx.len() / batch
        } else {
            idx.len().div_ceil(batch)
        };
        Ok(Batches {
            idx,
            batch,
            next: 0,
            count,
        })
    }
}

/// The batches of one epoch on one rank ([`Sampler::batches`]).
#[derive(Clone, Debug)]
pub struct Batches {
    idx: Vec<usize>,
    batch: usize,
    next: usize,
    count: usize,
}

impl Batches {
    /// Batches in the epoch (those already taken included).
    pub fn total(&self) -> usize {
        self.count
    }

    /// The sample indices of batch `k`, or `None` past the end.
    pub fn get(&self, k: usize) -> Option<&[usize]> {
        if k >= self.count {
            return None;
        }
        let start = k * self.batch;
        let end = (start + self.batch).min(self.idx.len());
        self.idx.get(start..end)
    }
}

impl Iterator for Batches {
    type Item = Vec<usize>;

    fn next(&mut self) -> Option<Vec<usize>> {
        let b = self.get(self.next)?.to_vec();
        self.next += 1;
        Some(b)
    }

    fn nth(&mut self, n: usize) -> Option<Vec<usize>> {
        self.next = self.next.saturating_add(n);
        self.next()
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.count.saturating_sub(self.next);
        (left, Some(left))
    }
}

impl ExactSizeIterator for Batches {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn unshuffled_one_rank_is_in_order_with_a_short_last_batch() {
        let s = Sampler::new(10);
        assert_eq!(s.indices(0).unwrap(), (0..10).collect::<Vec<_>>());
        let b: Vec<_> = s.batches(0, 4, false).unwrap().collect();
        assert_eq!(b, vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7], vec![8, 9]]);
        let b: Vec<_> = s.batches(0, 4, true).unwrap().collect();
        assert_eq!(b.len(), 2);
        assert!(Sampler::new(0)
            .batches(0, 4, false)
            .unwrap()
            .next()
            .is_none());
        assert!(s.batches(0, 0, false).is_err());
    }

    #[test]
    fn shuffle_is_a_permutation_fixed_by_seed_and_epoch() {
        let s = Sampler::new(1000).shuffle(42);
        let e0 = s.indices(0).unwrap();
        assert_eq!(e0, s.indices(0).unwrap());
        assert_ne!(e0, s.indices(1).unwrap());
        assert_ne!(e0, Sampler::new(1000).shuffle(43).indices(0).unwrap());
        let mut sorted = e0.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..1000).collect::<Vec<_>>());
        assert_ne!(e0, sorted);
    }

    #[test]
    fn shards_follow_distributed_sampler() {
        // DistributedSampler(range(10), num_replicas=3, shuffle=False): num_samples 4, padded
        // with the first two: [0..10, 0, 1]; rank r takes r, r+3, ...
        let shares: Vec<Vec<usize>> = (0..3)
            .map(|r| Sampler::new(10).shard(r, 3).unwrap().indices(0).unwrap())
            .collect();
        assert_eq!(shares[0], vec![0, 3, 6, 9]);
        assert_eq!(shares[1], vec![1, 4, 7, 0]);
        assert_eq!(shares[2], vec![2, 5, 8, 1]);
        // drop_last=True: num_samples 3, the list cut to 9.
        let shares: Vec<Vec<usize>> = (0..3)
            .map(|r| {
                Sampler::new(10)
                    .shard(r, 3)
                    .unwrap()
                    .drop_uneven(true)
                    .indices(0)
                    .unwrap()
            })
            .collect();
        assert_eq!(shares, vec![vec![0, 3, 6], vec![1, 4, 7], vec![2, 5, 8]]);
        // Padding longer than the dataset wraps around again: 2 samples on 5 ranks.
        let s: Vec<_> = (0..5)
            .map(|r| Sampler::new(2).shard(r, 5).unwrap().indices(0).unwrap())
            .collect();
        assert_eq!(s, vec![vec![0], vec![1], vec![0], vec![1], vec![0]]);
        assert!(Sampler::new(10).shard(3, 3).is_err());
        assert!(Sampler::new(10).shard(0, 0).is_err());
    }

    #[test]
    fn shuffled_shards_are_disjoint_equal_and_cover_the_epoch() {
        for (n, world) in [(1000, 4), (1003, 4), (7, 8)] {
            let shares: Vec<Vec<usize>> = (0..world)
                .map(|r| {
                    Sampler::new(n)
                        .shuffle(5)
                        .shard(r, world)
                        .unwrap()
                        .indices(9)
                        .unwrap()
                })
                .collect();
            let per = n.div_ceil(world);
            assert!(shares.iter().all(|s| s.len() == per));
            let all: HashSet<usize> = shares.iter().flatten().copied().collect();
            assert_eq!(all.len(), n, "every sample visited");
            if n % world == 0 {
                let total: usize = shares.iter().map(Vec::len).sum();
                assert_eq!(total, n, "disjoint when it divides");
            }
        }
    }

    #[test]
    fn resume_at_a_batch_gives_the_rest_of_the_epoch() {
        let s = Sampler::new(103).shuffle(1).shard(1, 2).unwrap();
        let whole: Vec<_> = s.batches(4, 8, false).unwrap().collect();
        let rest: Vec<_> = s.batches(4, 8, false).unwrap().skip(3).collect();
        assert_eq!(rest, whole[3..].to_vec());
        let b = s.batches(4, 8, false).unwrap();
        assert_eq!(b.len(), whole.len());
        assert_eq!(b.get(3), Some(&whole[3][..]));
        assert_eq!(b.get(whole.len()), None);
        let mut b = s.batches(4, 8, false).unwrap();
        assert_eq!(b.nth(usize::MAX), None);
    }
}
