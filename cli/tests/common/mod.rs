//! Helpers shared by the test executables of `pinstream-cli`.
#![allow(dead_code)]

use libtest_mimic::Failed;

pub type R = Result<(), Failed>;

/// Fails with `msg` unless `cond`.
pub fn ensure(cond: bool, msg: impl FnOnce() -> String) -> R {
    if cond {
        Ok(())
    } else {
        Err(msg().into())
    }
}

/// The repository's `tests/data` folder: under `CARGO_MANIFEST_DIR`'s parent when cargo runs
/// this crate's tests (the manifest is `cli/Cargo.toml`), under `CARGO_MANIFEST_DIR` itself when
/// the packed tests' runner sets it to the repository root, else under the working directory.
pub fn test_data() -> std::path::PathBuf {
    let dir = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_default();
    [dir.join("tests/data"), dir.join("../tests/data")]
        .into_iter()
        .find(|p| p.is_dir())
        .unwrap_or_else(|| dir.join("tests/data"))
}
