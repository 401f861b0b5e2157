// A view of a pinned buffer is a copy source only, never a device-to-host destination.
use pinstream::{Device, DeviceBuffer, HostAlloc, PinnedBuffer};

fn main() -> pinstream::Result<()> {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let d = DeviceBuffer::<u8>::new(&dev, 16)?;
    let host = PinnedBuffer::<u8>::new(&dev, 32, HostAlloc::DEFAULT)?;
    let mut view = host.slice(8..24)?;
    stream.copy_d2h(&d, &mut view)?.wait()?;
    Ok(())
}
