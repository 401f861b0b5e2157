//! Prefetch: the background prefetcher (order, errors, pinned and file sources, resident
//! ranges), the CPUs its threads run on, its fault schedules, the hostile review, and extreme sizes across the public API.
//!
//! One binary of the integration tests by subject (tests/README.md).

#[path = "../common/mod.rs"]
mod common;
mod cpus;
mod faults;
mod hostile;
mod limits;
mod prefetcher;

use libtest_mimic::Arguments;

fn main() {
    // A child process that one of the trials started (this executable again, with a
    // variable of its module set): it runs that part only.
    if hostile::child_mode() || limits::child_mode() {
        return;
    }
    let mut args = Arguments::from_args();
    // One trial at a time unless asked otherwise: implicit device-wide synchronisations
    // (cudaFree, cudaHostAlloc) and spins on the GPU in one trial would disturb the
    // timing-sensitive checks of another.
    args.test_threads.get_or_insert(1);
    let mut trials = Vec::new();
    trials.extend(prefetcher::trials());
    trials.extend(cpus::trials());
    // Each installs a panic hook that keeps its expected panics out of the output.
    trials.extend(faults::trials());
    trials.extend(hostile::trials());
    trials.extend(limits::trials());
    libtest_mimic::run(&args, trials).exit();
}
