// A pinned source borrowed by an in-flight upload cannot be dropped.
use pinstream::{Device, DeviceBuffer, HostAlloc, PinnedBuffer};

fn main() -> pinstream::Result<()> {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let mut d = DeviceBuffer::<u8>::new(&dev, 16)?;
    let host = PinnedBuffer::<u8>::new(&dev, 16, HostAlloc::DEFAULT)?;
    let upload = stream.copy_h2d(&host, &mut d)?;
    drop(host);
    upload.wait()?;
    Ok(())
}
