//! CPU reference of every normalize / denormalize / resized-crop variant, computed in f64. The
//! GPU tests compare against it, and `pinstream normalize --cpu` runs it instead of the GPU.

pub use super::element::{DenormInput, OutputElement};
use super::spec::{Layout, Spec};
use crate::error::{Error, Result};

pub use super::resize_cpu::{
    resize_tolerance, resize_worst_error, resized_crop, resized_crop_exact,
};

/// The worst element of a result: where it is and its `OutputElement::rounding_error`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WorstError {
    /// Index of the worst element.
    pub index: usize,
    /// Error in units of rounding (1 or less is correct; infinite for NaN where a number is due).
    pub units: f64,
    /// `|got - O::reference(exact)|` there.
    pub abs: f64,
}

/// The largest `rounding_error` of `got` against `exact` (from `normalize_exact`), the one
/// error measure of `pinstream normalize --verify` and the tests. `None` for empty slices.
pub fn worst_error<O: OutputElement>(
    got: &[O],
    exact: &[f64],
    shift: f32,
) -> Result<Option<WorstError>> {
    if got.len() != exact.len() {
        return Err(Error::LengthMismatch {
            op: "kernels::cpu::worst_error",
            src: exact.len(),
            dst: got.len(),
        });
    }
    let mut worst: Option<WorstError> = None;
    for (index, (&g, &e)) in got.iter().zip(exact).enumerate() {
        let units = g.rounding_error(e, shift);
        if worst.is_none_or(|w| units > w.units) {
            let abs = (g.to_f64() - O::reference(e)).abs();
            worst = Some(WorstError { index, units, abs });
        }
    }
    Ok(worst)
}

/// Per-sample mean and std on the host: `n * channels` each, sample-major.
#[derive(Clone, Copy, Debug)]
pub struct PerSample<'a> {
    /// Mean of each sample's channels, sample-major.
    pub mean: &'a [f32],
    /// Std of each sample's channels, sample-major.
    pub std: &'a [f32],
}

fn input_index(
    spec: &Spec,
    in_off: usize,
    h: usize,
    w: usize,
    c: usize,
    y: usize,
    x: usize,
) -> usize {
    match spec.in_layout {
        Layout::Nchw => in_off + c * h * w + y * w + x,
        Layout::Nhwc => in_off + (y * w + x) * spec.channels + c,
    }
}

fn output_index(
    spec: &Spec,
    out_off: usize,
    oh: usize,
    ow: usize,
    c: usize,
    y: usize,
    x: usize,
) -> usize {
    let co = spec.out_channels();
    match spec.out_layout {
        Layout::Nchw => out_off + c * oh * ow + y * ow + x,
        Layout::Nhwc => out_off + (y * ow + x) * co + c,
    }
}

/// `len` zeros, or an error (instead of an abort) where the host cannot hold them.
fn zeroed_f64(op: &'static str, len: usize) -> Result<Vec<f64>> {
    let mut v = crate::error::try_vec(op, len)?;
    v.resize(len, 0.0);
    Ok(v)
}

/// The exact result of every output element, in f64, in the output layout.
pub fn normalize_exact(
    input: &[u8],
    spec: &Spec,
    per_sample: Option<PerSample<'_>>,
) -> Result<Vec<f64>> {
    const OP: &str = "kernels::cpu::normalize";
    spec.validate(OP)?;
    let in_len = spec.input_len()?;
    if input.len() != in_len {
        return Err(Error::LengthMismatch {
            op: OP,
            src: input.len(),
            dst: in_len,
        });
    }
    let n_stats = spec.samples.len() * spec.channels;
    if let Some(p) = per_sample {
        if p.mean.len() != n_stats || p.std.len() != n_stats {
            return Err(Error::LengthMismatch {
                op: OP,
                src: p.mean.len().min(p.std.len()),
                dst: n_stats,
            });
        }
    }
    let norm = &spec.norm;
    let (scale, shift) = (f64::from(norm.scale), f64::from(norm.shift));
    let mut out = zeroed_f64(OP, spec.output_len()?)?;
    for (si, (s, (in_off, out_off))) in spec.samples.iter().zip(spec.offsets()?).enumerate() {
        let (oh, ow) = s.out_hw();
        let (cx, cy) = s.crop.map_or((0, 0), |c| (c.x, c.y));
        for c in 0..spec.out_channels() {
            let (mean, std) = match per_sample {
                _ if c >= spec.channels => (0.0, 1.0),
                Some(p) => (
                    f64::from(p.mean[si * spec.channels + c]),
                    f64::from(p.std[si * spec.channels + c]),
                ),
                None => (f64::from(norm.mean[c]), f64::from(norm.std[c])),
            };
            for y in 0..oh {
                for x in 0..ow {
                    let v = if c < spec.channels {
                        let sx = cx + if s.mirror { ow - 1 - x } else { x };
                        let xv =
                            f64::from(input[input_index(spec, in_off, s.h, s.w, c, cy + y, sx)]);
                        scale * (xv - mean) / std + shift
                    } else {
                        f64::from(spec.pad_to_4.unwrap_or(0.0))
                    };
                    out[output_index(spec, out_off, oh, ow, c, y, x)] = v;
                }
            }
        }
    }
    Ok(out)
}

