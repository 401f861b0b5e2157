//! The fused resized crop (`cuda/resize.cu`): every sample's crop box of its own source image,
//! resampled to one output size, mirrored, normalized and cast in one launch. What torchvision
//! spells `RandomResizedCrop(224)` + `RandomHorizontalFlip()` + `ToTensor()` + `Normalize(...)`
//! (or `Resize(256)` + `CenterCrop(224)` + ... for validation), on the GPU, for a whole batch.
//!
//! The source images are u8, of any sizes, anywhere in one input buffer (a packed arena of
//! decoded images); the output is `n x c x out_h x out_w` (or NHWC). The filter is bilinear,
//! widened by the scale where it downscales with `antialias` (torchvision's `antialias=True`
//! and PIL's convention); [`cpu::resized_crop`](super::cpu::resized_crop) is its f64 reference.
//!
//! ```
//! use pinstream::kernels::{cpu, CropBox, Normalize, ResizeSpec};
//! # fn main() -> pinstream::Result<()> {
//! // Two RGB images (HWC u8) back to back: 30 x 40 and 20 x 20.
//! let pixels: Vec<u8> = (0..(30 * 40 + 20 * 20) * 3).map(|i| (i * 7 % 251) as u8).collect();
//! let mut spec = ResizeSpec::new(3, 16, 16, Normalize::imagenet());
//! // A random crop box (pinstream-vision's `RandomResizedCrop` makes these), mirrored:
//! let random = CropBox { top: 3.0, left: 5.5, height: 20.0, width: 24.0, flip: true, clamp_to_box: true };
//! spec.push(0, 30, 40, random);
//! spec.push(30 * 40 * 3, 20, 20, CropBox::center(20, 20, 18, 16)?);
//! let mut out = vec![0f32; spec.output_len()?];      // 2 x 3 x 16 x 16, NCHW
//! cpu::resized_crop(&pixels, &spec, &mut out)?;      // the GPU: kernels::resized_crop
//! # Ok(()) }
//! ```

use super::element::{check_element, Element, OutputElement};
use super::spec::{CropBox, Layout, Normalize};
use crate::error::{check_with, Error, Result};
use crate::memory::tracker::{self, Access};
use crate::memory::{DeviceSlice, DeviceSliceMut};
use crate::stream::Stream;
use crate::sys;

// SAFETY: plain C struct (56 bytes: one u64, then six i32, four f32 and two i32; no padding);
// any bit pattern is valid.
unsafe impl bytemuck::Zeroable for sys::pinstream_rrc_sample {}
// SAFETY: as above.
unsafe impl bytemuck::Pod for sys::pinstream_rrc_sample {}

/// The largest source side (2^24 pixels): positions within it are exact in f32.
pub const MAX_SIDE: usize = 1 << 24;

/// The largest output side: the launch's grid covers 65535 tiles of 16 rows.
pub const MAX_OUT_SIDE: usize = 65535 * 16;

/// One output sample: its source image (`height x width x channels` u8 at `offset` elements
/// into the input, in the spec's input layout) and the box of it to resample.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ResizeSample {
    /// First input element of the source image.
    pub offset: usize,
    /// Source height in pixels.
    pub height: usize,
    /// Source width in pixels.
    pub width: usize,
    /// The box, its mirror, and where the filter stops.
    pub crop: CropBox,
}

/// A batch for [`resized_crop`]: one output size, the samples' sources and boxes, layouts,
/// channel padding, the normalization and the filter.
#[derive(Clone, Debug, PartialEq)]
pub struct ResizeSpec {
    /// Channels of every source image, 1..=4.
    pub channels: usize,
    /// Output height of every sample.
    pub out_h: usize,
    /// Output width of every sample.
    pub out_w: usize,
    /// The samples, in output order.
    pub samples: Vec<ResizeSample>,
    /// Layout of each source image (`Nhwc`: interleaved, as decoders write).
    pub in_layout: Layout,
    /// Layout of the output batch.
    pub out_layout: Layout,
    /// `Some(fill)`: 4 output channels, the missing ones set to `fill`.
    pub pad_to_4: Option<f32>,
    /// `out = scale * (v - mean[c]) / std[c] + shift`, `v` on the input's 0..255 scale.
    pub norm: Normalize,
    /// Widen the filter by the scale where it downscales (torchvision's and PIL's antialiased
    /// bilinear). `false`: plain two-tap bilinear, like `interpolate(mode="bilinear")`.
    pub antialias: bool,
}

