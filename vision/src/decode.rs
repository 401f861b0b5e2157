//! JPEG and PNG decoding to 8-bit RGB, straight into memory the caller provides (page-locked
//! host memory, typically), for training feeds that crop and resize on the GPU.
//!
//! The pixels are those of PIL's `Image.open(f).convert("RGB")`, torchvision's default loader:
//! grayscale is replicated to three channels, alpha is dropped (not composited), palettes are
//! expanded, 16-bit samples keep their high byte, CMYK/YCCK JPEGs are converted to RGB, and the
//! EXIF orientation is not applied. The format is taken from the magic bytes, never from a file
//! name. Baseline, progressive and restart-marker JPEGs decode; so do interlaced PNGs (the first
//! frame of an APNG).
//!
//! Where this differs from PIL (13): a 16-bit grayscale PNG keeps its high byte, as 16-bit RGB,
//! RGBA and gray+alpha do in PIL, whereas PIL opens it as `I;16` and clamps each value to 255
//! (which turns nearly every pixel white); and the CRCs of a PNG's image data are checked (PIL
//! skips them). As in PIL, a JPEG without its end-of-image marker after the last scan is
//! truncated, an error (zune-jpeg alone would pad it). Chunks after a PNG's image data (and
//! `IEND`) are not read.
//!
//! JPEG goes through `zune-jpeg` (its AVX2/SSE paths are chosen at run time, so a binary built
//! on one x86 machine runs on any other), PNG through the `png` crate. JPEG pixels can differ
//! from libjpeg-turbo's (PIL's) by a few levels where chroma is upsampled: on ImageNet-like
//! 4:2:0 files about 10% of the samples differ, by 0.14 on average and by at most 11.
//!
//! ```
//! # fn main() -> pinstream::Result<()> {
//! use pinstream_vision::decode::{self, Format};
//! # let bytes: Vec<u8> = {
//! #     let img = image::RgbImage::from_pixel(4, 2, image::Rgb([10, 20, 30]));
//! #     let mut png = Vec::new();
//! #     img.write_to(&mut std::io::Cursor::new(&mut png), image::ImageFormat::Png).unwrap();
//! #     png
//! # };
//! // `bytes` holds a whole PNG or JPEG file, e.g. from `std::fs::read`.
//! let info = decode::info(&bytes)?;                  // the header only: cheap
//! assert_eq!((info.height, info.width, info.format), (2, 4, Format::Png));
//! let mut out = vec![0u8; info.rgb_len()];           // or a pinned buffer's slice
//! decode::decode_rgb_into(&bytes, &mut out)?;
//! assert_eq!(&out[..3], &[10, 20, 30]);              // HWC, rows top to bottom
//! # Ok(()) }
//! ```
//!
//! Errors: a file that is not a JPEG or PNG, or is truncated or corrupt, gives
//! [`Error::Format`] with `format` `"jpeg"`, `"png"` or `"image"` and `path` `"(in memory)"`;
//! an `out` that is too short gives [`Error::InvalidArgument`] and is left as it was. Images
//! whose RGB pixels would take more than [`MAX_OUTPUT_BYTES`] are refused from their header,
//! before anything of their size is allocated. A panic inside a decoder (third-party decoders do
//! panic on hostile input) is caught and reported as [`Error::Format`]; the panic hook still
//! prints its message.
//!
//! Memory besides `out`: small row buffers, except for progressive JPEGs, whose coefficients the
//! decoder keeps for the whole image (2 bytes per sample of each component: up to twice the RGB
//! size), and interlaced PNGs that are not plain RGB (one frame of their decoded pixels).

use std::io::Cursor;
use std::panic::{catch_unwind, AssertUnwindSafe};

use zune_jpeg::zune_core::bytestream::ZCursor;
use zune_jpeg::zune_core::colorspace::ColorSpace;
use zune_jpeg::zune_core::options::DecoderOptions;
use zune_jpeg::JpegDecoder;

use pinstream::{Error, Result};

/// The largest decoded image accepted, in bytes of RGB output (`height * width * 3`): 2^31
/// (2 GiB, e.g. 26754 x 26754 pixels). Larger images, and headers that claim them, are refused
/// with [`Error::Format`] before any allocation of their size.
pub const MAX_OUTPUT_BYTES: usize = 1 << 31;

/// The `path` of errors from this module; the caller knows the file and may replace it.
const IN_MEMORY: &str = "(in memory)";

const PNG_MAGIC: &[u8] = b"\x89PNG\r\n\x1a\n";
const JPEG_MAGIC: &[u8] = &[0xFF, 0xD8, 0xFF];

/// An image file format, as told by the file's first bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Format {
    /// JPEG (JFIF, EXIF, Adobe): starts with `FF D8 FF`.
    Jpeg,
    /// PNG: starts with `89 50 4E 47 0D 0A 1A 0A`.
    Png,
}

impl Format {
    /// The format of a file that starts with `bytes`, or `None` if it is neither JPEG nor PNG.
    pub fn detect(bytes: &[u8]) -> Option<Format> {
        if bytes.starts_with(JPEG_MAGIC) {
            Some(Format::Jpeg)
        } else if bytes.starts_with(PNG_MAGIC) {
            Some(Format::Png)
        } else {
            None
        }
    }

    /// `"jpeg"` or `"png"`, as in [`Error::Format`]'s `format`.
    pub fn name(self) -> &'static str {
        match self {
            Format::Jpeg => "jpeg",
            Format::Png => "png",
        }
    }
}

/// What the header says about an image, read without decoding pixels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ImageInfo {
    /// Rows.
    pub height: usize,
    /// Pixels per row.
    pub width: usize,
    /// The file's format.
    pub format: Format,
}

impl ImageInfo {
    /// Bytes of the decoded RGB image, `height * width * 3` (at most [`MAX_OUTPUT_BYTES`]).
    pub fn rgb_len(&self) -> usize {
        self.height * self.width * 3
    }
}

/// An [`Error::Format`] for bytes in memory (`path` is `"(in memory)"`; the caller may put the
/// file's path in its place).
pub(crate) fn decode_error(format: &'static str, detail: impl Into<String>) -> Error {
    Error::Format {
        format,
        path: IN_MEMORY.into(),
        tensor: None,
        detail: detail.into(),
    }
}

/// Reads the header and returns the image's size and format; decodes no pixels. Fails as the
/// decoding functions would for a file that is not a JPEG or PNG, a header that is cut short or
/// broken, or an image larger than [`MAX_OUTPUT_BYTES`].
pub fn info(bytes: &[u8]) -> Result<ImageInfo> {
    match detect(bytes)? {
        Format::Jpeg => guarded(Format::Jpeg, || jpeg_headers(bytes).map(|(_, i, _)| i)),
        Format::Png => guarded(Format::Png, || png_info(bytes)),
    }
}

