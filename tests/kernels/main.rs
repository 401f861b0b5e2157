//! Kernels: normalize (and denormalize), resize, and their property-based trials against the
//! CPU reference.
//!
//! One binary of the integration tests by subject (tests/README.md).

mod boxes;
#[path = "../common/mod.rs"]
mod common;
mod hostile30;
mod normalize;
mod props;
mod resize;

use libtest_mimic::Arguments;

fn main() {
    // A child process that one of the trials started (this executable again, with a
    // variable of its module set): it runs that part only.
    if normalize::child_mode() {
        return;
    }
    let mut args = Arguments::from_args();
    // One trial at a time unless asked otherwise: implicit device-wide synchronisations
    // (cudaFree, cudaHostAlloc) and spins on the GPU in one trial would disturb the
    // timing-sensitive checks of another.
    args.test_threads.get_or_insert(1);
    let mut trials = Vec::new();
    trials.extend(normalize::trials());
    trials.extend(props::trials());
    trials.extend(resize::trials());
    trials.extend(hostile30::trials());
    libtest_mimic::run(&args, trials).exit();
}
