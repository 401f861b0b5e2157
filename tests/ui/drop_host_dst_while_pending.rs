// The host destination of a pending download cannot be dropped while the Pending lives.
use pinstream::{Device, DeviceBuffer, HostAlloc, PinnedBuffer};

fn main() -> pinstream::Result<()> {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let d = DeviceBuffer::<u8>::new(&dev, 16)?;
    let mut host = PinnedBuffer::<u8>::new(&dev, 16, HostAlloc::DEFAULT)?;
    let pending = stream.copy_d2h(&d, &mut host)?;
    drop(host);
    pending.wait()?;
    Ok(())
}