/// Decodes a JPEG or PNG file to 8-bit RGB, rows top to bottom, interleaved (HWC), into
/// `out[..height * width * 3]`; `out` may be longer, and the bytes after the image are left as
/// they were. Returns the image's [`ImageInfo`].
///
/// # Errors
/// [`Error::InvalidArgument`] if `out` is shorter than the image (nothing is written then);
/// [`Error::Format`] for input that is not a JPEG or PNG, is truncated or corrupt, or is larger
/// than [`MAX_OUTPUT_BYTES`] (`out` may then hold part of the image).
pub fn decode_rgb_into(bytes: &[u8], out: &mut [u8]) -> Result<ImageInfo> {
    decode_with(bytes, move |info| {
        let need = info.rgb_len();
        if out.len() < need {
            return Err(Error::invalid(
                "decode::decode_rgb_into",
                format!(
                    "the output has {} bytes, the {}x{} (height x width) RGB image needs {need}",
                    out.len(),
                    info.height,
                    info.width
                ),
            ));
        }
        Ok(&mut out[..need])
    })
}

/// Decodes a JPEG or PNG file to 8-bit RGB (HWC) in a new `Vec` of exactly
/// `height * width * 3` bytes; see [`decode_rgb_into`]. Where the host cannot give that much
/// memory, the error is [`Error::InvalidArgument`] (not an abort).
pub fn decode_rgb(bytes: &[u8]) -> Result<(ImageInfo, Vec<u8>)> {
    let mut pixels = Vec::new();
    let slot = &mut pixels;
    let info = decode_with(bytes, move |info| {
        let need = info.rgb_len();
        let mut v = crate::util::try_vec::<u8>("decode::decode_rgb", need)?;
        v.resize(need, 0);
        *slot = v;
        Ok(&mut slot[..])
    })?;
    Ok((info, pixels))
}

fn detect(bytes: &[u8]) -> Result<Format> {
    Format::detect(bytes).ok_or_else(|| {
        let head = &bytes[..bytes.len().min(8)];
        decode_error(
            "image",
            if bytes.is_empty() {
                "the input is empty".to_string()
            } else {
                format!("neither a JPEG nor a PNG file (it starts with {head:02X?})")
            },
        )
    })
}

/// Parses the header, asks `target` for the output (exactly `rgb_len` bytes) and decodes into
/// it, with panics of the decoder turned into errors.
fn decode_with<'o>(
    bytes: &[u8],
    target: impl FnOnce(&ImageInfo) -> Result<&'o mut [u8]>,
) -> Result<ImageInfo> {
    match detect(bytes)? {
        Format::Jpeg => guarded(Format::Jpeg, || decode_jpeg(bytes, target)),
        Format::Png => guarded(Format::Png, || decode_png(bytes, target)),
    }
}

/// Where an image's encoded data ends in a buffer that holds the start of its file: what
/// [`end_of_image`] finds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum End {
    /// The decoder needs `bytes[..n]` and nothing after: a JPEG's end-of-image marker after
    /// its last scan, or a PNG's first chunk after its image data (its header: the decoder
    /// reads no chunk after the image data).
    At(usize),
    /// The end is not in the buffer yet: the file goes on past it, or is cut short.
    More,
    /// Not found by the walk (a structure it does not follow): the decoder gets the whole file.
    Unknown,
}

/// Where the image that `bytes` starts with ends (see [`End`]), by walking its structure: a
/// JPEG's marker segments by their lengths and its entropy-coded data up to the next marker
/// (stuffed `FF 00` bytes and restart markers are data), a PNG's chunks by their lengths. A
/// reader stops there, so that bytes after the image (a trailer of any size) are never read.
pub(crate) fn end_of_image(bytes: &[u8]) -> End {
    match Format::detect(bytes) {
        Some(Format::Jpeg) => jpeg_end(bytes),
        Some(Format::Png) => png_end(bytes),
        None if bytes.len() < PNG_MAGIC.len() => End::More,
        None => End::Unknown,
    }
}

fn jpeg_end(b: &[u8]) -> End {
    let n = b.len();
    let mut i = 2;
    let (mut scan, mut scanned) = (false, false);
    loop {
        if scan {
            // Entropy-coded data, up to a marker that is neither a stuffed byte nor a restart.
            loop {
                // The next 0xFF (memchr: the data is most of the file, and this walk runs for
                // every file the feed reads).
                let Some(skip) = memchr::memchr(0xFF, b.get(i..).unwrap_or(&[])) else {
                    return End::More;
                };
                i += skip;
                let Some(&m) = b.get(i + 1) else {
                    return End::More;
                };
                match m {
                    0x00 | 0xD0..=0xD7 => i += 2,
                    0xFF => i += 1,
                    _ => break,
                }
            }
            scan = false;
        }
        // A marker: skipped to, past its fill bytes (bytes between headers are tolerated, as
        // the decoder tolerates them).
        while i < n && b[i] != 0xFF {
            i += 1;
        }
        while i < n && b[i] == 0xFF {
            i += 1;
        }
        let Some(&m) = b.get(i) else {
            return End::More;
        };
        i += 1;
        match m {
            // End of image: after a scan, the end; before any, not an image the walk follows.
            0xD9 if scanned => return End::At(i),
            0xD9 => return End::Unknown,
            0x00 | 0x01 | 0xD0..=0xD8 => {}
            _ => {
                let Some(l) = b.get(i..i + 2) else {
                    return End::More;
                };
                let len = usize::from(u16::from_be_bytes([l[0], l[1]]));
                if len < 2 {
                    return End::Unknown;
                }
                i += len;
                if m == 0xDA {
                    (scan, scanned) = (true, true);
                }
            }
        }
    }
}

fn png_end(b: &[u8]) -> End {
    let mut i = PNG_MAGIC.len();
    let mut image_data = false;
    loop {
        let Some(head) = b.get(i..i + 8) else {
            return End::More;
        };
        let len = u32::from_be_bytes([head[0], head[1], head[2], head[3]]);
        if len > i32::MAX as u32 {
            return End::Unknown;
        }
        let kind = &head[4..8];
        if kind == b"IDAT" {
            image_data = true;
        } else if image_data || kind == b"IEND" {
            // The image data has ended: the decoder stops at this chunk's header.
            return End::At(i + 8);
        }
        i += 12 + len as usize;
    }
}

