//! Prefetched batches handed to other libraries through DLPack: the slot leaves the feeder's
//! circle until every consumer has released it, and a spare slot takes its place meanwhile.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytemuck::Pod;

use super::pipeline::{give_back, Returner};
use super::slot::Slot;
use crate::device::Device;
use crate::dlpack::export::Consumer;
use crate::dlpack::Owner;
use crate::error::Result;
use crate::event::Event;
use crate::stream::Stream;

/// How many slots the consumers of exported batches hold, and how many spares stand in.
#[derive(Debug)]
pub(crate) struct Exports {
    /// Exported batches not released yet.
    pub(crate) held: AtomicUsize,
    /// Slots made beyond the depth to stand in for held ones (at most `limit`).
    pub(crate) spares: AtomicUsize,
    pub(crate) limit: usize,
    pub(crate) depth: usize,
}

impl Exports {
    pub(crate) fn new(depth: usize, limit: usize) -> Exports {
        Exports {
            held: AtomicUsize::new(0),
            spares: AtomicUsize::new(0),
            limit,
            depth,
        }
    }

    /// Slots the feeder and the consumer can still use: 0 means `next()` could only wait
    /// for a release.
    pub(crate) fn circulating(&self) -> usize {
        let total = self.depth + self.spares.load(Ordering::Acquire);
        total.saturating_sub(self.held.load(Ordering::Acquire))
    }

    /// Claims the right to make one more spare.
    pub(crate) fn claim_spare(&self) -> bool {
        self.spares
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.limit).then_some(n + 1)
            })
            .is_ok()
    }

    /// A held slot came back: retire one spare (the caller drops the slot) when more spares
    /// stand in than slots are still held, so that `depth` slots keep circulating.
    fn retire_spare(&self) -> bool {
        let held = self.held.load(Ordering::Acquire);
        self.spares
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n > held).then(|| n - 1)
            })
            .is_ok()
    }
}

/// One exported batch's slot, shared by its tensors (pixels, extras); the last release sends
/// it back to the feeder (or drops it, when a spare stands in for it or the prefetcher is
/// gone).
pub(crate) struct Lease<S: Leased> {
    slot: Mutex<Option<S>>,
    /// Events recorded on the consumers' streams at their release.
    also: Mutex<Vec<Event>>,
    /// A consumer released it without naming a stream: the device must be idle first.
    device_sync: AtomicBool,
    device: Device,
    back: Returner<S>,
    exports: Arc<Exports>,
}

/// What a lease needs of its slot.
pub(crate) trait Leased: Send + 'static {
    fn ready(&self) -> &Event;
    fn add_released(&mut self, events: Vec<Event>);
    fn forget_buffers(&mut self, err: &crate::Error);
}

impl<O: Pod + Send, E: Pod + Send> Leased for Box<Slot<O, E>> {
    fn ready(&self) -> &Event {
        &self.ready
    }
    fn add_released(&mut self, events: Vec<Event>) {
        self.also.extend(events);
    }
    fn forget_buffers(&mut self, err: &crate::Error) {
        if let Some(b) = self.bufs.take() {
            let bytes = b.input.byte_len() + b.output.byte_len() + b.extras.byte_len();
            crate::memory::tracker::leak("an exported prefetch slot", bytes, err);
            std::mem::forget(b);
        }
    }
}

impl<S: Leased> Lease<S> {
    pub(crate) fn new(slot: S, device: Device, back: Returner<S>, exports: Arc<Exports>) -> Self {
        Lease {
            slot: Mutex::new(Some(slot)),
            also: Mutex::new(Vec::new()),
            device_sync: AtomicBool::new(false),
            device,
            back,
            exports,
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl<S: Leased> Drop for Lease<S> {
    fn drop(&mut self) {
        let Some(mut slot) = lock(&self.slot).take() else {
            return;
        };
        self.exports.held.fetch_sub(1, Ordering::AcqRel);
        if self.device_sync.load(Ordering::Acquire) {
            if let Err(e) = self.device.synchronize() {
                // Nobody can say when the consumer is done with it: keep it out of use.
                slot.forget_buffers(&e);
                return;
            }
        }
        slot.add_released(std::mem::take(&mut *lock(&self.also)));
        if self.exports.retire_spare() {
            // Dropping the slot waits for its releases, then frees it.
            drop(slot);
        } else {
            give_back(&self.back, slot);
        }
    }
}

/// A tensor's share of a lease.
pub(crate) struct LeaseOwner<S: Leased>(pub(crate) Arc<Lease<S>>);

impl<S: Leased> Owner for LeaseOwner<S> {
    fn sync(&self, consumer: Option<&Stream>) -> Result<()> {
        match (consumer, lock(&self.0.slot).as_ref()) {
            (Some(s), Some(slot)) => s.wait(slot.ready()),
            _ => Ok(()),
        }
    }

    fn release(&self, consumer: Consumer<'_>) {
        let recorded = match consumer {
            Consumer::Nobody => return,
            Consumer::Unknown => None,
            // Without the event, the device is waited for before the slot is reused.
            Consumer::Stream(s) => Event::new(&s.device())
                .and_then(|ev| s.record(&ev).map(|()| ev))
                .ok(),
        };
        match recorded {
            Some(ev) => lock(&self.0.also).push(ev),
            None => self.0.device_sync.store(true, Ordering::Release),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Spares stand in for held slots up to the limit, and retire only when fewer slots are
    /// held than spares exist: `depth` slots keep circulating while they can.
    #[test]
    fn spares_keep_the_depth() {
        let x = Exports::new(2, 1);
        // Three exports: one spare, then none left to claim.
        assert!(x.claim_spare());
        x.held.fetch_add(1, Ordering::AcqRel);
        assert_eq!(x.circulating(), 2);
        assert!(!x.claim_spare());
        x.held.fetch_add(2, Ordering::AcqRel);
        assert_eq!(x.circulating(), 0);
        // One comes back: it returns to the feeder (2 still held > 1 spare).
        x.held.fetch_sub(1, Ordering::AcqRel);
        assert!(!x.retire_spare());
        assert_eq!(x.circulating(), 1);
        x.held.fetch_sub(1, Ordering::AcqRel);
        assert!(!x.retire_spare());
        assert_eq!(x.circulating(), 2);
        // The last one: now the spare retires and the depth is back to 2.
        x.held.fetch_sub(1, Ordering::AcqRel);
        assert!(x.retire_spare());
        assert_eq!((x.circulating(), x.spares.load(Ordering::Acquire)), (2, 0));
    }
}
