//! Tracking the GPU's uses of a piece of memory with events, so that host access, a use on
//! another stream and freeing all wait for them. The heart of the "never undefined behaviour"
//! promise: even if a `Pending` is leaked with `mem::forget`, the buffer still waits.
//!
//! Reads and writes are told apart, as a reader-writer lock would: a use that only reads the
//! memory waits for the last write, not for other reads, so one pinned source can feed copies
//! to several streams and devices at once; a write (and freeing) waits for the last write and
//! for every read queued since it. A read on a stream replaces that stream's earlier read: a
//! stream's work finishes in order, so the later event stands for both.
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

/// The events of the memory's last write and of the reads queued after it.
#[derive(Debug, Default)]
pub struct Tracker {
    state: Mutex<State>,
    /// For memory another library orders too: what follows each use (see [`Mirror`]).
    #[cfg(feature = "cudarc-any")]
    mirror: Option<Mirror>,
}

/// Another library's view of the same memory, kept up to date use by use: after every operation
/// pinstream queues on the memory, `stream` waits for it and `event` (the other library's
/// "last use" event, if it keeps one) is recorded there again — after a wait for its previous
/// record, so that it still stands for every use it stood for. The other library's later work
/// on the memory, on any stream, and its free wait for `event` (or come after on `stream`):
/// nothing is left to do when the memory is given back, so a view leaked with `mem::forget`
/// is as safe as one dropped.
#[cfg(feature = "cudarc-any")]
#[derive(Debug)]
pub(crate) struct Mirror {
    /// The stream the memory was lent on (the other library's).
    pub(crate) stream: Stream,
    /// The other library's event (borrowed: see `Event::from_raw`).
    pub(crate) event: Option<Event>,
}

#[cfg(feature = "cudarc-any")]
impl Mirror {
    /// Makes the mirror follow `event`, just recorded on `on` after a use.
    fn follow(&self, on: &Stream, event: &Event) -> Result<()> {
        // Two mirrors of one event (views of two halves of a slice, on two threads) must not
        // interleave their wait and record: the second record would stand only for its own
        // use. One lock for all mirrors: a few microseconds, rarely contended.
        static FOLLOW: Mutex<()> = Mutex::new(());
        let _one_at_a_time = crate::sync::lock(&FOLLOW);
        if let Some(theirs) = &self.event {
            self.stream.wait(theirs)?;
        }
        if on.id() != self.stream.id() {
            self.stream.wait(event)?;
        }
        if let Some(theirs) = &self.event {
            self.stream.record(theirs)?;
        }
        if on.device() != self.stream.device() {
            on.enter()?;
        }
        Ok(())
    }
}

/// One queued use: the event recorded after it and the `Stream::id` of the stream it was queued
/// on (ids are never reused).
#[derive(Clone, Debug)]
struct Use {
    event: Arc<Event>,
    stream: u64,
}

#[derive(Debug, Default)]
struct State {
    /// The latest operation that wrote the memory; every use waits for it.
    write: Option<Use>,
    /// Reads queued after `write` (each waited for it), at most one per stream: together with
    /// `write` they stand for every use so far.
    reads: Vec<Use>,
    /// Set when queued work on the memory could be neither tracked nor waited for.
    poisoned: Option<Error>,
}

/// Past this many streams with reads, finished ones are dropped before another is added.
const PRUNE_READS: usize = 8;

impl State {
    /// Every event that stands for a use so far (the write's, then the reads').
    fn all(&self) -> impl Iterator<Item = &Use> {
        self.write.iter().chain(self.reads.iter())
    }

    fn check(&self) -> Result<()> {
        match &self.poisoned {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }
}

type Guard<'a> = MutexGuard<'a, State>;

/// How an operation uses a tracked piece of memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Access {
    /// The GPU only reads it: waits for the last write, runs beside other reads.
    Read,
    /// The GPU writes it (or the operation is not known to only read): waits for everything.
    Write,
}

impl Tracker {
    pub(crate) fn new() -> Tracker {
        Tracker::default()
    }