/// Runs a decoder, turning a panic into `Error::Format`.
fn guarded<T>(format: Format, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            let msg = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "(no message)".into());
            Err(decode_error(
                format.name(),
                format!("the decoder panicked: {msg}"),
            ))
        }
    }
}

/// The image's size, checked against zero and [`MAX_OUTPUT_BYTES`].
fn checked_info(format: Format, width: usize, height: usize) -> Result<ImageInfo> {
    if width == 0 || height == 0 {
        return Err(decode_error(
            format.name(),
            format!("the header gives an empty image ({height}x{width}, height x width)"),
        ));
    }
    match height.checked_mul(width).and_then(|n| n.checked_mul(3)) {
        Some(n) if n <= MAX_OUTPUT_BYTES => Ok(ImageInfo {
            height,
            width,
            format,
        }),
        _ => Err(decode_error(
            format.name(),
            format!(
                "the header gives {height}x{width} (height x width) pixels: more than the \
                 {MAX_OUTPUT_BYTES}-byte limit on decoded images (decode::MAX_OUTPUT_BYTES)"
            ),
        )),
    }
}

// ---- JPEG ----------------------------------------------------------------------------------

fn jpeg_error(e: impl std::fmt::Display) -> Error {
    decode_error("jpeg", e.to_string())
}

fn jpeg_options(strict: bool) -> DecoderOptions {
    DecoderOptions::default()
        // JPEG's own limit; ours is MAX_OUTPUT_BYTES, checked after the header.
        .set_max_width(usize::from(u16::MAX))
        .set_max_height(usize::from(u16::MAX))
        .set_strict_mode(strict)
        .jpeg_set_out_colorspace(ColorSpace::RGB)
}

fn jpeg_header(bytes: &[u8], strict: bool) -> Result<(Jpeg<'_>, ImageInfo)> {
    let mut d = JpegDecoder::new_with_options(ZCursor::new(bytes), jpeg_options(strict));
    d.decode_headers().map_err(jpeg_error)?;
    let (width, height) = d
        .dimensions()
        .ok_or_else(|| decode_error("jpeg", "no frame header"))?;
    let info = checked_info(Format::Jpeg, width, height)?;
    match (d.output_colorspace(), d.output_buffer_size()) {
        (Some(ColorSpace::RGB), Some(n)) if n == info.rgb_len() => Ok((d, info)),
        (cs, _) => Err(decode_error(
            "jpeg",
            format!(
                "cannot convert to RGB (input {:?}, output {cs:?})",
                d.input_colorspace()
            ),
        )),
    }
}

type Jpeg<'b> = JpegDecoder<ZCursor<&'b [u8]>>;

/// The headers parsed strictly, or tolerantly where strict mode refused them for a reason
/// [`tolerable`]; the `bool` says whether the decoder is strict.
fn jpeg_headers(bytes: &[u8]) -> Result<(Jpeg<'_>, ImageInfo, bool)> {
    match jpeg_header(bytes, true) {
        Ok((d, info)) => Ok((d, info, true)),
        Err(e) if tolerable(&e) => jpeg_header(bytes, false).map(|(d, i)| (d, i, false)),
        Err(e) => Err(e),
    }
}

/// Errors that strict mode raises for files libjpeg (and so PIL) decodes with a warning: those
/// are decoded again, tolerantly. Truncation and broken entropy data stay errors.
fn tolerable(e: &impl std::fmt::Display) -> bool {
    let msg = e.to_string();
    msg.contains("Extra bytes between headers")
        || msg.contains("found where not expected")
        || msg.contains("Unexpected marker")
}

/// Whether an end-of-image marker (`FF D9`) follows the last start-of-scan (`FF DA`). Entropy-
/// coded data cannot hold either (an `FF` byte there is followed by `00` or a restart marker), so
/// a file cut anywhere in or before its last scan fails this; trailing bytes after the marker
/// are allowed. (zune-jpeg itself fills a scan that ends early with zeros.)
fn ends_its_last_scan(bytes: &[u8]) -> bool {
    // The marker segments from SOI up to the first start of scan, each skipped by its length
    // (so that nothing inside an APP segment, such as an EXIF thumbnail, counts); then an
    // end-of-image marker somewhere after it. Entropy-coded data stuffs every 0xFF, so an
    // FF D9 there is the end of the image (or of a scan's trailer): data appended after the
    // end-of-image marker, which may hold any bytes, does not make a whole file truncated.
    let len = bytes.len();
    let mut i = 2;
    let first_scan = loop {
        while i < len && bytes[i] != 0xFF {
            i += 1;
        }
        while i < len && bytes[i] == 0xFF {
            i += 1;
        }
        if i >= len {
            return false;
        }
        let m = bytes[i];
        i += 1;
        match m {
            0xDA => break i,
            0xD9 => return false,
            0x01 | 0xD0..=0xD8 => {}
            _ => {
                let Some(l) = bytes.get(i..i + 2) else {
                    return false;
                };
                i += usize::from(u16::from_be_bytes([l[0], l[1]]));
            }
        }
    };
    bytes[first_scan..].windows(2).any(|w| w == [0xFF, 0xD9])
}

fn decode_jpeg<'o>(
    bytes: &[u8],
    target: impl FnOnce(&ImageInfo) -> Result<&'o mut [u8]>,
) -> Result<ImageInfo> {
    let (mut d, info, strict) = jpeg_headers(bytes)?;
    if !ends_its_last_scan(bytes) {
        return Err(decode_error(
            "jpeg",
            "the file is truncated: no end-of-image marker after the last scan",
        ));
    }
    let out = target(&info)?;
    match d.decode_into(out) {
        Ok(()) => Ok(info),
        Err(e) if strict && tolerable(&e) => {
            let (mut d, _) = jpeg_header(bytes, false)?;
            d.decode_into(out).map_err(jpeg_error)?;
            Ok(info)
        }
        Err(e) => Err(jpeg_error(e)),
    }
}

// ---- PNG -----------------------------------------------------------------------------------

fn png_error(e: impl std::fmt::Display) -> Error {
    decode_error("png", e.to_string())
}

fn png_info(bytes: &[u8]) -> Result<ImageInfo> {
    let mut d = png::Decoder::new(Cursor::new(bytes));
    let h = d.read_header_info().map_err(png_error)?;
    checked_info(Format::Png, h.width as usize, h.height as usize)
}

