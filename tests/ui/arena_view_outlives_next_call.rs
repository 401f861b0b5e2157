// A view into a reused packed arena borrows it: the next upload into the arena (which overwrites
// it) cannot be made while the view lives.
use pinstream::{Device, PackedArena, Packer, Stager, StagerConfig};

fn main() -> pinstream::Result<()> {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let stager = Stager::new(&dev, StagerConfig::default())?;
    let mut arena = PackedArena::new();
    let data = vec![1.0f32; 16];
    let mut packer = Packer::new();
    let h = packer.push(&data)?;
    let first = stager.upload_packed_into(&stream, &packer, &mut arena)?;
    let view = first.get(h)?;
    let second = stager.upload_packed_into(&stream, &packer, &mut arena)?;
    println!("{} {}", view.len(), second.bytes());
    Ok(())
}
