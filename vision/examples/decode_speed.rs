//! Single-thread decode speed of `pinstream::decode` against the `image` crate
//! (`load_from_memory` + PIL-style RGB), on the JPEG/PNG files of one or more folders.
//!
//! ```text
//! cargo run --release --example decode_speed -- /path/to/jpegs [/path/to/pngs ...]
//! ```
//!
//! Files are read into memory first; each decoder decodes the whole set repeatedly for about
//! 0.4 s per round, rounds alternate between decoders, and the best round counts. MB/s in is
//! compressed bytes; Mpx/s is output pixels.

use std::time::Instant;

use pinstream_vision::decode;

fn main() {
    let dirs: Vec<String> = std::env::args().skip(1).collect();
    if dirs.is_empty() {
        eprintln!("usage: decode_speed FOLDER [FOLDER ...]");
        std::process::exit(2);
    }
    for dir in dirs {
        let mut paths: Vec<_> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("{dir}: {e}"))
            .filter_map(|e| e.ok().map(|e| e.path()))
            .collect();
        paths.sort();
        let files: Vec<Vec<u8>> = paths
            .iter()
            .filter_map(|p| std::fs::read(p).ok())
            .filter(|b| decode::Format::detect(b).is_some())
            .collect();
        if files.is_empty() {
            println!("{dir}: no JPEG or PNG files");
            continue;
        }
        let in_bytes: usize = files.iter().map(Vec::len).sum();
        let max = files
            .iter()
            .map(|b| decode::info(b).map(|i| i.rgb_len()).unwrap_or(0))
            .max()
            .unwrap_or(0);
        let mut out = vec![0u8; max];
        let pixels: usize = files
            .iter()
            .map(|b| decode::decode_rgb_into(b, &mut out).map_or(0, |i| i.rgb_len() / 3))
            .sum();
        println!(
            "{dir}: {} files, {:.1} MB compressed, {:.1} Mpx",
            files.len(),
            in_bytes as f64 / 1e6,
            pixels as f64 / 1e6
        );
        type Decoder<'a> = Box<dyn FnMut(&[u8]) + 'a>;
        let out = std::cell::RefCell::new(out);
        let mut candidates: Vec<(&str, Decoder)> = vec![
            (
                "image load_from_memory + RGB",
                Box::new(|b: &[u8]| {
                    let img = image::load_from_memory(b).expect("image crate decode");
                    std::hint::black_box(img.to_rgb8());
                }),
            ),
            (
                "pinstream_vision::decode::decode_rgb_into",
                Box::new(|b: &[u8]| {
                    let mut out = out.borrow_mut();
                    std::hint::black_box(decode::decode_rgb_into(b, &mut out).ok());
                }),
            ),
        ];
        let mut best = vec![f64::MAX; candidates.len()];
        for _round in 0..6 {
            for (k, (_, f)) in candidates.iter_mut().enumerate() {
                let t = Instant::now();
                let mut reps = 0u32;
                while t.elapsed().as_secs_f64() < 0.4 {
                    for b in &files {
                        f(b);
                    }
                    reps += 1;
                }
                best[k] = best[k].min(t.elapsed().as_secs_f64() / f64::from(reps));
            }
        }
        for ((name, _), secs) in candidates.iter().zip(best) {
            println!(
                "  {name:36} {:8.1} images/s {:7.1} MB/s in {:7.1} Mpx/s",
                files.len() as f64 / secs,
                in_bytes as f64 / secs / 1e6,
                pixels as f64 / secs / 1e6
            );
        }
    }
}
