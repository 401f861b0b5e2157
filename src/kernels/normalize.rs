//! The GPU launcher of the fused normalize / cast kernels (`cuda/normalize.cu`).

use super::element::{check_element, DenormInput, Element, OutputElement};
use super::spec::{check_denormalize_spec, Spec};
use crate::error::{check_with, Error, Result};
use crate::memory::sealed::DeviceMem;
use crate::memory::tracker::{self, Access};
use crate::memory::{DeviceBuffer, DeviceSlice, DeviceSliceMut};
use crate::stream::Stream;
use crate::sys;

// SAFETY: plain C struct of integers (48 bytes, no padding: two u64 then eight i32), any bit
// pattern is valid.
unsafe impl bytemuck::Zeroable for sys::pinstream_norm_sample {}
// SAFETY: as above.
unsafe impl bytemuck::Pod for sys::pinstream_norm_sample {}

/// Per-sample mean and std on the device: `n * channels` f32 each, sample-major. Their values
/// are not checked on the host (a zero std gives inf / NaN, as division does).
#[derive(Clone, Copy, Debug)]
pub struct DevicePerSample<'a> {
    /// Mean of each sample's channels, `n * channels` f32, sample-major.
    pub mean: &'a DeviceBuffer<f32>,
    /// Std of each sample's channels, `n * channels` f32, sample-major.
    pub std: &'a DeviceBuffer<f32>,
}

fn base_args(spec: &Spec) -> sys::pinstream_norm_args {
    let n = &spec.norm;
    let mut mean = [0f32; 4];
    let mut k = [0f32; 4];
    for c in 0..spec.channels {
        mean[c] = n.mean[c];
        k[c] = n.k(c);
    }
    let (h, w) = spec
        .samples
        .iter()
        .map(|s| s.out_hw())
        .fold((0, 0), |(h, w), (sh, sw)| (h.max(sh), w.max(sw)));
    sys::pinstream_norm_args {
        in_: std::ptr::null(),
        out: std::ptr::null_mut(),
        samples: std::ptr::null(),
        sample_mean: std::ptr::null(),
        sample_std: std::ptr::null(),
        mean,
        k,
        scale: n.scale,
        shift: n.shift,
        fill: spec.pad_to_4.unwrap_or(0.0),
        n: spec.samples.len() as i32,
        c_in: spec.channels as i32,
        c_out: spec.out_channels() as i32,
        h: h as i32,
        w: w as i32,
        in_layout: spec.in_layout.code(),
        out_layout: spec.out_layout.code(),
        reserved: 0,
    }
}

/// The per-sample table for the general kernel.
fn sample_table(spec: &Spec) -> Result<Vec<sys::pinstream_norm_sample>> {
    Ok(spec
        .samples
        .iter()
        .zip(spec.offsets()?)
        .map(|(s, (i, o))| {
            let (oh, ow) = s.out_hw();
            let (cx, cy) = s.crop.map_or((0, 0), |c| (c.x, c.y));
            sys::pinstream_norm_sample {
                in_offset: i as u64,
                out_offset: o as u64,
                src_h: s.h as i32,
                src_w: s.w as i32,
                crop_x: cx as i32,
                crop_y: cy as i32,
                out_h: oh as i32,
                out_w: ow as i32,
                mirror: i32::from(s.mirror),
                reserved: 0,
            }
        })
        .collect())
}

