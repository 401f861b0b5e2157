//! pinstream's stream-ordered device pool (`DeviceBuffer::new_async`): it keeps freed memory
//! for the next allocation (no growth over many allocate / free rounds), gives it back on
//! `Device::empty_cache`, and gives it back by itself when an allocation would otherwise run
//! out of memory. One process-wide pool per device: the trials run one at a time.
//!
//! They need a GPU and are ignored where there is none. Build them for a GPU machine with
//! `cargo test --release --test memory --no-run`.

use std::time::Duration;

use crate::common::{ensure, within, R};
use libtest_mimic::Trial;
use pinstream::{Device, DeviceBuffer};

use crate::common::trial;

/// Prefix of this module's trial names (its path in the binary).
const PREFIX: &str = "stream_pool/";

const BOUND: Duration = Duration::from_secs(120);
const MIB: usize = 1 << 20;

/// The trials of this module, named `stream_pool/...`.
pub fn trials() -> Vec<Trial> {
    let no_gpu = !pinstream::available();
    let t = |name: &str, f: fn() -> R| {
        let name = format!("gpu/{name}");
        let what = name.clone();
        trial(PREFIX, name, move || within(&what, BOUND, f)).with_ignored_flag(no_gpu)
    };
    vec![
        t("reuses_and_empties", reuses_and_empties),
        t("gives_back_before_out_of_memory", gives_back_before_oom),
    ]
}

/// 50 rounds of 64 MiB allocated, written and freed: the pool holds about one buffer's worth
/// (it reused it), and after `empty_cache` none.
fn reuses_and_empties() -> R {
    let dev = Device::get(0)?;
    let s = dev.stream()?;
    dev.empty_cache()?;
    let r0 = dev.pool_reserved()?;
    for i in 0..50u8 {
        let mut b = DeviceBuffer::<u8>::new_async(&s, 64 * MIB)?;
        s.memset(&mut b, i.wrapping_add(1))?;
        drop(b);
        s.synchronize()?;
    }
    let r1 = dev.pool_reserved()?;
    ensure(
        r1 >= r0 + 64 * MIB as u64 && r1 <= r0 + 2 * 64 * MIB as u64,
        || format!("pool reserved {r0} -> {r1} bytes over 50 rounds of 64 MiB"),
    )?;
    let free1 = dev.memory_info()?.free;
    dev.empty_cache()?;
    let r2 = dev.pool_reserved()?;
    let free2 = dev.memory_info()?.free;
    ensure(r2 <= r0, || {
        format!("pool reserved {r2} bytes after empty_cache (before: {r0})")
    })?;
    ensure(free2 >= free1 + 64 * MIB, || {
        format!("free device memory {free1} -> {free2} after empty_cache")
    })
}

/// The pool keeps a large freed block; most of what is left is then taken by `cudaMalloc`; an
/// allocation larger than what is left but smaller than left + kept must succeed (the pool
/// trims itself and tries again) rather than report `OutOfMemory`.
fn gives_back_before_oom() -> R {
    let dev = Device::get(0)?;
    let s = dev.stream()?;
    dev.empty_cache()?;
    let free = dev.memory_info()?.free;
    let kept = free / 10 * 3;
    {
        let mut b = DeviceBuffer::<u8>::new_async(&s, kept)?;
        s.memset(&mut b, 7)?;
    }
    s.synchronize()?;
    ensure(dev.pool_reserved()? >= kept as u64, || {
        "the pool did not keep the freed block".into()
    })?;
    // Leave about a tenth of the device outside both.
    let left = dev.memory_info()?.free;
    let hog = DeviceBuffer::<u8>::new(&dev, left.saturating_sub(free / 10))?;
    let want = kept + free / 20;
    let got = DeviceBuffer::<u8>::new_async(&s, want);
    let ok = got.is_ok();
    let err = got.err().map(|e| e.to_string());
    drop(hog);
    s.synchronize()?;
    dev.empty_cache()?;
    ensure(ok, || {
        format!("{want} bytes with {kept} kept in the pool: {err:?}")
    })
}
