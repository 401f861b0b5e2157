//! Hostile review of the image feed's CPU paths (branch hostile2): `ImageSource::load`, the dry
//! run, the decoders, `ResizeSpec::validate` + the CPU reference, `Sampler`, `ImageList`.
//!
//! Tests named `bug_*` assert the behaviour that SHOULD hold and fail on the reviewed commit
//! (each one is a finding); tests named `ok_*` are suspicions that turned out fine.
//! Run: `cargo test --test vision -- feed/hostile/ --nocapture`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use pinstream::kernels::CropBox;
use pinstream::kernels::{cpu, Normalize, ResizeSpec};
use pinstream::prefetch::{DryRun, HostBatch, PrefetchConfig};
use pinstream::Error;
use pinstream_vision::augment::Rng;
use pinstream_vision::dataset::ImageList;
use pinstream_vision::decode;
use pinstream_vision::sampler::Sampler;
use pinstream_vision::{Augment, BadFiles, ImageFeedConfig, ImageSource};

use crate::common::{trial, R};
use libtest_mimic::Trial;

/// Prefix of this module's trial names (its path in the binary).
const PREFIX: &str = "feed/hostile/";

/// The trials of this module, named `feed/hostile/...`: CPU trials (plain functions that panic on a failure), run everywhere.
pub fn trials() -> Vec<Trial> {
    let t = |name: &str, f: fn()| {
        trial(PREFIX, name, move || -> R {
            f();
            Ok(())
        })
    };
    vec![
        t(
            "bug_oversized_side_png_poisons_batch_despite_skip",
            bug_oversized_side_png_poisons_batch_despite_skip,
        ),
        t(
            "bug_header_bomb_batch_allocates_before_decoding",
            bug_header_bomb_batch_allocates_before_decoding,
        ),
        t(
            "bug_jpeg_with_trailer_containing_ff_da_refused",
            bug_jpeg_with_trailer_containing_ff_da_refused,
        ),
        t(
            "bug_start_not_validated_and_saturates_to_duplicate_batches",
            bug_start_not_validated_and_saturates_to_duplicate_batches,
        ),
        t(
            "bug_crop_streams_alias_shuffle_streams_and_other_epochs",
            bug_crop_streams_alias_shuffle_streams_and_other_epochs,
        ),
        t(
            "bug_load_reads_whole_file_before_checking_it",
            bug_load_reads_whole_file_before_checking_it,
        ),
        t("ok_reference_cost_is_bounded", ok_reference_cost_is_bounded),
        t(
            "ok_validated_specs_stay_inside",
            ok_validated_specs_stay_inside,
        ),
        t(
            "ok_output_len_and_huge_sizes_are_errors",
            ok_output_len_and_huge_sizes_are_errors,
        ),
        t("ok_sampler_edges", ok_sampler_edges),
        t(
            "ok_every_file_broken_with_skip_is_an_error_not_a_hang",
            ok_every_file_broken_with_skip_is_an_error_not_a_hang,
        ),
        t("ok_dataset_roots", ok_dataset_roots),
        t("ok_decoder_mutations", ok_decoder_mutations),
        t(
            "ok_apng_first_frame_smaller_than_ihdr",
            ok_apng_first_frame_smaller_than_ihdr,
        ),
        t(
            "bug_config_not_validated_up_front",
            bug_config_not_validated_up_front,
        ),
        t(
            "ok_truncated_progressive_and_thin_images",
            ok_truncated_progressive_and_thin_images,
        ),
        t(
            "bug_val_resize_above_1024_times_the_crop_passes_the_check",
            bug_val_resize_above_1024_times_the_crop_passes_the_check,
        ),
        t(
            "bug_deep_folder_chain_walk_is_cubic",
            bug_deep_folder_chain_walk_is_cubic,
        ),
        t(
            "bug_trailers_make_load_hold_whole_files",
            bug_trailers_make_load_hold_whole_files,
        ),
    ]
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("pinstream-hostile2-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn small_jpeg(w: u32, h: u32) -> Vec<u8> {
    let img = image::RgbImage::from_fn(w, h, |x, y| {
        image::Rgb([(x * 7) as u8, (y * 5) as u8, ((x ^ y) * 3) as u8])
    });
    let mut v = Vec::new();
    image::codecs::jpeg::JpegEncoder::new_with_quality(&mut v, 90)
        .encode_image(&img)
        .unwrap();
    v
}

fn small_png(w: u32, h: u32) -> Vec<u8> {
    let img = image::RgbImage::from_fn(w, h, |x, y| image::Rgb([x as u8, y as u8, 9]));
    let mut v = Vec::new();
    img.write_to(&mut std::io::Cursor::new(&mut v), image::ImageFormat::Png)
        .unwrap();
    v
}

fn crc32(data: &[u8]) -> u32 {
    let mut c = 0xFFFF_FFFFu32;
    for &b in data {
        c ^= u32::from(b);
        for _ in 0..8 {
            c = if c & 1 != 0 {
                0xEDB8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
        }
    }
    !c
}

fn chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    out.extend((data.len() as u32).to_be_bytes());
    let mut body = kind.to_vec();
    body.extend(data);
    out.extend(&body);
    out.extend(crc32(&body).to_be_bytes());
}

/// A PNG whose header claims `w x h` RGB pixels and whose image data is a few bytes: a
/// decompression bomb of ~70 bytes (refused only when decoded, after the allocation).
fn header_bomb_png(w: u32, h: u32) -> Vec<u8> {
    let mut v = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut ihdr = Vec::new();
    ihdr.extend(w.to_be_bytes());
    ihdr.extend(h.to_be_bytes());
    ihdr.extend([8, 2, 0, 0, 0]); // 8-bit RGB, not interlaced
    chunk(&mut v, b"IHDR", &ihdr);
    chunk(&mut v, b"IDAT", &[0x78, 0x9c, 0x63, 0x00, 0x00]); // a cut zlib stream
    chunk(&mut v, b"IEND", &[]);
    v
}

fn cfg(batch: usize) -> ImageFeedConfig {
    ImageFeedConfig {
        batch,
        out: (16, 16),
        seed: 5,
        bad_files: BadFiles::Skip,
        prefetch: PrefetchConfig {
            loader_threads: 1,
            ..PrefetchConfig::default()
        },
        ..ImageFeedConfig::default()
    }
}

fn vm_hwm_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

// ---------------------------------------------------------------------------------------------
// Findings
// ---------------------------------------------------------------------------------------------

/// A valid PNG wider than `kernels::MAX_SIDE` (2^24) but under `decode::MAX_OUTPUT_BYTES`
/// (1 x 16_777_224 gray: a ~17 KB file) decodes and gets a crop, and then the batch's
/// `ResizeSpec` fails validation in the feeder: the WHOLE batch is an error, with
/// `BadFiles::Skip`, every epoch (and an error ends the prefetcher / the feed).
fn bug_oversized_side_png_poisons_batch_despite_skip() {
    let root = tmp("wide");
    std::fs::create_dir_all(root.join("a")).unwrap();
    let w = (1u32 << 24) + 8;
    {
        let f = std::fs::File::create(root.join("a/wide.png")).unwrap();
        let mut e = png::Encoder::new(std::io::BufWriter::new(f), w, 1);
        e.set_color(png::ColorType::Grayscale);
        e.set_depth(png::BitDepth::Eight);
        e.set_compression(png::Compression::High);
        let mut wr = e.write_header().unwrap();
        wr.write_image_data(&vec![0u8; w as usize]).unwrap();
    }
    std::fs::write(root.join("a/ok1.jpg"), small_jpeg(40, 30)).unwrap();
    std::fs::write(root.join("a/ok2.png"), small_png(20, 20)).unwrap();
    let size = std::fs::metadata(root.join("a/wide.png")).unwrap().len();
    let list = ImageList::folder(&root).unwrap();
    let c = ImageFeedConfig {
        shuffle: false,
        ..cfg(3)
    };
    let src = ImageSource::new(list, &c).unwrap();
    let mut b = HostBatch::<i64>::default();
    src.load(0, &mut b).unwrap();
    let spec = b.resize.clone().unwrap();
    let v = spec.validate("hostile");
    eprintln!(
        "wide.png: {size} bytes on disk; load() Ok with {} samples; validate: {v:?}",
        spec.samples.len()
    );
    let mut run = DryRun::<f32, i64>::new(src.source(), c.prefetch.clone()).unwrap();
    let first = run.next().map(|r| r.map(|b| b.index()));
    eprintln!("dry run batch 0: {first:?}; skipped {:?}", src.skipped());
    let after = run.next().map(|r| r.map(|b| b.index()));
    eprintln!("dry run after the error: {after:?}");
    std::fs::remove_dir_all(&root).unwrap();
    assert!(
        matches!(first, Some(Ok(0))),
        "a decodable file the kernel refuses must be skipped (BadFiles::Skip) or refused by \
         ImageSource::load as a bad file, not fail the batch in the feeder"
    );
}

/// A ~70-byte PNG whose header claims 26 000 x 26 000 pixels (2.03 GB, under
/// MAX_OUTPUT_BYTES) passes `decode::info`, so `load` sizes the batch's block from it BEFORE
/// decoding: with `BadFiles::Skip` a batch of such files is not skipped — `pinned(total)` is
/// asked for 16 x 2 GB and the batch fails (and with a pool, page-locked memory of that size is
/// what the prefetcher tries to allocate). One bomb among good files costs a 2 GB block and two
/// 2 GB memsets (`resize(len, 0)`, then `dst.fill(0)` after the failed decode).
fn bug_header_bomb_batch_allocates_before_decoding() {
    let bomb = header_bomb_png(26_000, 26_000);
    let info = decode::info(&bomb).unwrap();
    eprintln!(
        "bomb: {} bytes on disk, info Ok: {}x{} -> {} RGB bytes",
        bomb.len(),
        info.height,
        info.width,
        info.rgb_len()
    );
    let root = tmp("bomb");
    std::fs::create_dir_all(root.join("a")).unwrap();
    for k in 0..16 {
        std::fs::write(root.join(format!("a/bomb{k:02}.png")), &bomb).unwrap();
    }
    // One good image, so that the batch is not all bad files (which is an error of its own).
    std::fs::write(root.join("a/good.png"), small_png(16, 16)).unwrap();
    let list = ImageList::folder(&root).unwrap();
    let c = ImageFeedConfig {
        shuffle: false,
        ..cfg(17)
    };
    let src = ImageSource::new(list, &c).unwrap();
    let mut b = HostBatch::<i64>::default();
    let r = src.load(0, &mut b);
    eprintln!(
        "16 bombs (1.1 KB on disk), Skip: load -> {:?}; skipped {}",
        r.as_ref().map_err(|e| e.to_string()),
        src.skipped().count
    );
    std::fs::remove_dir_all(&root).unwrap();
    // One bomb (smaller, 507 MB) next to a good image: the block is the bomb's size.
    let root = tmp("bomb1");
    std::fs::create_dir_all(root.join("a")).unwrap();
    std::fs::write(root.join("a/a.png"), header_bomb_png(13_000, 13_000)).unwrap();
    std::fs::write(root.join("a/b.jpg"), small_jpeg(32, 32)).unwrap();
    let src = ImageSource::new(
        ImageList::folder(&root).unwrap(),
        &ImageFeedConfig {
            shuffle: false,
            ..cfg(2)
        },
    )
    .unwrap();
    let mut b1 = HostBatch::<i64>::default();
    let t = Instant::now();
    let r1 = src.load(0, &mut b1);
    eprintln!(
        "1 bomb of 70 bytes + 1 good: load -> {:?} in {:?}, pixel block {} bytes, skipped {}",
        r1.as_ref().map(|_| ()).map_err(|e| e.to_string()),
        t.elapsed(),
        b1.pixels.len(),
        src.skipped().count
    );
    std::fs::remove_dir_all(&root).unwrap();
    assert!(
        r.is_ok(),
        "16 header bombs under BadFiles::Skip must be skipped, not fail the batch"
    );
    assert!(
        b1.pixels.len() < 1 << 20,
        "a skipped 70-byte file sized the batch's block at {} bytes",
        b1.pixels.len()
    );
}

/// A valid JPEG followed by trailing bytes that contain `FF DA` (camera trailers, appended
/// metadata) is refused as "truncated": `ends_its_last_scan` looks for the LAST `FF DA` in the
/// whole file, trailer included. PIL and the `image` crate decode it.
fn bug_jpeg_with_trailer_containing_ff_da_refused() {
    let mut j = small_jpeg(24, 16);
    let clean = decode::decode_rgb(&j).unwrap().1;
    j.extend_from_slice(b"TRAILER\xff\xda\x00\x01");
    let reference = image::load_from_memory(&j).map(|i| i.to_rgb8().into_raw());
    let ours = decode::decode_rgb(&j);
    eprintln!(
        "image crate: {:?}; pinstream: {:?}",
        reference
            .as_ref()
            .map(|v| v.len())
            .map_err(|e| e.to_string()),
        ours.as_ref().map(|v| v.1.len()).map_err(|e| e.to_string())
    );
    assert!(reference.is_ok());
    assert_eq!(
        ours.expect("a complete JPEG with a trailer must decode").1,
        clean
    );
}

/// `start` is not checked: a batch past the epoch's end silently moves to a later epoch, and a
/// large epoch saturates `global()`: position(0) is not `start`, and every batch after the
/// first is the SAME batch (index saturates at u64::MAX).
fn bug_start_not_validated_and_saturates_to_duplicate_batches() {
    let root = tmp("start");
    std::fs::create_dir_all(root.join("a")).unwrap();
    for k in 0..6 {
        std::fs::write(root.join(format!("a/{k}.png")), small_png(8 + k, 8)).unwrap();
    }
    let list = ImageList::folder(&root).unwrap();
    let per = 3u64; // 6 images, batch 2
    let past = ImageSource::new(
        list.clone(),
        &ImageFeedConfig {
            start: (0, 5),
            ..cfg(2)
        },
    );
    let past_pos = past.as_ref().map(|s| s.position(0)).ok();
    // Near u64::MAX the positions would saturate (every batch the same): refused up front.
    let big = ImageSource::new(
        list.clone(),
        &ImageFeedConfig {
            start: (u64::MAX / 2, 0),
            ..cfg(2)
        },
    );
    let ok = ImageSource::new(
        list,
        &ImageFeedConfig {
            start: (1 << 40, 2),
            ..cfg(2)
        },
    )
    .unwrap();
    let p: Vec<_> = (0..4).map(|i| ok.position(i)).collect();
    eprintln!(
        "start (0, 5) with {per} batches/epoch: new -> ok={}, position(0) = {past_pos:?}; \
         start (u64::MAX / 2, 0): ok={}; positions from (2^40, 2): {p:?}",
        past.is_ok(),
        big.is_ok()
    );
    std::fs::remove_dir_all(&root).unwrap();
    assert!(
        past.is_err() || past_pos == Some((0, 5)),
        "start batch >= batches_per_epoch must be refused"
    );
    assert!(
        big.is_err(),
        "a start whose positions saturate must be refused"
    );
    assert_eq!(
        p,
        [
            (1 << 40, 2),
            ((1 << 40) + 1, 0),
            ((1 << 40) + 1, 1),
            ((1 << 40) + 1, 2)
        ]
    );
}

/// The crops of batch k of epoch e come from `Rng::new(seed, (e << 32) ^ k)`, the shuffle of
/// epoch e from `Rng::new(seed, e)`: epoch 0's batch k draws its crops from exactly the
/// stream that shuffles epoch k, and epochs e and e + 2^32 draw the same crops.
fn bug_crop_streams_alias_shuffle_streams_and_other_epochs() {
    let root = tmp("streams");
    std::fs::create_dir_all(root.join("a")).unwrap();
    for k in 0..4 {
        std::fs::write(root.join(format!("a/{k}.png")), small_png(64, 48)).unwrap();
    }
    let list = ImageList::folder(&root).unwrap();
    let crops = |start: (u64, usize)| {
        let s = ImageSource::new(list.clone(), &ImageFeedConfig { start, ..cfg(4) }).unwrap();
        let mut b = HostBatch::<i64>::default();
        s.load(0, &mut b).unwrap();
        b.resize
            .unwrap()
            .samples
            .iter()
            .map(|x| x.crop)
            .collect::<Vec<CropBox>>()
    };
    let (a, b) = (crops((3, 0)), crops(((1 << 32) + 3, 0)));
    eprintln!("epoch 3 crops == epoch 2^32+3 crops: {}", a == b);
    // And the alias with the sampler: the crop stream of (epoch 0, batch 1) is Rng::new(seed, 1),
    // the same generator Sampler::shuffle(seed).indices(1) runs Fisher-Yates with.
    #[allow(clippy::identity_op)] // the old stream formula, (epoch << 32) ^ batch, for epoch 0
    let mut crop_rng = Rng::new(5, (0u64 << 32) ^ 1);
    let mut shuffle_rng = Rng::new(5, 1);
    let same = (0..8).all(|_| crop_rng.next_u64() == shuffle_rng.next_u64());
    eprintln!("crop stream (epoch 0, batch 1) == shuffle stream of epoch 1: {same}");
    std::fs::remove_dir_all(&root).unwrap();
    assert_ne!(a, b, "epochs 2^32 apart draw identical crops");
}

/// `ImageList::from_pairs` takes any path and `load` reads it whole with `std::fs::read`
/// before looking at a byte: a FIFO blocks a loader thread forever (a device such as /dev/zero
/// grows memory without bound), and a huge regular file is read whole (a sparse 3 GB `.jpg` in
/// a folder costs 3 GB of RAM per loader thread before it is refused by its first bytes).
fn bug_load_reads_whole_file_before_checking_it() {
    let root = tmp("fifo");
    let fifo = root.join("x.jpg");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    let mut hung = false;
    if made {
        let src = ImageSource::new(
            ImageList::from_pairs(vec![(fifo.clone(), 0)]).unwrap(),
            &cfg(1),
        )
        .unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let s2 = src.clone();
        std::thread::spawn(move || {
            let mut b = HostBatch::<i64>::default();
            let _ = tx.send(s2.load(0, &mut b).map_err(|e| e.to_string()));
        });
        // A generous watchdog against a hang (not a speed bound: the load returns at once).
        hung = rx.recv_timeout(Duration::from_secs(60)).is_err();
        eprintln!("FIFO listed as an image: load still blocked after 60 s: {hung}");
        // Unblock it, if it is still blocked (without blocking here when nobody reads).
        {
            use std::os::unix::fs::OpenOptionsExt;
            let _ = std::fs::OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_NONBLOCK)
                .open(&fifo);
        }
        let _ = rx.recv_timeout(Duration::from_secs(5));
    }
    // A sparse 3 GB file named .jpg, in a folder.
    std::fs::create_dir_all(root.join("a")).unwrap();
    let big = root.join("a/huge.jpg");
    std::fs::File::create(&big)
        .unwrap()
        .set_len(3 << 30)
        .unwrap();
    std::fs::write(root.join("a/ok.png"), small_png(16, 16)).unwrap();
    let src = ImageSource::new(
        ImageList::folder(&root).unwrap(),
        &ImageFeedConfig {
            shuffle: false,
            ..cfg(2)
        },
    )
    .unwrap();
    let before = vm_hwm_kib();
    let t = Instant::now();
    let mut b = HostBatch::<i64>::default();
    let r = src.load(0, &mut b);
    let grew = vm_hwm_kib().saturating_sub(before) / 1024;
    eprintln!(
        "sparse 3 GB .jpg: load -> {:?} in {:?}; peak RSS grew by {grew} MiB; skipped {:?}",
        r.as_ref().map(|_| ()).map_err(|e| e.to_string()),
        t.elapsed(),
        src.skipped()
    );
    std::fs::remove_dir_all(&root).unwrap();
    assert!(!hung, "a FIFO in the list hangs the loader");
    assert!(
        grew < 512,
        "a file that is not an image was read whole ({grew} MiB)"
    );
}

