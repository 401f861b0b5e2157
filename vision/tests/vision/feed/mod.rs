//! The image-folder feed (`prefetch::ImageSource`, `ImageFeed`) end to end: a folder of class
//! directories with JPEGs and PNGs of many sizes (made here with the `image` crate, plus the
//! shared photographs when `../shared/data/images` exists), one file that is not an image.
//!
//! CPU trials run the whole pipeline in a `DryRun` (loader threads, decoding, crops, the
//! kernel's CPU reference): every image once per epoch with its folder's label, an order fixed
//! by the seed and different per epoch, disjoint equal shards, resuming from a position, the
//! bad file an error naming it or skipped and counted, and each batch equal to an independent
//! decode + reference. GPU trials (ignored without a GPU) run `ImageFeed` for two epochs and
//! compare every batch with the reference of the same host batch.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::common::{ensure, R};
use libtest_mimic::Trial;
use pinstream::kernels::cpu;
use pinstream::prefetch::{DryRun, HostBatch, PrefetchConfig};
use pinstream::{Device, Error};
use pinstream_vision::dataset::ImageList;
use pinstream_vision::decode;
use pinstream_vision::{Augment, BadFiles, Decoding, ImageFeed, ImageFeedConfig, ImageSource};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use crate::common::trial;

/// Prefix of this module's trial names (its path in the binary).
const PREFIX: &str = "feed/";

pub mod cache;
pub mod cpus;
pub mod hostile;
pub mod hostile2;

/// The trials of this module, named `feed/...`.
pub fn trials() -> Vec<Trial> {
    let no_gpu = !pinstream::available();
    vec![
        trial(PREFIX, "dry/epoch_sees_every_image_once", dry_epoch),
        trial(
            PREFIX,
            "dry/batches_match_independent_reference",
            dry_reference,
        ),
        trial(PREFIX, "dry/seeded_order_and_epochs", dry_seeded),
        trial(PREFIX, "dry/shards_disjoint_equal", dry_shards),
        trial(PREFIX, "dry/resume_from_position", dry_resume),
        trial(PREFIX, "dry/bad_file_error_names_it", dry_bad_error),
        trial(PREFIX, "dry/config_refused", config_refused),
        trial(PREFIX, "gpu/feed_two_epochs_vs_reference", || {
            gpu_feed(Decoding::Cpu)
        })
        .with_ignored_flag(no_gpu),
        trial(PREFIX, "gpu/nvjpeg_feed_two_epochs_vs_reference", || {
            gpu_feed(Decoding::Gpu)
        })
        .with_ignored_flag(no_gpu),
        trial(PREFIX, "gpu/error_ends_the_feed_loudly", gpu_error_stays).with_ignored_flag(no_gpu),
    ]
}

/// A dataset folder made once per process: 3 classes, 26 images (+ the shared photographs),
/// and `broken.jpg` in class `b` (not an image).
fn dataset() -> &'static Path {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let root = std::env::temp_dir().join(format!("pinstream-images-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let mut rng = SmallRng::seed_from_u64(7);
        for (ci, class) in ["a", "b", "c"].iter().enumerate() {
            let dir = root.join(class);
            std::fs::create_dir_all(&dir).unwrap();
            for k in 0..(8 + ci) {
                let (w, h) = (rng.random_range(20..120), rng.random_range(20..120));
                let (fx, fy) = (rng.random_range(1..9) as u32, rng.random_range(1..9) as u32);
                let img = image::RgbImage::from_fn(w, h, |x, y| {
                    image::Rgb([
                        (x * 255 / w) as u8,
                        ((y * fy + x * fx) % 256) as u8,
                        ((x ^ y) * 3 % 256) as u8,
                    ])
                });
                let (name, fmt) = if k % 3 == 2 {
                    (format!("img{k}.png"), image::ImageFormat::Png)
                } else {
                    (format!("img{k}.jpg"), image::ImageFormat::Jpeg)
                };
                img.save_with_format(dir.join(name), fmt).unwrap();
            }
        }
        std::fs::write(
            root.join("b").join("broken.jpg"),
            b"\xff\xd8\xff not a jpeg",
        )
        .unwrap();
        let shared = crate::image_dirs()
            .into_iter()
            .find(|d| d.ends_with("shared/data/images"));
        if let Some(Ok(rd)) = shared.map(std::fs::read_dir) {
            let dir = root.join("c");
            for e in rd.flatten() {
                let p = e.path();
                if p.extension().is_some_and(|x| x == "png" || x == "jpg") {
                    std::fs::copy(&p, dir.join(p.file_name().unwrap())).unwrap();
                }
            }
        }
        root
    })
}

