//! The batched GPU JPEG decoder: per image, the GPU's hardware JPEG engines (nvJPEG's hardware
//! backend: baseline, single scan, 4:4:4 / 4:2:2 / 4:2:0 / 4:4:0 / gray), the CUDA backend for
//! the other sequential JPEGs it accepts, and the CPU decoder ([`crate::decode`]) for the rest
//! (progressive, CMYK, lossless, PNG), all into one device arena, interleaved RGB.
//!
//! # The stream-ordering guarantee
//! On H100, nvJPEG's hardware engine writes its destinations before the work queued ahead of it
//! on the same stream has run (pytorch/vision #9606, meta-pytorch/torchcodec #1634). So
//! [`GpuDecoder::decode`] hands the engines only memory that nothing queued still touches: it
//! waits on the host for every use of the arena pinstream tracked (on any stream: kernels,
//! copies, memsets, `record_stream`) and for its own stream, and only then queues the decode.

use std::ffi::c_void;
use std::ptr;
use std::sync::Arc;

use pinstream::memory::{DeviceBuffer, HostAlloc, PinnedBuffer};
use pinstream::{Device, Error, Event, Result, Stream};

use super::alloc::Allocators;
use super::library::library;
use super::sys;
use crate::decode::{self, Format};

/// How one image is decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Route {
    /// The GPU's JPEG engines (nvJPEG's hardware backend).
    Hardware,
    /// nvJPEG's CUDA backend (Huffman decoding on the GPU or the calling thread).
    Cuda,
    /// The CPU decoder, then a copy to the device.
    Cpu,
}

/// A rectangle of an image, in pixels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Region {
    /// First row.
    pub top: usize,
    /// First column.
    pub left: usize,
    /// Rows.
    pub height: usize,
    /// Columns.
    pub width: usize,
}

impl Region {
    /// The whole `height x width` image.
    pub fn full(height: usize, width: usize) -> Region {
        Region {
            top: 0,
            left: 0,
            height,
            width,
        }
    }

    /// Bytes of this region as interleaved RGB (`usize::MAX` where that overflows: no arena
    /// holds it).
    pub fn rgb_len(&self) -> usize {
        self.height.saturating_mul(self.width).saturating_mul(3)
    }

    /// Whether it is a non-empty part of an `h x w` image.
    fn is_inside(&self, h: usize, w: usize) -> bool {
        self.height > 0
            && self.width > 0
            && self.top.checked_add(self.height).is_some_and(|b| b <= h)
            && self.left.checked_add(self.width).is_some_and(|b| b <= w)
    }

    /// [`rgb_len`](Self::rgb_len), `None` where it overflows.
    fn rgb_len_checked(&self) -> Option<usize> {
        self.height.checked_mul(self.width)?.checked_mul(3)
    }
}

/// What [`GpuDecoder::plan`] says of an image: its route, size, and the region a decode
/// writes (the region asked for where the route decodes regions, the whole image elsewhere).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Plan {
    /// The decoder that will take it.
    pub route: Route,
    /// Rows of the image.
    pub height: usize,
    /// Columns of the image.
    pub width: usize,
    /// What a decode writes: `region.height x region.width x 3` bytes at the item's offset.
    /// On the hardware route for 4:4:4 and gray files, the region asked for widened to whole
    /// MCUs around it (it contains the region asked for); elsewhere the whole image.
    pub region: Region,
}

/// One image of a batch: its file's bytes, its [`Plan`] (from [`GpuDecoder::plan`] of the same
/// bytes), and where its pixels go in the arena (bytes).
#[derive(Clone, Copy, Debug)]
pub struct Item<'a> {
    /// The file.
    pub data: &'a [u8],
    /// How it is decoded and what that writes. A plan that does not fit the bytes (they
    /// changed, or the plan was made up) makes the item a bad file, never a stray write.
    pub plan: Plan,
    /// First byte of its pixels in the arena.
    pub offset: usize,
}

fn status_name(s: sys::nvjpegStatus_t) -> &'static str {
    match s {
        1 => "NVJPEG_STATUS_NOT_INITIALIZED",
        2 => "NVJPEG_STATUS_INVALID_PARAMETER",
        3 => "NVJPEG_STATUS_BAD_JPEG",
        4 => "NVJPEG_STATUS_JPEG_NOT_SUPPORTED",
        5 => "NVJPEG_STATUS_ALLOCATOR_FAILURE",
        6 => "NVJPEG_STATUS_EXECUTION_FAILED",
        7 => "NVJPEG_STATUS_ARCH_MISMATCH",
        8 => "NVJPEG_STATUS_INTERNAL_ERROR",
        9 => "NVJPEG_STATUS_IMPLEMENTATION_NOT_SUPPORTED",
        10 => "NVJPEG_STATUS_INCOMPLETE_BITSTREAM",
        _ => "an unknown nvJPEG status",
    }
}

