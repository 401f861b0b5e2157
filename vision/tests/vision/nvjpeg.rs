//! The GPU JPEG decoder (`pinstream_vision::nvjpeg`): routes per file, pixels against the CPU
//! decoder (the shared photographs and the made JPEGs of `vision/tests/data/jpeg`), regions
//! (ROI decoding), batches that mix every route with bad files, and the stream-ordering
//! guarantee (a long kernel queued before a decode into memory it reads or writes, 200 times).
//!
//! GPU trials are ignored without a GPU; a machine where nvJPEG does not load fails them (the
//! feature is on, so the library must be found: the message says where it looked).

use std::path::PathBuf;
use std::time::Duration;

use crate::common::{ensure, trial, R};
use libtest_mimic::Failed;

/// A trial step's value or its failure.
type T<V> = Result<V, Failed>;
use libtest_mimic::Trial;
use pinstream::memory::DeviceBuffer;
use pinstream::Device;
use pinstream_vision::decode;
use pinstream_vision::nvjpeg::{GpuDecoder, Item, Nvjpeg, Plan, Region, Route};

const PREFIX: &str = "nvjpeg/";

/// The trials of this module, named `nvjpeg/...`.
pub fn trials() -> Vec<Trial> {
    let no_gpu = !pinstream::available();
    vec![
        trial(PREFIX, "library_loads_or_says_why", library),
        trial(
            PREFIX,
            "gpu/routes_and_pixels_match_the_cpu_decoder",
            pixels,
        )
        .with_ignored_flag(no_gpu),
        trial(PREFIX, "gpu/regions_match_the_whole_image", regions).with_ignored_flag(no_gpu),
        trial(PREFIX, "gpu/mixed_batch_with_bad_files", mixed).with_ignored_flag(no_gpu),
        trial(PREFIX, "gpu/refuses_bad_layouts_before_queuing", layouts).with_ignored_flag(no_gpu),
        trial(PREFIX, "gpu/stream_race_other_stream_200", || race(false)).with_ignored_flag(no_gpu),
        trial(PREFIX, "gpu/stream_race_own_stream_200", || race(true)).with_ignored_flag(no_gpu),
        trial(
            PREFIX,
            "gpu/decoder_stream_has_the_greatest_priority",
            priority,
        )
        .with_ignored_flag(no_gpu),
    ]
}

/// The made JPEGs (vision/tests/data/jpeg), found at run time.
fn corpus() -> Option<PathBuf> {
    let base = PathBuf::from(
        std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").into()),
    );
    ["tests/data/jpeg", "vision/tests/data/jpeg"]
        .iter()
        .map(|p| base.join(p))
        .find(|p| p.is_dir())
}

fn read(name: &str) -> T<Vec<u8>> {
    let dir = corpus().ok_or("vision/tests/data/jpeg not found")?;
    Ok(std::fs::read(dir.join(name))?)
}

/// The made JPEGs every decoder reads, with the route each must take on a GPU with engines.
const GOOD: &[(&str, Option<Route>)] = &[
    ("baseline_444.jpg", Some(Route::Hardware)),
    ("baseline_422.jpg", Some(Route::Hardware)),
    ("baseline_420.jpg", Some(Route::Hardware)),
    ("baseline_440.jpg", None),
    ("baseline_411.jpg", None),
    ("gray.jpg", None),
    ("cmyk.jpg", Some(Route::Cpu)),
    ("progressive_420.jpg", Some(Route::Cpu)),
    ("progressive_444.jpg", Some(Route::Cpu)),
    ("restart_420.jpg", None),
    ("optimized_420.jpg", Some(Route::Hardware)),
    ("exif_rotated.jpg", None),
    ("tiny_1x1.jpg", None),
    ("tiny_8x8.jpg", None),
    ("large_odd.jpg", Some(Route::Hardware)),
];

fn library() -> R {
    // Either it loads, or the reason names the library and where it looked.
    match pinstream_vision::nvjpeg::unavailable() {
        None => Ok(()),
        Some(why) => ensure(
            why.contains("libnvjpeg.so.13") && why.contains("Tried"),
            || why.to_string(),
        ),
    }
}

/// Per file its decode's result, its offset in the arena, and the arena copied back.
type Decoded = (Vec<pinstream::Result<Plan>>, Vec<usize>, Vec<u8>);

