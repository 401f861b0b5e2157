//! What a normalize launch computes: the batch's shape, layouts, parameters and per-sample
//! options, validated on the host before anything is queued. Shared by the GPU launcher and the
//! CPU reference.

use crate::error::{Error, Result};

/// Memory layout of a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Layout {
    /// Channel planes: `[n][c][h][w]`.
    Nchw,
    /// Channels last: `[n][h][w][c]`.
    Nhwc,
}

impl Layout {
    pub(crate) fn code(self) -> i32 {
        match self {
            Layout::Nchw => crate::sys::PINSTREAM_NCHW as i32,
            Layout::Nhwc => crate::sys::PINSTREAM_NHWC as i32,
        }
    }
}

/// `out = scale * (x - mean[c]) / std[c] + shift`.
#[derive(Clone, Debug, PartialEq)]
pub struct Normalize {
    /// One per input channel.
    pub mean: Vec<f32>,
    /// One per input channel; non-zero and finite.
    pub std: Vec<f32>,
    /// Multiplies the normalized value (1 for plain standardization).
    pub scale: f32,
    /// Added last (0 for plain standardization).
    pub shift: f32,
}

impl Normalize {
    /// Per-channel mean and std, scale 1, shift 0.
    pub fn new(mean: &[f32], std: &[f32]) -> Normalize {
        Normalize {
            mean: mean.to_vec(),
            std: std.to_vec(),
            scale: 1.0,
            shift: 0.0,
        }
    }

    /// The ImageNet statistics on the 0..255 scale (RGB): mean 0.485/0.456/0.406 x 255,
    /// std 0.229/0.224/0.225 x 255.
    pub fn imagenet() -> Normalize {
        Normalize::new(
            &[0.485 * 255.0, 0.456 * 255.0, 0.406 * 255.0],
            &[0.229 * 255.0, 0.224 * 255.0, 0.225 * 255.0],
        )
    }

    /// The same with `scale` and `shift`.
    pub fn with_scale_shift(mut self, scale: f32, shift: f32) -> Normalize {
        self.scale = scale;
        self.shift = shift;
        self
    }

    /// Checks the statistics for `channels` channels: one mean and std per channel, finite,
    /// std non-zero, and `scale / std` finite; `scale` and `shift` finite. `Error::InvalidArgument`
    /// (naming `op`) otherwise; the kernels check this themselves before a launch.
    pub fn check(&self, op: &'static str, channels: usize) -> Result<()> {
        let bad = |reason: String| Err(Error::invalid(op, reason));
        let n = self;
        if n.mean.len() != channels || n.std.len() != channels {
            return bad(format!(
                "{} means and {} stds for {} channels",
                n.mean.len(),
                n.std.len(),
                channels
            ));
        }
        for (c, (&m, &s)) in n.mean.iter().zip(&n.std).enumerate() {
            if !m.is_finite() {
                return bad(format!("mean[{c}] = {m} is not finite"));
            }
            if !s.is_finite() || s == 0.0 {
                return bad(format!("std[{c}] = {s} must be finite and non-zero"));
            }
            if !(n.scale / s).is_finite() {
                return bad(format!(
                    "scale / std[{c}] = {} / {s} is not finite",
                    n.scale
                ));
            }
        }
        if !n.scale.is_finite() || !n.shift.is_finite() {
            return bad(format!(
                "scale {} and shift {} must be finite",
                n.scale, n.shift
            ));
        }
        Ok(())
    }

    /// `scale / std[c]` as the kernels use it (f32).
    pub(crate) fn k(&self, c: usize) -> f32 {
        self.scale / self.std[c]
    }
}

/// A window read from the source image.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Crop {
    /// Left column of the window in the source image.
    pub x: usize,
    /// Top row of the window in the source image.
    pub y: usize,
    /// Width of the window (the sample's output width).
    pub w: usize,
    /// Height of the window (the sample's output height).
    pub h: usize,
}