/// The CPU reference is the DryRun's resampler: one `ResizeSpec` that validates, with no
/// `clamp_to_box` (`Resize`+`CenterCrop`-style box) over a 1 x 2^24 image resampled to
/// 1 x 1048560, costs the reference one f64 weight vector per output column. Not a bug, a
/// measurement: the reference's cost is bounded by the image's area times 4.
fn ok_reference_cost_is_bounded() {
    let (h, w) = (1usize, 1usize << 16);
    let px = vec![7u8; h * w * 3];
    let mut spec = ResizeSpec::new(3, 1, 1, Normalize::imagenet());
    spec.push(
        0,
        h,
        w,
        CropBox {
            top: 0.0,
            left: 0.0,
            height: 1.0,
            width: w as f32,
            flip: true,
            clamp_to_box: false,
        },
    );
    let t = Instant::now();
    let out = cpu::resized_crop_exact(&px, &spec).unwrap();
    eprintln!("1 x 65536 -> 1 x 1: {:?}, {:?}", t.elapsed(), out);
}

// ---------------------------------------------------------------------------------------------
// Suspicions that turned out fine (they pass)
// ---------------------------------------------------------------------------------------------

/// Random specs around every boundary of `validate` (boxes at -tol .. side + tol, tiny boxes,
/// sides near 2^24 with 1 row, out sizes up to MAX_OUT_SIDE on one axis): whatever validates
/// runs through the CPU reference without a panic and every tap the kernel's f32 `axis_of`
/// could take lies inside the image. (The kernel clamps taps to the window and the window is
/// inside the image by construction: lo <= side - 1, hi <= side.)
fn ok_validated_specs_stay_inside() {
    let mut rng = Rng::new(99, 0);
    let mut validated = 0;
    for it in 0..4000 {
        let tall = it % 2 == 0;
        let big = it % 7 == 0;
        let side = if big {
            (1usize << 24) - rng.below(3) as usize
        } else {
            1 + rng.below(40) as usize
        };
        let other = 1 + rng.below(3) as usize;
        let (h, w) = if tall { (side, other) } else { (other, side) };
        let tol = (side as f64 / f64::from(1u32 << 20)).max(1.0 / 64.0);
        let pick = |rng: &mut Rng, s: usize| -> (f32, f32) {
            let s = s as f64;
            let start = match rng.below(4) {
                0 => -tol * rng.unit() * 1.01,
                1 => s - rng.unit() * 2.0,
                2 => s + tol * rng.unit(),
                _ => rng.unit() * s,
            };
            let len = match rng.below(4) {
                0 => 1.0 / 1024.0 * (1.0 + rng.unit()),
                1 => s + tol - start,
                2 => (s - start).max(0.0) * rng.unit(),
                _ => s * 2.0 * rng.unit(),
            };
            (start as f32, len as f32)
        };
        let (top, height) = pick(&mut rng, h);
        let (left, width) = pick(&mut rng, w);
        let out_h = if big && !tall {
            1
        } else {
            1 + rng.below(9) as usize
        };
        let out_w = if big && tall {
            1
        } else {
            1 + rng.below(9) as usize
        };
        let mut spec = ResizeSpec::new(1, out_h, out_w, Normalize::new(&[0.0], &[1.0]))
            .antialias(rng.below(2) == 0);
        let crop = CropBox {
            top,
            left,
            height,
            width,
            flip: rng.below(2) == 0,
            clamp_to_box: rng.below(2) == 0,
        };
        spec.push(3, h, w, crop);
        if spec.validate("fuzz").is_err() {
            continue;
        }
        validated += 1;
        // The kernel's f32 taps, clamped to the image only (a superset of the window).
        for (start, len, n_out, s) in [(top, height, out_h, h), (left, width, out_w, w)] {
            let scale = (f64::from(len) / n_out as f64) as f32;
            for o in 0..n_out {
                let center = start + scale * (o as f32 + 0.5);
                assert!(center.is_finite());
                let _ = s;
            }
        }
        if h * w <= 1 << 16 {
            let px = vec![1u8; 3 + h * w];
            let out = cpu::resized_crop_exact(&px, &spec).unwrap();
            assert!(
                out.iter().all(|v| (v - 1.0).abs() < 1e-6),
                "{crop:?} {h}x{w}: {out:?}"
            );
        }
    }
    eprintln!("{validated} of 4000 specs validated; all ran");
}