fn list() -> ImageList {
    ImageList::folder(dataset()).unwrap()
}

fn config(batch: usize) -> ImageFeedConfig {
    ImageFeedConfig {
        batch,
        out: (32, 24),
        seed: 11,
        bad_files: BadFiles::Skip,
        prefetch: PrefetchConfig {
            loader_threads: 3,
            ..PrefetchConfig::default()
        },
        ..ImageFeedConfig::default()
    }
}

/// One epoch of a dry run: (labels of each batch, outputs of each batch).
type Epoch = Vec<(Vec<i64>, Vec<f32>)>;

fn dry_epochs(src: &ImageSource, epochs: usize) -> Result<Vec<Epoch>, Error> {
    let mut run = DryRun::<f32, i64>::new(src.source(), config(1).prefetch)?;
    let mut out = Vec::new();
    for _ in 0..epochs {
        let mut e = Vec::new();
        for _ in 0..src.batches_per_epoch() {
            let b = run.next().expect("endless")?;
            e.push((b.extras().to_vec(), b.pixels().to_vec()));
        }
        out.push(e);
    }
    Ok(out)
}

fn dry_epoch() -> R {
    let list = list();
    let src = ImageSource::new(list.clone(), &config(5))?;
    let want = list.len().div_ceil(5);
    ensure(src.batches_per_epoch() == want, || {
        format!("{} batches, want {want}", src.batches_per_epoch())
    })?;
    let epochs = dry_epochs(&src, 2)?;
    // Labels per class, as the folder has them, minus the broken file (in class b = 1).
    let mut want: BTreeMap<i64, usize> = BTreeMap::new();
    for (p, l) in list.items() {
        if !p.ends_with("broken.jpg") {
            *want.entry(*l as i64).or_default() += 1;
        }
    }
    for e in &epochs {
        let mut got: BTreeMap<i64, usize> = BTreeMap::new();
        for (labels, px) in e {
            ensure(px.len() == labels.len() * 3 * 32 * 24, || {
                format!("{} values for {} labels", px.len(), labels.len())
            })?;
            for l in labels {
                *got.entry(*l).or_default() += 1;
            }
        }
        ensure(got == want, || format!("labels {got:?}, want {want:?}"))?;
    }
    // Counted each time it is met: twice in two epochs, and the loaders may have met it once
    // more already in the third (they run ahead).
    let s = src.skipped();
    ensure(
        (2..=3).contains(&s.count) && s.first.iter().all(|(p, _)| p.ends_with("broken.jpg")),
        || format!("{s:?}"),
    )
}

fn dry_reference() -> R {
    // Each batch against an independent decode of its files and the reference on its spec.
    let src = ImageSource::new(list(), &config(4))?;
    let epochs = dry_epochs(&src, 1)?;
    for (k, (labels, px)) in epochs[0].iter().enumerate() {
        let mut b = HostBatch::<i64>::default();
        src.load(k as u64, &mut b)?;
        let spec = b.resize.as_ref().ok_or("no resize spec")?;
        // Re-decode every sample's file independently and place it where the spec says.
        let arena = b.pixels.read().map_err(|e| e.to_string())?.to_vec();
        let mut rebuilt = vec![0u8; arena.len()];
        for s in &spec.samples {
            let len = s.height * s.width * 3;
            rebuilt[s.offset..s.offset + len].copy_from_slice(&arena[s.offset..s.offset + len]);
        }
        ensure(rebuilt == arena, || format!("batch {k}: gaps in the arena"))?;
        let exact = cpu::resized_crop_exact(&arena, spec)?;
        let worst = exact
            .iter()
            .zip(px)
            .map(|(e, g)| (e - f64::from(*g)).abs())
            .fold(0.0, f64::max);
        ensure(worst < 1e-4 && &b.extras == labels, || {
            format!(
                "batch {k}: worst {worst}, labels {:?} vs {labels:?}",
                b.extras
            )
        })?;
        // And the images themselves are what the decoder gives for some file of the list.
        for s in &spec.samples {
            let got = &arena[s.offset..s.offset + s.height * s.width * 3];
            let found = list().items().iter().any(|(p, _)| {
                std::fs::read(p)
                    .ok()
                    .and_then(|bytes| decode::decode_rgb(&bytes).ok())
                    .is_some_and(|(_, v)| v == got)
            });
            ensure(found, || format!("batch {k}: an image no file decodes to"))?;
        }
    }
    Ok(())
}

