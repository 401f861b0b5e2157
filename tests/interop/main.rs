//! Interop: DLPack export and import (and their hostile reviews: releases, splits), foreign
//! CUDA streams, and cudarc.
//!
//! One binary of the integration tests by subject (tests/README.md).

#[path = "../common/mod.rs"]
mod common;
#[cfg(feature = "cudarc")]
mod cudarc;
mod dlpack;
mod foreign;

use libtest_mimic::Arguments;

fn main() {
    // A child process that one of the trials started (this executable again, with a
    // variable of its module set): it runs that part only.
    if dlpack::child_mode() || dlpack::hostile::release::child_mode() {
        return;
    }
    let mut args = Arguments::from_args();
    // One trial at a time unless asked otherwise: implicit device-wide synchronisations
    // (cudaFree, cudaHostAlloc) and spins on the GPU in one trial would disturb the
    // timing-sensitive checks of another.
    args.test_threads.get_or_insert(1);
    let mut trials = Vec::new();
    trials.extend(foreign::trials());
    trials.extend(dlpack::trials());
    trials.extend(dlpack::hostile::trials());
    trials.extend(dlpack::hostile::release::trials());
    trials.extend(dlpack::hostile::split::trials());
    trials.extend(dlpack::hostile30::trials());
    #[cfg(feature = "cudarc")]
    trials.extend(cudarc::trials());
    libtest_mimic::run(&args, trials).exit();
}