/// `Ok` for success, else an error naming the call and the status.
fn check(call: &'static str, s: sys::nvjpegStatus_t) -> Result<()> {
    if s == sys::nvjpegStatus_t_NVJPEG_STATUS_SUCCESS {
        return Ok(());
    }
    Err(Error::invalid(
        call,
        format!("nvJPEG returned {} ({s})", status_name(s)),
    ))
}

/// A file nvJPEG's parser refuses, as the CPU decoder's errors are: a `Format` error.
fn bad_jpeg(detail: String) -> Error {
    Error::Format {
        format: "jpeg",
        path: "(in memory)".into(),
        tensor: None,
        detail,
    }
}

/// nvJPEG's reading of a header: height, width, components, encoding, chroma subsampling.
type Header = (usize, usize, u32, u32, i32);

/// A library handle: the device it was made on, destroyed with it current.
struct Handle {
    lib: &'static sys::Nvjpeg,
    raw: sys::nvjpegHandle_t,
    device: Device,
}

// SAFETY: an nvJPEG handle may be used from several threads at once (its documentation: states,
// not handles, are per thread); `raw` is only destroyed in `drop`, with no other user left.
unsafe impl Send for Handle {}
// SAFETY: as above; `&Handle` only passes `raw` to nvJPEG's thread-safe calls.
unsafe impl Sync for Handle {}

impl Handle {
    fn new(
        lib: &'static sys::Nvjpeg,
        device: &Device,
        backend: sys::nvjpegBackend_t,
        alloc: &Allocators,
    ) -> Result<Self> {
        device.make_current()?;
        let mut raw = ptr::null_mut();
        let (mut dev_alloc, mut pinned_alloc) = alloc.tables();
        // Chroma upsampled with interpolation, as libjpeg-turbo (PIL, torchvision) and the CPU
        // decoder do, not by replication; a library without the flag decodes without it.
        for flags in [sys::NVJPEG_FLAGS_UPSAMPLING_WITH_INTERPOLATION, 0] {
            // SAFETY: the allocator tables point at `alloc`, which outlives the handle (`Shared`
            // drops its handles first); nvJPEG copies the tables; `raw` is written on success.
            let s = unsafe {
                lib.nvjpegCreateExV2(backend, &mut dev_alloc, &mut pinned_alloc, flags, &mut raw)
            };
            if s == 0 || flags == 0 {
                check("nvjpegCreateExV2", s)?;
                break;
            }
        }
        Ok(Handle {
            lib,
            raw,
            device: *device,
        })
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        let _ = self.device.make_current();
        // SAFETY: `raw` came from nvjpegCreateExV2, and every object made from it is gone: each
        // `GpuDecoder` holds an `Arc` of the handles and destroys its states, streams and params
        // first, after waiting for its stream.
        unsafe { self.lib.nvjpegDestroy(self.raw) };
    }
}

struct Shared {
    device: Device,
    hardware: Option<Handle>,
    cuda: Handle,
    engines: u32,
    hardware_absent: Option<String>,
    /// The handles' allocators: dropped after them (field order), at a stable address (boxed).
    alloc: Box<Allocators>,
}

/// nvJPEG on one device: the hardware backend where the GPU has JPEG engines, and the CUDA
/// backend. Cheap to clone; make one [`GpuDecoder`] per thread with [`decoder`](Self::decoder).
#[derive(Clone)]
pub struct Nvjpeg {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Nvjpeg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nvjpeg")
            .field("device", &self.shared.device.ordinal())
            .field("hardware_engines", &self.shared.engines)
            .finish()
    }
}

impl Nvjpeg {
    /// Loads nvJPEG (once per process) and opens it on `device`. `Err` where the library is
    /// missing (the message says what was tried) or refuses the device.
    pub fn new(device: &Device) -> Result<Nvjpeg> {
        const OP: &str = "nvjpeg::Nvjpeg::new";
        let lib = library().map_err(|why| Error::invalid(OP, why))?;
        let alloc = Box::new(Allocators::new(device)?);
        let cuda = Handle::new(
            lib,
            device,
            sys::nvjpegBackend_t_NVJPEG_BACKEND_GPU_HYBRID,
            &alloc,
        )?;
        let hardware = Handle::new(
            lib,
            device,
            sys::nvjpegBackend_t_NVJPEG_BACKEND_HARDWARE,
            &alloc,
        );
        let (hardware, engines, absent) = match hardware {
            Ok(h) => {
                let (mut engines, mut cores) = (0u32, 0u32);
                // SAFETY: `h.raw` is a live handle; the two counts are written on success.
                let s =
                    unsafe { lib.nvjpegGetHardwareDecoderInfo(h.raw, &mut engines, &mut cores) };
                match check("nvjpegGetHardwareDecoderInfo", s) {
                    Ok(()) if engines > 0 => (Some(h), engines, None),
                    Ok(()) => (None, 0, Some("the GPU has no JPEG engine".to_string())),
                    Err(e) => (None, 0, Some(e.to_string())),
                }
            }
            Err(e) => (None, 0, Some(e.to_string())),
        };
        Ok(Nvjpeg {
            shared: Arc::new(Shared {
                device: *device,
                hardware,
                cuda,
                engines,
                hardware_absent: absent,
                alloc,
            }),
        })
    }

