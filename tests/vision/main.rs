//! Vision: the image feed (decode, dataset, sampler, augment, `ImageSource`) and its hostile
//! reviews. Self-contained (only `../common`), to move into the vision crate's tests.
//!
//! One binary of the integration tests by subject (tests/README.md).

#[path = "../common/mod.rs"]
mod common;
mod feed;

use libtest_mimic::Arguments;

fn main() {
    let mut args = Arguments::from_args();
    // One trial at a time unless asked otherwise: implicit device-wide synchronisations
    // (cudaFree, cudaHostAlloc) and spins on the GPU in one trial would disturb the
    // timing-sensitive checks of another.
    args.test_threads.get_or_insert(1);
    let mut trials = Vec::new();
    trials.extend(feed::trials());
    trials.extend(feed::hostile::trials());
    trials.extend(feed::hostile2::trials());
    libtest_mimic::run(&args, trials).exit();
}