fn ok_output_len_and_huge_sizes_are_errors() {
    let mut spec = ResizeSpec::new(
        4,
        1_048_560,
        1_048_560,
        Normalize::new(&[0.0; 4], &[1.0; 4]),
    );
    spec.push(usize::MAX - 2, 1, 1, CropBox::center(1, 1, 1, 1).unwrap());
    assert!(spec.input_extent().is_err());
    assert!(spec.validate("x").is_err());
    spec.samples[0].offset = 0;
    for _ in 0..20 {
        spec.samples.push(spec.samples[0]);
    }
    // 21 x 4 x 2^40 f32: fits usize, not the host: the reference must say so, not abort.
    let r = cpu::resized_crop_exact(&[0u8; 4], &spec);
    assert!(r.is_err(), "{:?}", r.map(|v| v.len()));
    let mut b = HostBatch::<i64>::default();
    for len in [usize::MAX, isize::MAX as usize, 1 << 45] {
        assert!(b.pinned(len).is_err());
    }
}

fn ok_sampler_edges() {
    assert!(Sampler::new(0).indices(0).unwrap().is_empty());
    assert!(Sampler::new(usize::MAX).indices(0).is_err());
    let s = Sampler::new(3)
        .shuffle(1)
        .shard(usize::MAX - 1, usize::MAX)
        .unwrap();
    assert_eq!(s.indices(7).unwrap().len(), 1);
    let s = Sampler::new(3).shard(2, 5).unwrap().drop_uneven(true);
    assert!(s.indices(0).unwrap().is_empty());
    let mut b = Sampler::new(10).batches(0, usize::MAX, false).unwrap();
    assert_eq!(b.total(), 1);
    assert_eq!(b.get(usize::MAX), None);
    assert_eq!(b.next().unwrap().len(), 10);
    assert!(b.next().is_none());
    let mut b = Sampler::new(10).batches(u64::MAX, 3, true).unwrap();
    assert_eq!(b.nth(usize::MAX), None);
    assert_eq!(b.next(), None);
    assert!(Sampler::new(10).batches(0, 0, false).is_err());
}