/// Decodes `files` in one batch, packed, and copies the arena back.
fn decode_all(dec: &mut GpuDecoder, files: &[Vec<u8>], regions: &[Option<Region>]) -> T<Decoded> {
    let dev = dec.nvjpeg().device();
    let mut items = Vec::new();
    let mut offsets = Vec::new();
    // Per file: its plan's error, or its place among the items.
    let mut planned: Vec<Result<usize, pinstream::Error>> = Vec::new();
    let mut at = 0;
    for (f, r) in files.iter().zip(regions) {
        offsets.push(at);
        match dec.plan(f, *r) {
            Ok(plan) => {
                planned.push(Ok(items.len()));
                items.push(Item {
                    data: f,
                    plan,
                    offset: at,
                });
                at += plan.region.rgb_len();
            }
            Err(e) => planned.push(Err(e)),
        }
    }
    let mut arena = DeviceBuffer::<u8>::new(&dev, at.max(1))?;
    dec.stream().memset(&mut arena, 0xAB)?; // poison
    let mut decoded: Vec<Option<pinstream::Result<Plan>>> = dec
        .decode(&items, &mut arena)?
        .into_iter()
        .map(Some)
        .collect();
    let plans = planned
        .into_iter()
        .map(|p| p.and_then(|k| decoded[k].take().expect("one result per item")))
        .collect();
    let mut host = vec![0u8; arena.len()];
    dec.stream().copy_d2h(&arena, &mut host[..])?.wait()?;
    Ok((plans, offsets, host))
}

/// Mean and largest absolute difference, and the share of bytes more than 8 levels apart.
fn diff(a: &[u8], b: &[u8]) -> (f64, u8, f64) {
    let mut sum = 0u64;
    let (mut max, mut far) = (0u8, 0usize);
    for (x, y) in a.iter().zip(b) {
        let d = x.abs_diff(*y);
        sum += d as u64;
        max = max.max(d);
        far += (d > 8) as usize;
    }
    let n = a.len().max(1) as f64;
    (sum as f64 / n, max, far as f64 / n)
}

/// What the decoders may differ by: nvJPEG's IDCT is not zune-jpeg's (NVIDIA documents no
/// bit-exactness with libjpeg), and both upsample chroma by interpolation (nvJPEG with
/// `NVJPEG_FLAGS_UPSAMPLING_WITH_INTERPOLATION`): on average within 1 level, and at most
/// 0.1 % of the bytes more than 8 levels apart. (Without the flag, nvJPEG replicates chroma:
/// 6 % of a 4:2:2 file's bytes were over 8 levels apart, 33 at most.)
fn close(name: &str, got: &[u8], want: &[u8]) -> R {
    let (mean, max, far) = diff(got, want);
    eprintln!("  {name}: mean {mean:.3} max {max} far {:.4}", far);
    ensure(mean <= 1.0 && far <= 0.001, || {
        format!(
            "{name}: mean difference {mean:.3}, largest {max}, {:.2} % over 8 levels",
            far * 100.0
        )
    })
}

fn pixels() -> R {
    let dev = Device::get(0)?;
    let nv = Nvjpeg::new(&dev)?;
    eprintln!("  {} JPEG engines", nv.hardware_engines());
    let mut dec = nv.decoder()?;
    let mut files: Vec<(String, Vec<u8>, Option<Route>)> = Vec::new();
    for (name, route) in GOOD {
        files.push((name.to_string(), read(name)?, *route));
    }
    for dir in crate::image_dirs() {
        for e in std::fs::read_dir(dir)?.flatten() {
            let p = e.path();
            if p.extension()
                .is_some_and(|x| x == "jpg" || x == "jpeg" || x == "png")
            {
                files.push((p.display().to_string(), std::fs::read(&p)?, None));
            }
        }
    }
    let bytes: Vec<Vec<u8>> = files.iter().map(|f| f.1.clone()).collect();
    let (plans, offsets, host) = decode_all(&mut dec, &bytes, &vec![None; bytes.len()])?;
    // nvJPEG's own buffers came from pinstream's pools (its v2 allocators).
    let (device_bytes, pinned_bytes) = nv.pool_bytes();
    eprintln!("  nvJPEG holds {device_bytes} device and {pinned_bytes} pinned bytes of the pools");
    ensure(device_bytes > 0, || {
        "nvJPEG allocated no device memory through the pools".into()
    })?;
    let mut failed = Vec::new();
    for (((name, data, route), plan), at) in files.iter().zip(&plans).zip(&offsets) {
        let plan = plan.as_ref().map_err(|e| format!("{name}: {e}"))?;
        eprintln!("  {name}: {:?} {}x{}", plan.route, plan.height, plan.width);
        if let Some(want) = route {
            let want = if *want == Route::Hardware && nv.hardware_engines() == 0 {
                Route::Cuda
            } else {
                *want
            };
            ensure(plan.route == want, || {
                format!("{name}: {:?}, want {want:?}", plan.route)
            })?;
        }
        let (info, cpu) = decode::decode_rgb(data)?;
        ensure(
            (info.height, info.width) == (plan.height, plan.width),
            || name.clone(),
        )?;
        if let Err(e) = close(name, &host[*at..*at + cpu.len()], &cpu) {
            failed.push(format!("{e:?}"));
        }
    }
    ensure(failed.is_empty(), || failed.join("; "))
}

