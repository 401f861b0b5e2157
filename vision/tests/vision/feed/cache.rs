//! `ImageFeedConfig::gpu_cache_bytes`: decoded images kept in GPU memory between epochs. A
//! feed with the cache gives the same batches as one without, epoch after epoch, with a budget
//! for every image and with one for part of them; what it kept is served instead of decoded
//! (its stats and the decoders' counts say so); a budget the device cannot give is an error
//! before anything starts, and CPU decoding refuses a cache.

#[cfg(feature = "nvjpeg")]
use crate::common::within;
use crate::common::{ensure, trial, R};
use libtest_mimic::Trial;
use pinstream::Error;
use pinstream_vision::{Decoding, ImageFeedConfig};

const PREFIX: &str = "feed/cache/";

pub fn trials() -> Vec<Trial> {
    #[allow(unused_mut)]
    let mut v = vec![trial(PREFIX, "refused_with_cpu_decoding", refused_on_cpu)];
    #[cfg(feature = "nvjpeg")]
    {
        let no_gpu = !pinstream::available();
        let watchdog = std::time::Duration::from_secs(600);
        v.extend([
            trial(PREFIX, "gpu/every_image_kept_same_batches", move || {
                within("feed cache whole", watchdog, || gpu::same_batches(None))
            })
            .with_ignored_flag(no_gpu),
            trial(PREFIX, "gpu/part_kept_same_batches", move || {
                within("feed cache part", watchdog, || gpu::same_batches(Some(3)))
            })
            .with_ignored_flag(no_gpu),
            trial(PREFIX, "gpu/budget_too_large_is_an_error", gpu::too_large)
                .with_ignored_flag(no_gpu),
            trial(PREFIX, "gpu/failed_keeps_lose_nothing", move || {
                within("feed cache failures", watchdog, gpu::failed_keeps)
            })
            .with_ignored_flag(no_gpu),
        ]);
    }
    v
}

/// `Decoding::Cpu` with a cache: `InvalidArgument` from `validate` (no device needed).
fn refused_on_cpu() -> R {
    let cfg = ImageFeedConfig {
        decoding: Decoding::Cpu,
        gpu_cache_bytes: 1 << 20,
        ..ImageFeedConfig::default()
    };
    let r = cfg.validate();
    ensure(
        matches!(&r, Err(Error::InvalidArgument { .. }))
            && r.as_ref()
                .unwrap_err()
                .to_string()
                .contains("gpu_cache_bytes"),
        || format!("{r:?}"),
    )?;
    // Auto may decode on the CPU where the GPU cannot: accepted (the cache then does nothing).
    let auto = ImageFeedConfig {
        gpu_cache_bytes: 1 << 20,
        ..ImageFeedConfig::default()
    };
    auto.validate()?;
    Ok(())
}

#[cfg(feature = "nvjpeg")]
mod gpu {
    use super::super::{config, list};
    use crate::common::{ensure, R};
    use libtest_mimic::Failed;
    use pinstream::{Device, Error};
    use pinstream_vision::{Decoding, FeedBatch, ImageFeed, ImageFeedConfig};

    /// The decoded size of the dataset's images, and how many there are (bad files left out).
    fn decoded() -> Result<(usize, usize), Box<dyn std::error::Error>> {
        let mut total = 0usize;
        let mut n = 0usize;
        for (path, _) in list().items() {
            let bytes = std::fs::read(path)?;
            if let Ok(info) = pinstream_vision::decode::info(&bytes) {
                total += info.height * info.width * 3;
                n += 1;
            }
        }
        Ok((total, n))
    }

