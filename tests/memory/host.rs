//! Host allocation and registration flags: a CPU trial, run everywhere.

use crate::common::{ensure, R};
use libtest_mimic::Trial;
use pinstream::{HostAlloc, HostRegister};

use crate::common::trial;

/// Prefix of this module's trial names (its path in the binary).
const PREFIX: &str = "host/";

/// The trials of this module, named `host/...`.
pub fn trials() -> Vec<Trial> {
    vec![trial(PREFIX, "memory/flags", memory_flags)]
}

fn memory_flags() -> R {
    let f = HostAlloc::PORTABLE | HostAlloc::MAPPED;
    ensure(
        f.contains(HostAlloc::PORTABLE) && f.contains(HostAlloc::MAPPED),
        || format!("{f:?}"),
    )?;
    ensure(!f.contains(HostAlloc::WRITE_COMBINED), || format!("{f:?}"))?;
    ensure(
        HostAlloc::default() == HostAlloc::DEFAULT && HostAlloc::DEFAULT.bits() == 0,
        || "default".into(),
    )?;
    let r = HostRegister::READ_ONLY | HostRegister::PORTABLE;
    ensure(
        r.contains(HostRegister::READ_ONLY) && !r.contains(HostRegister::MAPPED),
        || format!("{r:?}"),
    )?;
    ensure(HostRegister::default().bits() == 0, || "default".into())
}