    /// A tracker whose every recorded use `mirror` follows.
    #[cfg(feature = "cudarc-any")]
    pub(crate) fn mirrored(mirror: Mirror) -> Tracker {
        Tracker {
            state: Mutex::default(),
            mirror: Some(mirror),
        }
    }

    /// Refuses every later use with `err`: the GPU's use of the memory can no longer be known
    /// (the owner then leaks it).
    #[cfg(feature = "cudarc-any")]
    pub(crate) fn poison(&self, err: Error) {
        self.lock().poisoned.get_or_insert(err);
    }

    /// Makes later work on `stream` wait for the uses an `access` conflicts with (a read: the
    /// last write; a write: every use), without recording anything.
    #[cfg(feature = "cudarc-any")]
    pub(crate) fn wait_for(&self, stream: &Stream, access: Access) -> Result<()> {
        let events: Vec<Arc<Event>> = {
            let st = self.lock();
            st.check()?;
            match access {
                Access::Read => st.write.iter().map(|u| u.event.clone()).collect(),
                Access::Write => st.all().map(|u| u.event.clone()).collect(),
            }
        };
        for ev in events {
            stream.wait(&*ev)?;
        }
        Ok(())
    }

    fn lock(&self) -> Guard<'_> {
        // A poisoned lock only means another thread panicked while holding it; the state inside
        // is only ever changed by whole fields, so it is still consistent.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The events of every use so far, or the error that poisoned the tracker.
    fn uses(&self) -> Result<Vec<Arc<Event>>> {
        let st = self.lock();
        st.check()?;
        Ok(st.all().map(|u| u.event.clone()).collect())
    }

    /// Blocks until the GPU has finished every use of the memory (before host writes and
    /// freeing). An error means that cannot be known: the owner must not free or hand out the
    /// memory.
    pub(crate) fn synchronize(&self) -> Result<()> {
        for ev in self.uses()? {
            ev.synchronize()?;
        }
        Ok(())
    }

    /// Blocks until the GPU's last write to the memory has finished: enough for host reads,
    /// which may run beside GPU reads.
    pub(crate) fn synchronize_writes(&self) -> Result<()> {
        let write = {
            let st = self.lock();
            st.check()?;
            st.write.as_ref().map(|u| u.event.clone())
        };
        match write {
            Some(ev) => ev.synchronize(),
            None => Ok(()),
        }
    }

    /// Whether the GPU has finished every use of the memory, without blocking (false on any
    /// error).
    pub(crate) fn is_idle(&self) -> bool {
        // Queries do not block: fine under the lock, and no list to build on the pool's path.
        let st = self.lock();
        st.poisoned.is_none() && st.all().all(|u| u.event.is_complete().unwrap_or(false))
    }

    /// Adds what `stream` has queued so far as a use of the memory (PyTorch's `record_stream`):
    /// the stream first waits for the uses `access` conflicts with (for a read, the last
    /// write), then an event recorded on it joins the others, so a later write or free waits
    /// for it too.
    pub(crate) fn record_use(&self, stream: &Stream, access: Access) -> Result<()> {
        stream.enter()?;
        ordered_rw(stream, &[(self, access)], || Ok(())).map(|_| ())
    }

    /// Makes later work on `stream` wait for every use (used before a stream-ordered free).
    pub(crate) fn wait_on(&self, stream: &Stream) -> Result<()> {
        for ev in self.uses()? {
            stream.wait(&*ev)?;
        }
        Ok(())
    }
}

/// Queues `op` on `stream` after every earlier use of the memory behind `trackers` that it must
/// follow, then records one event after it into all of them. Every tracker is written; see
/// [`ordered_rw`] for operations that only read some.
pub(crate) fn ordered<R>(
    stream: &Stream,
    trackers: &[&Tracker],
    op: impl FnOnce() -> Result<R>,
) -> Result<(R, Arc<Event>)> {
    let uses: Vec<(&Tracker, Access)> = trackers.iter().map(|t| (*t, Access::Write)).collect();
    ordered_rw(stream, &uses, op)
}

