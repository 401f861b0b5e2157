//! Hostile review (branch hostile-feed2) of the issue 29 fixes for findings 9-12: the image
//! feed's `end_of_image` cut and chunked `read_file` and the `ImageList::folder` walk. (Its
//! safetensors part is `safetensors`'s `file/hostile2`.)
//!
//! `end_of_image` is crate-private: it is attacked through `ImageSource::load` (which reads each
//! file only up to that end and decodes the cut bytes into `b.pixels`), compared with
//! `decode::decode_rgb` of the whole file.
//! Run: `cargo test --test vision -- feed/hostile2 --nocapture`.

use std::path::PathBuf;
use std::sync::mpsc;
use std::time::Duration;

use pinstream::prefetch::{HostBatch, Pixels, PrefetchConfig};
use pinstream::Error;
use pinstream_vision::dataset::ImageList;
use pinstream_vision::decode;
use pinstream_vision::{Augment, BadFiles, ImageFeedConfig, ImageSource};

use crate::common::{trial, R};
use libtest_mimic::Trial;

/// Prefix of this module's trial names (its path in the binary).
const PREFIX: &str = "feed/hostile2/";

/// The trials of this module, named `feed/hostile2/...`: CPU trials (plain functions that panic on a failure), run everywhere.
pub fn trials() -> Vec<Trial> {
    let t = |name: &str, f: fn()| {
        trial(PREFIX, name, move || -> R {
            f();
            Ok(())
        })
    };
    vec![
        t(
            "jpeg_cut_matches_whole_file_under_mutation",
            jpeg_cut_matches_whole_file_under_mutation,
        ),
        t(
            "png_cut_matches_whole_file_under_mutation",
            png_cut_matches_whole_file_under_mutation,
        ),
        t("jpeg_crafted_structures", jpeg_crafted_structures),
        t("png_crafted_structures", png_crafted_structures),
        t(
            "read_file_bounds_sparse_and_proc",
            read_file_bounds_sparse_and_proc,
        ),
        t(
            "read_file_growing_file_is_bounded",
            read_file_growing_file_is_bounded,
        ),
        t("walk_hostile_trees", walk_hostile_trees),
    ]
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("pinstream-hostile3-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Runs `f` on its own thread; panics (a hang) if it has not finished after a generous limit.
fn watchdog<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(120))
        .unwrap_or_else(|_| panic!("{what}: no answer after 120 s (a hang)"))
}

