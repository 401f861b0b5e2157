//! Small helpers the modules share: a lock that survives a panicked holder, and fallible
//! allocation with a typed error.

use std::sync::{Mutex, MutexGuard};

use pinstream::{Error, Result};

/// Locks `m`, also after a thread panicked while holding it: the data guarded here stays
/// consistent at every await point (counters, caches), so the poison carries no meaning.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// An empty `Vec` with room for `len` elements, or `Error::InvalidArgument` where the host
/// cannot give it (never an abort).
pub(crate) fn try_vec<T>(op: &'static str, len: usize) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|e| {
        Error::invalid(
            op,
            format!(
                "cannot allocate {len} elements of {} bytes of host memory: {e}",
                std::mem::size_of::<T>()
            ),
        )
    })?;
    Ok(v)
}

/// The message of a caught panic (`&str` or `String` payloads), for `Error::Panicked`.
#[cfg_attr(not(feature = "nvjpeg"), allow(dead_code))]
pub(crate) fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_string()
    }
}
