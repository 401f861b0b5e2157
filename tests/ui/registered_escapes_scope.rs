// A Registered cannot leave its scope (so it cannot be leaked with mem::forget while a copy
// into the caller's memory is in flight).
use pinstream::{Device, HostRegister, Registered};

fn main() -> pinstream::Result<()> {
    let dev = Device::get(0)?;
    let mut data = vec![0u8; 16];
    let mut escaped = None;
    Registered::scope(&dev, &mut data, HostRegister::DEFAULT, |r| {
        escaped = Some(r);
    })?;
    drop(escaped);
    Ok(())
}