/// The reference normalize into `out`, converted like the GPU does (round to nearest even,
/// saturating integers).
pub fn normalize<O: OutputElement>(
    input: &[u8],
    spec: &Spec,
    per_sample: Option<PerSample<'_>>,
    out: &mut [O],
) -> Result<()> {
    let exact = normalize_exact(input, spec, per_sample)?;
    if out.len() != exact.len() {
        return Err(Error::LengthMismatch {
            op: "kernels::cpu::normalize",
            src: exact.len(),
            dst: out.len(),
        });
    }
    for (o, v) in out.iter_mut().zip(exact) {
        *o = O::from_f64(v);
    }
    Ok(())
}

/// The inverse of `normalize` for a uniform batch in one layout:
/// `x = (y - shift) * std[c] / scale + mean[c]`, rounded and saturated to u8.
pub fn denormalize<I: DenormInput>(input: &[I], spec: &Spec, out: &mut [u8]) -> Result<()> {
    const OP: &str = "kernels::cpu::denormalize";
    super::spec::check_denormalize_spec(OP, spec)?;
    let len = spec.input_len()?;
    if input.len() != len || out.len() != len {
        return Err(Error::LengthMismatch {
            op: OP,
            src: input.len(),
            dst: out.len().max(len),
        });
    }
    let (c_n, hw) = (spec.channels, spec.samples[0].h * spec.samples[0].w);
    let n = &spec.norm;
    for (e, (o, &y)) in out.iter_mut().zip(input).enumerate() {
        let c = match spec.in_layout {
            Layout::Nchw => (e / hw) % c_n,
            Layout::Nhwc => e % c_n,
        };
        let x = (y.to_f64() - f64::from(n.shift)) * f64::from(n.std[c]) / f64::from(n.scale)
            + f64::from(n.mean[c]);
        *o = u8::from_f64(x);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    #[test]
    fn reference_allocation_failure_is_an_error() {
        // More bytes than any allocation may have (capacity overflow), and a size no machine
        // has: both an error, neither an abort.
        for len in [usize::MAX / 8 + 1, isize::MAX as usize / 8] {
            let r = zeroed_f64("t", len);
            assert!(
                matches!(r, Err(Error::InvalidArgument { .. })),
                "{len}: {:?}",
                r.map(|v| v.len())
            );
        }
        assert_eq!(zeroed_f64("t", 3).ok(), Some(vec![0.0; 3]));
    }

    #[test]
    fn saturation_is_not_an_error() {
        // The exact value 300 (or -7) becomes 255 (0): correct, whatever its distance.
        assert_eq!(255u8.rounding_error(300.0, 0.0), 0.0);
        assert_eq!(0u8.rounding_error(-7.0, 0.0), 0.0);
        assert_eq!((-128i8).rounding_error(-1000.0, 0.0), 0.0);
        assert_eq!(127i8.rounding_error(127.5, 0.0), 0.0);
        // A tie the f32 arithmetic put on the other side: one unit.
        assert_eq!(3u8.rounding_error(2.5, 0.0), 1.0);
        // Wrong values.
        assert_eq!(254u8.rounding_error(300.0, 0.0), 1.0);
        assert!(253u8.rounding_error(300.0, 0.0) > 1.0);
        assert!(0u8.rounding_error(5.0, 0.0) > 1.0);
        assert!(100i8.rounding_error(-3.0, 0.0) > 1.0);
    }

    #[test]
    fn float_errors() {
        assert!(f32::NAN.rounding_error(1.0, 0.0).is_infinite());
        assert!(f16::NAN.rounding_error(1.0, 0.0).is_infinite());
        assert!(bf16::NAN.rounding_error(1.0, 0.0).is_infinite());
        assert_eq!(1.0f32.rounding_error(1.0, 0.0), 0.0);
        assert!(1.00001f32.rounding_error(1.0, 0.0) > 1.0);
        assert!(1.0000005f32.rounding_error(1.0, 0.0) <= 1.0);
        // f16 overflows to infinity: that is the conversion, not an error.
        assert_eq!(f16::INFINITY.rounding_error(1e6, 0.0), 0.0);
        assert!(f16::MAX.rounding_error(1e6, 0.0).is_infinite());
        let one_unit = f16::from_f64(1.0 + 1.0 / 1024.0);
        assert!(one_unit.rounding_error(1.0, 0.0) <= 1.0);
        let two_units = f16::from_f64(1.0 + 2.0 / 1024.0);
        assert!(two_units.rounding_error(1.0, 0.0) > 1.0);
    }

    #[test]
    fn worst_error_finds_the_worst() {
        let got = [1u8, 255, 7, 0];
        let exact = [1.2, 400.0, 4.0, -3.0];
        let w = worst_error(&got, &exact, 0.0).ok().flatten();
        assert_eq!(
            w,
            Some(WorstError {
                index: 2,
                units: 3.0,
                abs: 3.0
            })
        );
        assert!(matches!(
            worst_error(&got[..3], &exact, 0.0),
            Err(Error::LengthMismatch { .. })
        ));
        assert_eq!(worst_error::<u8>(&[], &[], 0.0).ok(), Some(None));
    }
}