    /// Bytes nvJPEG holds now from pinstream's pools: (device, page-locked host).
    pub fn pool_bytes(&self) -> (usize, usize) {
        self.shared.alloc.in_use()
    }

    /// The GPU's JPEG engines (0: no hardware route).
    pub fn hardware_engines(&self) -> u32 {
        self.shared.engines
    }

    /// Why there is no hardware route, where there is none.
    pub fn hardware_absent(&self) -> Option<&str> {
        self.shared.hardware_absent.as_deref()
    }

    /// The device.
    pub fn device(&self) -> Device {
        self.shared.device
    }

    /// A decoder for one thread, with its own stream and decode states.
    pub fn decoder(&self) -> Result<GpuDecoder> {
        GpuDecoder::new(self)
    }
}

/// A per-thread nvJPEG object (`nvjpegJpegState_t`, `nvjpegJpegStream_t` or
/// `nvjpegDecodeParams_t`), destroyed with its handle still alive.
struct Owned {
    raw: *mut c_void,
    destroy: unsafe extern "C" fn(*mut c_void) -> sys::nvjpegStatus_t,
}

impl Drop for Owned {
    fn drop(&mut self) {
        // SAFETY: `raw` was made by the matching create call and is destroyed once; the decoder
        // keeps the handle it came from alive (field order: these drop before `nv`).
        unsafe { (self.destroy)(self.raw) };
    }
}

/// Makes an nvJPEG object with `create(handle, &mut out)`.
fn owned<T>(
    call: &'static str,
    create: impl FnOnce(*mut *mut T) -> sys::nvjpegStatus_t,
    destroy: unsafe extern "C" fn(*mut T) -> sys::nvjpegStatus_t,
) -> Result<Owned> {
    let mut raw: *mut T = ptr::null_mut();
    check(call, create(&mut raw))?;
    Ok(Owned {
        raw: raw.cast(),
        // SAFETY: the two function types differ only in the pointee of their one pointer
        // argument, which is passed through unchanged (the same ABI).
        destroy: unsafe {
            std::mem::transmute::<
                unsafe extern "C" fn(*mut T) -> sys::nvjpegStatus_t,
                unsafe extern "C" fn(*mut c_void) -> sys::nvjpegStatus_t,
            >(destroy)
        },
    })
}

/// One backend's batch state: its `nvjpegJpegState_t` and the batch size it was initialized for.
struct Batcher {
    state: Owned,
    initialized: Option<usize>,
}

/// Decodes batches on one thread: [`plan`](Self::plan) says how each file will be decoded,
/// [`decode`](Self::decode) decodes a batch into a device arena. Made by [`Nvjpeg::decoder`].
pub struct GpuDecoder {
    // Dropped first: the objects below need the handles in `nv`.
    parser: Owned,
    params: Vec<Owned>,
    hardware: Option<Batcher>,
    cuda: Batcher,
    staging: Option<PinnedBuffer<u8>>,
    stream: Stream,
    /// Recorded on `stream` to wait for it: an event's wait sleeps after a short spin, where
    /// `cudaStreamSynchronize` would spin a core for the whole decode.
    idle: Event,
    lib: &'static sys::Nvjpeg,
    nv: Nvjpeg,
    /// Decode only the region asked for where the route can (ROI decoding: the hardware
    /// route, for files without chroma subsampling). On by default.
    pub roi: bool,
}

// SAFETY: the decoder's nvJPEG objects are used by one thread at a time (every use takes
// `&mut self`), which is all nvJPEG asks of states, streams and parameters; the handles are
// `Send + Sync` themselves.
unsafe impl Send for GpuDecoder {}

impl Drop for GpuDecoder {
    fn drop(&mut self) {
        // Its states and buffers may still be used by work queued on its stream.
        let _ = self.wait_stream().or_else(|_| self.stream.synchronize());
    }
}

impl std::fmt::Debug for GpuDecoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuDecoder")
            .field("nvjpeg", &self.nv)
            .field("roi", &self.roi)
            .finish_non_exhaustive()
    }
}

