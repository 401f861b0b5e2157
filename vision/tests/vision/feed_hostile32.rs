//! Hostile review of issue 32's image feed (branch wt32h): what `pinstream.ImageFeed` hands the
//! Rust feed, attacked on the CPU through `ImageSource` (what both decoding paths run on).
//!
//! - `drop_last` is documented (python/pinstream/feed.py, docs/python.md) as
//!   `DistributedSampler`'s: the list is padded by wrapping around *unless* `drop_last`. Padded
//!   anyway, ranks got the same files (duplicates across ranks, the issue's own pain).
//! - The GPU-decoding path never checked `PrefetchConfig` (loader threads, depth): `threads =
//!   100_000` started that many loaders, each with its own nvJPEG state and stream, where the
//!   CPU path refuses it.
//!
//! Run: `cargo test -p pinstream-vision --test vision -- feed/hostile32`.

use std::collections::BTreeMap;
use std::path::PathBuf;

use pinstream::prefetch::{HostBatch, PrefetchConfig};
use pinstream::Error;
use pinstream_vision::dataset::ImageList;
use pinstream_vision::{ImageFeedConfig, ImageSource};

use crate::common::{ensure, trial, R};
use libtest_mimic::Trial;

/// Prefix of this module's trial names (its path in the binary).
const PREFIX: &str = "feed/hostile32/";

/// The trials of this module (CPU only: run everywhere).
pub fn trials() -> Vec<Trial> {
    vec![
        trial(
            PREFIX,
            "drop_last_shares_are_disjoint",
            drop_last_shares_are_disjoint,
        ),
        trial(
            PREFIX,
            "loader_threads_and_depth_checked_for_every_path",
            loader_threads_and_depth_checked,
        ),
    ]
}

/// `n` small JPEGs (8 x 8) in a fresh folder, labelled 0..n.
fn jpegs(n: usize) -> (PathBuf, Vec<(PathBuf, usize)>) {
    let dir = std::env::temp_dir().join(format!(
        "pinstream-hostile32-{}-{}",
        std::process::id(),
        rand::random::<u64>()
    ));
    std::fs::create_dir_all(&dir).expect("make the folder");
    let items = (0..n)
        .map(|i| {
            let p = dir.join(format!("{i}.jpg"));
            let img = image::RgbImage::from_fn(8, 8, |x, y| {
                image::Rgb([(x * 30) as u8, (y * 30) as u8, (i * 40) as u8])
            });
            img.save(&p).expect("write a JPEG");
            (p, i)
        })
        .collect();
    (dir, items)
}

fn config(batch: usize, rank: usize, world: usize, drop_last: bool) -> ImageFeedConfig {
    ImageFeedConfig {
        batch,
        out: (8, 8),
        rank,
        world,
        drop_last,
        shuffle: false,
        ..ImageFeedConfig::default()
    }
}

/// 5 files over 4 ranks, batches of 1, `drop_last`: `DistributedSampler(drop_last=True)` cuts
/// the list to 4 (one file per rank), so no file is seen by two ranks. Padded to 8 instead,
/// ranks 0 and 1 were each handed a second file that another rank also had.
fn drop_last_shares_are_disjoint() -> R {
    let (dir, items) = jpegs(5);
    let list = ImageList::from_pairs(items)?;
    let mut seen: BTreeMap<i64, Vec<usize>> = BTreeMap::new();
    for rank in 0..4 {
        let src = ImageSource::new(list.clone(), &config(1, rank, 4, true))?;
        ensure(src.batches_per_epoch() == 1, || {
            format!(
                "rank {rank}: {} batches per epoch with drop_last, want 1 (5 files // 4 ranks)",
                src.batches_per_epoch()
            )
        })?;
        for k in 0..src.batches_per_epoch() {
            let mut b = HostBatch::<i64>::default();
            src.load(k as u64, &mut b)?;
            for &l in &b.extras {
                seen.entry(l).or_default().push(rank);
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    let twice: Vec<_> = seen.iter().filter(|(_, r)| r.len() > 1).collect();
    ensure(twice.is_empty(), || {
        format!("files given to several ranks with drop_last: {twice:?}")
    })?;
    // Without drop_last the padding stays (DistributedSampler's default): 2 each, 8 in all.
    let src = ImageSource::new(list, &config(1, 0, 4, false))?;
    ensure(src.batches_per_epoch() == 2, || {
        format!("{} batches without drop_last", src.batches_per_epoch())
    })
}

/// `ImageSource::new` (which both decoding paths run first) refuses what `PrefetchConfig`
/// refuses, before a loader thread or a decoder is made.
fn loader_threads_and_depth_checked() -> R {
    let list = ImageList::from_pairs(vec![(PathBuf::from("/nonexistent/a.jpg"), 0)])?;
    for (threads, depth) in [(100_000, 2), (257, 2), (4, 17), (4, 0), (4, usize::MAX)] {
        let c = ImageFeedConfig {
            prefetch: PrefetchConfig {
                loader_threads: threads,
                depth,
                ..PrefetchConfig::default()
            },
            ..config(1, 0, 1, false)
        };
        let r = ImageSource::new(list.clone(), &c);
        ensure(matches!(r, Err(Error::InvalidArgument { .. })), || {
            format!("loader_threads {threads}, depth {depth}: {r:?}")
        })?;
    }
    // 0 loader threads is the feed's default: chosen by where it decodes, not refused; with
    // a depth the larger choice refuses, it is refused.
    let auto = config(1, 0, 1, false);
    ensure(auto.prefetch.loader_threads == 0, || {
        format!("default loader_threads {}", auto.prefetch.loader_threads)
    })?;
    ensure(
        auto.loader_threads(true) == pinstream_vision::AUTO_GPU_LOADER_THREADS
            && auto.loader_threads(false) == pinstream_vision::AUTO_CPU_LOADER_THREADS,
        || "0 loader threads resolves to the automatic choices".to_string(),
    )?;
    let src = ImageSource::new(list.clone(), &auto)?;
    // A DryRun of one's own over the source: the resolved config starts, the raw field (0)
    // is refused with a typed error (hostile review, fifth session).
    drop(pinstream::prefetch::DryRun::<f32, i64>::new(
        src.source(),
        auto.prefetch_config(false),
    )?);
    let raw = pinstream::prefetch::DryRun::<f32, i64>::new(src.source(), auto.prefetch.clone());
    ensure(matches!(raw, Err(Error::InvalidArgument { .. })), || {
        format!("a DryRun with loader_threads 0: {:?}", raw.err())
    })?;
    let deep = ImageFeedConfig {
        prefetch: PrefetchConfig {
            loader_threads: 0,
            depth: 17,
            ..PrefetchConfig::default()
        },
        ..config(1, 0, 1, false)
    };
    let r = ImageSource::new(list, &deep);
    ensure(matches!(r, Err(Error::InvalidArgument { .. })), || {
        format!("loader_threads 0, depth 17: {r:?}")
    })
}