fn decode_png<'o>(
    bytes: &[u8],
    target: impl FnOnce(&ImageInfo) -> Result<&'o mut [u8]>,
) -> Result<ImageInfo> {
    let mut d = png::Decoder::new(Cursor::new(bytes));
    let h = d.read_header_info().map_err(png_error)?;
    let info = checked_info(Format::Png, h.width as usize, h.height as usize)?;
    // Palette -> RGB(A), gray below 8 bits -> 8 bits (scaled), tRNS -> alpha (dropped below),
    // 16 bits -> the high byte.
    d.set_transformations(png::Transformations::EXPAND | png::Transformations::STRIP_16);
    let mut reader = d.read_info().map_err(png_error)?;
    let (color, depth) = reader.output_color_type();
    let channels = match (color, depth) {
        (png::ColorType::Grayscale, png::BitDepth::Eight) => 1,
        (png::ColorType::GrayscaleAlpha, png::BitDepth::Eight) => 2,
        (png::ColorType::Rgb, png::BitDepth::Eight) => 3,
        (png::ColorType::Rgba, png::BitDepth::Eight) => 4,
        other => {
            return Err(decode_error(
                "png",
                format!("unexpected decoded layout {other:?}"),
            ))
        }
    };
    let row_out = info.width * 3;
    let row_in = info.width * channels;
    let out = target(&info)?;
    if reader.info().interlaced {
        if channels == 3 {
            reader.next_frame(out).map_err(png_error)?;
        } else {
            let len = reader
                .output_buffer_size()
                .ok_or_else(|| decode_error("png", "the image is too large"))?;
            let mut frame = crate::util::try_vec::<u8>("decode::decode_rgb_into", len)?;
            frame.resize(len, 0);
            reader.next_frame(&mut frame).map_err(png_error)?;
            for (src, dst) in frame
                .chunks_exact(row_in)
                .zip(out.chunks_exact_mut(row_out))
            {
                to_rgb(src, channels, dst);
            }
        }
        return Ok(info);
    }
    let mut scratch = Vec::new();
    if channels != 3 {
        scratch = crate::util::try_vec::<u8>("decode::decode_rgb_into", row_in)?;
        scratch.resize(row_in, 0);
    }
    for (y, dst) in out.chunks_exact_mut(row_out).enumerate() {
        let buf = if channels == 3 {
            &mut *dst
        } else {
            &mut scratch[..]
        };
        if reader.read_row(buf).map_err(png_error)?.is_none() {
            return Err(decode_error(
                "png",
                format!("the image data ends after {y} of {} rows", info.height),
            ));
        }
        if channels != 3 {
            to_rgb(&scratch, channels, dst);
        }
    }
    // Reads the rest of the image data, checking the last chunk's CRC and the zlib stream's
    // end (no row is left: it returns `None`). Chunks after the image data are not read.
    if reader.read_row(&mut []).map_err(png_error)?.is_some() {
        return Err(decode_error("png", "more rows than the header says"));
    }
    Ok(info)
}