/// The decoder's stream, at the device's greatest priority. What the feed queues here (the
/// resized crop, the labels' copy, the CPU route's uploads) is then scheduled ahead of a
/// training step's kernels instead of waiting for their blocks to drain; it is a few per cent
/// of the step's GPU time, so the step loses little. nvJPEG's own copies and colour conversions
/// run on its internal streams, which this does not reach (measured: BENCHMARKS.md, 2026-11-27
/// third session, where this priority moved no ratio).
fn decode_stream(device: &Device) -> Result<Stream> {
    let (_, greatest) = device.stream_priority_range()?;
    Stream::with_priority(device, greatest)
}

impl GpuDecoder {
    fn new(nv: &Nvjpeg) -> Result<GpuDecoder> {
        let sh = &nv.shared;
        let lib = sh.cuda.lib;
        sh.device.make_current()?;
        let state = |h: &Handle| {
            owned(
                "nvjpegJpegStateCreate",
                // SAFETY: a live handle; the state is written on success only.
                |out| unsafe { lib.nvjpegJpegStateCreate(h.raw, out) },
                lib.nvjpegJpegStateDestroy,
            )
        };
        let hardware = match &sh.hardware {
            Some(h) => Some(Batcher {
                state: state(h)?,
                initialized: None,
            }),
            None => None,
        };
        let cuda = Batcher {
            state: state(&sh.cuda)?,
            initialized: None,
        };
        let parse_handle = sh.hardware.as_ref().unwrap_or(&sh.cuda);
        let parser = owned(
            "nvjpegJpegStreamCreate",
            // SAFETY: a live handle; the stream is written on success only.
            |out| unsafe { lib.nvjpegJpegStreamCreate(parse_handle.raw, out) },
            lib.nvjpegJpegStreamDestroy,
        )?;
        Ok(GpuDecoder {
            parser,
            params: Vec::new(),
            hardware,
            cuda,
            staging: None,
            stream: decode_stream(&sh.device)?,
            idle: Event::new(&sh.device)?,
            lib,
            nv: nv.clone(),
            roi: true,
        })
    }

    /// The stream the decodes are queued on (work queued after a decode on it sees the pixels).
    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// The nvJPEG this decoder belongs to.
    pub fn nvjpeg(&self) -> &Nvjpeg {
        &self.nv
    }

    /// How `data` will be decoded, and what a decode of it writes. `Err` (a `Format` error) for
    /// a file neither decoder can read the header of, or an image above
    /// [`decode::MAX_OUTPUT_BYTES`], or a `region` outside the image or empty.
    pub fn plan(&mut self, data: &[u8], region: Option<Region>) -> Result<Plan> {
        let info = decode::info(data)?;
        let ended = matches!(decode::end_of_image(data), decode::End::At(_));
        self.plan_known(data, info, ended, region)
    }

    /// [`plan`](Self::plan) where the caller read the header (`info`) and walked the file to
    /// its end (`ended`: an end-of-image marker after the last scan) already.
    pub(crate) fn plan_known(
        &mut self,
        data: &[u8],
        info: decode::ImageInfo,
        ended: bool,
        region: Option<Region>,
    ) -> Result<Plan> {
        const OP: &str = "nvjpeg::GpuDecoder::plan";
        let (h, w) = (info.height, info.width);
        if let Some(r) = region {
            if !r.is_inside(h, w) {
                return Err(Error::invalid(
                    OP,
                    format!("region {r:?} is not a non-empty part of the {h}x{w} image"),
                ));
            }
        }
        let full = Region::full(h, w);
        if info.format != Format::Jpeg {
            return Ok(Plan {
                route: Route::Cpu,
                height: h,
                width: w,
                region: full,
            });
        }
        // A file whose end of image is not found (cut short) goes to the CPU decoder, which
        // refuses it as the CPU path always has; nvJPEG might decode part of it without a word.
        let (route, mcu) = match ended {
            true => self.route(data, h, w)?,
            false => (Route::Cpu, (8, 8)),
        };
        // ROI decoding only where chroma is not subsampled: with a region, the engines
        // upsample chroma by replication, not interpolation (0.75 % of a 4:2:0 region's bytes
        // came out over 8 levels from the whole image's, on an H200).
        let region = match (route, region) {
            (Route::Hardware, Some(r)) if self.roi && mcu == (8, 8) => around(r, mcu, h, w),
            _ => full,
        };
        Ok(Plan {
            route,
            height: h,
            width: w,
            region,
        })
    }

