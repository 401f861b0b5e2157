//! Hostile review of issue 31 (GPU JPEG decoding): `nvjpeg::{Nvjpeg, GpuDecoder}` and the
//! GPU-decoding `ImageFeed`, driven as a hostile caller would: plans made up or made for other
//! bytes (cut short, a region the planner would never give, a route the file cannot take),
//! degenerate batches (empty, zero-length data, duplicate offsets, 10,000 items, plans whose
//! sizes overflow), data that ends at an unmapped page (nvJPEG must not read past the slice),
//! decoders that outlive their `Nvjpeg` and move between threads, several decoders on one
//! `Nvjpeg`, and feeds dropped mid-epoch, fed only bad files or special files, or whose GPU and
//! CPU decoders disagree on which files are bad.
//!
//! CPU trials run everywhere; GPU trials are ignored without a GPU. Every GPU trial runs under
//! a watchdog (a hang is a failure, never a wall-clock assertion). Trials that may crash the
//! process (reads past a slice) or that need another environment run in a child process: this
//! binary again, `--exact` on the same trial, with `PINSTREAM_HOSTILE31_CHILD` set.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use crate::common::{ensure, trial, within, R};
use libtest_mimic::{Failed, Trial};
use pinstream::memory::DeviceBuffer;
use pinstream::prefetch::{DryRun, PrefetchConfig};
use pinstream::{Device, Error};
use pinstream_vision::dataset::ImageList;
use pinstream_vision::decode;
use pinstream_vision::nvjpeg::{GpuDecoder, Item, Nvjpeg, Plan, Region, Route};
use pinstream_vision::{Augment, BadFiles, Decoding, ImageFeed, ImageFeedConfig, ImageSource};

const PREFIX: &str = "nvjpeg/hostile31/";

/// A trial step's value or its failure.
type T<V> = Result<V, Failed>;

/// Set in a child process to the role it plays (see [`run_child`]).
const CHILD: &str = "PINSTREAM_HOSTILE31_CHILD";

/// What the arena holds outside every image: a decode must never write it.
const GUARD: u8 = 0xA5;

/// Generous: against hangs only, never a timing assertion.
const WATCHDOG: Duration = Duration::from_secs(240);

/// The trials of this module, named `nvjpeg/hostile31/...`.
pub fn trials() -> Vec<Trial> {
    let no_gpu = !pinstream::available();
    let gpu = |name: &'static str, f: fn() -> R| {
        trial(PREFIX, name, move || within(name, WATCHDOG, f)).with_ignored_flag(no_gpu)
    };
    vec![
        // CPU trials (this machine has no GPU).
        trial(
            PREFIX,
            "cpu/bogus_override_is_reported_not_replaced",
            bogus_override,
        ),
        trial(PREFIX, "cpu/region_rgb_len_never_wraps", rgb_len_wraps),
        trial(PREFIX, "cpu/send_sync_as_documented", send_sync),
        trial(
            PREFIX,
            "cpu/dry_run_with_decoding_gpu_decodes_on_the_cpu",
            dry_gpu,
        ),
        trial(
            PREFIX,
            "cpu/corrupt_scans_the_cpu_decoder_refuses",
            cpu_refuses_corrupt_scans,
        ),
        // GPU trials.
        gpu(
            "gpu/truncated_after_plan_is_a_bad_file",
            truncated_after_plan,
        ),
        gpu(
            "gpu/made_up_regions_stay_inside_and_are_right",
            made_up_regions,
        ),
        gpu("gpu/forced_routes_decode_right_or_refuse", forced_routes),
        gpu("gpu/reads_stay_inside_the_data", reads_inside),
        gpu("gpu/ten_thousand_items", ten_thousand),
        gpu("gpu/degenerate_batches", degenerate),
        gpu(
            "gpu/decoder_outlives_nvjpeg_and_moves_threads",
            moves_threads,
        ),
        gpu("gpu/shared_nvjpeg_parallel_decoders", parallel),
        gpu("gpu/arena_on_another_device", other_device),
        gpu("gpu/feed_dropped_mid_epoch_never_hangs", feed_drop),
        gpu("gpu/feed_every_file_bad", feed_all_bad),
        gpu("gpu/feed_special_files_skipped", feed_special),
        gpu("gpu/feed_gpu_and_cpu_keep_the_same_files", feed_same_files),
        gpu(
            "gpu/decoding_gpu_with_bogus_override_is_typed",
            bogus_override_gpu,
        ),
    ]
}

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

fn corpus() -> T<PathBuf> {
    let base = PathBuf::from(
        std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").into()),
    );
    ["tests/data/jpeg", "vision/tests/data/jpeg"]
        .iter()
        .map(|p| base.join(p))
        .find(|p| p.is_dir())
        .ok_or_else(|| "vision/tests/data/jpeg not found".into())
}

fn read(name: &str) -> T<Vec<u8>> {
    Ok(std::fs::read(corpus()?.join(name))?)
}

/// The made JPEGs every decoder reads.
const GOOD: &[&str] = &[
    "baseline_444.jpg",
    "baseline_422.jpg",
    "baseline_420.jpg",
    "baseline_440.jpg",
    "baseline_411.jpg",
    "gray.jpg",
    "cmyk.jpg",
    "progressive_420.jpg",
    "progressive_444.jpg",
    "restart_420.jpg",
    "optimized_420.jpg",
    "exif_rotated.jpg",
    "tiny_1x1.jpg",
    "tiny_8x8.jpg",
    "large_odd.jpg",
];

/// The sequential files the GPU routes take (hardware or CUDA backend).
const SEQUENTIAL: &[&str] = &[
    "baseline_444.jpg",
    "baseline_420.jpg",
    "baseline_411.jpg",
    "gray.jpg",
    "restart_420.jpg",
    "large_odd.jpg",
];

/// `file[..cut]` with an end-of-image marker appended: the scan is cut short, but the file
/// "ends" (the planner's end-of-image walk finds the marker).
fn cut_with_eoi(file: &[u8], cut: usize) -> Vec<u8> {
    let mut v = file[..cut].to_vec();
    v.extend_from_slice(&[0xFF, 0xD9]);
    v
}

fn rgb_len(r: &Region) -> Option<usize> {
    r.height.checked_mul(r.width)?.checked_mul(3)
}

/// The `region` of `data` as the CPU decoder reads it (interleaved RGB).
fn cpu_region(data: &[u8], r: Region) -> pinstream::Result<Vec<u8>> {
    let (info, px) = decode::decode_rgb(data)?;
    let mut out = Vec::with_capacity(r.height * r.width * 3);
    for y in r.top..r.top + r.height {
        let from = (y * info.width + r.left) * 3;
        out.extend_from_slice(&px[from..from + r.width * 3]);
    }
    Ok(out)
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

/// As the module's own trials judge the decoders alike (nvjpeg.rs `close`).
fn close(got: &[u8], want: &[u8]) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!("{} bytes, want {}", got.len(), want.len()));
    }
    let (mean, max, far) = diff(got, want);
    if mean <= 1.0 && far <= 0.001 {
        Ok(())
    } else {
        Err(format!(
            "mean difference {mean:.3}, largest {max}, {:.2} % over 8 levels",
            far * 100.0
        ))
    }
}

