//! CPU reference of every normalize / denormalize variant, computed in f64. The GPU tests compare
//! against it, and `pinstream normalize --cpu` runs it instead of the GPU.

use bytemuck::Pod;
use half::{bf16, f16};

use super::spec::{Layout, Spec};
use crate::error::{Error, Result};

/// Output element types and their conversion from the exact (f64) value: round to nearest even;
/// integers saturate.
pub trait OutputElement: Pod + Send + Sync {
    /// The kernel's type code.
    const CODE: i32;
    /// Name for messages and files.
    const NAME: &'static str;
    fn from_f64(v: f64) -> Self;
    /// The value as f64 (for error measurement).
    fn to_f64(self) -> f64;
    /// One unit of rounding at magnitude `v` (the tests' tolerance for 16-bit and integer types).
    fn unit_at(v: f64) -> f64;
    /// A poison value written before each run (NaN for floats).
    fn poison() -> Self;
}

impl OutputElement for f32 {
    const CODE: i32 = crate::sys::PINSTREAM_F32 as i32;
    const NAME: &'static str = "f32";
    fn from_f64(v: f64) -> Self {
        v as f32
    }
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    fn unit_at(v: f64) -> f64 {
        v.abs() * f64::from(f32::EPSILON)
    }
    fn poison() -> Self {
        f32::NAN
    }
}

impl OutputElement for f16 {
    const CODE: i32 = crate::sys::PINSTREAM_F16 as i32;
    const NAME: &'static str = "f16";
    fn from_f64(v: f64) -> Self {
        f16::from_f64(v)
    }
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    fn unit_at(v: f64) -> f64 {
        (v.abs() * f64::from(f16::EPSILON)).max(f64::from(f16::MIN_POSITIVE_SUBNORMAL))
    }
    fn poison() -> Self {
        f16::NAN
    }
}

impl OutputElement for bf16 {
    const CODE: i32 = crate::sys::PINSTREAM_BF16 as i32;
    const NAME: &'static str = "bf16";
    fn from_f64(v: f64) -> Self {
        bf16::from_f64(v)
    }
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    fn unit_at(v: f64) -> f64 {
        (v.abs() * f64::from(bf16::EPSILON)).max(f64::from(bf16::MIN_POSITIVE_SUBNORMAL))
    }
    fn poison() -> Self {
        bf16::NAN
    }
}

impl OutputElement for u8 {
    const CODE: i32 = crate::sys::PINSTREAM_U8 as i32;
    const NAME: &'static str = "u8";
    fn from_f64(v: f64) -> Self {
        v.round_ties_even().clamp(0.0, 255.0) as u8
    }
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    fn unit_at(_: f64) -> f64 {
        1.0
    }
    fn poison() -> Self {
        0xAB
    }
}

impl OutputElement for i8 {
    const CODE: i32 = crate::sys::PINSTREAM_I8 as i32;
    const NAME: &'static str = "i8";
    fn from_f64(v: f64) -> Self {
        v.round_ties_even().clamp(-128.0, 127.0) as i8
    }
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    fn unit_at(_: f64) -> f64 {
        1.0
    }
    fn poison() -> Self {
        -85
    }
}

/// Per-sample mean and std on the host: `n * channels` each, sample-major.
#[derive(Clone, Copy, Debug)]
pub struct PerSample<'a> {
    pub mean: &'a [f32],
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

/// The exact result of every output element, in f64, in the output layout.
pub fn normalize_exact(
    input: &[u8],
    spec: &Spec,
    per_sample: Option<PerSample<'_>>,
) -> Result<Vec<f64>> {
    const OP: &str = "kernels::cpu::normalize";
    spec.validate(OP)?;
    if input.len() != spec.input_len() {
        return Err(Error::LengthMismatch {
            op: OP,
            src: input.len(),
            dst: spec.input_len(),
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
    let mut out = vec![0f64; spec.output_len()];
    for (si, (s, (in_off, out_off))) in spec.samples.iter().zip(spec.offsets()).enumerate() {
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

/// Input element types of `denormalize`.
pub trait DenormInput: Pod + Send + Sync {
    const CODE: i32;
    fn to_f64(self) -> f64;
}
impl DenormInput for f32 {
    const CODE: i32 = crate::sys::PINSTREAM_F32 as i32;
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
}
impl DenormInput for f16 {
    const CODE: i32 = crate::sys::PINSTREAM_F16 as i32;
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
}
impl DenormInput for bf16 {
    const CODE: i32 = crate::sys::PINSTREAM_BF16 as i32;
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
}

/// The inverse of `normalize` for a uniform batch in one layout:
/// `x = (y - shift) * std[c] / scale + mean[c]`, rounded and saturated to u8.
pub fn denormalize<I: DenormInput>(input: &[I], spec: &Spec, out: &mut [u8]) -> Result<()> {
    const OP: &str = "kernels::cpu::denormalize";
    super::normalize::check_denormalize_spec(OP, spec)?;
    let len = spec.input_len();
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
