//! Toolkit and runtime basics, CPU only: the build script's toolkit discovery, version and
//! PCIe parsing, driver advice, error formatting, `NoDevice` without a GPU.
//!
//! One binary of the integration tests by subject (tests/README.md).

#[path = "../common/mod.rs"]
mod common;
mod discovery;
mod hostile30;
mod runtime;

use libtest_mimic::Arguments;

fn main() {
    let args = Arguments::from_args();
    let mut trials = Vec::new();
    trials.extend(discovery::trials());
    trials.extend(runtime::trials());
    trials.extend(hostile30::trials());
    libtest_mimic::run(&args, trials).exit();
}