/// nvJPEG on device 0 and one decoder.
fn setup() -> T<(Device, Nvjpeg, GpuDecoder)> {
    let dev = Device::get(0)?;
    let nv = Nvjpeg::new(&dev)?;
    let dec = nv.decoder()?;
    Ok((dev, nv, dec))
}

/// What a guarded decode gives back.
struct Guarded {
    /// `decode`'s own error (the whole batch refused), or one result per item.
    results: pinstream::Result<Vec<pinstream::Result<Plan>>>,
    offsets: Vec<usize>,
    host: Vec<u8>,
    /// Arena bytes outside every item's planned bytes that are not the guard any more.
    stray: usize,
}

/// Decodes `items` (data, plan) into an arena where each item's planned bytes sit between
/// `gap` guard bytes (offsets `extra` bytes apart beyond that: odd offsets on purpose), and
/// reads the whole arena back.
fn decode_guarded(dec: &mut GpuDecoder, items: &[(&[u8], Plan)], gap: usize) -> T<Guarded> {
    let dev = dec.nvjpeg().device();
    let mut offsets = Vec::with_capacity(items.len());
    let mut at = gap;
    for (k, (_, p)) in items.iter().enumerate() {
        let len = rgb_len(&p.region).ok_or("a test plan overflows")?;
        offsets.push(at);
        at += len + gap + (k % 3);
    }
    let mut arena = DeviceBuffer::<u8>::new(&dev, at.max(1))?;
    dec.stream().memset(&mut arena, GUARD)?;
    let its: Vec<Item<'_>> = items
        .iter()
        .zip(&offsets)
        .map(|((data, plan), &offset)| Item {
            data,
            plan: *plan,
            offset,
        })
        .collect();
    let results = dec.decode(&its, &mut arena);
    let mut host = vec![0u8; arena.len()];
    dec.stream().copy_d2h(&arena, &mut host[..])?.wait()?;
    let mut inside = vec![false; host.len()];
    for ((_, p), &o) in items.iter().zip(&offsets) {
        let len = rgb_len(&p.region).unwrap_or(0);
        inside[o..o + len].iter_mut().for_each(|c| *c = true);
    }
    let stray = host
        .iter()
        .zip(&inside)
        .filter(|(b, i)| !**i && **b != GUARD)
        .count();
    Ok(Guarded {
        results,
        offsets,
        host,
        stray,
    })
}

/// Whether this process is the child playing `role`.
fn is_child(role: &str) -> bool {
    std::env::var(CHILD).is_ok_and(|r| r == role)
}

/// What a child prints once its work is done (a child that ran nothing prints nothing).
const DONE: &str = "HOSTILE31-CHILD-DONE";

/// Runs the trial `name` of this binary again in a child process, as `role`, with `envs`:
/// its exit status and its output. A child still running after `CHILD_LIMIT` is killed (a
/// hang: the trial fails, and no process is left behind).
fn run_child(
    name: &str,
    role: &str,
    envs: &[(&str, &std::ffi::OsStr)],
) -> T<(std::process::ExitStatus, String)> {
    use std::io::Read;
    const CHILD_LIMIT: Duration = Duration::from_secs(200);
    let exe = std::env::current_exe()?;
    let mut child = std::process::Command::new(exe)
        .arg(format!("{PREFIX}{name}"))
        .args(["--exact", "--include-ignored", "--test-threads=1"])
        .env(CHILD, role)
        .envs(envs.iter().map(|(k, v)| (*k, *v)))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let drain = |mut r: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            let _ = r.read_to_end(&mut v);
            String::from_utf8_lossy(&v).into_owned()
        })
    };
    let out = drain(Box::new(child.stdout.take().ok_or("no stdout")?));
    let err = drain(Box::new(child.stderr.take().ok_or("no stderr")?));
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        if start.elapsed() > CHILD_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("the child ({role}) HUNG: killed after {CHILD_LIMIT:?}").into());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let text = format!(
        "{}{}",
        out.join().unwrap_or_default(),
        err.join().unwrap_or_default()
    );
    Ok((status, text))
}

