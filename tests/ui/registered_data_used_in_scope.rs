// The registered slice is borrowed for the whole scope: it cannot be touched directly inside.
use pinstream::{Device, HostRegister, Registered};

fn main() -> pinstream::Result<()> {
    let dev = Device::get(0)?;
    let mut data = vec![0u8; 16];
    Registered::scope(&dev, &mut data, HostRegister::DEFAULT, |_r| {
        data[0] = 1;
    })?;
    Ok(())
}
