//! Tracking the GPU's last use of a piece of memory with an event, so that host access, a use on
//! another stream and freeing all wait for it. The heart of the "never undefined behaviour"
//! promise: even if a `Pending` is leaked with `mem::forget`, the buffer still waits.
//!
//! When the GPU's use of a piece of memory can no longer be known (work was queued, but neither
//! an event could be recorded after it nor the stream be waited for), the tracker is *poisoned*:
//! every later operation and host access is refused with the error that caused it, and the
//! owner leaks the memory instead of freeing it (see [`leaked`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::{Error, Result};
use crate::event::Event;
use crate::stream::Stream;

/// The event recorded after the latest operation that touched the memory. Every operation first
/// waits for it, so the latest event stands for all earlier uses on every stream.
#[derive(Debug, Default)]
pub struct Tracker {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    last: Option<Arc<Event>>,
    /// `Stream::id` of the stream `last` was recorded on (ids are never reused).
    last_stream: u64,
    /// Set when queued work on the memory could be neither tracked nor waited for.
    poisoned: Option<Error>,
}

type Guard<'a> = MutexGuard<'a, State>;

impl Tracker {
    pub(crate) fn new() -> Tracker {
        Tracker::default()
    }

    fn lock(&self) -> Guard<'_> {
        // A poisoned lock only means another thread panicked while holding it; the state inside
        // is only ever replaced whole, so it is still consistent.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The last event, or the error that poisoned the tracker.
    fn last(&self) -> Result<Option<Arc<Event>>> {
        let st = self.lock();
        match &st.poisoned {
            Some(e) => Err(e.clone()),
            None => Ok(st.last.clone()),
        }
    }

    /// Blocks until the GPU has finished with the memory. An error means that cannot be known:
    /// the owner must not free or hand out the memory.
    pub(crate) fn synchronize(&self) -> Result<()> {
        match self.last()? {
            Some(ev) => ev.synchronize(),
            None => Ok(()),
        }
    }

    /// Whether the GPU has finished with the memory, without blocking (false on any error).
    pub(crate) fn is_idle(&self) -> bool {
        match self.last() {
            Ok(Some(ev)) => ev.is_complete().unwrap_or(false),
            Ok(None) => true,
            Err(_) => false,
        }
    }

    /// Makes later work on `stream` wait for the last use (used before a stream-ordered free).
    pub(crate) fn wait_on(&self, stream: &Stream) -> Result<()> {
        match self.last()? {
            Some(ev) => stream.wait(&*ev),
            None => Ok(()),
        }
    }
}

/// Queues `op` on `stream` after every earlier use of the memory behind `trackers`, then records
/// one event after it into all of them. Returns `op`'s result and that event.
///
/// The trackers are locked in address order for the whole call, so concurrent operations on the
/// same memory from several threads are ordered too, and two locks never deadlock. A poisoned
/// tracker refuses the operation before anything is queued.
pub(crate) fn ordered<R>(
    stream: &Stream,
    trackers: &[&Tracker],
    op: impl FnOnce() -> Result<R>,
) -> Result<(R, Arc<Event>)> {
    let mut sorted: Vec<&Tracker> = trackers.to_vec();
    sorted.sort_by_key(|t| *t as *const Tracker as usize);
    sorted.dedup_by_key(|t| *t as *const Tracker as usize);
    let mut guards: Vec<Guard<'_>> = sorted.iter().map(|t| t.lock()).collect();

    for g in &guards {
        if let Some(e) = &g.poisoned {
            return Err(e.clone());
        }
    }
    // A use queued on this same stream is already ordered before `op`; each other event is
    // waited for once (the trackers of one earlier operation share its event).
    let mut waited: Vec<&Arc<Event>> = Vec::new();
    for g in &guards {
        if let Some(ev) = g.last.as_ref() {
            if g.last_stream == stream.id() || waited.iter().any(|w| Arc::ptr_eq(w, ev)) {
                continue;
            }
            stream.wait(&**ev)?;
            waited.push(ev);
        }
    }
    drop(waited);
    let out = op()?;

    // Reuse the first tracker's event when nobody else holds it and it is on this device.
    let reusable = guards
        .first_mut()
        .and_then(|g| g.last.take())
        .and_then(|ev| Arc::try_unwrap(ev).ok())
        .filter(|ev| ev.device() == stream.device());
    let event = reusable
        .map_or_else(|| Event::new(&stream.device()), Ok)
        .and_then(|ev| stream.record(&ev).map(|()| ev));
    let event = match event {
        Ok(ev) => Arc::new(ev),
        Err(e) => {
            // The work is queued but cannot be tracked: wait for it here, so nothing can be
            // freed or read under it. If even that fails, nobody can know when the memory is
            // free again: poison the trackers (their owners then leak the memory).
            if let Err(wait) = stream.synchronize() {
                for g in &mut guards {
                    g.poisoned = Some(wait.clone());
                }
            }
            return Err(e);
        }
    };
    for g in &mut guards {
        g.last = Some(event.clone());
        g.last_stream = stream.id();
    }
    Ok((out, event))
}

static LEAKED_ALLOCATIONS: AtomicU64 = AtomicU64::new(0);
static LEAKED_BYTES: AtomicU64 = AtomicU64::new(0);

/// Memory the crate deliberately did not free because it could not confirm that the GPU had
/// finished with it (a failed wait: in practice a CUDA context broken by a sticky error).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Leaked {
    /// Allocations (or registrations) leaked so far in this process.
    pub allocations: u64,
    /// Their total size in bytes.
    pub bytes: u64,
}

/// What the crate has leaked so far in this process rather than free memory a DMA or kernel
/// might still touch. Zero unless a wait for the GPU failed.
pub fn leaked() -> Leaked {
    Leaked {
        allocations: LEAKED_ALLOCATIONS.load(Ordering::Relaxed),
        bytes: LEAKED_BYTES.load(Ordering::Relaxed),
    }
}

/// Records (and says on stderr) that `bytes` of `what` are leaked because of `err`.
pub(crate) fn leak(what: &str, bytes: usize, err: &Error) {
    LEAKED_ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
    LEAKED_BYTES.fetch_add(bytes as u64, Ordering::Relaxed);
    eprintln!(
        "pinstream: leaking {bytes} bytes of {what}: could not confirm the GPU has finished with \
         them ({err})"
    );
}