/// A fresh folder under the temporary directory.
fn tmp(name: &str) -> T<PathBuf> {
    let d = std::env::temp_dir().join(format!("pinstream-hostile31-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d)?;
    Ok(d)
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> T<PathBuf> {
    let p = dir.join(name);
    std::fs::write(&p, bytes)?;
    Ok(p)
}

fn feed_cfg(batch: usize, decoding: Decoding, bad_files: BadFiles) -> ImageFeedConfig {
    ImageFeedConfig {
        batch,
        out: (16, 16),
        augment: Augment::Val { resize: 16 },
        seed: 5,
        shuffle: false,
        bad_files,
        decoding,
        prefetch: PrefetchConfig {
            loader_threads: 3,
            ..PrefetchConfig::default()
        },
        ..ImageFeedConfig::default()
    }
}

/// The corpus's good files copied `times` times into `dir`, labelled by position.
fn good_list(dir: &Path, times: usize) -> T<Vec<(PathBuf, usize)>> {
    let mut v = Vec::new();
    for t in 0..times {
        for name in GOOD {
            let p = write(dir, &format!("{t}-{name}"), &read(name)?)?;
            let label = v.len();
            v.push((p, label));
        }
    }
    Ok(v)
}

// ---------------------------------------------------------------------------------------------
// CPU trials
// ---------------------------------------------------------------------------------------------

/// `PINSTREAM_NVJPEG` names the library to use. Pointed at a path that is not a library (or
/// does not exist), nvJPEG must be reported unavailable with that path in the reason, not
/// silently loaded from elsewhere (the per-user cache, the toolkit) with no word said: the
/// override is the only handle a user has on which library runs, and the only way to see the
/// `Decoding::Gpu` error path. Runs in child processes (the library loads once per process).
fn bogus_override() -> R {
    if is_child("bogus") {
        match pinstream_vision::nvjpeg::unavailable() {
            None => println!("HOSTILE31 unavailable=None"),
            Some(why) => println!("HOSTILE31 unavailable=Some({why})"),
        }
        println!("{DONE}");
        return Ok(());
    }
    let dir = tmp("override")?;
    let not_a_library = write(&dir, "libnvjpeg.so.13", b"this is not an ELF file\n")?;
    let missing = dir.join("missing").join("libnvjpeg.so.13");
    let mut failures = Vec::new();
    for path in [&not_a_library, &missing] {
        let (status, out) = run_child(
            "cpu/bogus_override_is_reported_not_replaced",
            "bogus",
            &[("PINSTREAM_NVJPEG", path.as_os_str())],
        )?;
        ensure(status.success() && out.contains(DONE), || {
            format!("child for {}: {status}: {out}", path.display())
        })?;
        // libtest-mimic does not capture: the child's line may follow the trial's name.
        let line = out
            .lines()
            .find_map(|l| l.find("HOSTILE31 unavailable=").map(|i| &l[i..]))
            .unwrap_or("(no answer from the child)");
        let shown = path.display().to_string();
        if !(line.contains("Some(") && line.contains(&shown)) {
            failures.push(format!(
                "PINSTREAM_NVJPEG={shown}: {line} (the override was ignored without a word)"
            ));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    ensure(failures.is_empty(), || failures.join("; "))
}

/// `Region::rgb_len` is public and what the module's example sizes its arena with: for a
/// region whose byte count overflows `usize` it must not return a wrapped (small) number.
fn rgb_len_wraps() -> R {
    for r in [
        Region {
            top: 0,
            left: 0,
            height: 1 << 62,
            width: 2,
        },
        Region::full(usize::MAX, usize::MAX),
        Region::full(usize::MAX / 3 + 1, 1),
    ] {
        // Saturates (as documented): no arena holds usize::MAX bytes, so the fit checks refuse
        // it; a wrapped value could have fit (finding 5 of the review, in release builds).
        let got = r.rgb_len();
        ensure(got == usize::MAX, || {
            format!("{r:?}.rgb_len() returned {got}: the true value overflows usize")
        })?;
    }
    Ok(())
}

/// The thread-safety the documentation promises (checked by the compiler): a decoder may move
/// to another thread, an `Nvjpeg` may be shared, plans and items are plain data.
fn send_sync() -> R {
    fn send<X: Send>() {}
    fn sync<X: Sync>() {}
    send::<GpuDecoder>();
    send::<Nvjpeg>();
    sync::<Nvjpeg>();
    send::<Plan>();
    sync::<Plan>();
    send::<Item<'static>>();
    sync::<Item<'static>>();
    Ok(())
}

/// `Decoding::Gpu` in a configuration does not change what an `ImageSource` (and a dry run
/// over it, which decodes on the CPU) does: every batch comes, no error.
fn dry_gpu() -> R {
    let dir = tmp("dry")?;
    let list = ImageList::from_pairs(good_list(&dir, 1)?)?;
    let n = list.len();
    let cfg = feed_cfg(4, Decoding::Gpu, BadFiles::Error);
    let src = ImageSource::new(list, &cfg)?;
    let mut run = DryRun::<f32, i64>::new(src.source(), cfg.prefetch.clone())?;
    let mut labels = Vec::new();
    for _ in 0..src.batches_per_epoch() {
        let b = run.next().ok_or("the dry run ended")??;
        labels.extend(b.extras().iter().copied());
    }
    let _ = std::fs::remove_dir_all(&dir);
    ensure(labels == (0..n as i64).collect::<Vec<_>>(), || {
        format!("labels {labels:?}")
    })
}

/// Files whose entropy-coded data is overwritten (as `corrupt_huffman.jpg` is made: bytes
/// that are never 0xFF, so no marker appears), at a few places: the CPU decoder refuses some
/// of them (the set the feed trial `feed_gpu_and_cpu_keep_the_same_files` uses). Also the
/// baseline of `truncated_after_plan`: a file cut short (no end-of-image) is refused.
fn cpu_refuses_corrupt_scans() -> R {
    let refused = corrupted()?;
    eprintln!(
        "  the CPU decoder refuses {} corrupted files",
        refused.len()
    );
    for name in SEQUENTIAL {
        let full = read(name)?;
        let r = decode::decode_rgb(&full[..full.len() / 2]);
        ensure(r.is_err(), || {
            format!("{name} cut in half decodes on the CPU")
        })?;
    }
    ensure(!refused.is_empty(), || {
        "the CPU decoder accepts every corrupted file: nothing to compare".into()
    })
}

/// `file` with `len` bytes of its first scan's entropy-coded data, from `skip` bytes in,
/// overwritten by a pattern (`seed`) that holds no 0xFF; `None` where the file has no such scan.
fn corrupt(file: &[u8], skip: usize, len: usize, seed: u32) -> Option<Vec<u8>> {
    let sos = file.windows(2).position(|w| w == [0xFF, 0xDA])?;
    let seg = usize::from(u16::from_be_bytes([
        *file.get(sos + 2)?,
        *file.get(sos + 3)?,
    ]));
    let mut start = sos + 2 + seg + skip;
    while *file.get(start - 1)? == 0xFF {
        start += 1;
    }
    if start + len + 2 >= file.len() {
        return None;
    }
    let mut v = file.to_vec();
    let mut s = seed;
    for b in &mut v[start..start + len] {
        s = s.wrapping_mul(1103515245).wrapping_add(12345) & 0x7FFF_FFFF;
        *b = ((s >> 16) % 255) as u8;
    }
    Some(v)
}

/// The corrupted variants of the sequential files that the CPU decoder refuses: (name, bytes).
fn corrupted() -> T<Vec<(String, Vec<u8>)>> {
    let mut out = Vec::new();
    for name in SEQUENTIAL {
        let full = read(name)?;
        for (k, (skip, len)) in [(64, 200), (16, 600), (full.len() / 3, 300), (8, 2000)]
            .into_iter()
            .enumerate()
        {
            let Some(v) = corrupt(&full, skip, len, 0x1234567 + k as u32) else {
                continue;
            };
            if decode::decode_rgb(&v).is_err() {
                out.push((format!("corrupt{k}-{name}"), v));
            }
        }
    }
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// GPU trials: the decoder
// ---------------------------------------------------------------------------------------------

/// A plan made for the whole file, used with the file cut short (its header intact, so the
/// size still matches: what `decode` re-checks). `Item::plan` promises that a plan that does
/// not fit the bytes makes the item a bad file; `plan` sends a file without its end to the
/// CPU decoder, which refuses it, because nvJPEG "might decode part of it without a word".
/// Each case is decoded alone (a failed batch falls back to the CPU as a whole).
fn truncated_after_plan() -> R {
    let (_dev, _nv, mut dec) = setup()?;
    let mut silent = Vec::new();
    let mut cases = 0;
    for name in SEQUENTIAL {
        let full = read(name)?;
        let plan = dec.plan(&full, None)?;
        let n = full.len();
        let mut routes = vec![plan.route];
        if plan.route == Route::Hardware {
            routes.push(Route::Cuda);
        }
        for route in routes {
            for cut in [n - 2, n - 40, n * 3 / 4, n / 2] {
                let data = &full[..cut];
                if decode::decode_rgb(data).is_ok() {
                    continue; // the CPU decodes it too: not a cut the CPU path refuses
                }
                cases += 1;
                let p = Plan { route, ..plan };
                let g = decode_guarded(&mut dec, &[(data, p)], 64)?;
                ensure(g.stray == 0, || {
                    format!("{name}[..{cut}] {route:?}: {} stray bytes", g.stray)
                })?;
                match &g.results {
                    Ok(v) if v.len() == 1 => {
                        if let Ok(got) = &v[0] {
                            silent.push(format!(
                                "{name}[..{cut}/{n}] planned {route:?}: decoded Ok on {:?}",
                                got.route
                            ));
                        }
                    }
                    Ok(v) => return Err(format!("{} results for one item", v.len()).into()),
                    Err(_) => {}
                }
            }
        }
    }
    eprintln!("  {cases} cut files the CPU refuses");
    ensure(silent.is_empty(), || {
        format!(
            "cut-short data decoded as good images (the CPU decoder refuses each): {}",
            silent.join("; ")
        )
    })
}

/// Plans with a region the planner never gives (not widened to whole MCUs, on files with and
/// without chroma subsampling, on files of the same size as the planned one but another
/// encoding), routed to the engines. Each decoded alone: nothing outside the region's bytes
/// may be written, and a region that decodes must hold the image's pixels there (a region the
/// engine silently moved is a wrong answer, not a bad file).
fn made_up_regions() -> R {
    let (_dev, nv, mut dec) = setup()?;
    if nv.hardware_engines() == 0 {
        eprintln!(
            "  no JPEG engine: the hardware route becomes the CUDA one (checked all the same)"
        );
    }
    let mut bad = Vec::new();
    for name in [
        "baseline_444.jpg",
        "gray.jpg",
        "baseline_420.jpg",
        "baseline_422.jpg",
        "baseline_440.jpg",
        "progressive_444.jpg",
        "large_odd.jpg",
        "cmyk.jpg",
    ] {
        let data = read(name)?;
        let info = decode::info(&data)?;
        let (h, w) = (info.height, info.width);
        // Chroma at full resolution: the region's pixels must match the CPU's closely.
        let exact = matches!(
            name,
            "baseline_444.jpg" | "gray.jpg" | "progressive_444.jpg"
        );
        let regions = [
            Region {
                top: 3,
                left: 5,
                height: 7,
                width: 9,
            },
            Region {
                top: 1,
                left: 1,
                height: 1,
                width: 1,
            },
            Region {
                top: h - 3,
                left: w - 5,
                height: 3,
                width: 5,
            },
            Region {
                top: 9,
                left: 17,
                height: 16,
                width: 8,
            },
            Region {
                top: 0,
                left: 1,
                height: h,
                width: w - 1,
            },
            Region {
                top: 8,
                left: 8,
                height: h - 8,
                width: w - 8,
            },
        ];
        for r in regions {
            let plan = Plan {
                route: Route::Hardware,
                height: h,
                width: w,
                region: r,
            };
            let g = decode_guarded(&mut dec, &[(data.as_slice(), plan)], 4096)?;
            if g.stray > 0 {
                bad.push(format!(
                    "{name} {r:?}: {} bytes written outside the region's {} bytes",
                    g.stray,
                    r.height * r.width * 3
                ));
                continue;
            }
            let got = match &g.results {
                Ok(v) => v[0].as_ref().ok().copied(),
                Err(e) => {
                    bad.push(format!("{name} {r:?}: the batch was refused: {e}"));
                    continue;
                }
            };
            let Some(p) = got else { continue };
            let want = cpu_region(&data, r)?;
            let at = g.offsets[0];
            let have = &g.host[at..at + want.len()];
            // Regions of a few pixels: the decoders' IDCTs may differ by more than 8 levels
            // at a pixel or two, so a looser bound (a moved region is still tens of levels off
            // on these textured images); chroma replicated in a region (subsampled files): a
            // few levels on average, judged on regions of 32 pixels or more only.
            let (mean, max, _) = diff(have, &want);
            let small = r.height * r.width < 32;
            let verdict = match (exact, small) {
                (true, false) => close(have, &want),
                (true, true) | (false, false) if mean > if small { 6.0 } else { 3.0 } => {
                    Err(format!("mean difference {mean:.2}, largest {max}"))
                }
                _ => Ok(()),
            };
            if let Err(e) = verdict {
                bad.push(format!(
                    "{name} {r:?}: decoded Ok on {:?} but not the region's pixels: {e}",
                    p.route
                ));
            }
        }
    }
    ensure(bad.is_empty(), || bad.join("; "))
}

/// Every good file with every route forced (the right size, the whole image): each decode is
/// right or the file is refused; nothing outside its bytes is written.
fn forced_routes() -> R {
    let (_dev, _nv, mut dec) = setup()?;
    let mut bad = Vec::new();
    for name in GOOD {
        let data = read(name)?;
        let plan = dec.plan(&data, None)?;
        let full = Region::full(plan.height, plan.width);
        let (_, cpu) = decode::decode_rgb(&data)?;
        for route in [Route::Hardware, Route::Cuda, Route::Cpu] {
            let p = Plan {
                route,
                region: full,
                ..plan
            };
            let g = decode_guarded(&mut dec, &[(data.as_slice(), p)], 256)?;
            if g.stray > 0 {
                bad.push(format!("{name} forced {route:?}: {} stray bytes", g.stray));
            }
            match &g.results {
                Ok(v) => match &v[0] {
                    Ok(got) => {
                        let at = g.offsets[0];
                        if let Err(e) = close(&g.host[at..at + cpu.len()], &cpu) {
                            bad.push(format!(
                                "{name} forced {route:?}: decoded Ok on {:?}, wrong: {e}",
                                got.route
                            ));
                        }
                    }
                    Err(e) => eprintln!("  {name} forced {route:?}: refused ({e})"),
                },
                Err(e) => bad.push(format!("{name} forced {route:?}: batch refused: {e}")),
            }
        }
    }
    ensure(bad.is_empty(), || bad.join("; "))
}

/// `data` copied so that its last byte is the last one before an unmapped page (leaked: the
/// child process ends soon after). A read past the slice is a SIGSEGV.
fn at_guard_page(data: &[u8]) -> &'static [u8] {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
    let body = data.len().div_ceil(page).max(1) * page;
    // SAFETY: a fresh private anonymous mapping of `body + page` bytes, owned by no one else.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            body + page,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert!(base != libc::MAP_FAILED, "mmap failed");
    let base = base.cast::<u8>();
    // SAFETY: `body` is inside the mapping; the last page becomes the guard.
    let guard = unsafe { base.add(body) };
    // SAFETY: the guard page is inside the mapping, page-aligned.
    let rc = unsafe { libc::mprotect(guard.cast(), page, libc::PROT_NONE) };
    assert_eq!(rc, 0, "mprotect failed");
    // SAFETY: `data.len() <= body`, so `start..guard` is inside the readable part; the slice
    // is written once here and only read afterwards; the mapping is never unmapped.
    unsafe {
        let start = guard.sub(data.len());
        std::ptr::copy_nonoverlapping(data.as_ptr(), start, data.len());
        std::slice::from_raw_parts(start, data.len())
    }
}

/// nvJPEG is handed `data.as_ptr()` and `data.len()` (header parse and decode, on every route):
/// it must not read a byte past the slice. The data ends at an unmapped page; files cut at
/// every kind of place, zero-length data at the page itself. Run in a child process: a read
/// past the end kills it (SIGSEGV) and fails the trial.
fn reads_inside() -> R {
    const NAME: &str = "gpu/reads_stay_inside_the_data";
    if !is_child("reads") {
        let (status, out) = run_child(NAME, "reads", &[])?;
        let tail: String = out
            .lines()
            .rev()
            .take(20)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join("\n");
        return ensure(status.success() && out.contains(DONE), || {
            format!(
                "the child died or failed ({status}); a read past the data? Its output:\n{tail}"
            )
        });
    }
    let (dev, _nv, mut dec) = setup()?;
    let mut names: Vec<&str> = GOOD.to_vec();
    names.extend([
        "truncated.jpg",
        "no_eoi.jpg",
        "huge_header.jpg",
        "corrupt_huffman.jpg",
    ]);
    let mut arena = DeviceBuffer::<u8>::new(&dev, 4 << 20)?;
    let mut calls = 0;
    for name in names {
        let full = read(name)?;
        let n = full.len();
        // The plan of the whole file (made up from the good file for the bad ones).
        let plan = match dec.plan(&full, None) {
            Ok(p) => p,
            Err(_) => dec.plan(&read("baseline_420.jpg")?, None)?,
        };
        let mut cuts: Vec<usize> = vec![n, n - 1, n - 2, n / 2, n * 3 / 4];
        cuts.extend(
            [2, 3, 4, 20, 100, 160, 200, 300, 400, 600]
                .iter()
                .filter(|&&c| c < n),
        );
        for cut in cuts {
            let data = at_guard_page(&full[..cut]);
            let _ = dec.plan(data, None);
            let ended = at_guard_page(&cut_with_eoi(&full, cut));
            let _ = dec.plan(ended, None);
            for route in [plan.route, Route::Hardware, Route::Cuda] {
                let p = Plan { route, ..plan };
                if rgb_len(&p.region).is_none_or(|l| l > arena.len()) {
                    continue;
                }
                for d in [data, ended] {
                    let _ = dec.decode(
                        &[Item {
                            data: d,
                            plan: p,
                            offset: 0,
                        }],
                        &mut arena,
                    )?;
                    calls += 1;
                }
            }
        }
    }
    // Zero-length data whose pointer is the unmapped page itself.
    let empty = &at_guard_page(&[])[..0];
    let plan = dec.plan(&read("baseline_420.jpg")?, None)?;
    for route in [Route::Hardware, Route::Cuda, Route::Cpu] {
        let _ = dec.plan(empty, None);
        let r = dec.decode(
            &[Item {
                data: empty,
                plan: Plan { route, ..plan },
                offset: 0,
            }],
            &mut arena,
        )?;
        ensure(r.len() == 1 && r[0].is_err(), || {
            format!("zero-length data on {route:?}: {r:?}")
        })?;
        calls += 1;
    }
    println!("  {calls} decodes of data ending at an unmapped page");
    println!("{DONE}");
    Ok(())
}

/// 10,000 items in one batch (four files round-robin, odd offsets): each decodes, and every
/// copy of a file holds the same bytes as its first copy, which is close to the CPU's.
fn ten_thousand() -> R {
    let (_dev, _nv, mut dec) = setup()?;
    let names = [
        "tiny_8x8.jpg",
        "tiny_1x1.jpg",
        "gray.jpg",
        "baseline_420.jpg",
    ];
    let files: Vec<Vec<u8>> = names.iter().map(|n| read(n)).collect::<T<_>>()?;
    let plans: Vec<Plan> = files
        .iter()
        .map(|f| dec.plan(f, None))
        .collect::<pinstream::Result<_>>()?;
    let items: Vec<(&[u8], Plan)> = (0..10_000)
        .map(|i| (files[i % 4].as_slice(), plans[i % 4]))
        .collect();
    let g = decode_guarded(&mut dec, &items, 1)?;
    ensure(g.stray == 0, || format!("{} stray bytes", g.stray))?;
    let results = g
        .results
        .map_err(|e| format!("the batch was refused: {e}"))?;
    ensure(results.len() == 10_000, || {
        format!("{} results", results.len())
    })?;
    let mut routes = std::collections::BTreeMap::new();
    for (i, r) in results.iter().enumerate() {
        let p = r
            .as_ref()
            .map_err(|e| format!("item {i} ({}): {e}", names[i % 4]))?;
        *routes.entry(format!("{:?}", p.route)).or_insert(0) += 1;
        let len = rgb_len(&p.region).unwrap_or(0);
        let (at, first) = (g.offsets[i], g.offsets[i % 4]);
        ensure(g.host[at..at + len] == g.host[first..first + len], || {
            format!("item {i} ({}) differs from item {}", names[i % 4], i % 4)
        })?;
    }
    eprintln!("  routes: {routes:?}");
    for k in 0..4 {
        let (_, cpu) = decode::decode_rgb(&files[k])?;
        let at = g.offsets[k];
        close(&g.host[at..at + cpu.len()], &cpu).map_err(|e| format!("{}: {e}", names[k]))?;
    }
    Ok(())
}

/// Degenerate batches: none, zero-length data, duplicate offsets, a bad item overlapping a good
/// one, sizes that overflow or cannot fit. Each is answered (a typed error or per-item errors),
/// never a panic, and the arena keeps its guard wherever no good image goes.
fn degenerate() -> R {
    let (dev, _nv, mut dec) = setup()?;
    let a = read("baseline_420.jpg")?;
    let plan = dec.plan(&a, None)?;
    let len = rgb_len(&plan.region).ok_or("overflow")?;
    let mut arena = DeviceBuffer::<u8>::new(&dev, 3 * len)?;
    let untouched = |dec: &mut GpuDecoder, arena: &DeviceBuffer<u8>, what: &str| -> R {
        let mut host = vec![0u8; arena.len()];
        dec.stream().copy_d2h(arena, &mut host[..])?.wait()?;
        let n = host.iter().filter(|&&b| b != GUARD).count();
        ensure(n == 0, || format!("{what}: {n} bytes of the arena written"))
    };
    dec.stream().memset(&mut arena, GUARD)?;
    // No items.
    let r = dec.decode(&[], &mut arena)?;
    ensure(r.is_empty(), || format!("no items: {r:?}"))?;
    untouched(&mut dec, &arena, "no items")?;
    // Zero-length data on every route.
    for route in [Route::Hardware, Route::Cuda, Route::Cpu] {
        let r = dec.decode(
            &[Item {
                data: &[],
                plan: Plan { route, ..plan },
                offset: len,
            }],
            &mut arena,
        )?;
        ensure(r.len() == 1 && r[0].is_err(), || {
            format!("zero-length data on {route:?}: {r:?}")
        })?;
    }
    untouched(&mut dec, &arena, "zero-length data")?;
    // Two good items at the same offset: refused before anything is queued.
    let item = |offset| Item {
        data: &a,
        plan,
        offset,
    };
    let r = dec.decode(&[item(len), item(len)], &mut arena);
    ensure(matches!(r, Err(Error::InvalidArgument { .. })), || {
        format!("duplicate offsets: {r:?}")
    })?;
    untouched(&mut dec, &arena, "duplicate offsets")?;
    // Sizes that overflow usize, do not fit, or regions at usize::MAX: refused, no panic, no
    // allocation of the made-up size.
    let huge = [
        Plan {
            route: Route::Cpu,
            height: 1 << 31,
            width: 1 << 31,
            region: Region::full(1 << 31, 1 << 31),
        },
        Plan {
            route: Route::Cpu,
            height: 1 << 20,
            width: 1 << 20,
            region: Region::full(1 << 20, 1 << 20),
        },
        Plan {
            region: Region {
                top: usize::MAX,
                left: 0,
                height: 1,
                width: 1,
            },
            ..plan
        },
        Plan {
            region: Region {
                top: 1,
                left: usize::MAX - 1,
                height: 1,
                width: 2,
            },
            ..plan
        },
        Plan {
            route: Route::Hardware,
            height: usize::MAX,
            width: usize::MAX,
            region: Region {
                top: 0,
                left: 0,
                height: 1,
                width: 1,
            },
        },
        Plan {
            region: Region {
                top: 0,
                left: 0,
                height: 0,
                width: 0,
            },
            ..plan
        },
    ];
    for (k, p) in huge.iter().enumerate() {
        let r = dec.decode(
            &[Item {
                data: &a,
                plan: *p,
                offset: 0,
            }],
            &mut arena,
        );
        let refused = matches!(&r, Ok(v) if v.len() == 1 && v[0].is_err())
            || matches!(&r, Err(Error::InvalidArgument { .. }));
        ensure(refused, || format!("made-up plan {k} {p:?}: {r:?}"))?;
    }
    untouched(&mut dec, &arena, "made-up sizes")?;
    for r in [
        Region {
            top: usize::MAX,
            left: usize::MAX,
            height: usize::MAX,
            width: usize::MAX,
        },
        Region {
            top: 0,
            left: 0,
            height: usize::MAX,
            width: 1,
        },
    ] {
        let p = dec.plan(&a, Some(r));
        ensure(p.is_err(), || format!("plan with {r:?}: {p:?}"))?;
    }
    // A bad item (zero-length data) declared over a good one: the declared destinations
    // overlap, so the call is refused before anything is queued (the layout is the caller's);
    // apart, the good one decodes right, the bad one is an error of its own, and nothing else
    // is written.
    let bad = |offset| Item {
        data: &a[..0],
        plan,
        offset,
    };
    let r = dec.decode(&[item(0), bad(len / 2)], &mut arena);
    ensure(matches!(r, Err(Error::InvalidArgument { .. })), || {
        format!("good + overlapping bad: {r:?}")
    })?;
    untouched(&mut dec, &arena, "good + overlapping bad")?;
    let r = dec.decode(&[item(0), bad(2 * len)], &mut arena)?;
    ensure(r.len() == 2 && r[0].is_ok() && r[1].is_err(), || {
        format!("good + bad apart: {r:?}")
    })?;
    let mut host = vec![0u8; arena.len()];
    dec.stream().copy_d2h(&arena, &mut host[..])?.wait()?;
    let (_, cpu) = decode::decode_rgb(&a)?;
    close(&host[..len], &cpu).map_err(|e| format!("good item beside a bad one: {e}"))?;
    let n = host[len..].iter().filter(|&&b| b != GUARD).count();
    ensure(n == 0, || format!("{n} bytes past the good item written"))
}

/// The files of a mixed batch and its reference decode (bytes, route per item).
struct Reference {
    files: Vec<Vec<u8>>,
    plans: Vec<Plan>,
    host: Vec<u8>,
    offsets: Vec<usize>,
    routes: Vec<Route>,
}

fn reference(dec: &mut GpuDecoder) -> T<Reference> {
    let files: Vec<Vec<u8>> = GOOD.iter().map(|n| read(n)).collect::<T<_>>()?;
    let plans: Vec<Plan> = files
        .iter()
        .map(|f| dec.plan(f, None))
        .collect::<pinstream::Result<_>>()?;
    let (host, offsets, routes) = decode_mixed(dec, &files, &plans)?;
    Ok(Reference {
        files,
        plans,
        host,
        offsets,
        routes,
    })
}

/// Decodes `files` with `plans`, packed: (arena bytes, offsets, routes taken).
fn decode_mixed(
    dec: &mut GpuDecoder,
    files: &[Vec<u8>],
    plans: &[Plan],
) -> T<(Vec<u8>, Vec<usize>, Vec<Route>)> {
    let items: Vec<(&[u8], Plan)> = files
        .iter()
        .map(|f| f.as_slice())
        .zip(plans.iter().copied())
        .collect();
    let g = decode_guarded(dec, &items, 1)?;
    ensure(g.stray == 0, || format!("{} stray bytes", g.stray))?;
    let results = g.results?;
    let routes = results
        .into_iter()
        .enumerate()
        .map(|(i, r)| r.map(|p| p.route).map_err(|e| format!("{}: {e}", GOOD[i])))
        .collect::<Result<Vec<_>, _>>()?;
    Ok((g.host, g.offsets, routes))
}

/// The same batch decoded again must give the reference's bytes where it took the same route,
/// else bytes close to the CPU decoder's.
fn same_as_reference(
    rf: &Reference,
    host: &[u8],
    offsets: &[usize],
    routes: &[Route],
) -> Result<(), String> {
    for (i, p) in rf.plans.iter().enumerate() {
        let len = p.region.rgb_len();
        let (a, b) = (offsets[i], rf.offsets[i]);
        let got = &host[a..a + len];
        if routes[i] == rf.routes[i] {
            if got != &rf.host[b..b + len] {
                return Err(format!(
                    "{} ({:?}): bytes differ from the reference",
                    GOOD[i], routes[i]
                ));
            }
        } else {
            let (_, cpu) = decode::decode_rgb(&rf.files[i]).map_err(|e| e.to_string())?;
            close(got, &cpu).map_err(|e| format!("{} ({:?}): {e}", GOOD[i], routes[i]))?;
        }
    }
    Ok(())
}

/// A decoder whose `Nvjpeg` was dropped first, moved to another thread and back (and dropped
/// there): every decode gives the reference's bytes.
fn moves_threads() -> R {
    let (_dev, nv, mut dec) = setup()?;
    let rf = std::sync::Arc::new(reference(&mut dec)?);
    drop(nv);
    let rf2 = rf.clone();
    let dec = std::thread::spawn(move || -> T<GpuDecoder> {
        let (h, o, r) = decode_mixed(&mut dec, &rf2.files, &rf2.plans)?;
        same_as_reference(&rf2, &h, &o, &r).map_err(|e| format!("on another thread: {e}"))?;
        Ok(dec)
    })
    .join()
    .map_err(|_| "the other thread panicked")??;
    let mut dec = dec;
    let (h, o, r) = decode_mixed(&mut dec, &rf.files, &rf.plans)?;
    same_as_reference(&rf, &h, &o, &r).map_err(|e| format!("back on this thread: {e}"))?;
    // Dropped on a thread of its own, the last owner of the handles.
    std::thread::spawn(move || drop(dec))
        .join()
        .map_err(|_| "dropping the decoder panicked")?;
    // And a new one still works.
    let (_d, _n, mut again) = setup()?;
    let (h, o, r) = decode_mixed(&mut again, &rf.files, &rf.plans)?;
    same_as_reference(&rf, &h, &o, &r).map_err(|e| format!("a new decoder: {e}"))?;
    Ok(())
}

/// Four decoders of one `Nvjpeg` (its handles shared) on four threads, 20 batches each, every
/// one the reference's bytes.
fn parallel() -> R {
    let (_dev, nv, mut dec) = setup()?;
    let rf = std::sync::Arc::new(reference(&mut dec)?);
    let handles: Vec<_> = (0..4)
        .map(|t| {
            let nv = nv.clone();
            let rf = rf.clone();
            std::thread::spawn(move || -> Result<(), String> {
                let mut dec = nv.decoder().map_err(|e| e.to_string())?;
                for i in 0..20 {
                    let (h, o, r) = decode_mixed(&mut dec, &rf.files, &rf.plans)
                        .map_err(|e| format!("thread {t} batch {i}: {e:?}"))?;
                    same_as_reference(&rf, &h, &o, &r)
                        .map_err(|e| format!("thread {t} batch {i}: {e}"))?;
                }
                Ok(())
            })
        })
        .collect();
    let mut bad = Vec::new();
    for h in handles {
        match h.join() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => bad.push(e),
            Err(_) => bad.push("a thread panicked".into()),
        }
    }
    ensure(bad.is_empty(), || bad.join("; "))
}

/// With two GPUs: an arena on the other device is refused (`WrongDevice`) with nothing written;
/// a decoder of device 1 decodes right while device 0 is current on the calling thread, and is
/// dropped so. One GPU: nothing to check (said on stderr).
fn other_device() -> R {
    if Device::count()? < 2 {
        eprintln!("  one GPU: nothing to check");
        return Ok(());
    }
    let (d0, d1) = (Device::get(0)?, Device::get(1)?);
    let nv = Nvjpeg::new(&d1)?;
    let mut dec = nv.decoder()?;
    let a = read("baseline_444.jpg")?;
    let plan = dec.plan(&a, None)?;
    let len = plan.region.rgb_len();
    let mut wrong = DeviceBuffer::<u8>::new(&d0, len)?;
    let s0 = d0.stream()?;
    s0.memset(&mut wrong, GUARD)?;
    let r = dec.decode(
        &[Item {
            data: &a,
            plan,
            offset: 0,
        }],
        &mut wrong,
    );
    ensure(matches!(r, Err(Error::WrongDevice { .. })), || {
        format!("arena on device 0, decoder on 1: {r:?}")
    })?;
    let mut host = vec![0u8; len];
    s0.copy_d2h(&wrong, &mut host[..])?.wait()?;
    ensure(host.iter().all(|&b| b == GUARD), || {
        "the refused arena was written".into()
    })?;
    d0.make_current()?;
    let g = decode_guarded(&mut dec, &[(a.as_slice(), plan)], 64)?;
    ensure(g.stray == 0, || format!("{} stray bytes", g.stray))?;
    let got = g.results?;
    got[0]
        .as_ref()
        .map_err(|e| format!("device 1 with 0 current: {e}"))?;
    let (_, cpu) = decode::decode_rgb(&a)?;
    close(&g.host[g.offsets[0]..g.offsets[0] + cpu.len()], &cpu)?;
    d0.make_current()?;
    drop(dec);
    drop(nv);
    let nv = Nvjpeg::new(&d1)?;
    let mut dec = nv.decoder()?;
    let g = decode_guarded(&mut dec, &[(a.as_slice(), plan)], 64)?;
    ensure(g.results.is_ok_and(|v| v[0].is_ok()), || {
        "a new decoder of device 1 after the drop".into()
    })
}

// ---------------------------------------------------------------------------------------------
// GPU trials: the feed
// ---------------------------------------------------------------------------------------------

/// Feeds dropped at once (loaders starting), after one batch (loaders busy ahead), and after a
/// few batches, ten times over: every drop returns (the watchdog catches a hang), and every
/// batch taken is a good one.
fn feed_drop() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let dir = tmp("drop")?;
    let list = ImageList::from_pairs(good_list(&dir, 3)?)?;
    for round in 0..10 {
        let mut cfg = feed_cfg(4, Decoding::Gpu, BadFiles::Error);
        cfg.prefetch.loader_threads = 1 + round % 4;
        let mut feed = ImageFeed::<f32>::new(&stream, list.clone(), cfg)?;
        ensure(feed.decoding() == Decoding::Gpu, || {
            format!("{:?}", feed.decoding())
        })?;
        for k in 0..(round % 3) * 2 {
            let b = feed.next().ok_or("None in the first epoch")??;
            ensure(b.dims()[0] == 4, || {
                format!("round {round} batch {k}: {:?}", b.dims())
            })?;
        }
        drop(feed);
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// A list of bad files only: with `Skip` the first batch is an error saying every file was left
/// out, with `Error` an error naming one; either way the feed then stays an error (never a
/// `None`, never a hang), on the GPU as on the CPU.
fn feed_all_bad() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let dir = tmp("bad")?;
    let files = vec![
        (write(&dir, "text.jpg", b"not an image at all")?, 0),
        (write(&dir, "truncated.jpg", &read("truncated.jpg")?)?, 1),
        (write(&dir, "huge.jpg", &read("huge_header.jpg")?)?, 2),
        (write(&dir, "empty.jpg", b"")?, 3),
        (dir.join("missing.jpg"), 4),
    ];
    let list = ImageList::from_pairs(files)?;
    for decoding in [Decoding::Gpu, Decoding::Cpu] {
        for bad_files in [BadFiles::Skip, BadFiles::Error] {
            let what = format!("{decoding:?} {bad_files:?}");
            let mut feed =
                ImageFeed::<f32>::new(&stream, list.clone(), feed_cfg(5, decoding, bad_files))?;
            let first = feed.next().map(|r| r.map(|b| b.dims()));
            let msg = match &first {
                Some(Err(e)) => e.to_string(),
                other => return Err(format!("{what}: first batch {other:?}").into()),
            };
            let named = match bad_files {
                BadFiles::Skip => msg.contains("left out"),
                BadFiles::Error => msg.contains(dir.to_string_lossy().as_ref()),
            };
            ensure(named, || format!("{what}: {msg}"))?;
            for i in 0..3 {
                let again = feed.next().map(|r| r.map(|b| b.dims()));
                ensure(matches!(again, Some(Err(_))), || {
                    format!("{what}: call {i} after the error: {again:?}")
                })?;
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// Special files among good ones (a FIFO with no writer, a directory, /dev/zero, a symlink to
/// the FIFO, a missing path) with `Skip`: one epoch comes whole, without them, and no read
/// waits on the FIFO.
fn feed_special() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let dir = tmp("special")?;
    let mut pairs = good_list(&dir, 1)?;
    let goods = pairs.len();
    let fifo = dir.join("fifo.jpg");
    let c = std::ffi::CString::new(fifo.to_string_lossy().as_bytes())?;
    // SAFETY: a valid NUL-terminated path.
    ensure(unsafe { libc::mkfifo(c.as_ptr(), 0o644) } == 0, || {
        "mkfifo failed".into()
    })?;
    let sub = dir.join("folder.jpg");
    std::fs::create_dir_all(&sub)?;
    let link = dir.join("link.jpg");
    std::os::unix::fs::symlink(&fifo, &link)?;
    let specials = [
        fifo.clone(),
        sub,
        PathBuf::from("/dev/zero"),
        link,
        dir.join("missing.jpg"),
    ];
    // Interleaved with the good files: no batch is all bad.
    for (k, p) in specials.iter().enumerate() {
        let label = 1000 + k;
        pairs.insert(2 * k + 1, (p.clone(), label));
    }
    let list = ImageList::from_pairs(pairs)?;
    let mut feed =
        ImageFeed::<f32>::new(&stream, list, feed_cfg(4, Decoding::Gpu, BadFiles::Skip))?;
    let mut labels = Vec::new();
    for _ in 0..feed.batches_per_epoch() {
        let b = feed.next().ok_or("None within the epoch")??;
        let mut host = vec![0i64; b.dims()[0]];
        stream.copy_d2h(&b.labels()?, &mut host[..])?.wait()?;
        labels.extend(host);
    }
    drop(feed);
    let _ = std::fs::remove_dir_all(&dir);
    ensure(
        labels.len() == goods && labels.iter().all(|&l| l < 1000),
        || format!("labels {labels:?} (want the {goods} good files only)"),
    )
}

/// The same list, `Skip`, no shuffle, decoded on the GPU and on the CPU: the batches must hold
/// the same files (labels). Among the good files: files with corrupted entropy-coded data that
/// the CPU decoder refuses (see `cpu/corrupt_scans_...`); a GPU feed that decodes them (as
/// nvjpeg.rs's `mixed` trial allows of `corrupt_huffman.jpg`) trains on other data than the
/// CPU feed of the same list and seed, and its batches are no longer the same files, without
/// a word (`Decoding::Auto` picks one or the other by machine).
fn feed_same_files() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let dir = tmp("same")?;
    let mut pairs = good_list(&dir, 1)?;
    for (name, data) in corrupted()? {
        let label = pairs.len();
        let p = write(&dir, &name, &data)?;
        // Spread among the good files.
        pairs.insert(label % 13, (p, label));
    }
    let list = ImageList::from_pairs(pairs)?;
    let mut per = Vec::new();
    for decoding in [Decoding::Cpu, Decoding::Gpu] {
        let mut feed =
            ImageFeed::<f32>::new(&stream, list.clone(), feed_cfg(4, decoding, BadFiles::Skip))?;
        let mut batches = Vec::new();
        for _ in 0..feed.batches_per_epoch() {
            let b = feed.next().ok_or("None within the epoch")??;
            let mut host = vec![0i64; b.dims()[0]];
            stream.copy_d2h(&b.labels()?, &mut host[..])?.wait()?;
            batches.push(host);
        }
        per.push(batches);
    }
    let _ = std::fs::remove_dir_all(&dir);
    // A documented limit (docs/image-feed.md): the engines decode corrupt entropy-coded data
    // without an error, as DALI's do, so the GPU feed may keep a file whose scan the CPU decoder
    // refuses. Every file the CPU feed keeps, the GPU feed keeps, in the same batch and order;
    // the only extra ones are the corrupted files (labels from `first_bad` on).
    let first_bad = list.len() - corrupted()?.len();
    let ok = per[0].len() == per[1].len()
        && per[0].iter().zip(&per[1]).all(|(c, g)| {
            let kept: Vec<i64> = g.iter().copied().filter(|l| c.contains(l)).collect();
            kept == *c && g.iter().all(|l| c.contains(l) || *l as usize >= first_bad)
        });
    ensure(ok, || {
        format!(
            "the CPU feed's batches {:?} are not the GPU feed's {:?} less corrupted files",
            per[0], per[1]
        )
    })
}

/// `Decoding::Gpu` in a process whose `PINSTREAM_NVJPEG` names no library: `ImageFeed::new`
/// either decodes on the GPU (a library was found elsewhere) or fails with a typed error; never
/// a panic. `Decoding::Auto` always gives a feed. In a child process (the library loads once).
fn bogus_override_gpu() -> R {
    const NAME: &str = "gpu/decoding_gpu_with_bogus_override_is_typed";
    if !is_child("gpu-bogus") {
        let (status, out) = run_child(
            NAME,
            "gpu-bogus",
            &[(
                "PINSTREAM_NVJPEG",
                std::ffi::OsStr::new("/nonexistent/libnvjpeg.so.13"),
            )],
        )?;
        eprintln!(
            "{}",
            out.lines()
                .filter(|l| l.contains("HOSTILE31"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        return ensure(status.success() && out.contains(DONE), || {
            format!("child: {status}: {out}")
        });
    }
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let dir = tmp("gpu-bogus")?;
    let list = ImageList::from_pairs(good_list(&dir, 1)?)?;
    match ImageFeed::<f32>::new(
        &stream,
        list.clone(),
        feed_cfg(4, Decoding::Gpu, BadFiles::Error),
    ) {
        Ok(mut f) => {
            println!("HOSTILE31 Decoding::Gpu gave a feed ({:?})", f.decoding());
            ensure(f.decoding() == Decoding::Gpu, || {
                format!("{:?}", f.decoding())
            })?;
            f.next().ok_or("None")??;
        }
        Err(e) => {
            println!("HOSTILE31 Decoding::Gpu refused: {e}");
            ensure(matches!(e, Error::InvalidArgument { .. }), || {
                format!("{e:?}")
            })?;
        }
    }
    let mut f = ImageFeed::<f32>::new(&stream, list, feed_cfg(4, Decoding::Auto, BadFiles::Error))?;
    println!("HOSTILE31 Decoding::Auto chose {:?}", f.decoding());
    f.next().ok_or("None")??;
    drop(f);
    let _ = std::fs::remove_dir_all(&dir);
    println!("{DONE}");
    Ok(())
}
