//! Where to crop: torchvision's `RandomResizedCrop` and the validation transform
//! (`Resize(r)` + `CenterCrop(c)`) as crop boxes in the source image's pixel coordinates, drawn
//! from a seeded generator that gives the same boxes on every machine.
//!
//! ```
//! use pinstream::kernels::CropBox;
//! use pinstream_vision::augment::{RandomResizedCrop, Rng};
//! let rrc = RandomResizedCrop::default();          // scale (0.08, 1), ratio (3/4, 4/3)
//! let mut rng = Rng::new(42, 0);                   // seed, stream (e.g. the epoch)
//! let b: CropBox = rrc.sample(&mut rng, 375, 500).unwrap();
//! assert!(b.top >= 0.0 && b.top + b.height <= 375.0);
//! let v = CropBox::center(375, 500, 256, 224).unwrap(); // Resize(256) + CenterCrop(224)
//! assert!((v.height - 224.0 * 375.0 / 256.0).abs() < 1e-3);
//! ```

use pinstream::kernels::CropBox;
use pinstream::{Error, Result};

/// One 64-bit stream number from two (an epoch and a batch, say), by SplitMix64 of each: no
/// two pairs met in practice share one, unlike `(a << 32) ^ b`.
pub fn mix(a: u64, b: u64) -> u64 {
    let mut x = a;
    let ha = splitmix(&mut x);
    let mut y = b ^ ha;
    splitmix(&mut y)
}

/// A small, fast, seeded generator (xoshiro256**, seeded through SplitMix64): the same seed and
/// stream give the same numbers on every machine. `stream` separates sequences of one seed
/// (the epoch, a loader thread).
#[derive(Clone, Debug)]
pub struct Rng {
    s: [u64; 4],
}

fn splitmix(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Rng {
    /// The generator of `seed` and `stream`.
    pub fn new(seed: u64, stream: u64) -> Rng {
        let mut t = stream.wrapping_mul(0xd1b5_4a32_d192_ed03);
        let mut x = seed ^ splitmix(&mut t);
        let s = [
            splitmix(&mut x),
            splitmix(&mut x),
            splitmix(&mut x),
            splitmix(&mut x),
        ];
        Rng { s }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.s;
        let out = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        out
    }

    /// Uniform in `[0, 1)` (53 bits).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in `[lo, hi)`.
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.unit()
    }

    /// Uniform integer in `[0, n)`, without modulo bias; 0 when `n` is 0.
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            return 0;
        }
        // Lemire's multiply-shift with rejection.
        let threshold = n.wrapping_neg() % n;
        loop {
            let m = u128::from(self.next_u64()) * u128::from(n);
            if (m as u64) >= threshold {
                return (m >> 64) as u64;
            }
        }
    }
}

/// torchvision's `RandomResizedCrop` box sampler (and `RandomHorizontalFlip`): a random area
/// fraction in `scale` and aspect ratio (log-uniform) in `ratio`, ten tries, then the centre
/// crop fallback, exactly as `torchvision.transforms.RandomResizedCrop.get_params` (Python's
/// rounding included); the random numbers are this crate's [`Rng`], not torch's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RandomResizedCrop {
    scale: (f64, f64),
    ratio: (f64, f64),
    flip_p: f64,
}

impl Default for RandomResizedCrop {
    /// `scale (0.08, 1.0)`, `ratio (3/4, 4/3)`, flips with probability 0.5.
    fn default() -> Self {
        RandomResizedCrop {
            scale: (0.08, 1.0),
            ratio: (3.0 / 4.0, 4.0 / 3.0),
            flip_p: 0.5,
        }
    }
}

impl RandomResizedCrop {
    /// A sampler with area fractions in `scale`, aspect ratios (width / height) in `ratio`, and
    /// a left-right flip with probability `flip_p`. `Error::InvalidArgument` for bounds that
    /// are not finite, not positive, reversed, a scale above 1, or `flip_p` outside `[0, 1]`
    /// (torchvision only warns about reversed bounds).
    pub fn new(scale: (f64, f64), ratio: (f64, f64), flip_p: f64) -> Result<Self> {
        const OP: &str = "augment::RandomResizedCrop::new";
        let ok = |(lo, hi): (f64, f64)| lo.is_finite() && hi.is_finite() && lo > 0.0 && lo <= hi;
        if !ok(scale) || scale.1 > 1.0 {
            return Err(Error::invalid(
                OP,
                format!("scale {scale:?}: needs 0 < min <= max <= 1"),
            ));
        }
        if !ok(ratio) {
            return Err(Error::invalid(
                OP,
                format!("ratio {ratio:?}: needs 0 < min <= max, finite"),
            ));
        }
        if !(0.0..=1.0).contains(&flip_p) {
            return Err(Error::invalid(
                OP,
                format!("flip probability {flip_p} is not in [0, 1]"),
            ));
        }
        Ok(RandomResizedCrop {
            scale,
            ratio,
            flip_p,
        })
    }

