//! Vision: the image feed (decode, dataset, sampler, augment, `ImageSource`) and its hostile
//! reviews. The shared helpers are the core's (tests/common).
//!
//! One binary of the integration tests by subject (tests/README.md).

#[path = "../../../tests/common/mod.rs"]
mod common;
mod feed;
mod feed_hostile32;
#[cfg(feature = "nvjpeg")]
mod nvjpeg;
#[cfg(feature = "nvjpeg")]
mod nvjpeg_hostile;

use libtest_mimic::Arguments;

fn main() {
    let mut args = Arguments::from_args();
    // One trial at a time unless asked otherwise: implicit device-wide synchronisations
    // (cudaFree, cudaHostAlloc) and spins on the GPU in one trial would disturb the
    // timing-sensitive checks of another.
    args.test_threads.get_or_insert(1);
    let mut trials = Vec::new();
    trials.extend(feed::trials());
    trials.extend(feed::cache::trials());
    trials.extend(feed::cpus::trials());
    trials.extend(feed::hostile::trials());
    trials.extend(feed::hostile2::trials());
    trials.extend(feed_hostile32::trials());
    #[cfg(feature = "nvjpeg")]
    trials.extend(nvjpeg::trials());
    #[cfg(feature = "nvjpeg")]
    trials.extend(nvjpeg_hostile::trials());
    libtest_mimic::run(&args, trials).exit();
}

/// Where the test images may be, best first: the shared photographs (`../shared/data/images`
/// beside the repository), then the repository's `tests/data/images`. `CARGO_MANIFEST_DIR` is
/// vision/ under cargo and the repository's root on a GPU machine's pack (`.gpu/run`).
pub fn image_dirs() -> Vec<std::path::PathBuf> {
    let base = std::path::PathBuf::from(
        std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").into()),
    );
    [
        "../shared/data/images",
        "../../shared/data/images",
        "tests/data/images",
        "../tests/data/images",
    ]
    .iter()
    .map(|p| base.join(p))
    .filter(|p| p.is_dir())
    .collect()
}
