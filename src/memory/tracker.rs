//! Tracking the GPU's last use of a piece of memory with an event, so that host access, a use on
//! another stream and freeing all wait for it. The heart of the "never undefined behaviour"
//! promise: even if a `Pending` is leaked with `mem::forget`, the buffer still waits.

use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::Result;
use crate::event::Event;
use crate::stream::Stream;

/// The event recorded after the latest operation that touched the memory. Every operation first
/// waits for it, so the latest event stands for all earlier uses on every stream.
#[derive(Debug, Default)]
pub struct Tracker {
    last: Mutex<Option<Arc<Event>>>,
}

type Guard<'a> = MutexGuard<'a, Option<Arc<Event>>>;

impl Tracker {
    pub(crate) fn new() -> Tracker {
        Tracker::default()
    }

    fn lock(&self) -> Guard<'_> {
        // A poisoned lock only means another thread panicked while holding it; the event inside
        // is still valid.
        self.last.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Blocks until the GPU has finished with the memory.
    pub(crate) fn synchronize(&self) -> Result<()> {
        let last = self.lock().clone();
        match last {
            Some(ev) => ev.synchronize(),
            None => Ok(()),
        }
    }

    /// Makes later work on `stream` wait for the last use (used before a stream-ordered free).
    pub(crate) fn wait_on(&self, stream: &Stream) -> Result<()> {
        let last = self.lock();
        match last.as_ref() {
            Some(ev) => stream.wait(&**ev),
            None => Ok(()),
        }
    }
}

/// Queues `op` on `stream` after every earlier use of the memory behind `trackers`, then records
/// one event after it into all of them. Returns `op`'s result and that event.
///
/// The trackers are locked in address order for the whole call, so concurrent operations on the
/// same memory from several threads are ordered too, and two locks never deadlock.
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
        if let Some(ev) = g.as_ref() {
            stream.wait(&**ev)?;
        }
    }
    let out = op()?;

    // Reuse the first tracker's event when nobody else holds it and it is on this device.
    let reusable = guards
        .first_mut()
        .and_then(|g| g.take())
        .and_then(|ev| Arc::try_unwrap(ev).ok())
        .filter(|ev| ev.device() == stream.device());
    let event = match reusable.map_or_else(|| Event::new(&stream.device()), Ok) {
        Ok(ev) => ev,
        Err(e) => return Err(untracked(stream, e)),
    };
    if let Err(e) = stream.record(&event) {
        return Err(untracked(stream, e));
    }
    let event = Arc::new(event);
    for g in &mut guards {
        **g = Some(event.clone());
    }
    Ok((out, event))
}

/// The work is queued but could not be tracked: wait for it here so nothing can be freed or read
/// under it, then report the error.
fn untracked(stream: &Stream, err: crate::Error) -> crate::Error {
    let _ = stream.synchronize();
    err
}
