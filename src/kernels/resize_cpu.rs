//! The f64 reference of the fused resized crop (`kernels::resized_crop`): the same filter, taps
//! and window as the kernel, from the same f32 box values, computed separably in f64. The GPU
//! tests compare against it; a CPU dry run of a training feed uses it instead of the GPU.

use super::cpu::WorstError;
use super::element::OutputElement;
use super::resize::{window, ResizeSpec};
use super::spec::Layout;
use crate::error::{Error, Result};

/// One output coordinate's filter: its first source index and normalized weights.
fn taps(
    start: f32,
    scale: f32,
    o: usize,
    win0: usize,
    winn: usize,
    aa: bool,
    w: &mut Vec<f64>,
) -> usize {
    let (start, scale) = (f64::from(start), f64::from(scale));
    let center = start + scale * (o as f64 + 0.5);
    let support = if aa && scale > 1.0 { scale } else { 1.0 };
    let (w0, w1) = (win0 as f64, (win0 + winn) as f64);
    let mut lo = (center - support + 0.5).floor().max(w0);
    let mut hi = (center + support + 0.5).floor().min(w1);
    if hi <= lo {
        lo = center.floor().max(w0).min(w1 - 1.0);
        hi = lo + 1.0;
    }
    let (lo, n) = (lo as usize, (hi - lo) as usize);
    w.clear();
    w.extend((0..n).map(|j| {
        let d = ((lo + j) as f64 - center + 0.5) / support;
        (1.0 - d.abs()).max(0.0)
    }));
    let total: f64 = w.iter().sum();
    for x in w.iter_mut() {
        *x = if total > 0.0 {
            *x / total
        } else {
            1.0 / n as f64
        };
    }
    lo
}

/// The exact result of every output element, in f64, in the output layout (before the cast).
/// `input` must hold at least `spec.input_extent()` bytes.
pub fn resized_crop_exact(input: &[u8], spec: &ResizeSpec) -> Result<Vec<f64>> {
    const OP: &str = "kernels::cpu::resized_crop";
    spec.validate(OP)?;
    let need = spec.input_extent()?;
    if input.len() < need {
        return Err(Error::LengthMismatch {
            op: OP,
            src: input.len(),
            dst: need,
        });
    }
    let (oh, ow, c_in, c_out) = (spec.out_h, spec.out_w, spec.channels, spec.out_channels());
    let per = spec.sample_len()?;
    let mut out = crate::error::try_vec(OP, spec.output_len()?)?;
    out.resize(spec.output_len()?, 0.0f64);
    let n = &spec.norm;
    let fill = f64::from(spec.pad_to_4.unwrap_or(0.0));
    let (mut wx, mut wy) = (Vec::new(), Vec::new());
    for (si, s) in spec.samples.iter().enumerate() {
        let m = window(s, oh, ow).map_err(|r| Error::invalid(OP, r))?;
        let [wy0, wx0, wh, ww] = m.win;
        let (h, w) = (s.height, s.width);
        let px = |r: usize, x: usize, c: usize| -> f64 {
            let i = match spec.in_layout {
                Layout::Nhwc => (r * w + x) * c_in + c,
                Layout::Nchw => (c * h + r) * w + x,
            };
            f64::from(input[s.offset + i])
        };
        // Columns: first tap and weights of every output column (mirrored first).
        let mut cols = Vec::with_capacity(ow);
        for x in 0..ow {
            let xs = if s.crop.flip { ow - 1 - x } else { x };
            let f = taps(m.left, m.scale_x, xs, wx0, ww, spec.antialias, &mut wx);
            cols.push((f, wx.clone()));
        }
        for y in 0..oh {
            let fy = taps(m.top, m.scale_y, y, wy0, wh, spec.antialias, &mut wy);
            for (x, (fx, wxs)) in cols.iter().enumerate() {
                for c in 0..c_out {
                    let v = if c < c_in {
                        let mut v = 0.0;
                        for (i, &a) in wy.iter().enumerate() {
                            let row: f64 = wxs
                                .iter()
                                .enumerate()
                                .map(|(j, &b)| b * px(fy + i, fx + j, c))
                                .sum();
                            v += a * row;
                        }
                        f64::from(n.scale) * (v - f64::from(n.mean[c])) / f64::from(n.std[c])
                            + f64::from(n.shift)
                    } else {
                        fill
                    };
                    let i = match spec.out_layout {
                        Layout::Nchw => (c * oh + y) * ow + x,
                        Layout::Nhwc => (y * ow + x) * c_out + c,
                    };
                    out[si * per + i] = v;
                }
            }
        }
    }
    Ok(out)
}

/// The reference resized crop into `out` (`spec.output_len()` elements), converted as the GPU
/// converts (round to nearest even, integers saturate).
pub fn resized_crop<O: OutputElement>(
    input: &[u8],
    spec: &ResizeSpec,
    out: &mut [O],
) -> Result<()> {
    let exact = resized_crop_exact(input, spec)?;
    if out.len() != exact.len() {
        return Err(Error::LengthMismatch {
            op: "kernels::cpu::resized_crop",
            src: exact.len(),
            dst: out.len(),
        });
    }
    for (o, v) in out.iter_mut().zip(exact) {
        *o = O::from_f64(v);
    }
    Ok(())
}

/// How far the kernel's f32 resampling may be from the f64 reference, in input levels (0..255
/// scale): four f32 roundings of a position at the largest coordinate, times the full range
/// of a pixel, plus f32 accumulation.
pub fn resize_tolerance(spec: &ResizeSpec) -> f64 {
    let side = spec
        .samples
        .iter()
        .map(|s| s.height.max(s.width))
        .max()
        .unwrap_or(1) as f64;
    255.0 * 4.0 * side / (1u64 << 24) as f64 + 255.0 * 1e-5
}

/// The worst element of a GPU result `got` against `exact` (from `resized_crop_exact`), in
/// units of what is allowed there: [`resize_tolerance`] levels times the largest
/// `scale / std`, plus one unit of rounding of `O` (and f32's own rounding). 1 or less is
/// correct; an unwritten (NaN) element where a number is due is infinitely wrong.
pub fn resize_worst_error<O: OutputElement>(
    got: &[O],
    exact: &[f64],
    spec: &ResizeSpec,
) -> Result<Option<WorstError>> {
    if got.len() != exact.len() {
        return Err(Error::LengthMismatch {
            op: "kernels::cpu::resize_worst_error",
            src: exact.len(),
            dst: got.len(),
        });
    }
    let k = (0..spec.channels.min(spec.norm.std.len()))
        .map(|c| f64::from(spec.norm.scale / spec.norm.std[c]).abs())
        .fold(0.0, f64::max);
    let slack = k * resize_tolerance(spec);
    let shift = f64::from(spec.norm.shift.abs());
    let mut worst: Option<WorstError> = None;
    for (index, (&g, &e)) in got.iter().zip(exact).enumerate() {
        let want = O::reference(e);
        let g = g.to_f64();
        let allowed = slack + O::unit_at(e) + 1e-6 * (e.abs() + shift) + 1e-30;
        let units = if g == want {
            0.0
        } else {
            let u = (g - want).abs() / allowed;
            if u.is_nan() {
                f64::INFINITY
            } else {
                u
            }
        };
        if worst.is_none_or(|w| units > w.units) {
            worst = Some(WorstError {
                index,
                units,
                abs: (g - want).abs(),
            });
        }
    }
    Ok(worst)
}
