//! Helpers shared by the test executables.
#![allow(dead_code)]

pub mod guard;
pub mod threads;

use libtest_mimic::Failed;
use rand::rngs::SmallRng;
use rand::{RngCore, SeedableRng};

pub type R = Result<(), Failed>;

/// Fails with `msg` unless `cond`.
pub fn ensure(cond: bool, msg: impl FnOnce() -> String) -> R {
    if cond {
        Ok(())
    } else {
        Err(msg().into())
    }
}

/// A fresh generator with a seed from the OS; the seed goes into failure messages.
pub fn rng() -> (SmallRng, u64) {
    let seed = rand::random::<u64>();
    (SmallRng::seed_from_u64(seed), seed)
}

/// `n` random bytes that are never all zero.
pub fn random_bytes(n: usize) -> (Vec<u8>, u64) {
    let (mut rng, seed) = rng();
    let mut v = vec![0u8; n];
    rng.fill_bytes(&mut v);
    if n > 0 && v.iter().all(|&b| b == 0) {
        v[0] = 1;
    }
    (v, seed)
}

/// Compares two slices and names the first difference.
pub fn same<T: PartialEq + std::fmt::Debug>(what: &str, got: &[T], want: &[T], seed: u64) -> R {
    if got.len() != want.len() {
        return Err(format!(
            "{what}: length {} != {} (seed {seed})",
            got.len(),
            want.len()
        )
        .into());
    }
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        let bad = got.iter().zip(want).filter(|(a, b)| a != b).count();
        return Err(format!(
            "{what}: {bad} of {} elements differ, first at {i}: got {:?}, want {:?} (seed {seed})",
            want.len(),
            got[i],
            want[i]
        )
        .into());
    }
    Ok(())
}

/// Runs `f` on its own thread and fails if it has not returned within `bound`: a hang becomes a
/// failure (the stuck thread is left behind; the process ends with the runner).
pub fn within<T: Send + 'static>(
    what: &str,
    bound: std::time::Duration,
    f: impl FnOnce() -> Result<T, Failed> + Send + 'static,
) -> Result<T, Failed> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name(format!("watched: {what}"))
        .spawn(move || {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
            let _ = tx.send(r);
        })
        .map_err(|e| format!("{what}: spawn: {e}"))?;
    match rx.recv_timeout(bound) {
        Ok(Ok(r)) => r,
        Ok(Err(_)) => Err(format!("{what}: panicked").into()),
        Err(_) => Err(format!("{what}: HUNG (no return within {bound:?})").into()),
    }
}

/// A trial named `prefix` + `name`: each binary's modules put their trials under their path
/// (`pool/hostile/...`), the rest of the name as it was.
pub fn trial(
    prefix: &str,
    name: impl AsRef<str>,
    f: impl FnOnce() -> R + Send + 'static,
) -> libtest_mimic::Trial {
    libtest_mimic::Trial::test(format!("{prefix}{}", name.as_ref()), f)
}