/// One row of 8-bit gray, gray+alpha, RGB or RGBA samples to RGB, as PIL's `convert("RGB")`:
/// gray replicated, alpha dropped.
fn to_rgb(src: &[u8], channels: usize, dst: &mut [u8]) {
    match channels {
        1 => {
            for (d, &g) in dst.chunks_exact_mut(3).zip(src) {
                d.fill(g);
            }
        }
        2 => {
            for (d, s) in dst.chunks_exact_mut(3).zip(src.chunks_exact(2)) {
                d.fill(s[0]);
            }
        }
        3 => dst.copy_from_slice(src),
        _ => {
            for (d, s) in dst.chunks_exact_mut(3).zip(src.chunks_exact(4)) {
                d.copy_from_slice(&s[..3]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use image::{DynamicImage, ImageFormat};
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};
    use std::path::PathBuf;

    /// Made by PIL 13 (quality 95) from the 32x24 gradient of `gradient`: progressive.
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
    /// The same gradient, baseline, with a restart marker after every MCU.
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
    /// Made by PIL 13 (quality 95): Adobe CMYK, 16x8, every pixel C=0 M=255 Y=255 K=64 (PIL: RGB 191,0,0).
    const CMYK_JPEG: &str = concat!(
        "ffd8ffee000e41646f626500640000000000ffdb00430002010101010102010101020202020204030202020205040403",
        "04060506060605060606070908060709070606080b08090a0a0a0a0a06080b0c0b0a0c090a0a0affc000140800080010",
        "044311004d11005911004b1100ffc4001f0000010501010101010100000000000000000102030405060708090a0bffc4",
        "00b5100002010303020403050504040000017d01020300041105122131410613516107227114328191a1082342b1c115",
        "52d1f02433627282090a161718191a25262728292a3435363738393a434445464748494a535455565758595a63646566",
        "6768696a737475767778797a838485868788898a92939495969798999aa2a3a4a5a6a7a8a9aab2b3b4b5b6b7b8b9bac2",
        "c3c4c5c6c7c8c9cad2d3d4d5d6d7d8d9dae1e2e3e4e5e6e7e8e9eaf1f2f3f4f5f6f7f8f9faffda000e0443004d005900",
        "4b00003f00fdfcafe7febf9ffafbf28a28a2bfffd9",
    );

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    /// The sample photos (`shared/data/images` next to the repository), if present.
    fn images_dir() -> Option<PathBuf> {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/data/images");
        if dir.join("rocket.jpg").is_file() {
            Some(dir)
        } else {
            eprintln!(
                "note: {} not found; skipping the real images",
                dir.display()
            );
            None
        }
    }

    /// PIL's `convert("RGB")` of what the `image` crate decoded: gray replicated, alpha
    /// dropped, 16-bit samples to their high byte.
    fn pil_rgb(img: &DynamicImage) -> Vec<u8> {
        fn px<const N: usize, T: Copy>(raw: &[T], f: impl Fn(T) -> u8) -> Vec<u8> {
            raw.chunks_exact(N)
                .flat_map(|p| {
                    let v = |i: usize| f(p[i]);
                    if N <= 2 {
                        [v(0), v(0), v(0)]
                    } else {
                        [v(0), v(1), v(2)]
                    }
                })
                .collect()
        }
        let hi = |v: u16| (v >> 8) as u8;
        match img {
            DynamicImage::ImageLuma8(b) => px::<1, u8>(b.as_raw(), |v| v),
            DynamicImage::ImageLumaA8(b) => px::<2, u8>(b.as_raw(), |v| v),
            DynamicImage::ImageRgb8(b) => px::<3, u8>(b.as_raw(), |v| v),
            DynamicImage::ImageRgba8(b) => px::<4, u8>(b.as_raw(), |v| v),
            DynamicImage::ImageLuma16(b) => px::<1, u16>(b.as_raw(), hi),
            DynamicImage::ImageLumaA16(b) => px::<2, u16>(b.as_raw(), hi),
            DynamicImage::ImageRgb16(b) => px::<3, u16>(b.as_raw(), hi),
            DynamicImage::ImageRgba16(b) => px::<4, u16>(b.as_raw(), hi),
            other => panic!("unexpected {:?}", other.color()),
        }
    }

    fn max_abs_diff(a: &[u8], b: &[u8]) -> u8 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| x.abs_diff(*y))
            .max()
            .unwrap_or(0)
    }

    fn encode(img: &DynamicImage, format: ImageFormat) -> Vec<u8> {
        let mut v = Vec::new();
        if format == ImageFormat::Jpeg {
            image::codecs::jpeg::JpegEncoder::new_with_quality(&mut v, 95)
                .encode_image(img)
                .unwrap();
        } else {
            img.write_to(&mut std::io::Cursor::new(&mut v), format)
                .unwrap();
        }
        v
    }

    /// Decodes with both entry points, checks they agree and `info` matches.
    fn decode_checked(bytes: &[u8]) -> (ImageInfo, Vec<u8>) {
        let head = info(bytes).unwrap();
        let (i, v) = decode_rgb(bytes).unwrap();
        assert_eq!(head, i);
        assert_eq!(v.len(), i.rgb_len());
        let mut out = vec![0x5A; i.rgb_len() + 7];
        assert_eq!(decode_rgb_into(bytes, &mut out).unwrap(), i);
        assert_eq!(&out[..i.rgb_len()], &v[..]);
        assert!(
            out[i.rgb_len()..].iter().all(|&b| b == 0x5A),
            "wrote past the image"
        );
        (i, v)
    }

    fn is_format_error(r: &Result<impl std::fmt::Debug>, format: &str) -> bool {
        matches!(r, Err(Error::Format { format: f, path, .. }) if *f == format && path == IN_MEMORY)
    }

    #[test]
    fn real_images_match_the_image_crate() {
        let Some(dir) = images_dir() else { return };
        for (name, format, color) in [
            ("rocket.jpg", Format::Jpeg, image::ColorType::Rgb8),
            ("chelsea.png", Format::Png, image::ColorType::Rgb8),
            ("camera.png", Format::Png, image::ColorType::L8),
            ("logo.png", Format::Png, image::ColorType::Rgba8),
        ] {
            let bytes = std::fs::read(dir.join(name)).unwrap();
            let (i, ours) = decode_checked(&bytes);
            let reference = image::load_from_memory(&bytes).unwrap();
            assert_eq!(reference.color(), color, "{name}");
            assert_eq!(i.format, format, "{name}");
            assert_eq!(
                (i.width, i.height),
                (reference.width() as usize, reference.height() as usize),
                "{name}"
            );
            let want = pil_rgb(&reference);
            match format {
                Format::Png => assert!(ours == want, "{name}: pixels differ"),
                // Same decoder (image 0.25 uses zune-jpeg): the bound leaves room for its options.
                Format::Jpeg => assert!(max_abs_diff(&ours, &want) <= 2, "{name}"),
            }
            if color == image::ColorType::L8 {
                assert!(ours.chunks_exact(3).all(|p| p[0] == p[1] && p[1] == p[2]));
            }
        }
        // Known values: rocket.jpg is 640x427, camera.png 512x512.
        let i = info(&std::fs::read(dir.join("rocket.jpg")).unwrap()).unwrap();
        assert_eq!((i.height, i.width, i.format), (427, 640, Format::Jpeg));
        let i = info(&std::fs::read(dir.join("camera.png")).unwrap()).unwrap();
        assert_eq!((i.height, i.width, i.format), (512, 512, Format::Png));
    }

    fn random_bytes(rng: &mut SmallRng, n: usize) -> Vec<u8> {
        (0..n).map(|_| rng.random()).collect()
    }

    #[test]
    fn png_round_trips_exactly() {
        let mut rng = SmallRng::seed_from_u64(7);
        let (w, h) = (37u32, 23u32);
        let n = (w * h) as usize;
        let imgs = [
            DynamicImage::ImageRgb8(
                image::RgbImage::from_raw(w, h, random_bytes(&mut rng, n * 3)).unwrap(),
            ),
            DynamicImage::ImageLuma8(
                image::GrayImage::from_raw(w, h, random_bytes(&mut rng, n)).unwrap(),
            ),
            DynamicImage::ImageRgba8(
                image::RgbaImage::from_raw(w, h, random_bytes(&mut rng, n * 4)).unwrap(),
            ),
            DynamicImage::ImageLumaA8(
                image::GrayAlphaImage::from_raw(w, h, random_bytes(&mut rng, n * 2)).unwrap(),
            ),
            DynamicImage::ImageRgb16(
                image::ImageBuffer::from_raw(w, h, (0..n * 3).map(|_| rng.random()).collect())
                    .unwrap(),
            ),
            DynamicImage::ImageLuma16(
                image::ImageBuffer::from_raw(w, h, (0..n).map(|_| rng.random()).collect()).unwrap(),
            ),
            DynamicImage::ImageRgba16(
                image::ImageBuffer::from_raw(w, h, (0..n * 4).map(|_| rng.random()).collect())
                    .unwrap(),
            ),
        ];
        for img in &imgs {
            let bytes = encode(img, ImageFormat::Png);
            let (i, ours) = decode_checked(&bytes);
            assert_eq!((i.width, i.height, i.format), (37, 23, Format::Png));
            assert!(ours == pil_rgb(img), "{:?}", img.color());
        }
        // 16-bit: the high byte, checked by hand for one pixel.
        let img = &imgs[4];
        let (_, ours) = decode_rgb(&encode(img, ImageFormat::Png)).unwrap();
        let p = img.as_rgb16().unwrap().get_pixel(0, 0).0;
        assert_eq!(
            &ours[..3],
            &[(p[0] >> 8) as u8, (p[1] >> 8) as u8, (p[2] >> 8) as u8]
        );
    }

    /// A PNG written by the `png` crate (palette and low bit depths, which `image` cannot write).
    fn png_bytes(
        w: u32,
        h: u32,
        color: png::ColorType,
        depth: png::BitDepth,
        palette: Option<(&[u8], Option<&[u8]>)>,
        data: &[u8],
    ) -> Vec<u8> {
        let mut v = Vec::new();
        {
            let mut e = png::Encoder::new(&mut v, w, h);
            e.set_color(color);
            e.set_depth(depth);
            if let Some((plte, trns)) = palette {
                e.set_palette(plte.to_vec());
                if let Some(t) = trns {
                    e.set_trns(t.to_vec());
                }
            }
            let mut wr = e.write_header().unwrap();
            wr.write_image_data(data).unwrap();
        }
        v
    }

    #[test]
    fn palette_and_low_bit_depth_png() {
        let mut rng = SmallRng::seed_from_u64(11);
        let (w, h) = (13usize, 9usize);
        let plte = random_bytes(&mut rng, 256 * 3);
        let trns = random_bytes(&mut rng, 100);
        let idx = random_bytes(&mut rng, w * h);
        let want: Vec<u8> = idx
            .iter()
            .flat_map(|&i| plte[3 * i as usize..3 * i as usize + 3].to_vec())
            .collect();
        for t in [None, Some(&trns[..])] {
            let b = png_bytes(
                w as u32,
                h as u32,
                png::ColorType::Indexed,
                png::BitDepth::Eight,
                Some((&plte, t)),
                &idx,
            );
            let (_, ours) = decode_checked(&b);
            assert!(ours == want, "palette, tRNS {}", t.is_some());
        }
        // 4-bit palette of 16 entries.
        let idx4: Vec<u8> = (0..w * h).map(|_| rng.random_range(0..16u8)).collect();
        let packed = pack(&idx4, w, 4);
        let b = png_bytes(
            w as u32,
            h as u32,
            png::ColorType::Indexed,
            png::BitDepth::Four,
            Some((&plte[..48], None)),
            &packed,
        );
        let want4: Vec<u8> = idx4
            .iter()
            .flat_map(|&i| plte[3 * i as usize..3 * i as usize + 3].to_vec())
            .collect();
        assert!(decode_checked(&b).1 == want4, "4-bit palette");
        // Gray of 1, 2, 4 bits: scaled to 0..255 as PIL does (1 bit: 0/255, 2 bits: x 85 ...).
        for (bits, depth) in [
            (1u8, png::BitDepth::One),
            (2, png::BitDepth::Two),
            (4, png::BitDepth::Four),
        ] {
            let max = (1u8 << bits) - 1;
            let g: Vec<u8> = (0..w * h).map(|_| rng.random_range(0..=max)).collect();
            let b = png_bytes(
                w as u32,
                h as u32,
                png::ColorType::Grayscale,
                depth,
                None,
                &pack(&g, w, bits),
            );
            let want: Vec<u8> = g.iter().flat_map(|&v| [v * (255 / max); 3]).collect();
            assert!(decode_checked(&b).1 == want, "{bits}-bit gray");
        }
    }

    /// Packs samples of `bits` bits into PNG rows (MSB first, each row starting on a byte).
    fn pack(samples: &[u8], w: usize, bits: u8) -> Vec<u8> {
        let per = 8 / bits as usize;
        samples
            .chunks(w)
            .flat_map(|row| {
                row.chunks(per).map(|c| {
                    c.iter().enumerate().fold(0u8, |acc, (k, &s)| {
                        acc | (s << (8 - bits as usize * (k + 1)))
                    })
                })
            })
            .collect()
    }

    /// The source of the embedded JPEGs: R = 8x, G = 10y, B = 128.
    fn gradient(w: usize, h: usize) -> Vec<u8> {
        (0..h)
            .flat_map(|y| (0..w).flat_map(move |x| [(8 * x) as u8, (10 * y) as u8, 128]))
            .collect()
    }

    #[test]
    fn jpeg_round_trips() {
        let mut rng = SmallRng::seed_from_u64(3);
        let (w, h) = (61u32, 45u32);
        // Smooth content plus noise: the decode must come close to what was encoded.
        let rgb: Vec<u8> = (0..h)
            .flat_map(|y| (0..w).flat_map(move |x| [(3 * x) as u8, (4 * y) as u8, (x + y) as u8]))
            .map(|v| v.saturating_add(rng.random_range(0..4)))
            .collect();
        let img = DynamicImage::ImageRgb8(image::RgbImage::from_raw(w, h, rgb.clone()).unwrap());
        let bytes = encode(&img, ImageFormat::Jpeg);
        let (i, ours) = decode_checked(&bytes);
        assert_eq!((i.width, i.height, i.format), (61, 45, Format::Jpeg));
        let reference = pil_rgb(&image::load_from_memory(&bytes).unwrap());
        assert!(max_abs_diff(&ours, &reference) <= 2);
        let mean: f64 = ours
            .iter()
            .zip(&rgb)
            .map(|(a, b)| f64::from(a.abs_diff(*b)))
            .sum::<f64>()
            / rgb.len() as f64;
        assert!(mean < 4.0, "mean abs error {mean} against the source");

        // Grayscale JPEG: one component, replicated.
        let gray: Vec<u8> = (0..w * h).map(|k| (k % 251) as u8).collect();
        let img = DynamicImage::ImageLuma8(image::GrayImage::from_raw(w, h, gray).unwrap());
        let bytes = encode(&img, ImageFormat::Jpeg);
        let (_, ours) = decode_checked(&bytes);
        let reference = pil_rgb(&image::load_from_memory(&bytes).unwrap());
        assert!(max_abs_diff(&ours, &reference) <= 2);
        assert!(ours.chunks_exact(3).all(|p| p[0] == p[1] && p[1] == p[2]));
    }

    #[test]
    fn progressive_restart_and_cmyk_jpeg() {
        let source = gradient(32, 24);
        for (name, data) in [
            ("progressive", PROGRESSIVE_JPEG),
            ("restart markers", RESTART_JPEG),
        ] {
            let bytes = hex(data);
            let (i, ours) = decode_checked(&bytes);
            assert_eq!((i.height, i.width), (24, 32), "{name}");
            // PIL's own decode is within 8 of the source.
            assert!(max_abs_diff(&ours, &source) <= 12, "{name}");
            let reference = pil_rgb(&image::load_from_memory(&bytes).unwrap());
            assert!(max_abs_diff(&ours, &reference) <= 2, "{name}");
        }
        assert!(hex(RESTART_JPEG).windows(2).any(|m| m == [0xFF, 0xD0]));
        // CMYK: converted to RGB by the decoder; PIL gives (191, 0, 0) for every pixel.
        let (i, ours) = decode_checked(&hex(CMYK_JPEG));
        assert_eq!((i.height, i.width), (8, 16));
        for p in ours.chunks_exact(3) {
            assert!(max_abs_diff(p, &[191, 0, 0]) <= 4, "CMYK pixel {p:?}");
        }
    }

    #[test]
    fn jpeg_with_extraneous_bytes_decodes_as_libjpeg_does() {
        // libjpeg warns ("N extraneous bytes before marker") and decodes; strict zune-jpeg
        // refuses, so the tolerant decoder takes over.
        let good = sample_jpeg();
        let (_, want) = decode_checked(&good);
        for marker in [0xC0u8, 0xDA] {
            let at = good.windows(2).position(|m| m == [0xFF, marker]).unwrap();
            let mut odd = good.clone();
            odd.splice(at..at, [1u8, 2, 3, 4, 5]);
            assert!(jpeg_header(&odd, true).is_err(), "strict mode accepted it");
            let (i, got) = decode_checked(&odd);
            assert_eq!((i.height, i.width), (30, 40));
            assert!(got == want, "marker {marker:02X}");
        }
    }

    fn png_chunks(bytes: &[u8]) -> Vec<(usize, [u8; 4], usize)> {
        // (offset of the length field, type, data length)
        let mut v = Vec::new();
        let mut at = 8;
        while at + 12 <= bytes.len() {
            let len = u32::from_be_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
            v.push((at, bytes[at + 4..at + 8].try_into().unwrap(), len));
            at += 12 + len;
        }
        v
    }

    fn crc32(data: &[u8]) -> u32 {
        let mut c = !0u32;
        for &b in data {
            c ^= u32::from(b);
            for _ in 0..8 {
                c = if c & 1 != 0 {
                    (c >> 1) ^ 0xEDB8_8320
                } else {
                    c >> 1
                };
            }
        }
        !c
    }

    /// Rewrites the CRC of the chunk whose length field is at `at`.
    fn fix_crc(bytes: &mut [u8], at: usize) {
        let len = u32::from_be_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
        let crc = crc32(&bytes[at + 4..at + 8 + len]);
        bytes[at + 8 + len..at + 12 + len].copy_from_slice(&crc.to_be_bytes());
    }

    fn sample_png(rng: &mut SmallRng) -> Vec<u8> {
        let img = image::RgbImage::from_raw(40, 30, random_bytes(rng, 40 * 30 * 3)).unwrap();
        encode(&DynamicImage::ImageRgb8(img), ImageFormat::Png)
    }

    fn sample_jpeg() -> Vec<u8> {
        let img = image::RgbImage::from_raw(40, 30, gradient(40, 30)).unwrap();
        encode(&DynamicImage::ImageRgb8(img), ImageFormat::Jpeg)
    }

    /// `bytes[..n]` for `End::At(n)` decodes as the whole file does, and bytes after the
    /// image (any trailer) are left out.
    #[test]
    fn end_of_image_is_what_the_decoder_needs() {
        let mut rng = SmallRng::seed_from_u64(29);
        let mut files = vec![
            hex(PROGRESSIVE_JPEG),
            hex(RESTART_JPEG),
            hex(CMYK_JPEG),
            sample_jpeg(),
            sample_png(&mut rng),
        ];
        // A PNG whose image data is split over several IDAT chunks, with a chunk after them.
        let img = DynamicImage::ImageRgb8(image::RgbImage::from_fn(37, 23, |x, y| {
            image::Rgb([x as u8 * 5, y as u8 * 9, (x * y) as u8])
        }));
        let whole = encode(&img, ImageFormat::Png);
        let mut out = whole[..8].to_vec();
        let chunk = |out: &mut Vec<u8>, kind: &[u8], data: &[u8]| {
            let mut c = (data.len() as u32).to_be_bytes().to_vec();
            c.extend_from_slice(kind);
            c.extend_from_slice(data);
            let crc = crc32(&c[4..]);
            c.extend_from_slice(&crc.to_be_bytes());
            out.extend(c);
        };
        for (at, kind, len) in png_chunks(&whole) {
            let data = &whole[at + 8..at + 8 + len];
            if &kind == b"IDAT" {
                for part in data.chunks(data.len().div_ceil(3).max(1)) {
                    chunk(&mut out, b"IDAT", part);
                }
                chunk(&mut out, b"tEXt", b"ab\0cd");
            } else {
                chunk(&mut out, &kind, data);
            }
        }
        files.push(out);
        for f in files {
            let full = decode_checked(&f);
            let mut with_trailer = f.clone();
            with_trailer.extend((0..5000).map(|_| rng.random::<u8>()));
            with_trailer.extend_from_slice(&[0xFF, 0xD9, 0xFF, 0xDA, 0, 4, 1, 2]);
            let End::At(n) = end_of_image(&with_trailer) else {
                panic!("no end found in a {}-byte file", f.len());
            };
            assert!(n <= f.len(), "{n} of {}", f.len());
            assert_eq!(decode_checked(&with_trailer[..n]), full);
            // Cut anywhere before its end: more is needed.
            for cut in [n / 3, n / 2, n - 1] {
                assert_ne!(end_of_image(&f[..cut]), End::At(cut));
                assert!(!matches!(end_of_image(&f[..cut]), End::At(_)));
            }
        }
        assert_eq!(end_of_image(b"\xFF\xD8"), End::More);
        assert_eq!(end_of_image(b"GIF89a-not-an-image"), End::Unknown);
    }

    #[test]
    fn not_an_image() {
        for bytes in [
            &b""[..],
            b"\xFF",
            b"\xFF\xD8",
            b"GIF89a......",
            b"\x89PNG\r\n\x1a",
        ] {
            assert!(is_format_error(&info(bytes), "image"), "{bytes:?}");
            assert!(is_format_error(&decode_rgb(bytes), "image"), "{bytes:?}");
            let mut out = [7u8; 16];
            assert!(is_format_error(&decode_rgb_into(bytes, &mut out), "image"));
            assert_eq!(out, [7u8; 16]);
        }
        let mut rng = SmallRng::seed_from_u64(5);
        for n in [1usize, 2, 3, 10, 100, 1000, 10_000] {
            let mut b = random_bytes(&mut rng, n);
            assert!(decode_rgb(&b).is_err());
            // Random bytes behind a valid magic reach the decoders.
            for magic in [JPEG_MAGIC, PNG_MAGIC] {
                b.splice(..0, magic.iter().copied());
                let r = decode_rgb(&b).map(|(i, _)| i);
                let f = Format::detect(&b).unwrap().name();
                assert!(is_format_error(&r, f), "{f} {n}: {r:?}");
                assert!(is_format_error(&info(&b), f) || info(&b).is_ok());
            }
        }
    }

    #[test]
    fn truncated_files_are_errors() {
        let mut rng = SmallRng::seed_from_u64(9);
        for (name, bytes) in [
            ("baseline", sample_jpeg()),
            ("progressive", hex(PROGRESSIVE_JPEG)),
            ("restart", hex(RESTART_JPEG)),
        ] {
            assert!(decode_rgb(&bytes).is_ok());
            for cut in (0..bytes.len()).step_by(97).chain([bytes.len() - 3]) {
                let r = decode_rgb(&bytes[..cut]).map(|(i, _)| i);
                let f = if cut < 3 { "image" } else { "jpeg" };
                assert!(is_format_error(&r, f), "{name} cut at {cut}: {r:?}");
            }
        }
        let bytes = sample_png(&mut rng);
        let chunks = png_chunks(&bytes);
        let (at, _, len) = *chunks.iter().rfind(|c| &c.1 == b"IDAT").unwrap();
        let data_end = at + 12 + len;
        for cut in (0..data_end).step_by(97).chain([data_end - 1]) {
            let r = decode_rgb(&bytes[..cut]).map(|(i, _)| i);
            let f = if cut < 8 { "image" } else { "png" };
            assert!(is_format_error(&r, f), "png cut at {cut}: {r:?}");
        }
    }

    #[test]
    fn huge_headers_are_refused_before_allocating() {
        // JPEG: a valid file whose frame header claims 65535 x 65535 (12.9 GB of RGB).
        let mut jpeg = sample_jpeg();
        let sof = jpeg.windows(2).position(|m| m == [0xFF, 0xC0]).unwrap();
        jpeg[sof + 5..sof + 9].copy_from_slice(&[0xFF, 0xFF, 0xFF, 0xFF]);
        // PNG: IHDR claiming 65535 x 65535, and the PNG maximum 2^31-1 x 1.
        let mut rng = SmallRng::seed_from_u64(1);
        let mut png = sample_png(&mut rng);
        png[16..24].copy_from_slice(&[0, 0, 0xFF, 0xFF, 0, 0, 0xFF, 0xFF]);
        fix_crc(&mut png, 8);
        let mut wide = png.clone();
        wide[16..24].copy_from_slice(&[0x7F, 0xFF, 0xFF, 0xFF, 0, 0, 0, 1]);
        fix_crc(&mut wide, 8);
        for (f, bytes) in [("jpeg", &jpeg), ("png", &png), ("png", &wide)] {
            assert!(bytes.len() < 10_000);
            for r in [info(bytes).map(|_| ()), decode_rgb(bytes).map(|_| ())] {
                match r {
                    Err(Error::Format { format, detail, .. }) => {
                        assert_eq!(format, f);
                        assert!(detail.contains("MAX_OUTPUT_BYTES"), "{detail}");
                    }
                    other => panic!("{f}: {other:?}"),
                }
            }
            let mut out = [1u8; 64];
            assert!(is_format_error(&decode_rgb_into(bytes, &mut out), f));
            assert_eq!(out, [1u8; 64]);
        }
        // At the limit `info` accepts (the decode would then fail: the data is for 40x30), one
        // pixel more it refuses.
        let w = (MAX_OUTPUT_BYTES / 3) as u32;
        for (w, ok) in [(w, true), (w + 1, false)] {
            let mut b = png.clone();
            b[16..24].copy_from_slice(&[w.to_be_bytes(), 1u32.to_be_bytes()].concat());
            fix_crc(&mut b, 8);
            assert_eq!(info(&b).is_ok(), ok, "{w}");
        }
    }

    #[test]
    fn short_output_is_refused_and_untouched() {
        let mut rng = SmallRng::seed_from_u64(2);
        for bytes in [sample_jpeg(), sample_png(&mut rng), hex(PROGRESSIVE_JPEG)] {
            let need = info(&bytes).unwrap().rgb_len();
            for len in [0, 1, need - 1] {
                let mut out = vec![0xAB; len];
                match decode_rgb_into(&bytes, &mut out) {
                    Err(Error::InvalidArgument { op, reason }) => {
                        assert_eq!(op, "decode::decode_rgb_into");
                        assert!(reason.contains(&need.to_string()), "{reason}");
                    }
                    other => panic!("{other:?}"),
                }
                assert!(out.iter().all(|&b| b == 0xAB));
            }
        }
    }

    #[test]
    fn broken_png_chunks_are_errors() {
        let mut rng = SmallRng::seed_from_u64(4);
        let good = sample_png(&mut rng);
        let (at, _, len) = *png_chunks(&good).iter().find(|c| &c.1 == b"IDAT").unwrap();
        // A wrong CRC on the image data.
        let mut bad_crc = good.clone();
        bad_crc[at + 8 + len] ^= 0x55;
        assert!(is_format_error(&decode_rgb(&bad_crc).map(|_| ()), "png"));
        // A broken zlib stream with a correct CRC: invalid header, then garbage deflate data.
        let mut bad_zlib = good.clone();
        bad_zlib[at + 8] = 0x00;
        fix_crc(&mut bad_zlib, at);
        let r = decode_rgb(&bad_zlib).map(|(i, _)| i);
        assert!(is_format_error(&r, "png"), "{r:?}");
        let mut garbage = good.clone();
        for b in &mut garbage[at + 10..at + 8 + len] {
            *b = rng.random();
        }
        fix_crc(&mut garbage, at);
        let r = decode_rgb(&garbage).map(|(i, _)| i);
        assert!(is_format_error(&r, "png"), "{r:?}");
        // A wrong CRC on the header.
        let mut bad_ihdr = good.clone();
        bad_ihdr[29] ^= 1;
        let r = info(&bad_ihdr);
        assert!(is_format_error(&r, "png"), "{r:?}");
    }

    #[test]
    fn mutated_files_never_panic() {
        let mut rng = SmallRng::seed_from_u64(6);
        let files = [
            sample_jpeg(),
            hex(PROGRESSIVE_JPEG),
            hex(RESTART_JPEG),
            hex(CMYK_JPEG),
            sample_png(&mut rng),
        ];
        let mut out = vec![0u8; 40 * 30 * 3];
        for f in &files {
            for _ in 0..300 {
                let mut b = f.clone();
                for _ in 0..rng.random_range(1..8) {
                    let k = rng.random_range(0..b.len());
                    b[k] = rng.random();
                }
                // Either outcome is fine; the calls must return.
                let _ = info(&b);
                let _ = decode_rgb(&b);
                let _ = decode_rgb_into(&b, &mut out);
            }
        }
    }

    #[test]
    fn a_panicking_decoder_becomes_a_format_error() {
        let r: Result<()> = guarded(Format::Png, || panic!("boom"));
        match r {
            Err(Error::Format { format, detail, .. }) => {
                assert_eq!(format, "png");
                assert!(detail.contains("boom"), "{detail}");
            }
            other => panic!("{other:?}"),
        }
    }
}