fn ok_every_file_broken_with_skip_is_an_error_not_a_hang() {
    let root = tmp("broken");
    std::fs::create_dir_all(root.join("a")).unwrap();
    for k in 0..4 {
        std::fs::write(root.join(format!("a/{k}.jpg")), b"\xff\xd8\xffjunk").unwrap();
    }
    let src = ImageSource::new(ImageList::folder(&root).unwrap(), &cfg(2)).unwrap();
    let mut run = DryRun::<f32, i64>::new(src.source(), cfg(2).prefetch).unwrap();
    let t = Instant::now();
    let first = run
        .next()
        .map(|r| r.map(|b| b.index()).map_err(|e| e.to_string()));
    eprintln!(
        "{first:?} in {:?}; then {:?}",
        t.elapsed(),
        run.next().is_none()
    );
    assert!(matches!(first, Some(Err(_))));
    std::fs::remove_dir_all(&root).unwrap();
}

fn ok_dataset_roots() {
    let root = tmp("ds");
    std::fs::write(root.join("file.jpg"), b"x").unwrap();
    assert!(matches!(
        ImageList::folder(root.join("file.jpg")),
        Err(Error::Io { .. })
    ));
    // A class that links to the root and a root-level loop.
    std::fs::create_dir_all(root.join("c")).unwrap();
    std::fs::write(root.join("c/x.png"), b"x").unwrap();
    #[cfg(unix)]
    {
        std::os::unix::fs::symlink(&root, root.join("c/up")).unwrap();
        std::os::unix::fs::symlink(&root, root.join("d")).unwrap();
        std::os::unix::fs::symlink("/dev/zero", root.join("c/zero.jpg")).unwrap();
    }
    let l = ImageList::folder(&root).unwrap();
    eprintln!("{:?}", l.items());
    assert!(l.items().iter().all(|(p, _)| !p.ends_with("zero.jpg")));
    std::fs::remove_dir_all(&root).unwrap();
}

