//! A diagnostic: JPEG decoding on the GPU's engines and nothing else, in a process of its own, at
//! a capped rate, until killed. Run beside a training process, it says what nvJPEG's work costs
//! that process when it shares no CUDA context (no driver locks, no streams) with it.
//!
//! ```text
//! decode_loop FOLDER [THREADS=2] [IMAGES_PER_S=17000] [BATCH=256]
//! ```
//!
//! Each thread has its own decoder and decodes batches of whole images into its own device arena
//! (no crop, no colour work of its own), sleeping between batches to hold the rate. Every second
//! it prints the images decoded in that second to stderr. It reads at most the first
//! `MAX_FILES` JPEGs of the folder into memory, and exits with status 1 if a thread fails.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pinstream::memory::DeviceBuffer;
use pinstream::{Device, Stream};
use pinstream_vision::nvjpeg::{Item, Nvjpeg, Route};

/// The most files read into memory (a few GB of ImageNet-sized JPEGs).
const MAX_FILES: usize = 20_000;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(dir) = args.first() else {
        eprintln!("usage: decode_loop FOLDER [THREADS] [IMAGES_PER_S] [BATCH]");
        std::process::exit(2);
    };
    let arg = |i: usize, d: usize| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (threads, rate, batch) = (arg(1, 2), arg(2, 17_000), arg(3, 256));
    let mut paths = Vec::new();
    let mut stack = vec![std::path::PathBuf::from(dir)];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).expect("read_dir").flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p
                .extension()
                .is_some_and(|x| x.eq_ignore_ascii_case("jpg") || x.eq_ignore_ascii_case("jpeg"))
            {
                paths.push(p);
            }
        }
    }
    paths.sort();
    paths.truncate(MAX_FILES);
    let files: Arc<Vec<Vec<u8>>> =
        Arc::new(paths.iter().filter_map(|p| std::fs::read(p).ok()).collect());
    assert!(!files.is_empty(), "{dir}: no JPEG files");
    let device = Device::get(0).expect("device 0");
    let nv = Arc::new(Nvjpeg::new(&device).expect("nvJPEG"));
    eprintln!(
        "decode_loop: {} files, {threads} threads, {rate} images/s at most, batch {batch}, {} engines",
        files.len(),
        nv.hardware_engines()
    );
    let done = Arc::new(AtomicU64::new(0));
    let per_thread = rate as f64 / threads as f64;
    let mut workers = Vec::with_capacity(threads);
    for t in 0..threads {
        let (files, nv, done) = (files.clone(), nv.clone(), done.clone());
        workers.push(std::thread::spawn(move || {
            let mut dec = nv.decoder().expect("decoder");
            let stream = Stream::new(&device).expect("stream");
            let mut arena: Option<DeviceBuffer<u8>> = None;
            let mut next = t * 997;
            let start = Instant::now();
            let mut decoded = 0u64;
            loop {
                let picked: Vec<&[u8]> = (0..batch)
                    .map(|k| files[(next + k) % files.len()].as_slice())
                    .collect();
                next += batch;
                let plans: Vec<_> = picked.iter().map(|b| dec.plan(b, None)).collect();
                let mut items = Vec::with_capacity(batch);
                let mut offset = 0usize;
                for (b, p) in picked.iter().zip(&plans) {
                    let Ok(plan) = p else { continue };
                    if plan.route == Route::Cpu {
                        continue;
                    }
                    items.push(Item {
                        data: b,
                        plan: *plan,
                        offset,
                    });
                    offset += plan.region.rgb_len();
                }
                if items.is_empty() {
                    // Nothing the GPU decodes in this batch: wait, not spin on the headers.
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
                if arena.as_ref().is_none_or(|a| a.len() < offset) {
                    arena = Some(DeviceBuffer::new_async(&stream, offset * 2).expect("arena"));
                    stream.synchronize().expect("sync");
                }
                dec.decode(&items, arena.as_mut().expect("arena"))
                    .expect("decode");
                decoded += items.len() as u64;
                done.fetch_add(items.len() as u64, Ordering::Relaxed);
                let due = Duration::from_secs_f64(decoded as f64 / per_thread);
                if let Some(wait) = due.checked_sub(start.elapsed()) {
                    std::thread::sleep(wait);
                }
            }
        }));
    }
    let mut last = 0;
    loop {
        std::thread::sleep(Duration::from_secs(1));
        if workers.iter().any(|w| w.is_finished()) {
            eprintln!("decode_loop: a decoding thread failed");
            std::process::exit(1);
        }
        let now = done.load(Ordering::Relaxed);
        eprintln!("decode_loop: {} images/s", now - last);
        last = now;
    }
}