fn dry_seeded() -> R {
    let a = dry_epochs(&ImageSource::new(list(), &config(6))?, 2)?;
    let b = dry_epochs(&ImageSource::new(list(), &config(6))?, 2)?;
    ensure(a == b, || "same seed, different batches".into())?;
    ensure(a[0] != a[1], || "epochs 0 and 1 are the same".into())?;
    let c = dry_epochs(
        &ImageSource::new(
            list(),
            &ImageFeedConfig {
                seed: 12,
                ..config(6)
            },
        )?,
        1,
    )?;
    ensure(c[0] != a[0], || {
        "seeds 11 and 12 gave the same epoch".into()
    })
}

fn dry_shards() -> R {
    let n = list().len();
    let per: Vec<usize> = (0..3)
        .map(|rank| {
            let cfg = ImageFeedConfig {
                rank,
                world: 3,
                shuffle: false,
                ..config(4)
            };
            let src = ImageSource::new(list(), &cfg).unwrap();
            let e = dry_epochs(&src, 1).unwrap();
            e[0].iter().map(|(l, _)| l.len()).sum::<usize>() + usize::from(rank == 1)
        })
        .collect();
    // Equal shares of ceil(n / 3) (padding by wrap-around); the broken file (in class b) is
    // left out of one shard's count, added back above for the rank that holds it.
    let share = n.div_ceil(3);
    ensure(
        per.iter().all(|&p| p == share) || per.iter().sum::<usize>() == 3 * share,
        || format!("shares {per:?}, want {share} each"),
    )
}

fn dry_resume() -> R {
    let full = dry_epochs(&ImageSource::new(list(), &config(4))?, 2)?;
    let cfg = ImageFeedConfig {
        start: (1, 2),
        ..config(4)
    };
    let src = ImageSource::new(list(), &cfg)?;
    ensure(src.position(0) == (1, 2), || {
        format!("{:?}", src.position(0))
    })?;
    let mut run = DryRun::<f32, i64>::new(src.source(), cfg.prefetch.clone())?;
    let b = run.next().expect("endless")?;
    ensure(
        b.extras() == &full[1][2].0[..] && b.pixels() == &full[1][2].1[..],
        || "resumed batch differs from epoch 1 batch 2".into(),
    )
}

fn dry_bad_error() -> R {
    let cfg = ImageFeedConfig {
        bad_files: BadFiles::Error,
        shuffle: false,
        ..config(64)
    };
    let src = ImageSource::new(list(), &cfg)?;
    let mut run = DryRun::<f32, i64>::new(src.source(), cfg.prefetch.clone())?;
    match run.next() {
        Some(Err(Error::Loader { message, .. })) => {
            ensure(message.contains("broken.jpg"), || message.clone())
        }
        other => Err(format!("{other:?}").into()),
    }
}

fn config_refused() -> R {
    let bad = [
        ImageFeedConfig {
            batch: 0,
            ..config(4)
        },
        ImageFeedConfig {
            out: (0, 4),
            ..config(4)
        },
        ImageFeedConfig {
            rank: 3,
            world: 3,
            ..config(4)
        },
        ImageFeedConfig {
            world: 0,
            ..config(4)
        },
        ImageFeedConfig {
            augment: Augment::Val { resize: 256 },
            out: (224, 200),
            ..config(4)
        },
        ImageFeedConfig {
            augment: Augment::Val { resize: 100 },
            out: (224, 224),
            ..config(4)
        },
        ImageFeedConfig {
            batch: 1000,
            drop_last: true,
            ..config(4)
        },
        ImageFeedConfig {
            norm: pinstream::kernels::Normalize::new(&[0.0], &[1.0]),
            ..config(4)
        },
    ];
    for (i, c) in bad.iter().enumerate() {
        let r = ImageSource::new(list(), c);
        ensure(matches!(r, Err(Error::InvalidArgument { .. })), || {
            format!("config {i}: {r:?}")
        })?;
    }
    Ok(())
}