/// One sample of a batch: its source size, and optionally a crop window and a horizontal mirror.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sample {
    /// Source height in pixels.
    pub h: usize,
    /// Source width in pixels.
    pub w: usize,
    /// Read only this window of the source (`None`: all of it).
    pub crop: Option<Crop>,
    /// Mirror the output horizontally (after the crop).
    pub mirror: bool,
}

impl Sample {
    /// A whole `h x w` source image: no crop, no mirror.
    pub fn new(h: usize, w: usize) -> Sample {
        Sample {
            h,
            w,
            crop: None,
            mirror: false,
        }
    }

    /// Output height and width (the crop's, or the source's).
    pub fn out_hw(&self) -> (usize, usize) {
        self.crop.map_or((self.h, self.w), |c| (c.h, c.w))
    }
}

/// A batch to normalize: samples packed back to back in the input (each `c x h x w` in the input
/// layout) and in the output (each `c_out x out_h x out_w` in the output layout).
///
/// Building and checking a `Spec` needs no GPU; [`cpu::normalize`](super::cpu::normalize) runs
/// it on the host:
///
/// ```
/// use pinstream::kernels::{cpu, Crop, Layout, Normalize, Spec};
/// # fn main() -> pinstream::Result<()> {
/// // Two gray images of different sizes; the second cropped to 2 x 2 and mirrored.
/// let mut spec = Spec::variable(1, &[(2, 3), (4, 4)], Normalize::new(&[127.5], &[127.5]))
///     .layouts(Layout::Nhwc, Layout::Nchw);
/// spec.samples[1].crop = Some(Crop { x: 1, y: 1, w: 2, h: 2 });
/// spec.samples[1].mirror = true;
/// spec.validate("example")?;
/// assert_eq!((spec.input_len()?, spec.output_len()?), (6 + 16, 6 + 4));
/// let pixels: Vec<u8> = (0..22).map(|i| (i * 10) as u8).collect();
/// let mut out = vec![0f32; spec.output_len()?];
/// cpu::normalize(&pixels, &spec, None, &mut out)?;
/// assert_eq!(out[0], -1.0); // (0 - 127.5) / 127.5
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct Spec {
    /// Input channels, 1..=4.
    pub channels: usize,
    /// The samples, in the order they are packed in the input and the output.
    pub samples: Vec<Sample>,
    /// Layout of each input sample.
    pub in_layout: Layout,
    /// Layout of each output sample (a transpose from the input layout is fused).
    pub out_layout: Layout,
    /// `Some(fill)`: the output has 4 channels, the missing ones set to `fill`.
    pub pad_to_4: Option<f32>,
    /// The per-channel statistics and the affine map applied to every element.
    pub norm: Normalize,
}

impl Spec {
    /// `n` samples of `c x h x w`, NCHW in and out. Nothing is checked but that the host can
    /// hold `n` samples: `Error::InvalidArgument` where it cannot (`n` near `usize::MAX`), not a
    /// panic or an abort. [`validate`](Spec::validate) checks the rest.
    pub fn uniform(n: usize, c: usize, h: usize, w: usize, norm: Normalize) -> Result<Spec> {
        let mut samples = crate::error::try_vec("Spec::uniform", n)?;
        samples.resize(n, Sample::new(h, w));
        Ok(Spec {
            channels: c,
            samples,
            in_layout: Layout::Nchw,
            out_layout: Layout::Nchw,
            pad_to_4: None,
            norm,
        })
    }

    /// One sample per `(h, w)`, NCHW in and out.
    pub fn variable(c: usize, sizes: &[(usize, usize)], norm: Normalize) -> Spec {
        Spec {
            channels: c,
            samples: sizes.iter().map(|&(h, w)| Sample::new(h, w)).collect(),
            in_layout: Layout::Nchw,
            out_layout: Layout::Nchw,
            pad_to_4: None,
            norm,
        }
    }

    /// Sets the layouts.
    pub fn layouts(mut self, input: Layout, output: Layout) -> Spec {
        self.in_layout = input;
        self.out_layout = output;
        self
    }