/// A region decoded alone equals that region of the whole image decoded (the CPU crops its
/// decode; the hardware route decodes the region): compared with the CPU decoder's region.
fn regions() -> R {
    let dev = Device::get(0)?;
    let nv = Nvjpeg::new(&dev)?;
    let mut dec = nv.decoder()?;
    let mut files = Vec::new();
    let mut regions = Vec::new();
    let mut cases = Vec::new();
    for name in [
        "large_odd.jpg",
        "baseline_444.jpg",
        "baseline_420.jpg",
        "progressive_420.jpg",
    ] {
        let data = read(name)?;
        let info = decode::info(&data)?;
        let (h, w) = (info.height, info.width);
        for r in [
            Region {
                top: 0,
                left: 0,
                height: h,
                width: w,
            },
            Region {
                top: 1,
                left: 3,
                height: h / 2,
                width: w / 3,
            },
            Region {
                top: h / 3,
                left: w / 5,
                height: h - h / 3,
                width: w - w / 5,
            },
            Region {
                top: h - 1,
                left: w - 1,
                height: 1,
                width: 1,
            },
            Region {
                top: 7,
                left: 9,
                height: 17,
                width: 33,
            },
        ] {
            if r.top + r.height > h || r.left + r.width > w || r.height == 0 || r.width == 0 {
                continue;
            }
            files.push(data.clone());
            regions.push(Some(r));
            cases.push((name, r));
        }
    }
    let (plans, offsets, host) = decode_all(&mut dec, &files, &regions)?;
    for (((name, r), plan), (at, data)) in cases.iter().zip(&plans).zip(offsets.iter().zip(&files))
    {
        let plan = plan.as_ref().map_err(|e| format!("{name}: {e}"))?;
        let (info, full) = decode::decode_rgb(data)?;
        let out = plan.region;
        // The decode wrote `out` (the region on the hardware route, else the whole image).
        let mut want = Vec::with_capacity(out.rgb_len());
        for y in out.top..out.top + out.height {
            let from = (y * info.width + out.left) * 3;
            want.extend_from_slice(&full[from..from + out.width * 3]);
        }
        let contains = out.top <= r.top
            && out.left <= r.left
            && out.top + out.height >= r.top + r.height
            && out.left + out.width >= r.left + r.width;
        ensure(contains, || format!("{name}: wrote {out:?}, asked {r:?}"))?;
        close(
            &format!("{name} {r:?} ({:?})", plan.route),
            &host[*at..*at + want.len()],
            &want,
        )?;
    }
    Ok(())
}