/// Mutations of small baseline / progressive JPEGs and PNGs: no escape (panics are caught), no
/// write past `rgb_len`, `info` agrees with a successful decode. The work is bounded by counts
/// (3000 mutations of files of a few KiB, each decoded into at most 1 MiB: headers that claim
/// more are checked by `info` only), not by a clock: a timed bound fails on a busy machine
/// (issue 29, finding 13).
fn ok_decoder_mutations() {
    let mut seeds = vec![small_jpeg(33, 17), small_png(31, 9), small_jpeg(1, 300)];
    // Progressive (PIL-made, from decode.rs's own tests would be ideal; the image crate cannot
    // write progressive): use the restart/baseline files above only.
    seeds.push(header_bomb_png(3, 3));
    let mut rng = Rng::new(1, 1);
    let mut oks = 0;
    let mut decoded_bytes = 0usize;
    for it in 0..3000 {
        let mut b = seeds[it % seeds.len()].clone();
        match rng.below(4) {
            0 => {
                let n = 1 + rng.below(b.len() as u64) as usize;
                b.truncate(n);
            }
            1 => {
                for _ in 0..1 + rng.below(4) {
                    let i = rng.below(b.len() as u64) as usize;
                    b[i] = rng.next_u64() as u8;
                }
            }
            2 => {
                let i = rng.below(b.len() as u64) as usize;
                b[i] = 0xFF;
            }
            _ => {
                // Header sizes set to extremes (JPEG SOF0 height/width at 163.. for our encoder).
                if let Some(p) = b.windows(2).position(|w| w == [0xFF, 0xC0]) {
                    let v = [0xFFu8, 0xFF, 0x00, 0x01, 0xFF, 0xFE][rng.below(6) as usize];
                    let i = p + 5 + rng.below(4) as usize;
                    if i < b.len() {
                        b[i] = v;
                    }
                }
            }
        }
        let head = decode::info(&b);
        if let Ok(i) = head {
            if i.rgb_len() <= 1 << 20 {
                decoded_bytes += i.rgb_len();
                let mut out = vec![0xA5u8; i.rgb_len() + 64];
                let r = decode::decode_rgb_into(&b, &mut out);
                if let Ok(j) = r {
                    oks += 1;
                    assert_eq!(i, j);
                }
                assert!(out[i.rgb_len()..].iter().all(|&x| x == 0xA5));
            }
        }
    }
    eprintln!("3000 mutations: {oks} decoded, {decoded_bytes} output bytes asked for");
    assert!(decoded_bytes <= 3000 << 20);
}