    /// Pads the output to 4 channels with `fill`.
    pub fn pad_to_4(mut self, fill: f32) -> Spec {
        self.pad_to_4 = Some(fill);
        self
    }

    /// Output channels.
    pub fn out_channels(&self) -> usize {
        if self.pad_to_4.is_some() {
            4
        } else {
            self.channels
        }
    }

    /// Input elements of the whole batch (`channels x h x w` summed over the samples), or
    /// `Error::InvalidArgument` where that does not fit in `usize`.
    pub fn input_len(&self) -> Result<usize> {
        checked_total(
            "Spec::input_len",
            self.samples.iter().map(|s| [self.channels, s.h, s.w]),
        )
    }

    /// Output elements of the whole batch, or `Error::InvalidArgument` where that does not fit
    /// in `usize`.
    pub fn output_len(&self) -> Result<usize> {
        let co = self.out_channels();
        checked_total(
            "Spec::output_len",
            self.samples.iter().map(|s| {
                let (h, w) = s.out_hw();
                [co, h, w]
            }),
        )
    }

    /// Whether every sample has the same source size, without crop or mirror.
    pub fn is_uniform(&self) -> bool {
        let first = self.samples.first();
        self.samples
            .iter()
            .all(|s| s.crop.is_none() && !s.mirror && Some((s.h, s.w)) == first.map(|f| (f.h, f.w)))
    }

    /// (input offset, output offset) of each sample, in elements, or `Error::InvalidArgument`
    /// where an offset (or the end of the batch) does not fit in `usize`.
    pub fn offsets(&self) -> Result<Vec<(usize, usize)>> {
        const OP: &str = "Spec::offsets";
        let co = self.out_channels();
        let (mut i, mut o) = (0usize, 0usize);
        let mut v = crate::error::try_vec(OP, self.samples.len())?;
        for s in &self.samples {
            v.push((i, o));
            let (h, w) = s.out_hw();
            i = checked_total(OP, [[self.channels, s.h, s.w], [1, 1, i]])?;
            o = checked_total(OP, [[co, h, w], [1, 1, o]])?;
        }
        Ok(v)
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
        self.norm.check(op, self.channels)?;
        if let Some(f) = self.pad_to_4 {
            if !f.is_finite() {
                return bad(format!("pad fill {f} is not finite"));
            }
        }
        for (i, s) in self.samples.iter().enumerate() {
            if s.h == 0 || s.w == 0 {
                return bad(format!("sample {i} is {}x{}: empty", s.h, s.w));
            }
            if s.h > i32::MAX as usize
                || s.w > i32::MAX as usize
                || s.h.checked_mul(s.w).is_none_or(|p| p > u32::MAX as usize)
            {
                return bad(format!("sample {i} is {}x{}: too large", s.h, s.w));
            }
            if let Some(c) = s.crop {
                let inside = c.w > 0
                    && c.h > 0
                    && c.x.checked_add(c.w).is_some_and(|r| r <= s.w)
                    && c.y.checked_add(c.h).is_some_and(|b| b <= s.h);
                if !inside {
                    return bad(format!(
                        "sample {i}: crop {}x{} at ({}, {}) is outside the {}x{} image",
                        c.w, c.h, c.x, c.y, s.w, s.h
                    ));
                }
            }
        }
        // The totals: every sample fits, but the batch must too.
        check_totals(op, self.input_len(), self.output_len())
    }
}

/// The batch as a whole: both lengths computable, and within what any allocation can hold
/// (isize::MAX bytes, with output elements of up to 4 bytes).
fn check_totals(op: &'static str, input: Result<usize>, output: Result<usize>) -> Result<()> {
    let fits = |n: usize, bytes: usize| {
        n.checked_mul(bytes)
            .is_some_and(|b| b <= isize::MAX as usize)
    };
    match (input, output) {
        (Ok(i), Ok(o)) if fits(i, 1) && fits(o, 4) => Ok(()),
        (Ok(i), Ok(o)) => Err(Error::invalid(
            op,
            format!("the batch has {i} input and {o} output elements: too large"),
        )),
        (Err(e), _) | (_, Err(e)) => Err(Error::invalid(
            op,
            format!("the batch's size cannot be computed: {e}"),
        )),
    }
}

