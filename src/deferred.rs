//! Deferred releases: memory given back only after the devices have finished the work queued
//! before now, from a background thread. Used for exported memory (`dlpack`) whose consumer's
//! work cannot be ordered on the GPU; the prefetcher waits for them before it reports every
//! slot held.
//!
//! A consumer that names no stream (`-1`, a host consumer such as numpy or a PyTorch CPU
//! tensor, or the per-thread default stream) or a stream pinstream may no longer touch (one
//! the consumer lent only for the `__dlpack__` call: it may be destroyed, and its handle
//! reused, before the release) leaves no point on the GPU to order the memory's reuse after.
//! The memory may go back only after the devices involved have finished what was queued
//! before the release. Waiting for that in the deleter would stall the caller behind
//! unrelated GPU work, and deadlock with a queued host callback that needs the GIL the deleter
//! holds; one background thread waits instead and gives the memory back afterwards.
//!
//! Which devices are waited for ([`Scope`]): the device of device memory, or, for page-locked
//! host memory (which any device may read), every device on which the process has a context —
//! devices the job never used are not touched (no context is created on them). Where a wait
//! fails, the owners that depended on that device are leaked (nobody can say when the memory
//! is free again); the others go back.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::device::Device;
use crate::error::{Error, Result};

/// Which devices a deferred release waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Scope {
    /// The device the memory is on (device memory: its consumer's work is queued there).
    Device(Device),
    /// Every device with an active context in this process (page-locked host memory).
    Active,
}

/// What gives the memory back: run once the scope's devices have finished, or forgotten
/// (leaked) where they could not be waited for.
pub(crate) type Release = Box<dyn FnOnce() + Send>;

/// A release, with what it waits for.
type Job = (Release, Scope);

/// Releases queued and not yet done.
static PENDING: Mutex<usize> = Mutex::new(0);
static DONE: Condvar = Condvar::new();
/// The reaper thread's queue (`None` where the thread could not be started).
type Queue = Option<Mutex<Sender<Job>>>;
static QUEUE: OnceLock<Queue> = OnceLock::new();

/// The process whose reaper this is (0 before it starts). A forked child has no reaper thread,
/// and may have inherited the locks below held by a parent thread: it takes none of them.
static REAPER_PID: AtomicU32 = AtomicU32::new(0);

/// Whether this is a forked child of the process that started the reaper.
fn forked() -> bool {
    let owner = REAPER_PID.load(Ordering::SeqCst);
    owner != 0 && owner != std::process::id()
}

fn pending() -> std::sync::MutexGuard<'static, usize> {
    PENDING.lock().unwrap_or_else(|e| e.into_inner())
}

/// The devices on which this process has a context. A device the driver cannot say about is
/// included (waiting on it is safe, only maybe wasteful).
fn active_devices() -> Result<Vec<Device>> {
    Ok(Device::all()?
        .into_iter()
        .filter(|d| crate::sys::driver::primary_context_active(d.raw()).unwrap_or(true))
        .collect())
}

/// Set at process exit (`atexit`), before the CUDA runtime tears itself down: the reaper
/// touches CUDA no more and leaves what it holds to the operating system.
static SHUTDOWN: AtomicBool = AtomicBool::new(false);
/// Held by the reaper around each batch of releases, and for good by the exit handler once
/// the reaper is idle: no CUDA call of the reaper's can overlap the runtime's teardown.
static BUSY: Mutex<()> = Mutex::new(());

/// The `atexit` handler: stops the reaper from touching CUDA. Waits (a bounded time) for the
/// batch in progress, then keeps the reaper out for good.
extern "C" fn stop_reaper() {
    SHUTDOWN.store(true, Ordering::SeqCst);
    if forked() {
        // A forked child exiting: it has no reaper (and its copy of the lock may be held).
        return;
    }
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        match BUSY.try_lock() {
            Ok(guard) => {
                std::mem::forget(guard);
                return;
            }
            Err(std::sync::TryLockError::Poisoned(p)) => {
                std::mem::forget(p.into_inner());
                return;
            }
            Err(std::sync::TryLockError::WouldBlock) if Instant::now() < end => {
                std::thread::sleep(Duration::from_millis(1));
            }
            Err(std::sync::TryLockError::WouldBlock) => return,
        }
    }
}

/// Counts a batch of jobs as done when dropped, even if the batch unwinds.
struct Done(usize);

impl Drop for Done {
    fn drop(&mut self) {
        let mut p = pending();
        *p = p.saturating_sub(self.0);
        DONE.notify_all();
    }
}