    /// Three epochs of a feed with the cache (a budget for every image, or for about
    /// `1/part` of the decoded bytes) against the same feed with a cache that holds nothing
    /// (every image decoded whole, as with any cache): every batch's pixels and labels equal,
    /// bit for bit. Against the feed without a cache (which decodes only the crop's region of
    /// 4:4:4 files, the crop then in other coordinates): within float rounding. With every
    /// image kept, the third epoch decodes nothing.
    pub fn same_batches(part: Option<usize>) -> R {
        let dev = Device::get(0)?;
        let stream = dev.stream()?;
        let (total, n) = decoded()?;
        let budget = match part {
            None => total + (1 << 20),
            Some(p) => total / p,
        };
        let base = ImageFeedConfig {
            decoding: Decoding::Gpu,
            ..config(5)
        };
        let with = |bytes| ImageFeedConfig {
            gpu_cache_bytes: bytes,
            ..base.clone()
        };
        let mut plain = ImageFeed::<f32>::new(&stream, list(), base.clone())?;
        let mut none = ImageFeed::<f32>::new(&stream, list(), with(1))?;
        let mut feed = ImageFeed::<f32>::new(&stream, list(), with(budget))?;
        ensure(feed.gpu_cache().budget == budget, || {
            format!("{:?}", feed.gpu_cache())
        })?;
        let per = feed.batches_per_epoch();
        // Poisoned first: a batch that wrote nothing cannot pass as equal.
        let host = |x: &FeedBatch<'_, f32>, poison: f32| -> Result<(Vec<f32>, Vec<i64>), Failed> {
            let px = x.pixels()?;
            let mut v = vec![poison; px.len()];
            stream.copy_d2h(&px, &mut v[..])?.wait()?;
            let mut l = vec![-1i64; x.dims()[0]];
            stream.copy_d2h(&x.extras()?, &mut l[..])?.wait()?;
            Ok((v, l))
        };
        let worst = |x: &[f32], y: &[f32]| {
            x.iter()
                .zip(y)
                .map(|(p, q)| (*p as f64 - *q as f64).abs())
                .fold(0.0f64, f64::max)
        };
        let mut decoded_by_epoch = Vec::new();
        for epoch in 0..3u64 {
            let mut seen = 0;
            loop {
                let (a, z, b) = match (plain.next(), none.next(), feed.next()) {
                    (None, None, None) => break,
                    (Some(a), Some(z), Some(b)) => (a?, z?, b?),
                    (a, z, b) => {
                        return Err(format!(
                            "epoch {epoch} batch {seen}: a feed ended ({} / {} / {})",
                            a.is_some(),
                            z.is_some(),
                            b.is_some()
                        )
                        .into())
                    }
                };
                ensure(a.dims() == b.dims() && z.dims() == b.dims(), || {
                    format!("{:?} / {:?} / {:?}", a.dims(), z.dims(), b.dims())
                })?;
                let ((ga, la), (gz, lz), (gb, lb)) =
                    (host(&a, f32::NAN)?, host(&z, -1e30)?, host(&b, 1e30)?);
                ensure(gb.iter().all(|v| v.is_finite()) && gz == gb, || {
                    format!(
                        "epoch {epoch} batch {seen}: kept and decoded differ by up to {}",
                        worst(&gz, &gb)
                    )
                })?;
                ensure(worst(&ga, &gb) <= 1e-4, || {
                    format!(
                        "epoch {epoch} batch {seen}: against no cache, up to {}",
                        worst(&ga, &gb)
                    )
                })?;
                ensure(la == lb && lz == lb, || {
                    format!("labels {la:?} / {lz:?} / {lb:?}")
                })?;
                seen += 1;
            }
            ensure(seen == per, || {
                format!("epoch {epoch}: {seen} batches, want {per}")
            })?;
            let r = feed.routes();
            decoded_by_epoch.push(r.hardware + r.cuda + r.cpu);
        }
        let s = feed.gpu_cache();
        ensure(s.used <= budget && s.images <= n && s.failures == 0, || {
            format!("{s:?}")
        })?;
        let e = none.gpu_cache();
        ensure(e.images == 0 && e.hits == 0 && e.budget == 1, || {
            format!("{e:?}")
        })?;
        match part {
            None => {
                // Every image kept (the loaders run ahead: epoch 2 may still decode a few);
                // epoch 3 served from the cache alone.
                ensure(s.images == n && s.hits >= n as u64, || {
                    format!("{s:?}, {n} images")
                })?;
                let d = &decoded_by_epoch;
                ensure(d[2] == d[1] && (d[1] as usize) < 2 * n, || {
                    format!("decoded by the end of each epoch: {d:?} ({n} images)")
                })?;
            }
            Some(_) => {
                ensure(s.images > 0 && s.images < n && s.hits > 0, || {
                    format!("{s:?}, {n} images")
                })?;
            }
        }
        Ok(())
    }

    /// The cache's failure path (`__fail_cache_keeps`, as a CUDA error during a keep would):
    /// the first `FAILS` batches' images are not kept. Every batch of three epochs is still
    /// what a feed whose cache holds nothing gives, bit for bit; the failures are counted; the
    /// images that failed are decoded again and kept later, so that by the end every image is.
    pub fn failed_keeps() -> R {
        const FAILS: u64 = 3;
        let dev = Device::get(0)?;
        let stream = dev.stream()?;
        let (total, n) = decoded()?;
        // Room for every image twice (the failed keeps' room is not given back), and a budget
        // no other trial uses: the failures are made for this cache only.
        let budget = 2 * total + 12_345;
        let base = ImageFeedConfig {
            decoding: Decoding::Gpu,
            ..config(5)
        };
        let with = |bytes| ImageFeedConfig {
            gpu_cache_bytes: bytes,
            ..base.clone()
        };
        let mut none = ImageFeed::<f32>::new(&stream, list(), with(1))?;
        pinstream_vision::__fail_cache_keeps(budget, FAILS);
        let made = ImageFeed::<f32>::new(&stream, list(), with(budget));
        let mut feed = match made {
            Ok(f) => f,
            Err(e) => {
                pinstream_vision::__fail_cache_keeps(budget, 0);
                return Err(e.into());
            }
        };
        let per = feed.batches_per_epoch();
        ensure(per as u64 > FAILS, || {
            format!("{per} batches an epoch: too few for {FAILS} failures")
        })?;
        let host = |x: &FeedBatch<'_, f32>, poison: f32| -> Result<(Vec<f32>, Vec<i64>), Failed> {
            let px = x.pixels()?;
            let mut v = vec![poison; px.len()];
            stream.copy_d2h(&px, &mut v[..])?.wait()?;
            let mut l = vec![-1i64; x.dims()[0]];
            stream.copy_d2h(&x.extras()?, &mut l[..])?.wait()?;
            Ok((v, l))
        };
        for epoch in 0..3u64 {
            let mut seen = 0;
            loop {
                let (z, b) = match (none.next(), feed.next()) {
                    (None, None) => break,
                    (Some(z), Some(b)) => (z?, b?),
                    (z, b) => {
                        return Err(format!(
                            "epoch {epoch} batch {seen}: a feed ended ({} / {})",
                            z.is_some(),
                            b.is_some()
                        )
                        .into())
                    }
                };
                let ((gz, lz), (gb, lb)) = (host(&z, -1e30)?, host(&b, 1e30)?);
                ensure(
                    gb.iter().all(|v| v.is_finite()) && gz == gb && lz == lb,
                    || format!("epoch {epoch} batch {seen}: the batch differs from one decoded"),
                )?;
                seen += 1;
            }
            ensure(seen == per, || {
                format!("epoch {epoch}: {seen} batches, want {per}")
            })?;
        }
        let s = feed.gpu_cache();
        pinstream_vision::__fail_cache_keeps(budget, 0);
        ensure(s.failures == FAILS, || {
            format!("{s:?}: {} failures, {FAILS} made", s.failures)
        })?;
        ensure(s.images == n && s.hits > 0 && s.used <= budget, || {
            format!("{s:?}, {n} images: every image kept by the end")
        })
    }

    /// A budget no device has: an error from `new`, before a thread starts.
    pub fn too_large() -> R {
        let dev = Device::get(0)?;
        let stream = dev.stream()?;
        let cfg = ImageFeedConfig {
            decoding: Decoding::Gpu,
            gpu_cache_bytes: 1 << 50,
            ..config(5)
        };
        let before = pinstream_threads()?;
        let r = ImageFeed::<f32>::new(&stream, list(), cfg);
        ensure(
            matches!(&r, Err(Error::InvalidArgument { .. }))
                && r.as_ref()
                    .err()
                    .is_some_and(|e| e.to_string().contains("gpu_cache_bytes")),
            || format!("{:?}", r.as_ref().err()),
        )?;
        ensure(pinstream_threads()? == before, || {
            "a loader thread was left running".to_string()
        })
    }

    fn pinstream_threads() -> Result<usize, libtest_mimic::Failed> {
        Ok(crate::common::threads::pinstream_thread_names()?
            .iter()
            .filter(|n| n.starts_with("pinstream-nvjpeg"))
            .count())
    }
}
