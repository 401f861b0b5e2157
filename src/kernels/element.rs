//! The element types the kernels read and write: [`OutputElement`] (normalize and resized-crop
//! outputs: f32, f16, bf16, u8, i8) and [`DenormInput`] (denormalize inputs), sealed by the
//! private `Element` trait whose type code the launchers pass to the kernels.

use half::{bf16, f16};

use crate::error::{Error, Result};
use crate::sys;

pub(crate) use sealed::Element;

/// Seals `OutputElement` and `DenormInput`: the launchers pass `Element::CODE` to the kernels,
/// which then store or load elements of the type the code stands for. A type outside this crate
/// could otherwise claim the f32 code for 1-byte elements and make a safe call write out of
/// bounds. The trait is public (as a supertrait must be) but lives in a private module, so no
/// other crate can name it, let alone implement it.
mod sealed {
    use half::{bf16, f16};

    /// An element type the kernels know, and its type code (`PINSTREAM_F32`, ...).
    pub trait Element: bytemuck::Pod {
        const CODE: i32;
    }
    impl Element for f32 {
        const CODE: i32 = crate::sys::PINSTREAM_F32 as i32;
    }
    impl Element for f16 {
        const CODE: i32 = crate::sys::PINSTREAM_F16 as i32;
    }
    impl Element for bf16 {
        const CODE: i32 = crate::sys::PINSTREAM_BF16 as i32;
    }
    impl Element for u8 {
        const CODE: i32 = crate::sys::PINSTREAM_U8 as i32;
    }
    impl Element for i8 {
        const CODE: i32 = crate::sys::PINSTREAM_I8 as i32;
    }
}

/// Output element types of `normalize` (f32, f16, bf16, u8, i8) and their conversion from the
/// exact (f64) value: round to nearest even; integers saturate.
///
/// Sealed: the kernels store elements of the type the (private) type code stands for, so only
/// the five types above can implement it. Use it as a bound: `fn f<O: OutputElement>()`.
pub trait OutputElement: Element + Send + Sync {
    /// Name for messages and files.
    const NAME: &'static str;
    /// The exact value converted: round to nearest even, integers saturate.
    fn from_f64(v: f64) -> Self;
    /// The value as f64 (for error measurement).
    fn to_f64(self) -> f64;
    /// One unit of rounding at magnitude `v` (the tests' tolerance for 16-bit and integer types).
    fn unit_at(v: f64) -> f64;
    /// A poison value written before each run (NaN for floats).
    fn poison() -> Self;
    /// What a produced value is compared with, given the exact (f64) result: for integers the
    /// exact value rounded and saturated (what the conversion is defined to give); for floats
    /// the exact value itself (or the infinity it overflows to).
    fn reference(exact: f64) -> f64;
    /// The error of this produced value against the exact (f64) result, in units of rounding:
    /// 1 or less is correct. `shift` is the `Normalize::shift` of the launch (adding it rounds at
    /// its magnitude in f32). Integers: the distance to `reference(exact)` (the kernels compute
    /// in f32, so a tie may round either way: 1 unit). f32: relative to 1e-6 x (|exact| +
    /// |shift|). f16 / bf16: one unit of rounding at `exact` plus that f32 error. An unwritten
    /// (NaN) value where a number is due is infinitely wrong; the result is never NaN.
    fn rounding_error(self, exact: f64, shift: f32) -> f64;
}

/// Distance between `got` and `want` over `tol`; equal values (infinities and NaNs included)
/// are 0, a NaN against a number is infinite.
fn units(got: f64, want: f64, tol: f64) -> f64 {
    if got == want || (got.is_nan() && want.is_nan()) {
        return 0.0;
    }
    let err = (got - want).abs() / tol;
    if err.is_nan() {
        f64::INFINITY
    } else {
        err
    }
}