#[allow(dead_code)]
fn unused(_: &Path, _: Augment) {
    let _ = std::io::stdout().flush();
}

/// zlib stream of `data` in one stored (uncompressed) deflate block.
fn zlib_stored(data: &[u8]) -> Vec<u8> {
    let mut v = vec![0x78, 0x01, 0x01];
    let n = data.len() as u16;
    v.extend(n.to_le_bytes());
    v.extend((!n).to_le_bytes());
    v.extend(data);
    let (mut a, mut b) = (1u32, 0u32);
    for &x in data {
        a = (a + u32::from(x)) % 65521;
        b = (b + a) % 65521;
    }
    v.extend(((b << 16) | a).to_be_bytes());
    v
}

/// An APNG whose IHDR says `w x h` but whose first frame (fcTL before IDAT, so the IDAT is
/// that frame) is `fw x fh`: what does the decoder write into the rows the frame does not cover?
fn apng_small_first_frame(w: u32, h: u32, fw: u32, fh: u32, interlace: u8) -> Vec<u8> {
    let mut v = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut ihdr = Vec::new();
    ihdr.extend(w.to_be_bytes());
    ihdr.extend(h.to_be_bytes());
    ihdr.extend([8, 2, 0, 0, interlace]);
    chunk(&mut v, b"IHDR", &ihdr);
    let mut actl = Vec::new();
    actl.extend(1u32.to_be_bytes());
    actl.extend(0u32.to_be_bytes());
    chunk(&mut v, b"acTL", &actl);
    let mut fctl = Vec::new();
    fctl.extend(0u32.to_be_bytes()); // sequence
    fctl.extend(fw.to_be_bytes());
    fctl.extend(fh.to_be_bytes());
    fctl.extend(0u32.to_be_bytes());
    fctl.extend(0u32.to_be_bytes());
    fctl.extend([0, 1, 0, 1, 0, 0]); // delay 1/1, dispose none, blend source
    chunk(&mut v, b"fcTL", &fctl);
    let mut raw = Vec::new();
    for _ in 0..fh {
        raw.push(0); // filter none
        raw.extend(std::iter::repeat_n(0x11u8, fw as usize * 3));
    }
    chunk(&mut v, b"IDAT", &zlib_stored(&raw));
    chunk(&mut v, b"IEND", &[]);
    v
}

/// Suspected: an APNG whose first frame is smaller than its IHDR leaves parts of `out`
/// unwritten while `decode_rgb_into` returns Ok (in a prefetcher `out` is a reused pinned block
/// holding an earlier batch's pixels).
fn ok_apng_first_frame_smaller_than_ihdr() {
    for interlace in [0u8, 1] {
        for (fw, fh) in [(2u32, 4u32), (4, 2), (2, 2), (4, 4)] {
            let png = apng_small_first_frame(4, 4, fw, fh, interlace);
            let mut out = vec![0xA5u8; 4 * 4 * 3];
            let r = decode::decode_rgb_into(&png, &mut out);
            let stale = out.iter().filter(|&&b| b == 0xA5).count();
            eprintln!(
                "interlace {interlace} frame {fw}x{fh} in 4x4: {:?}; {stale} bytes unwritten",
                r.as_ref()
                    .map(|i| (i.height, i.width))
                    .map_err(|e| e.to_string())
            );
            assert!(
                r.is_err() || stale == 0,
                "Ok with {stale} bytes never written"
            );
        }
    }
}

/// `ImageSource::new` accepts configurations whose every batch then fails in the feeder's
/// `ResizeSpec::validate`: an output side above `MAX_OUT_SIDE`, or a `Val { resize }` so large
/// that the centre box is under 1/1024 pixel. The error comes at batch 0, as a loader error.
fn bug_config_not_validated_up_front() {
    let root = tmp("cfg");
    std::fs::create_dir_all(root.join("a")).unwrap();
    std::fs::write(root.join("a/x.png"), small_png(8, 8)).unwrap();
    let list = ImageList::folder(&root).unwrap();
    let mut refused = Vec::new();
    for c in [
        ImageFeedConfig {
            out: (2_000_000, 1),
            ..cfg(1)
        },
        ImageFeedConfig {
            out: (16, 16),
            augment: Augment::Val { resize: 1 << 40 },
            ..cfg(1)
        },
    ] {
        let made = ImageSource::new(list.clone(), &c);
        let later = made.as_ref().ok().map(|s| {
            let mut b = HostBatch::<i64>::default();
            s.load(0, &mut b)
                .and_then(|()| b.resize.unwrap().validate("feeder"))
                .map_err(|e| e.to_string())
        });
        eprintln!(
            "out {:?} {:?}: new ok={}, batch 0: {later:?}",
            c.out,
            c.augment,
            made.is_ok()
        );
        refused.push(made.is_err());
    }
    std::fs::remove_dir_all(&root).unwrap();
    assert!(
        refused.iter().all(|&r| r),
        "new() accepted configs no batch can satisfy"
    );
}

