// The trait that carries the kernels' element type code cannot be named (or implemented)
// outside pinstream.
use bytemuck::{Pod, Zeroable};

#[derive(Clone, Copy, Pod, Zeroable)]
#[repr(transparent)]
struct Byte(u8);

impl pinstream::kernels::element::sealed::Element for Byte {
    const CODE: i32 = 2;
}

fn main() {}
