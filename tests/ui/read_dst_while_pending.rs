// The PyTorch hazard: `cuda_tensor.to("cpu", non_blocking=True)` read before a sync. Reading the
// destination while the copy's `Pending` lives must not compile.
use pinstream::{Device, DeviceBuffer, HostAlloc, PinnedBuffer};

fn main() -> pinstream::Result<()> {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let d = DeviceBuffer::<f32>::new(&dev, 16)?;
    let mut host = PinnedBuffer::<f32>::new(&dev, 16, HostAlloc::DEFAULT)?;
    let pending = stream.copy_d2h(&d, &mut host)?;
    let mean: f32 = host.as_slice()?.iter().sum::<f32>() / 16.0;
    let _ = pending.wait()?;
    println!("{mean}");
    Ok(())
}