impl ResizeSpec {
    /// No samples yet, `channels` interleaved (HWC) input, NCHW output of `out_h x out_w`,
    /// antialiased, no padding.
    pub fn new(channels: usize, out_h: usize, out_w: usize, norm: Normalize) -> ResizeSpec {
        ResizeSpec {
            channels,
            out_h,
            out_w,
            samples: Vec::new(),
            in_layout: Layout::Nhwc,
            out_layout: Layout::Nchw,
            pad_to_4: None,
            norm,
            antialias: true,
        }
    }

    /// Sets the layouts.
    pub fn layouts(mut self, input: Layout, output: Layout) -> ResizeSpec {
        self.in_layout = input;
        self.out_layout = output;
        self
    }

    /// Pads the output to 4 channels with `fill`.
    pub fn pad_to_4(mut self, fill: f32) -> ResizeSpec {
        self.pad_to_4 = Some(fill);
        self
    }

    /// Turns the antialiasing of downscales on or off.
    pub fn antialias(mut self, on: bool) -> ResizeSpec {
        self.antialias = on;
        self
    }

    /// Adds a sample: the `height x width` image at `offset`, resampled from `crop`.
    pub fn push(&mut self, offset: usize, height: usize, width: usize, crop: CropBox) {
        self.samples.push(ResizeSample {
            offset,
            height,
            width,
            crop,
        });
    }

    /// Output channels.
    pub fn out_channels(&self) -> usize {
        if self.pad_to_4.is_some() {
            4
        } else {
            self.channels
        }
    }

    /// Output elements of one sample, or `Error::InvalidArgument` where that overflows.
    pub fn sample_len(&self) -> Result<usize> {
        super::spec::checked_total(
            "ResizeSpec::sample_len",
            [[self.out_channels(), self.out_h, self.out_w]],
        )
    }

    /// Output elements of the batch, or `Error::InvalidArgument` where that overflows.
    pub fn output_len(&self) -> Result<usize> {
        self.sample_len()?
            .checked_mul(self.samples.len())
            .ok_or_else(|| {
                Error::invalid(
                    "ResizeSpec::output_len",
                    format!(
                        "{} samples of {} elements overflow usize",
                        self.samples.len(),
                        self.sample_len().unwrap_or(0)
                    ),
                )
            })
    }

    /// The least input length the samples need: the end of the furthest source image.
    pub fn input_extent(&self) -> Result<usize> {
        const OP: &str = "ResizeSpec::input_extent";
        let mut end = 0usize;
        for (i, s) in self.samples.iter().enumerate() {
            let e = super::spec::checked_total(OP, [[self.channels, s.height, s.width]])?
                .checked_add(s.offset)
                .ok_or_else(|| {
                    Error::invalid(
                        OP,
                        format!(
                            "sample {i}: offset {} + its image overflows usize",
                            s.offset
                        ),
                    )
                })?;
            end = end.max(e);
        }
        Ok(end)
    }

    /// Every check that can be made on the host.
    pub fn validate(&self, op: &'static str) -> Result<()> {
        let bad = |reason: String| Err(Error::invalid(op, reason));
        if !(1..=4).contains(&self.channels) {
            return bad(format!("{} channels (1 to 4 are supported)", self.channels));
        }
        if self.samples.is_empty() {
            return bad("the batch has no samples".into());
        }
        if self.samples.len() > i32::MAX as usize {
            return bad(format!("{} samples is too many", self.samples.len()));
        }
        if !(1..=MAX_OUT_SIDE).contains(&self.out_h) || !(1..=MAX_OUT_SIDE).contains(&self.out_w) {
            return bad(format!(
                "output {}x{}: each side must be 1 to {MAX_OUT_SIDE}",
                self.out_h, self.out_w
            ));
        }
        self.norm.check(op, self.channels)?;
        if let Some(f) = self.pad_to_4 {
            if !f.is_finite() {
                return bad(format!("pad fill {f} is not finite"));
            }
        }
        for (i, s) in self.samples.iter().enumerate() {
            if let Err(reason) = window(s, self.out_h, self.out_w) {
                return bad(format!("sample {i}: {reason}"));
            }
        }
        let fits = |n: usize, bytes: usize| {
            n.checked_mul(bytes)
                .is_some_and(|b| b <= isize::MAX as usize)
        };
        match (self.input_extent(), self.output_len()) {
            (Ok(i), Ok(o)) if fits(i, 1) && fits(o, 4) => Ok(()),
            (Ok(i), Ok(o)) => bad(format!(
                "the batch needs {i} input and {o} output elements: too large"
            )),
            (Err(e), _) | (_, Err(e)) => bad(format!("the batch's size cannot be computed: {e}")),
        }
    }
}