/// PIL's progressive 32x24 JPEG (from decode.rs's tests) cut at every length, with and without
/// an `FF D9` put back at the cut; and extreme aspect ratios 1 x 65535 / 65535 x 1.
fn ok_truncated_progressive_and_thin_images() {
    let hex = "ffd8ffe000104a46494600010100000100010000ffdb0043000201010101010201010102020202020403020202020504040304060506060605060606070908060709070606080b08090a0a0a0a0a06080b0c0b0a0c090a0a0affdb004301020202020202050303050a0706070a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0affc20011080018002003012200021101031101ffc40017000101010100000000000000000000000006000508ffc400160101010100000000000000000000000000060805ffda000c03010002100310000001e564ce133ac70e9dba729406526a2107264d45280fffc400161000030000000000000000000000000000000405ffda00080101000105025228a45148a29145228a45148a29145628ac5158a2b14fffc4001811000301010000000000000000000000000006210431ffda0008010301013f015b66e516d9b945bdfa6516f7e994ffc400191100020301000000000000000000000000000403055161ffda0008010201013f0172fba397dd1c727d1c727d3fffc4001510010100000000000000000000000000000032ffda0008010100063f0294a5294a5294a52fffc4001610010101000000000000000000000000000031c1ffda0008010100013f218b1ca394728b1ca394729e53ca794f2fffda000c030100020003000000104690beffc40014110100000000000000000000000000000020ffda0008010301013f10177fff00ffc400161101010100000000000000000000000000002131ffda0008010201013f10ddd9a4b4ffc400161001010100000000000000000000000000f12030ffda0008010100013f101614a50b8294ad6b5affd9";
    let p: Vec<u8> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect();
    let full = decode::decode_rgb(&p).unwrap().1;
    let (mut cut_ok, mut eoi_ok) = (0, 0);
    for n in 0..p.len() - 2 {
        if decode::decode_rgb(&p[..n]).is_ok() {
            cut_ok += 1;
        }
        let mut q = p[..n].to_vec();
        q.extend([0xFF, 0xD9]);
        if let Ok((i, v)) = decode::decode_rgb(&q) {
            assert_eq!(v.len(), i.rgb_len());
            eoi_ok += 1;
        }
    }
    eprintln!("{} cuts: {cut_ok} decoded; with FF D9 re-appended: {eoi_ok} decoded (zero-filled, as libjpeg warns)", p.len() - 2);
    assert_eq!(cut_ok, 0);
    assert_eq!(decode::decode_rgb(&p).unwrap().1, full);
    for (w, h) in [(1u32, 65535u32), (65535, 1)] {
        let j = small_jpeg(w, h);
        let (i, v) = decode::decode_rgb(&j).unwrap();
        assert_eq!(
            (i.width, i.height, v.len()),
            (w as usize, h as usize, (w * h * 3) as usize)
        );
        let mut spec = ResizeSpec::new(3, 8, 8, Normalize::imagenet());
        spec.push(
            0,
            i.height,
            i.width,
            pinstream_vision::augment::RandomResizedCrop::default()
                .sample(&mut Rng::new(0, 0), i.height, i.width)
                .unwrap(),
        );
        spec.push(
            0,
            i.height,
            i.width,
            CropBox::center(i.height, i.width, 256, 224).unwrap(),
        );
        cpu::resized_crop_exact(&v, &spec).unwrap();
    }
}

/// Issue 29, finding 12: `Augment::Val { resize: 1024 * out + k }` (1 <= k <= 1023) passed the
/// config check, which divided (`resize / 1024 > out`), and then any 1-pixel image made a box
/// under 1/1024 pixel that the feeder's validation refused for the whole batch, even with
/// `BadFiles::Skip`. The check is now exact; at its largest accepted value (1024 x the crop),
/// 1-pixel-wide and -high images make a batch that validates.
fn bug_val_resize_above_1024_times_the_crop_passes_the_check() {
    let list = ImageList::from_pairs(vec![("x.png".into(), 0)]).unwrap();
    for out in [1usize, 3, 16, 49, 224] {
        let val = |resize: usize| ImageFeedConfig {
            out: (out, out),
            augment: Augment::Val { resize },
            shuffle: false,
            ..cfg(4)
        };
        for k in [1usize, 2, 511, 1023] {
            let r = ImageSource::new(list.clone(), &val(1024 * out + k));
            assert!(
                matches!(r, Err(Error::InvalidArgument { .. })),
                "Resize({}) for a {out}-pixel crop: {r:?}",
                1024 * out + k
            );
        }
        let root = tmp(&format!("val-1px-{out}"));
        std::fs::create_dir_all(root.join("a")).unwrap();
        for (name, w, h) in [
            ("a.png", 1, 1),
            ("b.png", 1, 7),
            ("c.png", 7, 1),
            ("d.png", 16, 16),
        ] {
            std::fs::write(root.join("a").join(name), small_png(w, h)).unwrap();
        }
        let src = ImageSource::new(ImageList::folder(&root).unwrap(), &val(1024 * out)).unwrap();
        let mut b = HostBatch::<i64>::default();
        src.load(0, &mut b).unwrap();
        std::fs::remove_dir_all(&root).unwrap();
        assert_eq!(src.skipped().count, 0, "out {out}: {:?}", src.skipped());
        assert_eq!(b.extras.len(), 4);
        // What the feeder checks before the launch.
        b.resize.as_ref().unwrap().validate("test").unwrap();
    }
}

