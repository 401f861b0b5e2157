// The buffer cannot be written while a view of it (a copy source) lives.
use pinstream::{Device, DeviceBuffer, HostAlloc, PinnedBuffer};

fn main() -> pinstream::Result<()> {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let mut d = DeviceBuffer::<u8>::new(&dev, 16)?;
    let mut host = PinnedBuffer::<u8>::new(&dev, 32, HostAlloc::DEFAULT)?;
    let view = host.slice(8..24)?;
    let upload = stream.copy_h2d(&view, &mut d)?;
    host.as_mut_slice()?.fill(1);
    upload.wait()?;
    Ok(())
}
