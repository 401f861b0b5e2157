//! Safetensors: headers, the writer, loading into one device arena, and the hostile reviews of
//! its file handling.
//!
//! One binary of the integration tests by subject (tests/README.md).

#[path = "../common/mod.rs"]
mod common;
mod file;

use libtest_mimic::Arguments;

fn main() {
    // A child process that one of the trials started (this executable again, with a
    // variable of its module set): it runs that part only.
    if file::hostile::child_mode() {
        return;
    }
    let mut args = Arguments::from_args();
    // One trial at a time unless asked otherwise: implicit device-wide synchronisations
    // (cudaFree, cudaHostAlloc) and spins on the GPU in one trial would disturb the
    // timing-sensitive checks of another.
    args.test_threads.get_or_insert(1);
    let mut trials = Vec::new();
    trials.extend(file::trials());
    trials.extend(file::hostile::trials());
    trials.extend(file::hostile2::trials());
    trials.extend(file::sharded::trials());
    trials.extend(file::hostile32::trials());
    libtest_mimic::run(&args, trials).exit();
}
