// Same hazard with a plain Vec as the destination.
use pinstream::{Device, DeviceBuffer};

fn main() -> pinstream::Result<()> {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let d = DeviceBuffer::<u8>::new(&dev, 16)?;
    let mut host = vec![0u8; 16];
    let pending = stream.copy_d2h(&d, &mut host[..])?;
    let first = host[0];
    pending.wait()?;
    println!("{first}");
    Ok(())
}