/// Queues `op` on `stream` after the earlier uses it conflicts with — for a tracker it reads,
/// the last write; for one it writes, the last write and every read since — then records one
/// event after it into all of them. Returns `op`'s result and that event. A tracker named twice
/// counts as written if either names a write.
///
/// The trackers are locked in address order for the whole call, so concurrent operations on the
/// same memory from several threads are ordered too, and two locks never deadlock. A poisoned
/// tracker refuses the operation before anything is queued.
pub(crate) fn ordered_rw<R>(
    stream: &Stream,
    trackers: &[(&Tracker, Access)],
    op: impl FnOnce() -> Result<R>,
) -> Result<(R, Arc<Event>)> {
    let mut sorted: Vec<(&Tracker, Access)> = trackers.to_vec();
    sorted.sort_by_key(|(t, a)| (*t as *const Tracker as usize, *a == Access::Read));
    // After the sort a write comes first among entries for one tracker: keep it.
    sorted.dedup_by_key(|(t, _)| *t as *const Tracker as usize);
    let mut guards: Vec<(Guard<'_>, Access)> = sorted.iter().map(|(t, a)| (t.lock(), *a)).collect();

    for (g, _) in &guards {
        g.check()?;
    }
    let me = stream.id();
    // A use queued on this same stream is already ordered before `op`; each other event is
    // waited for once (the trackers of one earlier operation share its event).
    let mut waited: Vec<&Arc<Event>> = Vec::new();
    for (g, access) in &guards {
        let must: Vec<&Use> = match access {
            Access::Read => g.write.iter().collect(),
            Access::Write => g.all().collect(),
        };
        for u in must {
            if u.stream == me || waited.iter().any(|w| Arc::ptr_eq(w, &u.event)) {
                continue;
            }
            stream.wait(&*u.event)?;
            waited.push(&u.event);
        }
    }
    drop(waited);
    let out = op()?;

    // Reuse an event this call replaces when nobody else holds it and it is on this device.
    let device = stream.device();
    let reusable = guards.first_mut().and_then(|(g, access)| {
        let old = match access {
            Access::Write => g.write.take(),
            Access::Read => g
                .reads
                .iter()
                .position(|u| u.stream == me)
                .map(|i| g.reads.swap_remove(i)),
        };
        old.and_then(|u| Arc::try_unwrap(u.event).ok())
            .filter(|ev| ev.device() == device)
    });
    let event = reusable
        .map_or_else(|| Event::new(&device), Ok)
        .and_then(|ev| stream.record(&ev).map(|()| ev));
    let event = match event {
        Ok(ev) => Arc::new(ev),
        Err(e) => {
            // The work is queued but cannot be tracked: wait for it here, so nothing can be
            // freed or read under it. If even that fails, nobody can know when the memory is
            // free again: poison the trackers (their owners then leak the memory).
            if let Err(wait) = stream.synchronize() {
                for (g, _) in &mut guards {
                    g.poisoned = Some(wait.clone());
                }
            }
            return Err(e);
        }
    };
    let new = Use {
        event: event.clone(),
        stream: me,
    };
    for (g, access) in &mut guards {
        match access {
            Access::Write => {
                // It waited for every earlier use: it alone stands for them now.
                g.write = Some(new.clone());
                g.reads.clear();
            }
            Access::Read => {
                if let Some(u) = g.reads.iter_mut().find(|u| u.stream == me) {
                    *u = new.clone();
                    continue;
                }
                if g.reads.len() >= PRUNE_READS {
                    // Finished reads need no waiting any more (a failed query keeps one).
                    g.reads.retain(|u| !u.event.is_complete().unwrap_or(false));
                }
                g.reads.push(new.clone());
            }
        }
    }
    // Memory another library orders too: its stream and event follow this use at once.
    #[cfg(feature = "cudarc-any")]
    for (t, _) in &sorted {
        let Some(m) = &t.mirror else { continue };
        if let Err(e) = m.follow(stream, &event) {
            // The other library might not wait for this use: wait for it here (then there is
            // nothing to wait for). If even that fails, nobody can know when the memory is
            // free again: poison the trackers.
            if let Err(wait) = stream.synchronize() {
                for (g, _) in &mut guards {
                    g.poisoned = Some(wait.clone());
                }
            }
            let _ = stream.enter();
            return Err(e);
        }
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