/// The f32 arithmetic error allowed at `exact`: 1e-6 relative to |exact| + |shift|.
fn f32_tol(exact: f64, shift: f32) -> f64 {
    1e-6 * (exact.abs() + f64::from(shift.abs()))
}

/// The float reference: the exact value, or the infinity it rounds to in `O`.
fn float_reference<O: OutputElement>(exact: f64) -> f64 {
    let r = O::from_f64(exact).to_f64();
    if r.is_infinite() {
        r
    } else {
        exact
    }
}

impl OutputElement for f32 {
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
    fn reference(exact: f64) -> f64 {
        float_reference::<f32>(exact)
    }
    fn rounding_error(self, exact: f64, shift: f32) -> f64 {
        units(
            OutputElement::to_f64(self),
            Self::reference(exact),
            f32_tol(exact, shift) + 1e-30,
        )
    }
}

impl OutputElement for f16 {
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
    fn reference(exact: f64) -> f64 {
        float_reference::<f16>(exact)
    }
    fn rounding_error(self, exact: f64, shift: f32) -> f64 {
        units(
            OutputElement::to_f64(self),
            Self::reference(exact),
            Self::unit_at(exact) + f32_tol(exact, shift),
        )
    }
}

impl OutputElement for bf16 {
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
    fn reference(exact: f64) -> f64 {
        float_reference::<bf16>(exact)
    }
    fn rounding_error(self, exact: f64, shift: f32) -> f64 {
        units(
            OutputElement::to_f64(self),
            Self::reference(exact),
            Self::unit_at(exact) + f32_tol(exact, shift),
        )
    }
}

impl OutputElement for u8 {
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
    fn reference(exact: f64) -> f64 {
        Self::from_f64(exact).to_f64()
    }
    fn rounding_error(self, exact: f64, _shift: f32) -> f64 {
        units(self.to_f64(), Self::reference(exact), 1.0)
    }
}

impl OutputElement for i8 {
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
    fn reference(exact: f64) -> f64 {
        Self::from_f64(exact).to_f64()
    }
    fn rounding_error(self, exact: f64, _shift: f32) -> f64 {
        units(self.to_f64(), Self::reference(exact), 1.0)
    }
}

/// Input element types of `denormalize` (f32, f16, bf16). Sealed, like `OutputElement`.
pub trait DenormInput: Element + Send + Sync {
    /// The value as f64.
    fn to_f64(self) -> f64;
}
impl DenormInput for f32 {
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
}
impl DenormInput for f16 {
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
}
impl DenormInput for bf16 {
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
}

/// Bytes of one element of the type `code` stands for, as the kernels store and load them.
fn code_size(code: i32) -> Option<usize> {
    const U8: i32 = sys::PINSTREAM_U8 as i32;
    const I8: i32 = sys::PINSTREAM_I8 as i32;
    const F16: i32 = sys::PINSTREAM_F16 as i32;
    const BF16: i32 = sys::PINSTREAM_BF16 as i32;
    const F32: i32 = sys::PINSTREAM_F32 as i32;
    match code {
        U8 | I8 => Some(1),
        F16 | BF16 => Some(2),
        F32 => Some(4),
        _ => None,
    }
}

/// Defence in depth behind the sealed element traits: the kernels access memory as elements of
/// the size `T::CODE` stands for, so `T` must have exactly that size, and the device address
/// `ptr` must be aligned to it.
pub(crate) fn check_element<T: Element>(
    op: &'static str,
    ptr: *const std::ffi::c_void,
) -> Result<()> {
    let size = std::mem::size_of::<T>();
    match code_size(T::CODE) {
        Some(s) if s == size && (ptr as usize) % s == 0 => Ok(()),
        Some(s) if s == size => Err(Error::invalid(
            op,
            format!("device address {ptr:p} is not aligned to the {s}-byte element size"),
        )),
        want => Err(Error::invalid(
            op,
            format!(
                "element type code {} stands for {want:?}-byte elements, the type has {size} bytes",
                T::CODE
            ),
        )),
    }
}