    /// The route of a JPEG whose header the CPU decoder read as `h x w`: nvJPEG's parser must
    /// agree on the size (else the file is refused: the two would write different amounts).
    /// nvJPEG's own reading of the header (what its decode will write): `(height, width,
    /// components, encoding, subsampling)`, or `None` where it cannot parse it.
    fn parse(&mut self, data: &[u8]) -> Result<Option<Header>> {
        let lib = self.lib;
        let js = self.parser.raw.cast::<sys::nvjpegJpegStream>();
        self.nv.shared.device.make_current()?;
        let parse_handle = self
            .nv
            .shared
            .hardware
            .as_ref()
            .unwrap_or(&self.nv.shared.cuda);
        // SAFETY: `data` is a live slice of `data.len()` bytes, read during the call only; `js`
        // is this decoder's stream object.
        let s = unsafe {
            lib.nvjpegJpegStreamParseHeader(parse_handle.raw, data.as_ptr(), data.len(), js)
        };
        if s != sys::nvjpegStatus_t_NVJPEG_STATUS_SUCCESS {
            return Ok(None);
        }
        let (mut fw, mut fh, mut comps) = (0u32, 0u32, 0u32);
        let mut encoding: sys::nvjpegJpegEncoding_t = 0;
        let mut css: sys::nvjpegChromaSubsampling_t =
            sys::nvjpegChromaSubsampling_t_NVJPEG_CSS_UNKNOWN;
        // SAFETY: `js` holds a parsed header; each out-pointer is a live local.
        let ok = unsafe {
            lib.nvjpegJpegStreamGetFrameDimensions(js, &mut fw, &mut fh) == 0
                && lib.nvjpegJpegStreamGetComponentsNum(js, &mut comps) == 0
                && lib.nvjpegJpegStreamGetJpegEncoding(js, &mut encoding) == 0
                && lib.nvjpegJpegStreamGetChromaSubsampling(js, &mut css) == 0
        };
        Ok(ok.then_some((fh as usize, fw as usize, comps, encoding, css)))
    }

    /// The route, and the size of the file's MCU (rows, columns) where it goes to the engines.
    fn route(&mut self, data: &[u8], h: usize, w: usize) -> Result<(Route, (usize, usize))> {
        let lib = self.lib;
        let js = self.parser.raw.cast::<sys::nvjpegJpegStream>();
        // nvJPEG cannot parse what the CPU decoder could: let the CPU decide.
        let Some((fh, fw, comps, encoding, css)) = self.parse(data)? else {
            return Ok((Route::Cpu, (8, 8)));
        };
        if (fh, fw) != (h, w) {
            return Err(bad_jpeg(format!(
                "the header's size is read as {h}x{w} by the CPU decoder and {fh}x{fw} by nvJPEG"
            )));
        }
        let sequential = encoding == sys::nvjpegJpegEncoding_t_NVJPEG_ENCODING_BASELINE_DCT
            || encoding
                == sys::nvjpegJpegEncoding_t_NVJPEG_ENCODING_EXTENDED_SEQUENTIAL_DCT_HUFFMAN;
        // CMYK and other 4-component files, progressive and lossless ones go to the CPU decoder,
        // which reads them as the CPU path always has.
        if !sequential || !(comps == 1 || comps == 3) {
            return Ok((Route::Cpu, (8, 8)));
        }
        let hw_css = [
            sys::nvjpegChromaSubsampling_t_NVJPEG_CSS_444,
            sys::nvjpegChromaSubsampling_t_NVJPEG_CSS_422,
            sys::nvjpegChromaSubsampling_t_NVJPEG_CSS_420,
            sys::nvjpegChromaSubsampling_t_NVJPEG_CSS_440,
            sys::nvjpegChromaSubsampling_t_NVJPEG_CSS_GRAY,
        ];
        let nv = self.nv.clone();
        if let Some(hw) = &nv.shared.hardware {
            if hw_css.contains(&css) {
                let params = self.params_at(0)?;
                let mut unsupported = 1i32;
                // SAFETY: live handle, parsed stream, params object and out-pointer.
                let s = unsafe {
                    lib.nvjpegDecodeBatchedSupportedEx(hw.raw, js, params, &mut unsupported)
                };
                if s == 0 && unsupported == 0 {
                    let mcu = match css {
                        sys::nvjpegChromaSubsampling_t_NVJPEG_CSS_420 => (16, 16),
                        sys::nvjpegChromaSubsampling_t_NVJPEG_CSS_422 => (8, 16),
                        sys::nvjpegChromaSubsampling_t_NVJPEG_CSS_440 => (16, 8),
                        _ => (8, 8),
                    };
                    return Ok((Route::Hardware, mcu));
                }
            }
        }
        Ok((Route::Cuda, (8, 8)))
    }