    /// One box for an image of `height` x `width` pixels. `Error::InvalidArgument` for an
    /// empty image.
    pub fn sample(&self, rng: &mut Rng, height: usize, width: usize) -> Result<CropBox> {
        if height == 0 || width == 0 {
            return Err(Error::invalid(
                "augment::RandomResizedCrop::sample",
                format!("image {height}x{width} is empty"),
            ));
        }
        let (top, left, h, w) = self.window(rng, height, width);
        let flip = self.flip_p > 0.0 && rng.unit() < self.flip_p;
        Ok(CropBox {
            top: top as f32,
            left: left as f32,
            height: h as f32,
            width: w as f32,
            flip,
            clamp_to_box: true,
        })
    }

    /// `get_params`: `(top, left, height, width)` in whole pixels.
    fn window(&self, rng: &mut Rng, height: usize, width: usize) -> (usize, usize, usize, usize) {
        let (hf, wf) = (height as f64, width as f64);
        let area = hf * wf;
        let (lr0, lr1) = (self.ratio.0.ln(), self.ratio.1.ln());
        for _ in 0..10 {
            let target = area * rng.uniform(self.scale.0, self.scale.1);
            let aspect = rng.uniform(lr0, lr1).exp();
            // Python's int(round(x)): half to even, then truncation (x >= 0 here).
            let w = (target * aspect).sqrt().round_ties_even();
            let h = (target / aspect).sqrt().round_ties_even();
            if w > 0.0 && w <= wf && h > 0.0 && h <= hf {
                let (h, w) = (h as usize, w as usize);
                let top = rng.below((height - h + 1) as u64) as usize;
                let left = rng.below((width - w + 1) as u64) as usize;
                return (top, left, h, w);
            }
        }
        // The centre crop fallback.
        let in_ratio = wf / hf;
        let (h, w) = if in_ratio < self.ratio.0 {
            let h = (wf / self.ratio.0).round_ties_even() as usize;
            (h.clamp(1, height), width)
        } else if in_ratio > self.ratio.1 {
            let w = (hf * self.ratio.1).round_ties_even() as usize;
            (height, w.clamp(1, width))
        } else {
            (height, width)
        };
        ((height - h) / 2, (width - w) / 2, h, w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_boxes_other_seed_or_stream_others() {
        let r = RandomResizedCrop::default();
        let draw = |seed, stream| {
            let mut g = Rng::new(seed, stream);
            (0..50)
                .map(|_| r.sample(&mut g, 375, 500).unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(7, 0), draw(7, 0));
        assert_ne!(draw(7, 0), draw(8, 0));
        assert_ne!(draw(7, 0), draw(7, 1));
        // Pinned values: the same on every machine (a changed generator shows here).
        let mut g = Rng::new(0, 0);
        let first = [g.next_u64(), g.next_u64()];
        let mut g = Rng::new(0, 0);
        assert_eq!(first, [g.next_u64(), g.next_u64()]);
    }

    #[test]
    fn boxes_stay_inside_and_follow_scale_and_ratio() {
        let r = RandomResizedCrop::default();
        let mut g = Rng::new(1, 2);
        let mut flips = 0;
        for (h, w) in [(375, 500), (500, 375), (224, 224), (32, 32), (1000, 17)] {
            for _ in 0..2000 {
                let b = r.sample(&mut g, h, w).unwrap();
                flips += usize::from(b.flip);
                assert!(b.top >= 0.0 && b.left >= 0.0 && b.height >= 1.0 && b.width >= 1.0);
                assert!(
                    b.top + b.height <= h as f32 && b.left + b.width <= w as f32,
                    "{b:?}"
                );
                assert_eq!(b.top.fract() + b.left.fract() + b.height.fract(), 0.0);
                let frac = f64::from(b.height * b.width) / (h * w) as f64;
                let full = b.height as usize == h || b.width as usize == w;
                // A drawn box: area fraction within scale and ratio within bounds, up to the
                // rounding to whole pixels; the fallback touches two opposite edges.
                if !full {
                    let slack = 2.0 * (f64::from(b.height) + f64::from(b.width)) / (h * w) as f64;
                    assert!(frac >= 0.08 - slack && frac <= 1.0 + slack, "{frac} {b:?}");
                    let ar = f64::from(b.width / b.height);
                    let tol = 1.0 / f64::from(b.height.min(b.width));
                    assert!(
                        ar >= 0.75 * (1.0 - tol) - 1e-9 && ar <= 4.0 / 3.0 * (1.0 + tol) + 1e-9
                    );
                }
            }
        }
        assert!((4000..6000).contains(&flips), "{flips} flips of 10000");
    }

    #[test]
    fn fallback_is_the_centre_crop_of_torchvision() {
        // An area fraction that can never fit: scale 1 with a ratio the image does not have.
        let r = RandomResizedCrop::new((1.0, 1.0), (2.0, 3.0), 0.0).unwrap();
        let mut g = Rng::new(3, 0);
        // in_ratio 1 < 2: width kept, height = round(100 / 2) = 50, centred.
        let b = r.sample(&mut g, 100, 100).unwrap();
        assert_eq!((b.top, b.left, b.height, b.width), (25.0, 0.0, 50.0, 100.0));
        // in_ratio 4 > 3: height kept, width = round(10 * 3) = 30, centred.
        let b = r.sample(&mut g, 10, 40).unwrap();
        assert_eq!((b.top, b.left, b.height, b.width), (0.0, 5.0, 10.0, 30.0));
        // Python's round: 2.5 -> 2 (half to even).
        let r = RandomResizedCrop::new((1.0, 1.0), (2.0, 2.0), 0.0).unwrap();
        let b = r.sample(&mut g, 5, 5).unwrap();
        assert_eq!((b.height, b.width, b.top), (2.0, 5.0, 1.0));
    }

    #[test]
    fn bad_arguments_are_typed_errors() {
        let bad = [
            ((0.0, 1.0), (0.75, 1.33), 0.5),
            ((0.5, 0.1), (0.75, 1.33), 0.5),
            ((0.1, 1.5), (0.75, 1.33), 0.5),
            ((f64::NAN, 1.0), (0.75, 1.33), 0.5),
            ((0.1, 1.0), (0.0, 1.33), 0.5),
            ((0.1, 1.0), (2.0, 1.0), 0.5),
            ((0.1, 1.0), (0.75, f64::INFINITY), 0.5),
            ((0.1, 1.0), (0.75, 1.33), 1.5),
            ((0.1, 1.0), (0.75, 1.33), f64::NAN),
        ];
        for (s, r, p) in bad {
            assert!(
                matches!(
                    RandomResizedCrop::new(s, r, p),
                    Err(Error::InvalidArgument { .. })
                ),
                "{s:?} {r:?} {p}"
            );
        }
        let mut g = Rng::new(0, 0);
        assert!(RandomResizedCrop::default().sample(&mut g, 0, 5).is_err());
        assert!(CropBox::center(0, 5, 256, 224).is_err());
        assert!(CropBox::center(5, 5, 0, 224).is_err());
        assert!(CropBox::center(375, 500, 256, 300).is_err());
    }

    #[test]
    fn validation_box_is_resize_then_centre_crop() {
        // 375 x 500 -> Resize(256) -> 256 x 341 (int(256 * 500 / 375) = 341) -> crop 224:
        // top = round(16) = 16, left = round(58.5) = 58 (half to even).
        let b = CropBox::center(375, 500, 256, 224).unwrap();
        let (sy, sx) = (375.0 / 256.0, 500.0 / 341.0);
        assert!((f64::from(b.top) - 16.0 * sy).abs() < 1e-4);
        assert!((f64::from(b.left) - 58.0 * sx).abs() < 1e-4);
        assert!((f64::from(b.height) - 224.0 * sy).abs() < 1e-4);
        assert!((f64::from(b.width) - 224.0 * sx).abs() < 1e-4);
        assert!(!b.flip);
        // Square: no rounding at all.
        let b = CropBox::center(512, 512, 256, 224).unwrap();
        assert_eq!(
            (b.top, b.left, b.height, b.width),
            (32.0, 32.0, 448.0, 448.0)
        );
    }

    #[test]
    fn below_is_unbiased_and_in_range() {
        let mut g = Rng::new(9, 9);
        let mut counts = [0u32; 3];
        for _ in 0..30_000 {
            counts[g.below(3) as usize] += 1;
        }
        assert!(
            counts.iter().all(|&c| (9_000..11_000).contains(&c)),
            "{counts:?}"
        );
        assert_eq!(g.below(0), 0);
        assert_eq!(g.below(1), 0);
        for _ in 0..1000 {
            assert!(g.unit() < 1.0);
        }
    }
}