/// One batch with every route and every bad file: each good file decodes right, each bad one
/// is an error of its own (or, for data nvJPEG cannot tell from an image, decodes to
/// something), and nothing outside the images' bytes is written.
fn mixed() -> R {
    let dev = Device::get(0)?;
    let nv = Nvjpeg::new(&dev)?;
    let mut dec = nv.decoder()?;
    let mut names: Vec<&str> = GOOD.iter().map(|g| g.0).collect();
    names.extend([
        "truncated.jpg",
        "no_eoi.jpg",
        "huge_header.jpg",
        "corrupt_huffman.jpg",
    ]);
    // Twice over, interleaved, so that groups are not contiguous.
    let mut order: Vec<&str> = names.iter().chain(names.iter().rev()).copied().collect();
    order.push("not-an-image");
    let files: Vec<Vec<u8>> = order
        .iter()
        .map(|n| {
            if *n == "not-an-image" {
                Ok(b"GIF89a....".to_vec())
            } else {
                read(n)
            }
        })
        .collect::<T<_>>()?;
    let (plans, offsets, host) = decode_all(&mut dec, &files, &vec![None; files.len()])?;
    let mut covered = vec![false; host.len()];
    for ((name, plan), (at, data)) in order.iter().zip(&plans).zip(offsets.iter().zip(&files)) {
        let cpu = decode::decode_rgb(data);
        match (plan, &cpu) {
            (Ok(p), Ok((_, px))) => {
                close(name, &host[*at..*at + px.len()], px)?;
                covered[*at..*at + px.len()]
                    .iter_mut()
                    .for_each(|c| *c = true);
                let _ = p;
            }
            (Err(_), Err(_)) => {}
            // nvJPEG may decode corrupt entropy-coded data the CPU decoder refuses (both
            // decode something: neither reads outside the file).
            (Ok(p), Err(_)) if *name == "corrupt_huffman.jpg" => {
                covered[*at..*at + p.region.rgb_len()]
                    .iter_mut()
                    .for_each(|c| *c = true);
            }
            (Err(e), Ok(_)) if *name == "corrupt_huffman.jpg" => {
                let _ = e;
            }
            (p, c) => {
                return Err(format!(
                    "{name}: GPU {:?}, CPU {:?}",
                    p.as_ref().map(|p| p.route),
                    c.as_ref().map(|_| ())
                )
                .into())
            }
        }
    }
    // Bytes of no image keep the poison.
    let stray = host
        .iter()
        .zip(&covered)
        .filter(|(b, c)| !**c && **b != 0xAB)
        .count();
    ensure(stray == 0, || {
        format!("{stray} bytes outside the images were written")
    })
}

/// Overlapping or out-of-arena destinations, and an arena on another device, are refused with
/// nothing queued (the arena keeps its poison).
fn layouts() -> R {
    let dev = Device::get(0)?;
    let nv = Nvjpeg::new(&dev)?;
    let mut dec = nv.decoder()?;
    let a = read("baseline_420.jpg")?;
    let len = dec.plan(&a, None)?.region.rgb_len();
    let mut arena = DeviceBuffer::<u8>::new(&dev, 2 * len)?;
    dec.stream().memset(&mut arena, 0xAB)?;
    let plan = dec.plan(&a, None)?;
    let item = |offset| Item {
        data: &a,
        plan,
        offset,
    };
    for bad in [
        vec![item(0), item(len - 1)],
        vec![item(len + 1)],
        vec![item(usize::MAX - 3)],
    ] {
        let r = dec.decode(&bad, &mut arena);
        ensure(
            matches!(r, Err(pinstream::Error::InvalidArgument { .. })),
            || format!("{r:?}"),
        )?;
    }
    // Made-up plans: a size the file does not have, a region outside the image, a route the
    // file cannot take. Each is a bad file of its own; nothing outside its bytes is written.
    let lie = |p: Plan| Item {
        data: &a,
        plan: p,
        offset: 0,
    };
    let bigger = Plan {
        height: plan.height + 1,
        region: Region::full(plan.height + 1, plan.width),
        ..plan
    };
    let smaller = Plan {
        width: plan.width - 1,
        region: Region::full(plan.height, plan.width - 1),
        ..plan
    };
    let outside = Plan {
        region: Region {
            top: plan.height,
            left: 0,
            height: 1,
            width: 1,
        },
        ..plan
    };
    for (what, p) in [
        ("bigger", bigger),
        ("smaller", smaller),
        ("outside", outside),
    ] {
        for route in [Route::Hardware, Route::Cuda, Route::Cpu] {
            let p = Plan { route, ..p };
            let r = dec.decode(&[lie(p)], &mut arena);
            let bad = matches!(&r, Ok(v) if v.len() == 1 && v[0].is_err())
                || matches!(&r, Err(pinstream::Error::InvalidArgument { .. }));
            ensure(bad, || format!("{what} {route:?}: {r:?}"))?;
        }
    }
    let mut host = vec![0u8; arena.len()];
    dec.stream().copy_d2h(&arena, &mut host[..])?.wait()?;
    ensure(host[len + 3..].iter().all(|&b| b == 0xAB), || {
        "a lying plan wrote past its image".into()
    })?;
    dec.stream().memset(&mut arena, 0xAB)?;
    let bad_region = dec.plan(
        &a,
        Some(Region {
            top: 0,
            left: 0,
            height: 0,
            width: 4,
        }),
    );
    ensure(bad_region.is_err(), || format!("{bad_region:?}"))?;
    let bad_region = dec.plan(
        &a,
        Some(Region {
            top: 150,
            left: 0,
            height: 20,
            width: 4,
        }),
    );
    ensure(bad_region.is_err(), || format!("{bad_region:?}"))?;
    let mut host = vec![0u8; arena.len()];
    dec.stream().copy_d2h(&arena, &mut host[..])?.wait()?;
    ensure(host.iter().all(|&b| b == 0xAB), || {
        "a refused decode wrote".into()
    })
}

