//! Small helpers for the crate's worker threads (staging engine, prefetcher).

use std::sync::{Mutex, MutexGuard};

/// Locks `m`, ignoring poison: a poisoned lock only means a thread panicked while holding it, and
/// every state behind the crate's locks is updated in single steps, so it is still consistent.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The message of a caught panic (`&str` or `String` payloads), for `Error::Panicked` and
/// `Error::Loader`.
pub(crate) fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".to_string()
    }
}