/// How one sample maps into its source: the window the filter may read (`y0, x0, h, w`, whole
/// pixels inside the image) and the box's start and scale per axis.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Mapping {
    pub(crate) win: [usize; 4],
    pub(crate) top: f32,
    pub(crate) left: f32,
    pub(crate) scale_y: f32,
    pub(crate) scale_x: f32,
}

/// The mapping of `s` to an `out_h x out_w` output, or why the sample is refused: an empty or
/// too large image, a box that is not finite, smaller than 1/1024 pixel, or not inside the image (beyond a
/// rounding tolerance of 1/64 pixel, or 2^-20 of the side for sides past 16384).
pub(crate) fn window(
    s: &ResizeSample,
    out_h: usize,
    out_w: usize,
) -> std::result::Result<Mapping, String> {
    let (h, w) = (s.height, s.width);
    if h == 0 || w == 0 {
        return Err(format!("image {h}x{w} is empty"));
    }
    if h > MAX_SIDE || w > MAX_SIDE {
        return Err(format!(
            "image {h}x{w}: sides above {MAX_SIDE} are not supported"
        ));
    }
    let c = &s.crop;
    let axis = |start: f32, len: f32, side: usize, out: usize, name: &str| {
        let tol = (side as f64 / (1u64 << 20) as f64).max(1.0 / 64.0);
        let (start, len) = (f64::from(start), f64::from(len));
        let inside = start.is_finite()
            && len.is_finite()
            && len >= 1.0 / 1024.0
            && start >= -tol
            && start + len <= side as f64 + tol;
        let scale = (len / out as f64) as f32;
        if !inside || scale.is_nan() || scale <= 0.0 || !scale.is_finite() {
            return Err(format!(
                "box {name} {start} + {len} is not a range of at least 1/1024 pixel inside 0..{side}"
            ));
        }
        Ok(scale)
    };
    let scale_y = axis(c.top, c.height, h, out_h, "rows")?;
    let scale_x = axis(c.left, c.width, w, out_w, "columns")?;
    let span = |start: f32, len: f32, side: usize| {
        if c.clamp_to_box {
            let lo = f64::from(start).floor().max(0.0) as usize;
            let hi = (f64::from(start) + f64::from(len)).ceil().min(side as f64) as usize;
            let lo = lo.min(side - 1);
            (lo, hi.max(lo + 1) - lo)
        } else {
            (0, side)
        }
    };
    let (y0, wh) = span(c.top, c.height, h);
    let (x0, ww) = span(c.left, c.width, w);
    Ok(Mapping {
        win: [y0, x0, wh, ww],
        top: c.top,
        left: c.left,
        scale_y,
        scale_x,
    })
}

/// The kernel's per-sample table (validated spec).
fn rows(spec: &ResizeSpec) -> Result<Vec<sys::pinstream_rrc_sample>> {
    const OP: &str = "kernels::resized_crop";
    let mut v = crate::error::try_vec(OP, spec.samples.len())?;
    for s in &spec.samples {
        let m = window(s, spec.out_h, spec.out_w).map_err(|r| Error::invalid(OP, r))?;
        v.push(sys::pinstream_rrc_sample {
            in_offset: s.offset as u64,
            src_h: s.height as i32,
            src_w: s.width as i32,
            win_y: m.win[0] as i32,
            win_x: m.win[1] as i32,
            win_h: m.win[2] as i32,
            win_w: m.win[3] as i32,
            top: m.top,
            left: m.left,
            scale_y: m.scale_y,
            scale_x: m.scale_x,
            mirror: i32::from(s.crop.flip),
            reserved: 0,
        });
    }
    Ok(v)
}