fn cfg(batch: usize) -> ImageFeedConfig {
    ImageFeedConfig {
        batch,
        out: (16, 16),
        seed: 3,
        shuffle: false,
        bad_files: BadFiles::Error,
        augment: Augment::Val { resize: 16 },
        prefetch: PrefetchConfig {
            loader_threads: 1,
            ..PrefetchConfig::default()
        },
        ..ImageFeedConfig::default()
    }
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// src/decode.rs's test image: a progressive 32x24 gradient (several scans, DHT between them).
const PROGRESSIVE_JPEG: &str = concat!(
    "ffd8ffe000104a46494600010100000100010000ffdb0043000201010101010201010102020202020403020202020504",
    "040304060506060605060606070908060709070606080b08090a0a0a0a0a06080b0c0b0a0c090a0a0affdb0043010202",
    "02020202050303050a0706070a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a",
    "0a0a0a0a0a0a0a0a0a0a0a0a0a0affc20011080018002003012200021101031101ffc400170001010101000000000000",
    "00000000000006000508ffc400160101010100000000000000000000000000060805ffda000c03010002100310000001",
    "e564ce133ac70e9dba729406526a2107264d45280fffc400161000030000000000000000000000000000000405ffda00",
    "080101000105025228a45148a29145228a45148a29145628ac5158a2b14fffc400181100030101000000000000000000",
    "0000000006210431ffda0008010301013f015b66e516d9b945bdfa6516f7e994ffc40019110002030100000000000000",
    "0000000000000403055161ffda0008010201013f0172fba397dd1c727d1c727d3fffc400151001010000000000000000",
    "0000000000000032ffda0008010100063f0294a5294a5294a52fffc40016100101010000000000000000000000000000",
    "31c1ffda0008010100013f218b1ca394728b1ca394729e53ca794f2fffda000c030100020003000000104690beffc400",
    "14110100000000000000000000000000000020ffda0008010301013f10177fff00ffc400161101010100000000000000",
    "000000000000002131ffda0008010201013f10ddd9a4b4ffc400161001010100000000000000000000000000f12030ff",
    "da0008010100013f101614a50b8294ad6b5affd9",
);

/// src/decode.rs's test image: the same gradient, baseline, a restart marker after every MCU.
const RESTART_JPEG: &str = concat!(
    "ffd8ffe000104a46494600010100000100010000ffdb0043000201010101010201010102020202020403020202020504",
    "040304060506060605060606070908060709070606080b08090a0a0a0a0a06080b0c0b0a0c090a0a0affdb0043010202",
    "02020202050303050a0706070a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a",
    "0a0a0a0a0a0a0a0a0a0a0a0a0a0affc00011080018002003012200021101031101ffc4001f0000010501010101010100",
    "000000000000000102030405060708090a0bffc400b5100002010303020403050504040000017d010203000411051221",
    "31410613516107227114328191a1082342b1c11552d1f02433627282090a161718191a25262728292a3435363738393a",
    "434445464748494a535455565758595a636465666768696a737475767778797a838485868788898a9293949596979899",
    "9aa2a3a4a5a6a7a8a9aab2b3b4b5b6b7b8b9bac2c3c4c5c6c7c8c9cad2d3d4d5d6d7d8d9dae1e2e3e4e5e6e7e8e9eaf1",
    "f2f3f4f5f6f7f8f9faffc4001f0100030101010101010101010000000000000102030405060708090a0bffc400b51100",
    "020102040403040705040400010277000102031104052131061241510761711322328108144291a1b1c109233352f015",
    "6272d10a162434e125f11718191a262728292a35363738393a434445464748494a535455565758595a63646566676869",
    "6a737475767778797a82838485868788898a92939495969798999aa2a3a4a5a6a7a8a9aab2b3b4b5b6b7b8b9bac2c3c4",
    "c5c6c7c8c9cad2d3d4d5d6d7d8d9dae2e3e4e5e6e7e8e9eaf2f3f4f5f6f7f8f9faffdd00040001ffda000c0301000211",
    "0311003f00fcadf09fc14fbbfe89fa57a6f84fe0a7ddff0044ff00c76bdbfc27f053eeff00a27e95e99e13f829f77fd1",
    "3ff1dafdd339e3ddfdf3e43c36f133e0f7cfffd0f91bc27f053eeffa27fe3b5e9be13f829f77fd13ff001daf6ff09fc1",
    "4fbbfe89ff008ed7a6f84fe0a7ddff0044ff00c76bdece78f37f7cfed1f0dbc4cf83df3fffd1e9bc29f053eeff00a27f",
    "e3b5e99e14f829f77fd13ff1da28af80ce338c7ebef1fe76f86d9fe67ee7be7fffd2faff00c29f053eeffa27fe3b5e99",
    "e14f829f77fd13ff001da28afe6ace738c7ebef1e6f86d9fe67ee7be7fffd9",
);

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

/// The chunks of a PNG: (kind, data).
fn png_chunks(png: &[u8]) -> Vec<([u8; 4], Vec<u8>)> {
    let mut i = 8;
    let mut out = Vec::new();
    while i + 8 <= png.len() {
        let len = u32::from_be_bytes(png[i..i + 4].try_into().unwrap()) as usize;
        let kind: [u8; 4] = png[i + 4..i + 8].try_into().unwrap();
        out.push((kind, png[i + 8..i + 8 + len].to_vec()));
        i += 12 + len;
    }
    out
}

fn png_of(chunks: &[([u8; 4], Vec<u8>)]) -> Vec<u8> {
    let mut v = b"\x89PNG\r\n\x1a\n".to_vec();
    for (k, d) in chunks {
        chunk(&mut v, k, d);
    }
    v
}

struct Xs(u64);
impl Xs {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn mutate(r: &mut Xs, src: &[u8]) -> Vec<u8> {
    let mut v = src.to_vec();
    let n = v.len();
    for _ in 0..1 + r.below(2) {
        let at = r.below(v.len());
        match r.below(9) {
            0 => v[at] = r.next() as u8,
            1 => v[at] = 0xFF,
            2 => {
                v.splice(at..at, [0xFF, 0xD9]);
            }
            3 => {
                v.splice(at..at, [0xFF, 0x00, 0xFF, 0xD9]);
            }
            4 => {
                // A marker segment (APPn, COM, DNL, DHT, SOS) of a random length.
                let m = [0xE1, 0xFE, 0xDC, 0xC4, 0xDA, 0xDD][r.below(6)];
                let len = r.below(40) as u16;
                let mut seg = vec![0xFF, m];
                seg.extend(len.to_be_bytes());
                seg.extend((0..r.below(40)).map(|_| r.next() as u8));
                v.splice(at..at, seg);
            }
            5 => {
                // A trailer after the image (may hold markers).
                v.extend((0..1 + r.below(64)).map(|_| {
                    if r.below(4) == 0 {
                        0xFF
                    } else {
                        r.next() as u8
                    }
                }));
            }
            6 => {
                let len = r.below(64).min(v.len() - at);
                let dup = v[at..at + len].to_vec();
                let to = r.below(v.len());
                v.splice(to..to, dup);
            }
            7 => v.truncate(n.saturating_sub(1 + r.below(16)).max(8)),
            _ => {
                // A byte of the marker walk's lengths: 2 bytes after some FF xx.
                let ffs: Vec<usize> = (0..v.len() - 1).filter(|&i| v[i] == 0xFF).collect();
                if !ffs.is_empty() {
                    let p = ffs[r.below(ffs.len())] + 2 + r.below(2);
                    if p < v.len() {
                        v[p] = r.next() as u8;
                    }
                }
            }
        }
    }
    v
}

/// Loads each file of `files` alone (batch of 1) and compares with the whole-file decoder.
/// Returns the disagreements.
fn cut_vs_whole(name: &str, files: &[(String, Vec<u8>)]) -> Vec<String> {
    let dir = tmp(name);
    let mut pairs = Vec::new();
    for (k, (n, bytes)) in files.iter().enumerate() {
        let p = dir.join(format!("{k:05}-{n}"));
        std::fs::write(&p, bytes).unwrap();
        pairs.push((p, 0));
    }
    let src = ImageSource::new(ImageList::from_pairs(pairs).unwrap(), &cfg(1)).unwrap();
    let mut bad = Vec::new();
    for (k, (n, bytes)) in files.iter().enumerate() {
        let whole = decode::decode_rgb(bytes);
        let mut b = HostBatch::<i64>::default();
        let cut = src.load(k as u64, &mut b);
        match (&whole, &cut) {
            (Ok((_, px)), Ok(())) => {
                let got = match &b.pixels {
                    Pixels::Pageable(v) => v.clone(),
                    _ => panic!("no pool: pageable pixels"),
                };
                if &got != px {
                    let diff = got.iter().zip(px).filter(|(a, b)| a != b).count();
                    bad.push(format!(
                        "{k} {n}: the cut decodes {diff} bytes differently ({} vs {} bytes)",
                        got.len(),
                        px.len()
                    ));
                }
            }
            (Ok(_), Err(e)) => {
                let s = e.to_string();
                // Rules of the feed that the whole-file decoder does not have.
                if !s.contains("cannot be resized") && !s.contains("not believed") {
                    bad.push(format!("{k} {n}: whole decodes, the feed refuses: {s}"));
                }
            }
            (Err(e), Ok(())) => bad.push(format!(
                "{k} {n}: whole refused ({e}), the feed's cut decodes"
            )),
            (Err(_), Err(_)) => {}
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    bad
}

fn data(name: &str) -> Vec<u8> {
    crate::image_dirs()
        .iter()
        .find_map(|d| std::fs::read(d.join(name)).ok())
        .unwrap()
}

fn mutations(seed: u64, name: &str, src: &[u8], count: usize) -> Vec<(String, Vec<u8>)> {
    let mut r = Xs(seed);
    let mut out = vec![(name.to_string(), src.to_vec())];
    out.extend((0..count).map(|_| (name.to_string(), mutate(&mut r, src))));
    out
}

/// Randomized mutations of the JPEGs (progressive, restarts, the real photo): the feed's cut
/// must decode exactly what the whole file decodes.
fn jpeg_cut_matches_whole_file_under_mutation() {
    let mut files = Vec::new();
    files.extend(mutations(
        0x9E37_79B9,
        "prog.jpg",
        &hex(PROGRESSIVE_JPEG),
        1500,
    ));
    files.extend(mutations(0xC0FF_EE11, "rst.jpg", &hex(RESTART_JPEG), 1000));
    files.extend(mutations(
        0x1234_5678,
        "small.jpg",
        &small_jpeg(40, 24),
        150,
    ));
    files.extend(mutations(
        0xBEEF_0001,
        "rocket.jpg",
        &data("rocket.jpg"),
        12,
    ));
    let bad = watchdog("jpeg mutations", move || cut_vs_whole("jpegmut", &files));
    for b in &bad {
        eprintln!("{b}");
    }
    let silent: Vec<_> = bad.iter().filter(|b| b.contains("differently")).collect();
    assert!(silent.is_empty(), "{} cuts change pixels", silent.len());
    assert!(bad.is_empty(), "{} disagreements", bad.len());
}

/// The same for PNGs (a real one and a small one), with chunk-level mutations as well.
fn png_cut_matches_whole_file_under_mutation() {
    let mut files = Vec::new();
    files.extend(mutations(0x5151_7777, "small.png", &small_png(24, 20), 600));
    files.extend(mutations(0xABCD_EF01, "camera.png", &data("camera.png"), 6));
    let bad = watchdog("png mutations", move || cut_vs_whole("pngmut", &files));
    for b in &bad {
        eprintln!("{b}");
    }
    let silent: Vec<_> = bad.iter().filter(|b| b.contains("differently")).collect();
    assert!(silent.is_empty(), "{} cuts change pixels", silent.len());
}

/// Hand-made JPEG structures: SOS bytes inside an APP segment, EOI bytes after a stuffed FF00
/// in a scan, a DNL marker, a JPEG with no scan, segment lengths past the end, and 0/1 lengths.
fn jpeg_crafted_structures() {
    let base = hex(RESTART_JPEG);
    let prog = hex(PROGRESSIVE_JPEG);
    let mut files = Vec::new();
    // An APP1 segment holding FF DA ... FF D9 right after SOI.
    let mut app = vec![0xFF, 0xE1, 0x00, 0x10, 0xFF, 0xDA, 0x00, 0x02, 0xFF, 0xD9];
    app.extend([0u8; 6]);
    let mut v = base.clone();
    v.splice(2..2, app.clone());
    files.push(("sos-in-app.jpg".to_string(), v));
    let mut v = prog.clone();
    v.splice(2..2, app);
    files.push(("sos-in-app-prog.jpg".to_string(), v));
    // A COM segment holding FF D9 between scans of the progressive file.
    let second_sos = prog
        .windows(2)
        .enumerate()
        .filter(|(_, w)| *w == [0xFF, 0xDA])
        .nth(1)
        .unwrap()
        .0;
    let mut v = prog.clone();
    v.splice(
        second_sos..second_sos,
        [0xFF, 0xFE, 0x00, 0x06, 0xFF, 0xD9, 0xFF, 0xD9],
    );
    files.push(("eoi-in-com-between-scans.jpg".to_string(), v));
    // A DNL marker after the first scan.
    let mut v = prog.clone();
    v.splice(second_sos..second_sos, [0xFF, 0xDC, 0x00, 0x04, 0x00, 0x18]);
    files.push(("dnl.jpg".to_string(), v));
    // Fill bytes (FF FF FF) before a marker, and stray bytes between segments.
    let mut v = prog.clone();
    v.splice(second_sos..second_sos, [0xFF, 0xFF, 0xFF, 0x12, 0x34]);
    files.push(("fill-and-stray.jpg".to_string(), v));
    // EOI in the middle of the first scan, after a stuffed FF 00 (the rest of the scans after).
    let first_sos = prog.windows(2).position(|w| w == [0xFF, 0xDA]).unwrap();
    let mut v = prog.clone();
    v.splice(first_sos + 16..first_sos + 16, [0xFF, 0x00, 0xFF, 0xD9]);
    files.push(("eoi-mid-scan.jpg".to_string(), v));
    // A JPEG with no scan at all.
    let no_sos: Vec<u8> = base[..base.windows(2).position(|w| w == [0xFF, 0xDA]).unwrap()]
        .iter()
        .copied()
        .chain([0xFF, 0xD9])
        .collect();
    files.push(("no-sos.jpg".to_string(), no_sos));
    // A segment length pointing far past the end; lengths 0 and 1.
    for (n, len) in [("len-ffff", 0xFFFFu16), ("len-0", 0), ("len-1", 1)] {
        let mut v = base.clone();
        v.splice(2..2, [0xFF, 0xE2, (len >> 8) as u8, len as u8]);
        files.push((format!("{n}.jpg"), v));
    }
    // Many scans: the progressive file's scans repeated 500 times.
    let last = prog.len() - 2;
    let mut v = prog[..last].to_vec();
    let scans = prog[first_sos..last].to_vec();
    for _ in 0..500 {
        v.extend(&scans);
    }
    v.extend([0xFF, 0xD9]);
    files.push(("many-scans.jpg".to_string(), v));
    // 20 000 tiny COM segments before the frame.
    let mut v = base.clone();
    for _ in 0..20_000 {
        v.splice(2..2, [0xFF, 0xFE, 0x00, 0x02]);
    }
    files.push(("many-com.jpg".to_string(), v));
    let bad = watchdog("crafted jpegs", move || cut_vs_whole("jpegcraft", &files));
    for b in &bad {
        eprintln!("{b}");
    }
    assert!(bad.is_empty(), "{bad:#?}");
}

/// Hand-made PNG structures: a chunk between two IDAT chunks, an IDAT split into thousands of
/// tiny chunks, zero-length IDATs, a chunk of length 2^31 - 1 before the image data, ancillary
/// chunks after the image data with bad CRCs, no IEND.
fn png_crafted_structures() {
    let base = small_png(24, 20);
    let ch = png_chunks(&base);
    let ihdr = ch[0].clone();
    let idat: Vec<u8> = ch
        .iter()
        .filter(|c| &c.0 == b"IDAT")
        .flat_map(|c| c.1.clone())
        .collect();
    let iend = (*b"IEND", Vec::new());
    let half = idat.len() / 2;
    let mut files = Vec::new();
    // IDAT, tEXt, IDAT (out of spec: the whole decoder's verdict is the reference).
    files.push((
        "text-between-idat.png".to_string(),
        png_of(&[
            ihdr.clone(),
            (*b"IDAT", idat[..half].to_vec()),
            (*b"tEXt", b"k\0v".to_vec()),
            (*b"IDAT", idat[half..].to_vec()),
            iend.clone(),
        ]),
    ));
    // One-byte IDATs, with zero-length ones between.
    let mut tiny = vec![ihdr.clone()];
    for &b in &idat {
        tiny.push((*b"IDAT", vec![b]));
        tiny.push((*b"IDAT", Vec::new()));
    }
    tiny.push(iend.clone());
    files.push(("tiny-idat.png".to_string(), png_of(&tiny)));
    // No IEND, nothing after the image data.
    files.push((
        "no-iend.png".to_string(),
        png_of(&[ihdr.clone(), (*b"IDAT", idat.clone())]),
    ));
    // A chunk with a bad CRC after the image data, then a 2^31-1 length chunk header.
    let mut v = png_of(&[ihdr.clone(), (*b"IDAT", idat.clone())]);
    v.extend([0, 0, 0, 3]);
    v.extend(b"tEXtabc");
    v.extend([1, 2, 3, 4]);
    v.extend([0x7F, 0xFF, 0xFF, 0xFF]);
    v.extend(b"zTXt");
    files.push(("bad-crc-after.png".to_string(), v));
    // A chunk header claiming 2^31 - 1 bytes before the image data, and 2^32 - 1.
    for (n, len) in [("len-2g", 0x7FFF_FFFFu32), ("len-4g", u32::MAX)] {
        let mut v = png_of(std::slice::from_ref(&ihdr));
        v.extend(len.to_be_bytes());
        v.extend(b"tEXt");
        v.extend(png_of(&[(*b"IDAT", idat.clone()), iend.clone()])[8..].iter());
        files.push((format!("{n}.png"), v));
    }
    // IEND first after IHDR, then the image data.
    files.push((
        "iend-first.png".to_string(),
        png_of(&[ihdr.clone(), iend.clone(), (*b"IDAT", idat.clone())]),
    ));
    // An APNG-like fdAT after the image data.
    files.push((
        "fdat-after.png".to_string(),
        png_of(&[
            ihdr,
            (*b"IDAT", idat),
            (*b"fdAT", vec![0, 0, 0, 1, 9, 9]),
            iend,
        ]),
    ));
    let bad = watchdog("crafted pngs", move || cut_vs_whole("pngcraft", &files));
    for b in &bad {
        eprintln!("{b}");
    }
    assert!(bad.is_empty(), "{bad:#?}");
}

fn expect_bad_file(what: &str, r: pinstream::Result<()>) {
    match r {
        Err(Error::Format { .. }) | Err(Error::Io { .. }) | Err(Error::InvalidArgument { .. }) => {}
        other => panic!("{what}: expected a typed refusal, got {other:?}"),
    }
}

/// read_file's bounds: a sparse 200 MiB file whose valid 1x1 PNG header is followed by zeros
/// (endless zero-length chunks: the PNG walk takes 12 bytes a step) and a 200 MiB sparse JPEG
/// (no marker after the frame header) must be refused within the per-file bound, not read
/// whole; /proc files (size 0, streaming data) linked into a class folder are refused or read
/// as empty, never streamed.
fn read_file_bounds_sparse_and_proc() {
    let root = tmp("sparse");
    std::fs::create_dir_all(root.join("a")).unwrap();
    // A 1x1 PNG header, then 200 MiB of zeros (sparse).
    let png = png_of(&[(*b"IHDR", [0, 0, 0, 1, 0, 0, 0, 1, 8, 2, 0, 0, 0].to_vec())]);
    let p = root.join("a/sparse.png");
    std::fs::write(&p, &png).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(200 << 20)
        .unwrap();
    // A JPEG header (SOI, DQT, SOF, DHT from the restart file) then 200 MiB of zeros.
    let base = hex(RESTART_JPEG);
    let sos = base.windows(2).position(|w| w == [0xFF, 0xDA]).unwrap();
    let j = root.join("a/sparse.jpg");
    std::fs::write(&j, &base[..sos]).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&j)
        .unwrap()
        .set_len(200 << 20)
        .unwrap();
    // The same JPEG with its scan started and 200 MiB of zeros as entropy data.
    let j2 = root.join("a/sparse-scan.jpg");
    std::fs::write(&j2, &base[..sos + 14]).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&j2)
        .unwrap()
        .set_len(200 << 20)
        .unwrap();
    std::os::unix::fs::symlink("/proc/self/maps", root.join("a/maps.png")).unwrap();
    std::os::unix::fs::symlink("/proc/self/environ", root.join("a/environ.jpg")).unwrap();
    std::os::unix::fs::symlink("/dev/zero", root.join("a/zero.jpg")).unwrap();
    std::os::unix::fs::symlink("/dev/urandom", root.join("a/urandom.png")).unwrap();
    let list = ImageList::folder(&root).unwrap();
    let names: Vec<String> = list
        .items()
        .iter()
        .map(|(p, _)| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    eprintln!("listed: {names:?}");
    let n = list.len();
    let src = ImageSource::new(list, &cfg(1)).unwrap();
    let out = watchdog("sparse and /proc files", move || {
        (0..n)
            .map(|k| {
                let mut b = HostBatch::<i64>::default();
                let r = src.load(k as u64, &mut b);
                eprintln!("{}: {:?}", names[k], r.as_ref().map_err(|e| e.to_string()));
                (names[k].clone(), r)
            })
            .collect::<Vec<_>>()
    });
    let _ = std::fs::remove_dir_all(&root);
    for (n, r) in out {
        expect_bad_file(&n, r);
    }
}

/// A file that grows while it is read (a writer appending to it): the read stops at the
/// length seen at open, never follows the writer.
fn read_file_growing_file_is_bounded() {
    use std::io::Write;
    let root = tmp("grow");
    std::fs::create_dir_all(root.join("a")).unwrap();
    let base = hex(RESTART_JPEG);
    let sos = base.windows(2).position(|w| w == [0xFF, 0xDA]).unwrap();
    let p = root.join("a/grow.jpg");
    std::fs::write(&p, &base[..sos + 14]).unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let started = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (p, stop, started) = (p.clone(), stop.clone(), started.clone());
        std::thread::spawn(move || {
            let mut f = std::fs::OpenOptions::new().append(true).open(&p).unwrap();
            let block = vec![0x11u8; 1 << 20];
            let mut written = 0usize;
            f.write_all(&block).unwrap();
            written += block.len();
            started.store(true, std::sync::atomic::Ordering::Relaxed);
            // At most 64 MiB appended (counts, not time).
            while !stop.load(std::sync::atomic::Ordering::Relaxed) && written < 64 << 20 {
                f.write_all(&block).unwrap();
                written += block.len();
            }
            written
        })
    };
    while !started.load(std::sync::atomic::Ordering::Relaxed) {
        std::thread::yield_now();
    }
    let list = ImageList::folder(&root).unwrap();
    let src = ImageSource::new(list, &cfg(1)).unwrap();
    let rs: Vec<_> = (0..8)
        .map(|_| {
            let mut b = HostBatch::<i64>::default();
            src.load(0, &mut b).map_err(|e| e.to_string())
        })
        .collect();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let written = writer.join().unwrap();
    let _ = std::fs::remove_dir_all(&root);
    eprintln!("appended {written} bytes; loads: {rs:?}");
    assert!(rs.iter().all(|r| r.is_err()), "{rs:?}");
}

/// The walk: a symlink loop, a link to an ancestor, invalid UTF-8 file names, 300 nested
/// directories (over MAX_DEPTH), a class with 100 000 entries.
fn walk_hostile_trees() {
    use std::os::unix::ffi::OsStrExt;
    let root = tmp("walk");
    let a = root.join("a");
    std::fs::create_dir_all(a.join("sub")).unwrap();
    std::fs::write(a.join("x.jpg"), b"").unwrap();
    std::os::unix::fs::symlink(&a, a.join("sub/up")).unwrap();
    std::os::unix::fs::symlink(&root, a.join("root")).unwrap();
    std::os::unix::fs::symlink("loop1", a.join("loop2.jpg")).unwrap();
    std::os::unix::fs::symlink("loop2.jpg", a.join("loop1")).unwrap();
    let bad_name = std::ffi::OsStr::from_bytes(b"\xff\xfe-bad.jpg");
    std::fs::write(a.join(bad_name), b"").unwrap();
    let list = watchdog("walk with loops", {
        let root = root.clone();
        move || ImageList::folder(&root)
    })
    .unwrap();
    eprintln!("{} items with loops", list.len());
    assert!(list.len() < 10, "{:?}", list.items());
    assert!(list
        .items()
        .iter()
        .any(|(p, _)| p.file_name() == Some(bad_name)));
    // Invalid UTF-8 class name: a typed error.
    let root2 = tmp("walkutf8");
    let c = root2.join(std::ffi::OsStr::from_bytes(b"\xc3\x28"));
    std::fs::create_dir_all(&c).unwrap();
    std::fs::write(c.join("x.jpg"), b"").unwrap();
    match ImageList::folder(&root2) {
        Err(Error::Io { .. }) => {}
        other => panic!("non-UTF-8 class: {other:?}"),
    }
    // 300 nested directories: InvalidArgument, no stack overflow.
    let root3 = tmp("walkdeep");
    let mut d = root3.join("a");
    std::fs::create_dir_all(&d).unwrap();
    std::fs::write(d.join("top.png"), b"").unwrap();
    for _ in 0..300 {
        d = d.join("d");
        std::fs::create_dir(&d).unwrap();
    }
    let r = watchdog("deep walk", {
        let root3 = root3.clone();
        move || ImageList::folder(&root3).map(|l| l.len())
    });
    assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
    // 100 000 entries in one class.
    let root4 = tmp("walkwide");
    let w = root4.join("a");
    std::fs::create_dir_all(&w).unwrap();
    for k in 0..100_000 {
        std::fs::File::create(w.join(format!("{k}.jpg"))).unwrap();
    }
    let n = watchdog("wide walk", {
        let root4 = root4.clone();
        move || ImageList::folder(&root4).map(|l| l.len())
    });
    assert_eq!(n.unwrap(), 100_000);
    for r in [root, root2, root3, root4] {
        let _ = std::fs::remove_dir_all(r);
    }
}