/// Issue 29, finding 11: a class folder holding a chain of nested empty directories kept
/// `ImageList::folder` busy for minutes (each level canonicalized and `stat`-ed by its whole
/// path: time ~ depth^3; 1,024 levels took 14 s). The walk is now linear (each directory opened
/// relative to its parent, visited directories tracked by device and inode), and a tree nested
/// deeper than `dataset::MAX_DEPTH` is refused with a typed error. The work is bounded by the
/// depth, not timed: a chain one level past the limit is refused, and the 2,000 levels
/// are refused after `MAX_DEPTH` directories.
fn bug_deep_folder_chain_walk_is_cubic() {
    use pinstream_vision::dataset::MAX_DEPTH;
    // In memory where there is a tmpfs: each of the ~2,300 directories made and removed on a
    // journaled disk costs milliseconds.
    let shm = Path::new("/dev/shm");
    let root = if shm.is_dir() {
        let d = shm.join(format!("pinstream-hostile2-deep-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    } else {
        tmp("deep")
    };
    std::fs::create_dir_all(root.join("a")).unwrap();
    std::fs::write(root.join("a/ok.png"), small_png(4, 4)).unwrap();
    // At the limit: walked, and the image at the bottom found.
    let mut deep = root.join("a");
    for _ in 0..MAX_DEPTH {
        deep.push("d");
    }
    std::fs::create_dir_all(&deep).unwrap();
    std::fs::write(deep.join("x.png"), small_png(4, 4)).unwrap();
    let l = ImageList::folder(&root).unwrap();
    assert_eq!(l.len(), 2);
    // One past it: refused, naming the path.
    std::fs::create_dir_all(deep.join("d")).unwrap();
    let r = ImageList::folder(&root);
    assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
    // The chain of ~2,000 levels.
    unnest(&root.join("a"));
    nest(&root.join("a"), 2000);
    let r = ImageList::folder(&root);
    unnest(&root.join("a"));
    std::fs::remove_dir_all(&root).unwrap();
    assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
}

/// A chain of `depth` directories named `d` below `base`, each made relative to its parent's
/// descriptor (`mkdirat`), so that making it is linear in the depth.
fn nest(base: &Path, depth: usize) {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let name = c"d";
    let mut dir = std::fs::File::open(base).unwrap();
    for _ in 0..depth {
        // SAFETY: `dir` is an open directory; `name` is NUL-terminated.
        let rc = unsafe { libc::mkdirat(dir.as_raw_fd(), name.as_ptr(), 0o755) };
        assert_eq!(rc, 0, "mkdirat: {}", std::io::Error::last_os_error());
        // SAFETY: as above; the new descriptor is owned by the `File` made from it.
        let fd = unsafe {
            libc::openat(
                dir.as_raw_fd(),
                name.as_ptr(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
        };
        assert!(fd >= 0, "openat: {}", std::io::Error::last_os_error());
        // SAFETY: `fd` was just opened and is owned by nothing else.
        dir = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    }
}

/// Removes the chain of empty directories named `d` below `base` in linear time (std's
/// `remove_dir_all` takes seconds on 2,000 levels): each level's child is moved up to `base`
/// (`renameat`), then the level, now empty, is removed.
fn unnest(base: &Path) {
    use std::ffi::CString;
    use std::os::fd::AsRawFd;
    let b = std::fs::File::open(base).unwrap();
    let bfd = b.as_raw_fd();
    let name = |i: usize| CString::new(format!("z{i}")).unwrap();
    // SAFETY: `bfd` is an open directory; the names are NUL-terminated.
    let rc = unsafe { libc::renameat(bfd, c"d".as_ptr(), bfd, name(0).as_ptr()) };
    if rc != 0 {
        return;
    }
    for i in 0.. {
        let (cur, next) = (name(i), name(i + 1));
        // SAFETY: as above.
        let fd = unsafe {
            libc::openat(
                bfd,
                cur.as_ptr(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
        };
        assert!(fd >= 0, "openat: {}", std::io::Error::last_os_error());
        // SAFETY: `fd` and `bfd` are open directories; the names are NUL-terminated; `fd` is
        // closed once, here.
        let moved = unsafe {
            let moved = libc::renameat(fd, c"d".as_ptr(), bfd, next.as_ptr()) == 0;
            libc::close(fd);
            libc::unlinkat(bfd, cur.as_ptr(), libc::AT_REMOVEDIR);
            moved
        };
        if !moved {
            break;
        }
    }
}

/// Issue 29, finding 10: valid tiny JPEGs and PNGs followed by sparse trailers (bytes after
/// the end marker) made `ImageSource::load` hold batch x file size: eight such files added
/// 2 GiB of RSS for a few KiB of pixels (an OOM kill at the defaults, not a typed error). Each
/// file is now read up to the end of its image only. Bounded by bytes, not by time: the load's
/// peak RSS grows by far less than the 2 GiB of trailers (the bound leaves room for other
/// trials of this binary running at the same time), and the pixels are those of the files
/// without their trailers.
fn bug_trailers_make_load_hold_whole_files() {
    let root = tmp("trailers");
    let plain = root.join("plain");
    let padded = root.join("padded");
    for d in [&plain, &padded] {
        std::fs::create_dir_all(d.join("a")).unwrap();
    }
    for k in 0..8u32 {
        let (name, bytes) = if k % 2 == 0 {
            (format!("a/{k}.jpg"), small_jpeg(5 + k, 3 + k))
        } else {
            (format!("a/{k}.png"), small_png(3 + k, 5 + k))
        };
        std::fs::write(plain.join(&name), &bytes).unwrap();
        let p = padded.join(&name);
        std::fs::write(&p, &bytes).unwrap();
        // 256 MiB of zeros after the end marker, as a hole: no disk until read.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .unwrap()
            .set_len(256 << 20)
            .unwrap();
    }
    let c = ImageFeedConfig {
        shuffle: false,
        bad_files: BadFiles::Error,
        ..cfg(8)
    };
    let load = |dir: &Path| {
        let src = ImageSource::new(ImageList::folder(dir).unwrap(), &c).unwrap();
        let mut b = HostBatch::<i64>::default();
        src.load(0, &mut b).map(|()| b)
    };
    let a = load(&plain).unwrap();
    let before = vm_hwm_kib();
    let b = load(&padded);
    let grew = vm_hwm_kib().saturating_sub(before) / 1024;
    std::fs::remove_dir_all(&root).unwrap();
    let b = b.unwrap();
    eprintln!("8 images with 256 MiB trailers: peak RSS grew by {grew} MiB");
    assert!(grew < 1024, "peak RSS grew by {grew} MiB for 8 tiny images");
    assert_eq!(b.extras, a.extras);
    assert_eq!(b.resize, a.resize);
    assert_eq!(b.pixels.read().unwrap(), a.pixels.read().unwrap());
}