/// Resamples every sample's box of `input` to `spec.out_h x spec.out_w`, mirrors, normalizes
/// and casts into `output` (`spec.output_len()` elements of `O`), in one launch on `stream`.
/// `input` must hold at least `spec.input_extent()` bytes. Every argument is checked before
/// anything is queued (`Error::InvalidArgument`, `Error::LengthMismatch`,
/// `Error::WrongDevice`); the call does not wait for the stream.
///
/// ```no_run
/// use pinstream::kernels::{self, CropBox, Normalize, ResizeSpec};
/// use pinstream::{bf16, Device, DeviceBuffer};
/// # fn main() -> pinstream::Result<()> {
/// let dev = Device::get(0)?;
/// let stream = dev.stream()?;
/// let (h, w) = (375, 500);
/// let image = vec![90u8; h * w * 3];                 // one decoded RGB image
/// let mut d_in = DeviceBuffer::<u8>::new(&dev, image.len())?;
/// stream.copy_h2d(&image[..], &mut d_in)?;
/// let mut spec = ResizeSpec::new(3, 224, 224, Normalize::imagenet());
/// // Resize(256) + CenterCrop(224); pinstream-vision's `RandomResizedCrop` makes training boxes.
/// spec.push(0, h, w, CropBox::center(h, w, 256, 224)?);
/// let mut out = DeviceBuffer::<bf16>::new(&dev, spec.output_len()?)?;
/// kernels::resized_crop(&stream, &d_in, &spec, &mut out)?;
/// # Ok(()) }
/// ```
pub fn resized_crop<O, I, D>(
    stream: &Stream,
    input: &I,
    spec: &ResizeSpec,
    output: &mut D,
) -> Result<()>
where
    O: OutputElement,
    I: DeviceSlice<u8> + ?Sized,
    D: DeviceSliceMut<O> + ?Sized,
{
    const OP: &str = "kernels::resized_crop";
    spec.validate(OP)?;
    let (i, o) = (input.device_region(), output.device_region());
    let (need, out_len) = (spec.input_extent()?, spec.output_len()?);
    if i.len < need {
        return Err(Error::LengthMismatch {
            op: OP,
            src: i.len,
            dst: need,
        });
    }
    if o.len != out_len {
        return Err(Error::LengthMismatch {
            op: OP,
            src: out_len,
            dst: o.len,
        });
    }
    check_element::<O>(OP, o.ptr)?;
    stream.same_device(OP, i.device)?;
    stream.same_device(OP, o.device)?;
    let n = &spec.norm;
    let mut mean = [0f32; 4];
    let mut k = [0f32; 4];
    for c in 0..spec.channels {
        mean[c] = n.mean[c];
        k[c] = n.k(c);
    }
    let table = rows(spec)?;
    let placed = super::table::place(OP, stream, &table, sys::PINSTREAM_RRC_PARAM_ROWS as usize)?;
    let args = sys::pinstream_rrc_args {
        in_: i.ptr.cast_const().cast(),
        out: o.ptr,
        samples: placed.device.cast(),
        mean,
        k,
        shift: n.shift,
        fill: spec.pad_to_4.unwrap_or(0.0),
        n: spec.samples.len() as i32,
        c_in: spec.channels as i32,
        c_out: spec.out_channels() as i32,
        out_h: spec.out_h as i32,
        out_w: spec.out_w as i32,
        in_layout: spec.in_layout.code(),
        out_layout: spec.out_layout.code(),
        antialias: i32::from(spec.antialias),
    };
    let mut trackers = vec![(i.tracker, Access::Read), (o.tracker, Access::Write)];
    if let Some(t) = placed.tracker() {
        // Written just before by the table's copy on this stream.
        trackers.push((t, Access::Write));
    }
    let param_rows = placed.param;
    stream.enter()?;
    tracker::ordered_rw(stream, &trackers, || {
        // SAFETY: `args.in_` addresses at least `input_extent()` bytes and `args.out`
        // `output_len()` elements of `O` (aligned, checked) on this stream's device, kept alive
        // by the borrows and afterwards by the trackers; every row's window lies inside its
        // image, and every image inside the input (validated). `args.samples` is null and
        // `param_rows` the live table of at most PINSTREAM_RRC_PARAM_ROWS rows, which the
        // launcher copies before it returns, or `args.samples` is the stream's scratch holding
        // the uploaded table (tracked) and `param_rows` null.
        check_with(
            unsafe {
                sys::pinstream_resized_crop(
                    &args,
                    param_rows,
                    <O as Element>::CODE,
                    stream.as_raw(),
                )
            },
            "pinstream_resized_crop",
            || {
                format!(
                    "{} samples x {} channels to {}x{}, {:?} -> {:?}, {}",
                    spec.samples.len(),
                    spec.channels,
                    spec.out_h,
                    spec.out_w,
                    spec.in_layout,
                    spec.out_layout,
                    O::NAME
                )
            },
        )
    })
    .map(|_| ())
}
