//! Deferred releases of host tensors handed to host consumers ([`Tensor::host_as_cpu`]).
//!
//! A host consumer (numpy, a PyTorch CPU tensor) releases with no stream, often from a
//! deleter that holds Python's GIL. Its GPU work on the memory is unknown — PyTorch may still
//! be copying from the page-locked memory with `non_blocking=True`, on any device — so the
//! memory may go back only after every device has finished what was queued before the
//! release. Waiting for that in the deleter would stall the caller behind unrelated GPU work
//! (and deadlock with a host callback that needs the GIL); one background thread waits
//! instead and gives the memory back afterwards.
//!
//! [`Tensor::host_as_cpu`]: super::Tensor::host_as_cpu

use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::export::{Consumer, Owner};
use crate::device::Device;
use crate::error::Result;

/// Releases queued and not yet done.
static PENDING: Mutex<usize> = Mutex::new(0);
static DONE: Condvar = Condvar::new();
/// The reaper thread's queue (`None` where the thread could not be started).
type Queue = Option<Mutex<Sender<Arc<dyn Owner>>>>;
static QUEUE: OnceLock<Queue> = OnceLock::new();

fn pending() -> std::sync::MutexGuard<'static, usize> {
    PENDING.lock().unwrap_or_else(|e| e.into_inner())
}

/// Waits for every device, then releases `owners` (ordered: nothing of the consumer's is
/// left) and drops them; where a device cannot be waited for, they are leaked.
fn reap(owners: Vec<Arc<dyn Owner>>) {
    let n = owners.len();
    let waited: Result<()> = crate::sync::quietly(|| {
        for d in Device::all()? {
            d.synchronize()?;
        }
        Ok(())
    })
    .unwrap_or_else(|p| Err(crate::Error::invalid("dlpack release", p)));
    match waited {
        Ok(()) => {
            for o in owners {
                let _ = crate::sync::quietly(move || {
                    o.release(Consumer::Nobody);
                    drop(o);
                });
            }
        }
        Err(e) => {
            crate::memory::tracker::leak("host memory released by a host consumer", 0, &e);
            std::mem::forget(owners);
        }
    }
    let mut p = pending();
    *p = p.saturating_sub(n);
    DONE.notify_all();
}

fn queue() -> Option<&'static Mutex<Sender<Arc<dyn Owner>>>> {
    QUEUE
        .get_or_init(|| {
            let (tx, rx) = channel::<Arc<dyn Owner>>();
            std::thread::Builder::new()
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
                .map(|_| Mutex::new(tx))
        })
        .as_ref()
}

/// Gives `owner` back once every device has finished the work queued before now, from the
/// background thread (or here, where that thread cannot be started).
pub(crate) fn defer(owner: Arc<dyn Owner>) {
    *pending() += 1;
    let sent = match queue() {
        Some(q) => q
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .send(owner)
            .map_err(|e| e.0),
        None => Err(owner),
    };
    if let Err(owner) = sent {
        reap(vec![owner]);
    }
}

/// Waits until the host tensors that host consumers released (numpy arrays and CPU tensors
/// over [`Tensor::host_as_cpu`](super::Tensor::host_as_cpu) memory) have gone back to their
/// pools, at most `timeout`. Whether they all have. For tests and memory accounting: the
/// memory is given back in the background after every device finished what was queued
/// before each release.
pub fn wait_for_releases(timeout: Duration) -> bool {
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