/// Waits for the devices the jobs need, then releases each job's owner whose devices were all
/// waited for (ordered: nothing of the consumer's is left) and drops it; the others are leaked,
/// as is everything once the process is exiting.
fn reap(jobs: Vec<Job>) {
    let _done = Done(jobs.len());
    let _busy = BUSY.lock().unwrap_or_else(|e| e.into_inner());
    if SHUTDOWN.load(Ordering::SeqCst) {
        std::mem::forget(jobs);
        return;
    }
    // The devices each scope needs, and the errors of those that could not be waited for.
    let any_active = jobs.iter().any(|(_, s)| *s == Scope::Active);
    let outcome = crate::sync::quietly(|| {
        let mut wanted: Vec<Device> = jobs
            .iter()
            .filter_map(|(_, s)| match s {
                Scope::Device(d) => Some(*d),
                Scope::Active => None,
            })
            .collect();
        // Enumerating the devices can fail apart from waiting for them: that leaks only the
        // jobs that needed the enumeration.
        let active = if any_active {
            active_devices()
        } else {
            Ok(Vec::new())
        };
        if let Ok(a) = &active {
            wanted.extend(a.iter().copied());
        }
        wanted.sort_by_key(|d| d.raw());
        wanted.dedup();
        let mut failed: Vec<(Device, Error)> = Vec::new();
        for d in &wanted {
            if SHUTDOWN.load(Ordering::SeqCst) {
                failed.push((
                    *d,
                    Error::invalid("dlpack release", "the process is exiting"),
                ));
                continue;
            }
            if let Err(e) = d.synchronize() {
                failed.push((*d, e));
            }
        }
        (active.err(), failed)
    })
    .map_err(|p| Error::invalid("dlpack release", p));
    for (owner, scope) in jobs {
        let broken = match &outcome {
            Err(e) => Some(e.clone()),
            Ok((active_err, failed)) => match scope {
                Scope::Device(d) => failed.iter().find(|(f, _)| *f == d).map(|(_, e)| e.clone()),
                Scope::Active => active_err
                    .clone()
                    .or_else(|| failed.first().map(|(_, e)| e.clone())),
            },
        };
        if SHUTDOWN.load(Ordering::SeqCst) {
            // Exiting: the operating system takes the memory back; no CUDA call now.
            std::mem::forget(owner);
            continue;
        }
        match broken {
            None => {
                let _ = crate::sync::quietly(owner);
            }
            Some(e) => {
                // `leak` writes to stderr, which may be a closed pipe: never let that unwind.
                let _ = crate::sync::quietly(|| {
                    crate::memory::tracker::leak("memory released by a consumer", 0, &e)
                });
                std::mem::forget(owner);
            }
        }
    }
}

fn queue() -> Option<&'static Mutex<Sender<Job>>> {
    QUEUE
        .get_or_init(|| {
            REAPER_PID.store(std::process::id(), Ordering::SeqCst);
            let (tx, rx) = channel::<Job>();
            let started = std::thread::Builder::new()
                .name("pinstream-reaper".into())
                .spawn(move || {
                    while let Ok(first) = rx.recv() {
                        // Everything queued meanwhile shares one wait.
                        let mut batch = vec![first];
                        batch.extend(rx.try_iter());
                        reap(batch);
                    }
                })
                .ok()
                .map(|_| Mutex::new(tx));
            if started.is_some() {
                // SAFETY: `stop_reaper` is an `extern "C" fn()` that does not unwind (it only
                // stores an atomic, polls a mutex and sleeps). The runtime registered its own
                // teardown at its initialisation, before the first deferred release could
                // exist, so this handler (registered later) runs before it.
                let _ = unsafe { libc::atexit(stop_reaper) };
            }
            started
        })
        .as_ref()
}

/// Gives `owner` back once the devices of `scope` have finished the work queued before now,
/// from the background thread (or here, where that thread cannot be started). The caller
/// never waits for the GPU.
pub(crate) fn defer(owner: Release, scope: Scope) {
    if forked() {
        // The parent's memory, in a child with no reaper: left alone.
        std::mem::forget(owner);
        return;
    }
    *pending() += 1;
    let sent = match queue() {
        Some(q) => q
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send((owner, scope))
            .map_err(|e| e.0),
        None => Err((owner, scope)),
    };
    if let Err(job) = sent {
        reap(vec![job]);
    }
}

/// How many deferred releases are queued and not yet done.
pub(crate) fn pending_releases() -> usize {
    if forked() {
        return 0;
    }
    *pending()
}

/// Waits until the tensors whose release was deferred (see the module: consumers that named
/// no stream, host consumers, streams lent only for the handover) have gone back to their
/// owners, at most `timeout`. Whether they all have (`false` at once in a forked child, where
/// no reaper runs). For tests and memory accounting.
pub fn wait_for_releases(timeout: Duration) -> bool {
    if forked() {
        // A forked child: no reaper runs here, so nothing it inherited will ever be done.
        return false;
    }
    let end = Instant::now() + timeout;
    let mut p = pending();
    while *p > 0 {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        p = DONE
            .wait_timeout(p, left)
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
    true
}