    /// An item's plan, checked against its bytes as nvJPEG reads them (the bytes may have
    /// changed since `plan`, or the plan may be made up): `Err` makes it a bad file. The
    /// region must lie in the image; a route that cannot decode a region alone (CUDA) hands
    /// the item to the CPU decoder, which cuts the region from its decode.
    fn recheck(&mut self, it: &Item<'_>) -> Result<Plan> {
        const OP: &str = "nvjpeg::GpuDecoder::decode";
        let mut p = it.plan;
        let r = p.region;
        if !r.is_inside(p.height, p.width) || r.rgb_len_checked().is_none() {
            return Err(Error::invalid(
                OP,
                format!(
                    "the plan's region {r:?} is not in its {}x{} image",
                    p.height, p.width
                ),
            ));
        }
        if p.route == Route::Cpu {
            // The CPU decoder checks the size itself.
            return Ok(p);
        }
        // What the plan asked for must suit the bytes as they are now: cut short (no end of
        // image after the last scan) goes to the CPU decoder, which refuses it as the CPU path
        // does; the route and region are the decoder's own choice for these bytes (an unaligned
        // or subsampled region on the engines would come out wrong).
        let ended = it.data.ends_with(&[0xFF, 0xD9])
            || matches!(decode::end_of_image(it.data), decode::End::At(_));
        let (route, mcu) = match ended {
            true => self.route(it.data, p.height, p.width)?,
            false => (Route::Cpu, (8, 8)),
        };
        let full = Region::full(p.height, p.width);
        p.route = match route {
            _ if r == full => route,
            Route::Hardware if self.roi && mcu == (8, 8) && aligned(r, mcu, p.height, p.width) => {
                Route::Hardware
            }
            // A region the engines would get wrong, or a route that decodes only whole images:
            // the CPU decoder cuts it from its decode.
            _ => Route::Cpu,
        };
        Ok(p)
    }

    /// The `i`th decode-parameters object (made on first use), reset to interleaved RGB output
    /// of the whole image.
    fn params_at(&mut self, i: usize) -> Result<sys::nvjpegDecodeParams_t> {
        let lib = self.lib;
        while self.params.len() <= i {
            let h = self
                .nv
                .shared
                .hardware
                .as_ref()
                .unwrap_or(&self.nv.shared.cuda)
                .raw;
            self.params.push(owned(
                "nvjpegDecodeParamsCreate",
                // SAFETY: a live handle; the object is written on success only.
                |out| unsafe { lib.nvjpegDecodeParamsCreate(h, out) },
                lib.nvjpegDecodeParamsDestroy,
            )?);
        }
        let p = self.params[i].raw.cast::<sys::nvjpegDecodeParams>();
        // SAFETY: a live params object.
        unsafe {
            check(
                "nvjpegDecodeParamsSetOutputFormat",
                lib.nvjpegDecodeParamsSetOutputFormat(
                    p,
                    sys::nvjpegOutputFormat_t_NVJPEG_OUTPUT_RGBI,
                ),
            )?;
            check(
                "nvjpegDecodeParamsSetROI",
                lib.nvjpegDecodeParamsSetROI(p, 0, 0, -1, -1),
            )?;
        }
        Ok(p)
    }

