// The slice `wait()` hands out borrows the destination: it cannot outlive it.
use pinstream::{Device, DeviceBuffer, HostAlloc, PinnedBuffer};

fn main() -> pinstream::Result<()> {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let d = DeviceBuffer::<u8>::new(&dev, 16)?;
    let values: &[u8];
    {
        let mut host = PinnedBuffer::<u8>::new(&dev, 16, HostAlloc::DEFAULT)?;
        values = stream.copy_d2h(&d, &mut host)?.wait()?;
    }
    println!("{}", values[0]);
    Ok(())
}
