//! A copy round trip as a program that depends on pinstream would write it: host data into
//! pinned memory, up to the GPU, back into a second pinned buffer, checked.
//!
//! ```sh
//! cargo run --example copy_roundtrip            # 64 MiB
//! cargo run --example copy_roundtrip -- 256     # 256 MiB
//! ```
//!
//! In your own crate: `pinstream = { path = "../pinstream" }` (or a git dependency): the library
//! alone, none of the command-line program's dependencies (those are the `pinstream-cli` crate
//! in `cli/`). Without a CUDA device this prints
//! `no CUDA device: <error>` and exits with status 0.

mod common;

use std::process::ExitCode;
use std::time::Instant;

use pinstream::{Device, DeviceBuffer, HostAlloc, PinnedBuffer};

fn main() -> ExitCode {
    let mib: usize = match std::env::args().nth(1).map(|a| a.parse()) {
        None => 64,
        Some(Ok(n)) if n > 0 => n,
        Some(_) => {
            eprintln!("usage: copy_roundtrip [MIB]  (a positive number of MiB)");
            return ExitCode::FAILURE;
        }
    };
    // `Error::NoDevice` (no driver or GPU): a line that says so, and status 0.
    common::exit_status("copy_roundtrip", round_trip(mib << 20))
}

fn round_trip(bytes: usize) -> Result<(), Box<dyn std::error::Error>> {
    let dev = Device::get(0)?; // Error::NoDevice on a machine without driver or GPU
    println!("device 0: {}", dev.name()?);
    let stream = dev.stream()?; // non-blocking: never waits for the legacy default stream

    // Pinned (page-locked) memory: the copy engine reads it directly, at link speed.
    let n = bytes / std::mem::size_of::<u32>();
    let mut host = PinnedBuffer::<u32>::new(&dev, n, HostAlloc::DEFAULT)?;
    for (i, v) in host.as_mut_slice()?.iter_mut().enumerate() {
        *v = (i as u32).wrapping_mul(2_654_435_761); // a pattern that differs at every index
    }

    let mut device = DeviceBuffer::<u32>::new(&dev, n)?;
    let mut back = PinnedBuffer::<u32>::new(&dev, n, HostAlloc::DEFAULT)?;

    let t = Instant::now();
    // Asynchronous: returns once queued. `host` is guarded by the copy's event, so writing it
    // now would first wait for the copy to have read it.
    stream.copy_h2d(&host, &mut device)?;
    // Ordered after the upload on the same stream. `back` stays borrowed by `pending` until
    // `wait()` hands the data out: reading it earlier does not compile.
    let pending = stream.copy_d2h(&device, &mut back)?;
    let values: &[u32] = pending.wait()?;
    let secs = t.elapsed().as_secs_f64();

    let expected = host.as_slice()?;
    if let Some(i) = values.iter().zip(expected).position(|(a, b)| a != b) {
        let (got, sent) = (values[i], expected[i]);
        return Err(format!("element {i} came back as {got:#x}, sent {sent:#x}").into());
    }
    println!(
        "{} MiB up and back in {:.2} ms ({:.1} GB/s for both copies), every element checked",
        bytes >> 20,
        secs * 1e3,
        2.0 * (n * 4) as f64 / secs / 1e9
    );
    Ok(())
}
