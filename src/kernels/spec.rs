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
    pub scale: f32,
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

    /// `scale / std[c]` as the kernels use it (f32).
    pub(crate) fn k(&self, c: usize) -> f32 {
        self.scale / self.std[c]
    }
}

/// A window read from the source image.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Crop {
    pub x: usize,
    pub y: usize,
    pub w: usize,
    pub h: usize,
}

/// One sample of a batch: its source size, and optionally a crop window and a horizontal mirror.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sample {
    pub h: usize,
    pub w: usize,
    pub crop: Option<Crop>,
    pub mirror: bool,
}

impl Sample {
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
#[derive(Clone, Debug, PartialEq)]
pub struct Spec {
    /// Input channels, 1..=4.
    pub channels: usize,
    pub samples: Vec<Sample>,
    pub in_layout: Layout,
    pub out_layout: Layout,
    /// `Some(fill)`: the output has 4 channels, the missing ones set to `fill`.
    pub pad_to_4: Option<f32>,
    pub norm: Normalize,
}

impl Spec {
    /// `n` samples of `c x h x w`, NCHW in and out.
    pub fn uniform(n: usize, c: usize, h: usize, w: usize, norm: Normalize) -> Spec {
        Spec {
            channels: c,
            samples: vec![Sample::new(h, w); n],
            in_layout: Layout::Nchw,
            out_layout: Layout::Nchw,
            pad_to_4: None,
            norm,
        }
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

    /// Input elements of sample `i` and of the whole batch.
    pub fn input_len(&self) -> usize {
        self.samples.iter().map(|s| self.channels * s.h * s.w).sum()
    }

    /// Output elements of the whole batch.
    pub fn output_len(&self) -> usize {
        self.samples
            .iter()
            .map(|s| {
                let (h, w) = s.out_hw();
                self.out_channels() * h * w
            })
            .sum()
    }

    /// Whether every sample has the same source size, without crop or mirror.
    pub fn is_uniform(&self) -> bool {
        let first = self.samples.first();
        self.samples
            .iter()
            .all(|s| s.crop.is_none() && !s.mirror && Some((s.h, s.w)) == first.map(|f| (f.h, f.w)))
    }

    /// (input offset, output offset) of each sample, in elements.
    pub fn offsets(&self) -> Vec<(usize, usize)> {
        let (mut i, mut o) = (0, 0);
        self.samples
            .iter()
            .map(|s| {
                let r = (i, o);
                let (h, w) = s.out_hw();
                i += self.channels * s.h * s.w;
                o += self.out_channels() * h * w;
                r
            })
            .collect()
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
        let n = &self.norm;
        if n.mean.len() != self.channels || n.std.len() != self.channels {
            return bad(format!(
                "{} means and {} stds for {} channels",
                n.mean.len(),
                n.std.len(),
                self.channels
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
        Ok(())
    }
}
