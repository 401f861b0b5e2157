// DenormInput is sealed: a user type cannot become a denormalize input element (the kernel
// would read elements of the size its type code stands for).
use bytemuck::{Pod, Zeroable};
use pinstream::kernels::DenormInput;

#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(transparent)]
struct Byte(u8);

impl DenormInput for Byte {
    fn to_f64(self) -> f64 {
        f64::from(self.0)
    }
}

fn main() {}
