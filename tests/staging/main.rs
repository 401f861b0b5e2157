//! Staging: the engine (`Stager`, `Packer`, `FileSource`, packed arenas) uploading and
//! downloading through pinned slots.
//!
//! One binary of the integration tests by subject (tests/README.md).

#[path = "../common/mod.rs"]
mod common;
mod engine;

use libtest_mimic::Arguments;

fn main() {
    let mut args = Arguments::from_args();
    // One trial at a time unless asked otherwise: implicit device-wide synchronisations
    // (cudaFree, cudaHostAlloc) and spins on the GPU in one trial would disturb the
    // timing-sensitive checks of another.
    args.test_threads.get_or_insert(1);
    let mut trials = Vec::new();
    trials.extend(engine::trials());
    libtest_mimic::run(&args, trials).exit();
}