/// `sum(a * b * c)` over `sizes`, or `Error::InvalidArgument` where a product or the sum
/// overflows `usize`.
pub(crate) fn checked_total(
    op: &'static str,
    sizes: impl IntoIterator<Item = [usize; 3]>,
) -> Result<usize> {
    let mut total = 0usize;
    for (i, [a, b, c]) in sizes.into_iter().enumerate() {
        total = a
            .checked_mul(b)
            .and_then(|ab| ab.checked_mul(c))
            .and_then(|abc| total.checked_add(abc))
            .ok_or_else(|| {
                Error::invalid(
                    op,
                    format!("the element count overflows usize at sample {i} ({a} x {b} x {c})"),
                )
            })?;
    }
    Ok(total)
}

/// A crop of a source image in its pixel coordinates: rows `top .. top + height`, columns
/// `left .. left + width` (fractional for resize-then-crop boxes), mirrored left-right when
/// `flip`. The box is resized to the output size
/// ([`kernels::resized_crop`](crate::kernels::resized_crop)).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CropBox {
    /// First row.
    pub top: f32,
    /// First column.
    pub left: f32,
    /// Rows covered (> 0).
    pub height: f32,
    /// Columns covered (> 0).
    pub width: f32,
    /// Mirror left-right.
    pub flip: bool,
    /// Where the resampling filter stops. `true`: at the box's edges, as when the box is cut
    /// out first and then resized (torchvision's `RandomResizedCrop`; the box is then widened
    /// to whole pixels). `false`: at the image's edges, as when the whole image is resized
    /// and then cropped (`Resize` + `CenterCrop`): pixels just outside the box count too.
    pub clamp_to_box: bool,
}

impl CropBox {
    /// The box of torchvision's validation transform, `Resize(resize)` (the shorter side to
    /// `resize`, the longer scaled and truncated as torchvision does) then
    /// `CenterCrop(crop)`, in the source's coordinates. `Error::InvalidArgument` for an empty
    /// image, sizes of 0, or a crop larger than the resized image.
    pub fn center(height: usize, width: usize, resize: usize, crop: usize) -> Result<CropBox> {
        const OP: &str = "kernels::CropBox::center";
        if height == 0 || width == 0 || resize == 0 || crop == 0 {
            return Err(Error::invalid(
                OP,
                format!("image {height}x{width}, resize {resize}, crop {crop}: sizes must be > 0"),
            ));
        }
        let (h, w) = (height as f64, width as f64);
        // torchvision: the shorter side becomes `resize`, the longer `int(resize * long / short)`.
        let (rh, rw) = if height <= width {
            (resize as f64, (resize as f64 * w / h).trunc())
        } else {
            ((resize as f64 * h / w).trunc(), resize as f64)
        };
        let c = crop as f64;
        if c > rh || c > rw {
            return Err(Error::invalid(
                OP,
                format!("crop {crop} is larger than the resized image {rh}x{rw}"),
            ));
        }
        // CenterCrop: top = int(round((rh - c) / 2)), Python's round (half to even).
        let top = ((rh - c) / 2.0).round_ties_even();
        let left = ((rw - c) / 2.0).round_ties_even();
        let (sy, sx) = (h / rh, w / rw);
        Ok(CropBox {
            top: (top * sy) as f32,
            left: (left * sx) as f32,
            height: (c * sy) as f32,
            width: (c * sx) as f32,
            flip: false,
            clamp_to_box: false,
        })
    }
}

/// Checks that `spec` is something `denormalize` handles: a uniform batch, one layout, no pad.
pub(crate) fn check_denormalize_spec(op: &'static str, spec: &Spec) -> Result<()> {
    spec.validate(op)?;
    if !spec.is_uniform() || spec.in_layout != spec.out_layout || spec.pad_to_4.is_some() {
        return Err(Error::invalid(
            op,
            "denormalize takes a uniform batch in one layout, without crops, mirrors or padding",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