/// Normalizes `input` (u8, laid out as `spec` says) into `output` in one launch on `stream`:
/// `out = scale * (x - mean[c]) / std[c] + shift`, f32 arithmetic, converted to `O` with round to
/// nearest even (integers saturate). `per_sample` replaces the per-channel mean/std of `spec`.
///
/// Every argument is checked before anything is queued; a batch with crops, mirrors or samples
/// of different sizes uploads a small per-sample table first (ordered on the same stream,
/// staged in pinned memory that belongs to the stream: the call does not wait for the stream's
/// earlier work).
///
/// ```no_run
/// use pinstream::kernels::{self, Layout, Normalize, Spec};
/// use pinstream::{f16, Device, DeviceBuffer};
/// # fn main() -> pinstream::Result<()> {
/// let dev = Device::get(0)?;
/// let stream = dev.stream()?;
/// // 8 RGB images of 224 x 224, channels-last u8 in, NCHW f16 out.
/// let spec = Spec::uniform(8, 3, 224, 224, Normalize::imagenet())?
///     .layouts(Layout::Nhwc, Layout::Nchw);
/// let pixels = vec![128u8; spec.input_len()?];
/// let mut d_in = DeviceBuffer::<u8>::new(&dev, pixels.len())?;
/// stream.copy_h2d(&pixels[..], &mut d_in)?;
/// let mut d_out = DeviceBuffer::<f16>::new(&dev, spec.output_len()?)?;
/// kernels::normalize::<f16, _, _>(&stream, &d_in, &spec, &mut d_out, None)?;
/// # Ok(()) }
/// ```
pub fn normalize<O, I, D>(
    stream: &Stream,
    input: &I,
    spec: &Spec,
    output: &mut D,
    per_sample: Option<DevicePerSample<'_>>,
) -> Result<()>
where
    O: OutputElement,
    I: DeviceSlice<u8> + ?Sized,
    D: DeviceSliceMut<O> + ?Sized,
{
    const OP: &str = "kernels::normalize";
    spec.validate(OP)?;
    let (i, o) = (input.device_region(), output.device_region());
    let (in_len, out_len) = (spec.input_len()?, spec.output_len()?);
    if i.len != in_len {
        return Err(Error::LengthMismatch {
            op: OP,
            src: i.len,
            dst: in_len,
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
    let mut args = base_args(spec);
    args.in_ = i.ptr;
    args.out = o.ptr;
    let mut trackers = vec![(i.tracker, Access::Read), (o.tracker, Access::Write)];
    if let Some(p) = per_sample {
        // Both at most i32::MAX x 4 (validated).
        let want = spec.samples.len() * spec.channels;
        for b in [p.mean, p.std] {
            stream.same_device(OP, b.device())?;
            if b.len() != want {
                return Err(Error::LengthMismatch {
                    op: OP,
                    src: b.len(),
                    dst: want,
                });
            }
        }
        args.sample_mean = p.mean.as_device_ptr();
        args.sample_std = p.std.as_device_ptr();
    }
    let per = per_sample.map(|p| (p.mean.device_region(), p.std.device_region()));
    if let Some((m, s)) = &per {
        trackers.push((m.tracker, Access::Read));
        trackers.push((s.tracker, Access::Read));
    }
    // The per-sample table, when the batch needs one (`table::place`: in the launch's
    // parameters up to `PINSTREAM_PARAM_ROWS` samples, else uploaded on the stream).
    let rows = if spec.is_uniform() {
        Vec::new()
    } else {
        sample_table(spec)?
    };
    let placed = super::table::place(OP, stream, &rows, sys::PINSTREAM_PARAM_ROWS as usize)?;
    let param_rows = placed.param;
    args.samples = placed.device.cast();
    if let Some(t) = placed.tracker() {
        // Written just before by the table's copy on this stream.
        trackers.push((t, Access::Write));
    }
    stream.enter()?;
    tracker::ordered_rw(stream, &trackers, || {
        // SAFETY: every pointer in `args` addresses device memory of the checked size on this
        // stream's device, kept alive by the borrows and, afterwards, by the trackers (the table,
        // `samples`, is the stream's scratch). `param_rows` is null, or `rows` (a live Vec of
        // `spec.samples.len()` <= PINSTREAM_PARAM_ROWS entries, `samples` null), which the
        // launcher copies into the launch's parameters before it returns.
        check_with(
            unsafe {
                sys::pinstream_normalize(&args, param_rows, <O as Element>::CODE, stream.as_raw())
            },
            "pinstream_normalize",
            || {
                format!(
                    "{} samples x {} channels, {:?} -> {:?}, {}",
                    spec.samples.len(),
                    spec.channels,
                    spec.in_layout,
                    spec.out_layout,
                    O::NAME
                )
            },
        )
    })
    .map(|_| ())
}

/// The inverse for looking at results: `x = (y - shift) * std[c] / scale + mean[c]`, rounded and
/// saturated to u8, same layout in and out (a uniform batch described by `spec`).
pub fn denormalize<T, I, D>(stream: &Stream, input: &I, spec: &Spec, output: &mut D) -> Result<()>
where
    T: DenormInput,
    I: DeviceSlice<T> + ?Sized,
    D: DeviceSliceMut<u8> + ?Sized,
{
    const OP: &str = "kernels::denormalize";
    check_denormalize_spec(OP, spec)?;
    let (i, o) = (input.device_region(), output.device_region());
    let len = spec.input_len()?;
    check_element::<T>(OP, i.ptr)?;
    for got in [i.len, o.len] {
        if got != len {
            return Err(Error::LengthMismatch {
                op: OP,
                src: got,
                dst: len,
            });
        }
    }
    stream.same_device(OP, i.device)?;
    stream.same_device(OP, o.device)?;
    let mut args = base_args(spec);
    args.in_ = i.ptr;
    args.out = o.ptr;
    stream.enter()?;
    tracker::ordered_rw(
        stream,
        &[(i.tracker, Access::Read), (o.tracker, Access::Write)],
        || {
            // SAFETY: as in `normalize`.
            check_with(
                unsafe { sys::pinstream_denormalize(&args, <T as Element>::CODE, stream.as_raw()) },
                "pinstream_denormalize",
                || format!("{len} elements"),
            )
        },
    )
    .map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn element_size_must_match_the_code() {
        // The sealed types pass.
        let p = 256 as *const std::ffi::c_void;
        assert!(check_element::<f32>("t", p).is_ok());
        assert!(check_element::<half::f16>("t", p).is_ok());
        assert!(check_element::<half::bf16>("t", p).is_ok());
        assert!(check_element::<u8>("t", p).is_ok());
        assert!(check_element::<i8>("t", p).is_ok());
        // A 1-byte type claiming the f32 code (the soundness issue): refused.
        #[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
        #[repr(transparent)]
        struct Byte(u8);
        impl Element for Byte {
            const CODE: i32 = sys::PINSTREAM_F32 as i32;
        }
        assert!(matches!(
            check_element::<Byte>("t", p),
            Err(Error::InvalidArgument { .. })
        ));
        // An unknown code.
        #[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
        #[repr(transparent)]
        struct Odd(u32);
        impl Element for Odd {
            const CODE: i32 = 99;
        }
        assert!(matches!(
            check_element::<Odd>("t", p),
            Err(Error::InvalidArgument { .. })
        ));
        // A misaligned address.
        assert!(matches!(
            check_element::<f32>("t", 258 as *const std::ffi::c_void),
            Err(Error::InvalidArgument { .. })
        ));
    }
}
