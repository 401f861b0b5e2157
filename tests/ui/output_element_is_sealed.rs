// OutputElement is sealed: a user type cannot become a normalize output element. (A 1-byte
// type that claimed the f32 type code made `kernels::normalize` write 4 bytes per element, out
// of bounds.) Every item of the public trait is given, so the only error is the seal.
use bytemuck::{Pod, Zeroable};
use pinstream::kernels::OutputElement;

#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(transparent)]
struct Byte(u8);

impl OutputElement for Byte {
    const NAME: &'static str = "byte";
    fn from_f64(v: f64) -> Self {
        Byte(v as u8)
    }
    fn to_f64(self) -> f64 {
        f64::from(self.0)
    }
    fn unit_at(_: f64) -> f64 {
        1.0
    }
    fn poison() -> Self {
        Byte(0xAB)
    }
    fn reference(exact: f64) -> f64 {
        exact
    }
    fn rounding_error(self, _exact: f64, _shift: f32) -> f64 {
        0.0
    }
}

fn main() {}
