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

/// Runs user code (a `Display`, a `Drop`, a callback) so that a panic in it cannot unwind into
/// the crate's threads: `Err` carries the panic's message. The payload is dropped with
/// [`drop_quietly`], since its own `Drop` is user code too.
pub(crate) fn quietly<T>(f: impl FnOnce() -> T) -> std::result::Result<T, String> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(v) => Ok(v),
        Err(p) => {
            let message = panic_message(&*p);
            drop_quietly(p);
            Err(message)
        }
    }
}

/// Drops `x`, whose `Drop` may be user code, so that a panic in it goes no further. A panic
/// payload thrown by that `Drop` is leaked rather than dropped (its own `Drop` could throw again).
pub(crate) fn drop_quietly<T>(x: T) {
    if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(x))) {
        std::mem::forget(p);
    }
}

/// The `Display` of a user's error, or a note that it panicked.
pub(crate) fn display_quietly(e: &dyn std::fmt::Display) -> String {
    quietly(|| e.to_string()).unwrap_or_else(|p| format!("(the error's Display panicked: {p})"))
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Bomb;
    impl Drop for Bomb {
        fn drop(&mut self) {
            panic!("bomb dropped");
        }
    }
    impl std::fmt::Display for Bomb {
        fn fmt(&self, _: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            panic!("bomb shown")
        }
    }

    #[test]
    fn user_code_cannot_unwind() {
        let b = Bomb;
        assert_eq!(
            display_quietly(&b),
            "(the error's Display panicked: bomb shown)"
        );
        drop_quietly(b);
        // A panic whose payload panics again when dropped.
        let r = quietly(|| std::panic::panic_any(Bomb));
        assert_eq!(r.err().as_deref(), Some("a panic without a message"));
        assert_eq!(quietly(|| 7), Ok(7));
    }
}
