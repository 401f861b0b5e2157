//! Memory: pinned pools (`PinnedPool`, `PoolBlock`), the stream-ordered device pool, host
//! allocation flags.
//!
//! One binary of the integration tests by subject (tests/README.md).

#[path = "../common/mod.rs"]
mod common;
mod host;
mod pool;
mod stream_pool;

use libtest_mimic::Arguments;

fn main() {
    let mut args = Arguments::from_args();
    // One trial at a time, always: one process-wide device pool per device (pool/hostile,
    // stream_pool), and the soundness trials hold a stream with a spin kernel.
    args.test_threads = Some(1);
    let mut trials = Vec::new();
    // First: pool/hostile/gpu/pool/unused_ordinals_... runs before anything else made a pool.
    #[cfg(feature = "dlpack")]
    trials.extend(pool::hostile::trials());
    trials.extend(pool::trials());
    trials.extend(pool::hostile30::trials());
    trials.extend(stream_pool::trials());
    trials.extend(host::trials());
    libtest_mimic::run(&args, trials).exit();
}
