//! Random crop boxes for the resized-crop trials and bench: torchvision's
//! `RandomResizedCrop.get_params` (scale 0.08..1, ratio 3/4..4/3, ten tries, then the centre
//! crop) plus a coin-flip mirror, in whole pixels with the filter stopping at the box's edges.
//! The kernels take any `CropBox`; the training feed's own sampler is pinstream-vision's
//! `augment::RandomResizedCrop`, which these boxes follow.

use pinstream::kernels::CropBox;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// A seeded generator of boxes (`seed`, `stream`: independent sequences).
pub struct BoxRng(SmallRng);

impl BoxRng {
    pub fn new(seed: u64, stream: u64) -> BoxRng {
        BoxRng(SmallRng::seed_from_u64(
            seed ^ stream.wrapping_mul(0x9e37_79b9_7f4a_7c15),
        ))
    }
}

/// torchvision's defaults: scale (0.08, 1), ratio (3/4, 4/3), mirror with probability 1/2.
pub struct RandomResizedCrop {
    flip_p: f64,
}

impl Default for RandomResizedCrop {
    fn default() -> Self {
        RandomResizedCrop { flip_p: 0.5 }
    }
}

impl RandomResizedCrop {
    pub fn sample(
        &self,
        rng: &mut BoxRng,
        height: usize,
        width: usize,
    ) -> pinstream::Result<CropBox> {
        if height == 0 || width == 0 {
            return Err(pinstream::Error::invalid(
                "boxes::RandomResizedCrop::sample",
                format!("image {height}x{width} is empty"),
            ));
        }
        let (ratio, scale) = ((3.0f64 / 4.0, 4.0f64 / 3.0), (0.08f64, 1.0f64));
        let (hf, wf) = (height as f64, width as f64);
        let mut window = None;
        for _ in 0..10 {
            let target = hf * wf * rng.0.random_range(scale.0..scale.1);
            let aspect = rng.0.random_range(ratio.0.ln()..ratio.1.ln()).exp();
            let w = (target * aspect).sqrt().round_ties_even();
            let h = (target / aspect).sqrt().round_ties_even();
            if w > 0.0 && w <= wf && h > 0.0 && h <= hf {
                let (h, w) = (h as usize, w as usize);
                let top = rng.0.random_range(0..=height - h);
                let left = rng.0.random_range(0..=width - w);
                window = Some((top, left, h, w));
                break;
            }
        }
        let (top, left, h, w) = window.unwrap_or_else(|| {
            let in_ratio = wf / hf;
            let (h, w) = if in_ratio < ratio.0 {
                (
                    ((wf / ratio.0).round_ties_even() as usize).clamp(1, height),
                    width,
                )
            } else if in_ratio > ratio.1 {
                (
                    height,
                    ((hf * ratio.1).round_ties_even() as usize).clamp(1, width),
                )
            } else {
                (height, width)
            };
            ((height - h) / 2, (width - w) / 2, h, w)
        });
        Ok(CropBox {
            top: top as f32,
            left: left as f32,
            height: h as f32,
            width: w as f32,
            flip: rng.0.random_bool(self.flip_p),
            clamp_to_box: true,
        })
    }
}