    /// Decodes `items` into `arena`, each as interleaved RGB at its offset, the `plan.region`
    /// of it (see [`plan`](Self::plan)). Returns per item its plan, or the error that made it a bad
    /// file (its bytes in the arena are then unspecified); the other items are decoded all the
    /// same.
    ///
    /// Before anything is queued, waits on the host until no work pinstream tracked on the
    /// arena, and nothing on this decoder's stream, is still pending (the stream-ordering
    /// guarantee, see the module); returns with the decode finished and the arena's write
    /// recorded on [`stream`](Self::stream).
    ///
    /// # Errors
    /// `InvalidArgument`, with nothing queued, where an item's pixels would not fit the arena
    /// or two items' pixels overlap, or the arena is on another device; errors of the CUDA
    /// runtime.
    pub fn decode(
        &mut self,
        items: &[Item<'_>],
        arena: &mut DeviceBuffer<u8>,
    ) -> Result<Vec<Result<Plan>>> {
        const OP: &str = "nvjpeg::GpuDecoder::decode";
        if arena.device().ordinal() != self.nv.shared.device.ordinal() {
            return Err(Error::WrongDevice {
                op: OP,
                expected: self.nv.shared.device.ordinal() as i32,
                found: arena.device().ordinal() as i32,
            });
        }
        let plans: Vec<Result<Plan>> = items.iter().map(|it| self.recheck(it)).collect();
        // Every destination inside the arena, none overlapping another: checked before anything
        // is queued (nvJPEG writes where it is told).
        let mut spans: Vec<(usize, usize)> = Vec::with_capacity(items.len());
        for (it, p) in items.iter().zip(&plans) {
            let Ok(p) = p else { continue };
            let len = p.region.rgb_len();
            let end = it.offset.checked_add(len).filter(|&e| e <= arena.len());
            let Some(end) = end else {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "an image's {len} bytes at offset {} do not fit the {}-byte arena",
                        it.offset,
                        arena.len()
                    ),
                ));
            };
            if len > 0 {
                spans.push((it.offset, end));
            }
        }
        spans.sort_unstable();
        if spans.windows(2).any(|w| w[1].0 < w[0].1) {
            return Err(Error::invalid(
                OP,
                "two images' pixels overlap in the arena",
            ));
        }
        // The guarantee: nothing queued still reads or writes the arena, on any stream.
        arena.synchronize()?;
        self.wait_stream()?;
        let mut results = plans;
        let queued = self.queue(items, &mut results, arena);
        // On every way out once anything may be queued: the arena's write recorded, and the
        // decode finished (the files' bytes are borrowed for this call only, and the arena may
        // be freed after it).
        let recorded = arena.record_stream_mut(&self.stream);
        let waited = self.wait_stream().or_else(|_| self.stream.synchronize());
        queued?;
        recorded?;
        waited?;
        Ok(results)
    }

    /// Queues the batch's decodes (engines, CUDA backend, CPU decoder with copies).
    fn queue(
        &mut self,
        items: &[Item<'_>],
        results: &mut [Result<Plan>],
        arena: &mut DeviceBuffer<u8>,
    ) -> Result<()> {
        self.nv.shared.device.make_current()?;
        let base = arena.as_device_mut_ptr();
        let mut fallback = Vec::new();
        for route in [Route::Hardware, Route::Cuda] {
            let group: Vec<usize> = (0..items.len())
                .filter(|&i| matches!(&results[i], Ok(p) if p.route == route))
                .collect();
            if group.is_empty() {
                continue;
            }
            if let Err(e) = self.batch(route, items, results, &group, base) {
                // A batch fails as a whole: its images go to the CPU decoder one by one, which
                // names the bad one.
                let _ = e;
                fallback.extend(group);
            }
        }
        let cpu: Vec<usize> = (0..items.len())
            .filter(|&i| matches!(&results[i], Ok(p) if p.route == Route::Cpu))
            .chain(fallback)
            .collect();
        self.cpu(items, results, &cpu, arena)
    }

    /// Blocks until everything queued on the decoder's stream has run.
    fn wait_stream(&self) -> Result<()> {
        self.stream.record(&self.idle)?;
        self.idle.synchronize()
    }

    /// One nvJPEG batch of the images `group` (all of `route`) into the arena at `base`.
    fn batch(
        &mut self,
        route: Route,
        items: &[Item<'_>],
        plans: &[Result<Plan>],
        group: &[usize],
        base: *mut u8,
    ) -> Result<()> {
        let lib = self.lib;
        let mut params = Vec::with_capacity(group.len());
        for (k, &i) in group.iter().enumerate() {
            let p = self.params_at(k)?;
            if let (Ok(plan), Route::Hardware) = (&plans[i], route) {
                let r = plan.region;
                if r != Region::full(plan.height, plan.width) {
                    // SAFETY: a live params object; the region is inside the image (`plan`).
                    let s = unsafe {
                        lib.nvjpegDecodeParamsSetROI(
                            p,
                            r.left as i32,
                            r.top as i32,
                            r.width as i32,
                            r.height as i32,
                        )
                    };
                    check("nvjpegDecodeParamsSetROI", s)?;
                }
            }
            params.push(p);
        }
        let (handle, batcher) = match route {
            Route::Hardware => match (&self.nv.shared.hardware, &mut self.hardware) {
                (Some(h), Some(b)) => (h.raw, b),
                _ => {
                    return Err(Error::invalid(
                        "nvjpeg::GpuDecoder::decode",
                        "no hardware route",
                    ))
                }
            },
            _ => (self.nv.shared.cuda.raw, &mut self.cuda),
        };
        let state = batcher.state.raw.cast::<sys::nvjpegJpegState>();
        if batcher.initialized != Some(group.len()) {
            batcher.initialized = None;
            // SAFETY: live handle and state. One CPU thread: this one.
            let s = unsafe {
                lib.nvjpegDecodeBatchedInitialize(
                    handle,
                    state,
                    group.len() as i32,
                    1,
                    sys::nvjpegOutputFormat_t_NVJPEG_OUTPUT_RGBI,
                )
            };
            check("nvjpegDecodeBatchedInitialize", s)?;
            batcher.initialized = Some(group.len());
        }
        let mut data = Vec::with_capacity(group.len());
        let mut lengths = Vec::with_capacity(group.len());
        let mut images = Vec::with_capacity(group.len());
        for &i in group {
            let Ok(plan) = &plans[i] else { continue };
            data.push(items[i].data.as_ptr());
            lengths.push(items[i].data.len());
            let mut img = sys::nvjpegImage_t {
                channel: [ptr::null_mut(); 4],
                pitch: [0; 4],
            };
            // In bounds and not overlapping another image: checked by `decode`.
            img.channel[0] = base.wrapping_add(items[i].offset);
            img.pitch[0] = plan.region.width * 3;
            images.push(img);
        }
        // SAFETY: `data[k]` points at `lengths[k]` live bytes (the items' slices, borrowed until
        // `decode` has synchronized the stream); `images[k]` is `region.height` rows of
        // `pitch` bytes inside the arena, which nothing else uses now (waited for above); the
        // params, state and handle are live, the state initialized for this batch size.
        let s = unsafe {
            lib.nvjpegDecodeBatchedEx(
                handle,
                state,
                data.as_ptr(),
                lengths.as_ptr(),
                images.as_mut_ptr(),
                params.as_mut_ptr(),
                self.stream.as_raw().cast(),
            )
        };
        if s != 0 {
            batcher.initialized = None;
        }
        check("nvjpegDecodeBatchedEx", s)
    }

    /// Decodes the images `which` on the CPU into page-locked staging and copies each (its
    /// planned region) to the arena.
    fn cpu(
        &mut self,
        items: &[Item<'_>],
        results: &mut [Result<Plan>],
        which: &[usize],
        arena: &mut DeviceBuffer<u8>,
    ) -> Result<()> {
        if which.is_empty() {
            return Ok(());
        }
        let total: usize = which
            .iter()
            .filter_map(|&i| results[i].as_ref().ok())
            .map(|p| p.region.rgb_len())
            .sum();
        if self.staging.as_ref().is_none_or(|s| s.len() < total) {
            self.staging = None;
            let dev = self.nv.shared.device;
            self.staging = Some(PinnedBuffer::<u8>::new(
                &dev,
                total.max(1 << 20),
                HostAlloc::DEFAULT,
            )?);
        }
        let staging = self.staging.as_mut().expect("made above");
        let host = staging.as_mut_slice()?;
        let mut at = 0;
        let mut copies = Vec::new();
        for &i in which {
            let Ok(plan) = results[i] else { continue };
            let len = plan.region.rgb_len();
            let dst = &mut host[at..at + len];
            let same = |info: decode::ImageInfo| {
                if (info.height, info.width) == (plan.height, plan.width) {
                    Ok(())
                } else {
                    Err(bad_jpeg(format!(
                        "the file is not the {}x{} image it was planned as (changed since?)",
                        plan.height, plan.width
                    )))
                }
            };
            let r = if plan.region == Region::full(plan.height, plan.width) {
                // A larger image is refused before anything is written; a smaller one is
                // written in part and refused here.
                decode::decode_rgb_into(items[i].data, dst).and_then(same)
            } else {
                decode::decode_rgb(items[i].data).and_then(|(info, px)| {
                    same(info)?;
                    copy_region(&px, plan.width, plan.region, dst);
                    Ok(())
                })
            };
            match r {
                Ok(()) => {
                    let mut p = plan;
                    if p.route != Route::Cpu {
                        p.route = Route::Cpu;
                    }
                    results[i] = Ok(p);
                    copies.push((at, items[i].offset, len));
                }
                Err(e) => results[i] = Err(e),
            }
            at += len;
        }
        for (from, to, len) in copies {
            let src = staging.slice(from..from + len)?;
            let mut dst = arena.slice_mut(to..to + len)?;
            self.stream.copy_h2d(&src, &mut dst)?;
        }
        Ok(())
    }
}

/// The region decoded for a wanted one: widened by one MCU on every side (the chroma of the
/// wanted pixels is interpolated from its neighbours) and aligned to the MCU grid, within the
/// `h x w` image. Decoded so, its pixels equal those of the whole image decoded.
fn around(r: Region, (mh, mw): (usize, usize), h: usize, w: usize) -> Region {
    let top = r.top.saturating_sub(mh) / mh * mh;
    let left = r.left.saturating_sub(mw) / mw * mw;
    let bottom = (r.top + r.height)
        .saturating_add(mh)
        .div_ceil(mh)
        .saturating_mul(mh)
        .min(h);
    let right = (r.left + r.width)
        .saturating_add(mw)
        .div_ceil(mw)
        .saturating_mul(mw)
        .min(w);
    Region {
        top,
        left,
        height: bottom - top,
        width: right - left,
    }
}

/// Whether `r` lies on the MCU grid of an `h x w` image (its far edges may be the image's).
fn aligned(r: Region, (mh, mw): (usize, usize), h: usize, w: usize) -> bool {
    let (bottom, right) = (r.top + r.height, r.left + r.width);
    r.top % mh == 0
        && r.left % mw == 0
        && (bottom % mh == 0 || bottom == h)
        && (right % mw == 0 || right == w)
}

/// Copies `region` of the interleaved RGB image `px` (`width` columns) into `dst`.
fn copy_region(px: &[u8], width: usize, region: Region, dst: &mut [u8]) {
    let row = region.width * 3;
    for y in 0..region.height {
        let from = ((region.top + y) * width + region.left) * 3;
        dst[y * row..(y + 1) * row].copy_from_slice(&px[from..from + row]);
    }
}