/// The 2026 defect's pattern (pytorch/vision #9606): a long kernel, then a fill of the
/// destination and a copy of it elsewhere, queued (on another stream, or on the decoder's own),
/// then a decode into that memory. 200 times: the decoded images must be whole (the fill ran
/// first), and the copy must hold the fill (the engine did not write before it ran).
fn race(own_stream: bool) -> R {
    let dev = Device::get(0)?;
    let nv = Nvjpeg::new(&dev)?;
    let mut dec = nv.decoder()?;
    let data = read("large_odd.jpg")?;
    let files = vec![data; 8];
    let plan = dec.plan(&files[0], None)?;
    let len = plan.region.rgb_len();
    let items: Vec<Item<'_>> = (0..8)
        .map(|i| Item {
            data: &files[i],
            plan,
            offset: i * len,
        })
        .collect();
    let mut arena = DeviceBuffer::<u8>::new(&dev, 8 * len)?;
    let mut copy = DeviceBuffer::<u8>::new(&dev, 8 * len)?;
    // The reference: decoded with nothing queued.
    for r in dec.decode(&items, &mut arena)? {
        r?;
    }
    let mut want = vec![0u8; arena.len()];
    dec.stream().copy_d2h(&arena, &mut want[..])?.wait()?;
    let other = dev.stream()?;
    let mut got = vec![0u8; arena.len()];
    let mut seen = vec![0u8; arena.len()];
    for i in 0..200 {
        let s = if own_stream {
            dec.stream().clone()
        } else {
            other.clone()
        };
        s.spin(Duration::from_millis(5))?;
        s.memset(&mut arena, 0x5A)?;
        s.copy_d2d(&arena, &mut copy)?;
        for r in dec.decode(&items, &mut arena)? {
            r?;
        }
        dec.stream().copy_d2h(&arena, &mut got[..])?.wait()?;
        s.copy_d2h(&copy, &mut seen[..])?.wait()?;
        ensure(got == want, || {
            let bad = got.iter().zip(&want).filter(|(a, b)| a != b).count();
            format!("iteration {i}: {bad} decoded bytes differ (the fill ran after the engine)")
        })?;
        ensure(seen.iter().all(|&b| b == 0x5A), || {
            format!("iteration {i}: the copy saw decoded bytes (the engine wrote first)")
        })?;
    }
    Ok(())
}

/// Each decoder's stream runs at the device's greatest priority (the feed's small per-image
/// work must not wait behind a training step's kernels), and two decoders do not share one.
fn priority() -> R {
    let dev = Device::get(0)?;
    let (least, greatest) = dev.stream_priority_range()?;
    let nv = Nvjpeg::new(&dev)?;
    let (a, b) = (nv.decoder()?, nv.decoder()?);
    for d in [&a, &b] {
        ensure(d.stream().priority() == greatest, || {
            format!(
                "priority {} (range {greatest}..={least})",
                d.stream().priority()
            )
        })?;
    }
    ensure(a.stream().as_raw() != b.stream().as_raw(), || {
        "two decoders share a stream".to_string()
    })
}