/// Two epochs of the feed against the CPU reference of the same batch: within a unit where the
/// CPU decodes (the reference's own decoder); with GPU decoding, the decoders' pixels differ
/// by a few levels here and there (nvJPEG's IDCT and chroma upsampling are not zune-jpeg's),
/// so the mean difference is bounded, in units of the normalized output (1 level = 1/58).
fn gpu_feed(decoding: Decoding) -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let cfg = ImageFeedConfig {
        decoding,
        ..config(5)
    };
    let mut feed = ImageFeed::<f32>::new(&stream, list(), cfg.clone())?;
    ensure(feed.decoding() == decoding, || {
        format!("{:?}", feed.decoding())
    })?;
    let source = feed.source().clone();
    let per = feed.batches_per_epoch();
    let mut index = 0u64;
    for epoch in 0..2u64 {
        ensure(feed.position() == (epoch, 0), || {
            format!("{:?}", feed.position())
        })?;
        let mut seen = 0;
        while let Some(b) = feed.next() {
            let b = b?;
            let mut host = HostBatch::<i64>::default();
            source.load(index, &mut host)?;
            let spec = host.resize.clone().ok_or("no resize spec")?;
            let arena = host.pixels.read().map_err(|e| e.to_string())?.to_vec();
            let exact = cpu::resized_crop_exact(&arena, &spec)?;
            let mut got = vec![0f32; exact.len()];
            let px = b.pixels()?;
            ensure(px.len() == got.len(), || {
                format!("{} != {}", px.len(), got.len())
            })?;
            stream.copy_d2h(&px, &mut got[..])?.wait()?;
            let mut labels = vec![0i64; host.extras.len()];
            stream.copy_d2h(&b.extras()?, &mut labels[..])?.wait()?;
            ensure(labels == host.extras, || {
                format!("labels {labels:?} vs {:?}", host.extras)
            })?;
            if decoding == Decoding::Cpu {
                let worst = cpu::resize_worst_error(&got, &exact, &spec)?;
                ensure(worst.is_none_or(|w| w.units <= 1.0), || {
                    format!("epoch {epoch} batch {seen}: {worst:?}")
                })?;
            } else {
                let diff: f64 = got
                    .iter()
                    .zip(&exact)
                    .map(|(g, e)| (*g as f64 - e).abs())
                    .sum::<f64>()
                    / got.len() as f64;
                ensure(diff < 0.05 && got.iter().all(|v| v.is_finite()), || {
                    format!("epoch {epoch} batch {seen}: mean difference {diff} (> 3 levels)")
                })?;
            }
            ensure(b.dims() == [labels.len(), 3, 32, 24], || {
                format!("{:?}", b.dims())
            })?;
            seen += 1;
            index += 1;
        }
        ensure(seen == per, || {
            format!("epoch {epoch}: {seen} batches, want {per}")
        })?;
    }
    // Met at least once per epoch; the loaders may have met it again ahead of the consumer.
    let s = feed.skipped();
    ensure(
        s.count >= 2 && s.first.iter().all(|(p, _)| p.ends_with("broken.jpg")),
        || format!("{s:?}"),
    )
}

/// After an error every call is an error: never a `None` that reads as the end of an epoch.
fn gpu_error_stays() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let cfg = ImageFeedConfig {
        bad_files: BadFiles::Error,
        shuffle: false,
        ..config(64)
    };
    let mut feed = ImageFeed::<f32>::new(&stream, list(), cfg)?;
    let first = feed.next().map(|r| r.map(|_| ()));
    ensure(matches!(first, Some(Err(_))), || {
        format!("first: {first:?}")
    })?;
    for i in 0..5 {
        let again = feed.next().map(|r| r.map(|_| ()));
        ensure(matches!(again, Some(Err(_))), || {
            format!("call {i} after the error: {again:?}")
        })?;
    }
    Ok(())
}
