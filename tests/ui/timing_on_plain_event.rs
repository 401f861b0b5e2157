// Only a TimingEvent keeps time: asking a plain Event for elapsed time does not compile.
use pinstream::{Device, Event};

fn main() -> pinstream::Result<()> {
    let dev = Device::get(0)?;
    let a = Event::new(&dev)?;
    let b = Event::new(&dev)?;
    let _ = a.elapsed_ms(&b)?;
    Ok(())
}
