//! Prefetched batches handed to other libraries (through DLPack: `dlpack::batch`): the slot
//! leaves the feeder's circle until every consumer has released it, and a spare slot takes its
//! place meanwhile.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use bytemuck::Pod;

use super::pipeline::{give_back_or, Returner};
use super::slot::Slot;
use crate::device::Device;
use crate::error::Result;
use crate::event::Event;
use crate::stream::Stream;
use crate::sync::lock;

/// How many slots the consumers of exported batches hold, how many spares stand in, and the
/// spares parked while fewer batches are held than spares exist (so that `depth` slots
/// circulate, and an export takes a parked spare rather than make one).
pub(crate) struct Exports<S> {
    counts: Mutex<Counts<S>>,
    pub(crate) limit: usize,
    pub(crate) depth: usize,
}

struct Counts<S> {
    /// Exported batches not released yet.
    held: usize,
    /// Slots made beyond the depth (at most `limit`), circulating or parked.
    spares: usize,
    parked: Vec<S>,
}

/// What stands in for a slot leaving the circle.
pub(crate) enum Stand<S> {
    /// A parked spare: give it to the feeder.
    Parked(S),
    /// Make a new spare (and call `spare_failed` if that fails).
    New,
    /// Nothing: `limit` spares exist already.
    Nothing,
}

impl<S> Exports<S> {
    pub(crate) fn new(depth: usize, limit: usize) -> Self {
        Exports {
            counts: Mutex::new(Counts {
                held: 0,
                spares: 0,
                parked: Vec::new(),
            }),
            limit,
            depth,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Counts<S>> {
        crate::sync::lock(&self.counts)
    }

    /// Slots the feeder and the consumer can still use: 0 means `next()` could only wait
    /// for a release.
    pub(crate) fn circulating(&self) -> usize {
        let c = self.lock();
        (self.depth + c.spares).saturating_sub(c.held + c.parked.len())
    }

    /// Every slot there is, held and parked included.
    pub(crate) fn total(&self) -> usize {
        self.depth + self.lock().spares
    }

    /// A batch leaves the circle: what stands in for it.
    pub(crate) fn on_export(&self) -> Stand<S> {
        let mut c = self.lock();
        c.held += 1;
        if let Some(s) = c.parked.pop() {
            Stand::Parked(s)
        } else if c.spares < self.limit {
            c.spares += 1;
            Stand::New
        } else {
            Stand::Nothing
        }
    }

    /// The spare that `on_export` allowed could not be made.
    pub(crate) fn spare_failed(&self) {
        let mut c = self.lock();
        c.spares = c.spares.saturating_sub(1);
    }

    /// A held slot comes back: `Some` to give it to the feeder, `None` when it was parked
    /// (`depth` slots circulate without it).
    pub(crate) fn on_release(&self, slot: S) -> Option<S> {
        let mut c = self.lock();
        c.held = c.held.saturating_sub(1);
        let circulating = (self.depth + c.spares).saturating_sub(c.held + c.parked.len());
        if circulating > self.depth {
            c.parked.push(slot);
            None
        } else {
            Some(slot)
        }
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
    exports: Arc<Exports<S>>,
}

/// What a lease needs of its slot.
pub(crate) trait Leased: Send + 'static {
    /// Makes `s` wait for the batch (`ready`) and for every use of it recorded when it left
    /// the consumer (`release`, and the `record_stream` users' events): the new consumer may
    /// write it.
    fn order_after(&self, s: &Stream) -> Result<()>;
    fn add_released(&mut self, events: Vec<Event>);
    /// An event for a release on a stream of `device` (a spare one of the slot's, or new).
    fn release_event(&mut self, device: &Device) -> Result<Event>;
    fn forget_buffers(&mut self, err: &crate::Error);
}

impl<O: Pod + Send, E: Pod + Send> Leased for Box<Slot<O, E>> {
    fn order_after(&self, s: &Stream) -> Result<()> {
        s.wait(&self.ready)?;
        s.wait(&self.release)?;
        self.also.iter().try_for_each(|ev| s.wait(ev))
    }
    fn add_released(&mut self, events: Vec<Event>) {
        self.also.extend(events);
    }
    fn release_event(&mut self, device: &Device) -> Result<Event> {
        Slot::<O, E>::release_event(&mut self.spare_events, device)
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
    pub(crate) fn new(
        slot: S,
        device: Device,
        back: Returner<S>,
        exports: Arc<Exports<S>>,
    ) -> Self {
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

impl<S: Leased> Drop for Lease<S> {
    fn drop(&mut self) {
        let Some(mut slot) = lock(&self.slot).take() else {
            return;
        };
        if self.device_sync.load(Ordering::Acquire) {
            if let Err(e) = self.device.synchronize() {
                // Nobody can say when the consumer is done with it: keep it out of use (it
                // still counts as a slot, so the depth shrinks rather than grows).
                slot.forget_buffers(&e);
                let _ = self.exports.on_release(slot);
                return;
            }
        }
        slot.add_released(std::mem::take(&mut *lock(&self.also)));
        // The feeder waits for the releases before it refills the slot, parked or not.
        if let Some(slot) = self.exports.on_release(slot) {
            let device = self.device;
            give_back_or(&self.back, slot, |s| drop_later(s, device));
        }
    }
}

/// A slot the feeder no longer takes (it has stopped): dropped by the background reaper once
/// `device` has finished what was queued, not here. Its drop waits for its last users on the
/// device, and here may be a consumer's thread holding a lock the device's queued work needs
/// (Python's GIL, for a host callback), which would never come back.
pub(crate) fn drop_later<S: Send + 'static>(slot: S, device: Device) {
    #[cfg(feature = "dlpack")]
    crate::deferred::defer(
        Box::new(move || drop(slot)),
        crate::deferred::Scope::Device(device),
    );
    #[cfg(not(feature = "dlpack"))]
    {
        let _ = device;
        drop(slot);
    }
}

impl<S: Leased> Lease<S> {
    /// At a handover to `consumer`'s stream: makes it wait for the batch and its earlier uses.
    pub(crate) fn order_before(&self, consumer: Option<&Stream>) -> Result<()> {
        match (consumer, lock(&self.slot).as_ref()) {
            (Some(s), Some(slot)) => slot.order_after(s),
            _ => Ok(()),
        }
    }

    /// A consumer releases its share after its work on `s`: the slot's reuse waits for an event
    /// recorded there, or (without one) for the whole device.
    pub(crate) fn release_after(&self, s: &Stream) {
        let ev = match lock(&self.slot).as_mut() {
            Some(slot) => slot.release_event(&s.device()),
            None => Event::new(&s.device()),
        };
        match ev.and_then(|ev| s.record(&ev).map(|()| ev)) {
            Ok(ev) => lock(&self.also).push(ev),
            Err(_) => self.device_sync.store(true, Ordering::Release),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Spares stand in for held slots up to the limit; a slot that comes back while `depth`
    /// circulate without it is parked, and the next export takes it instead of a new spare:
    /// the circle stays at `depth` and no slot is made or freed per batch.
    #[test]
    fn spares_keep_the_depth_without_churn() {
        let x: Exports<u32> = Exports::new(2, 1);
        assert!(matches!(x.on_export(), Stand::New));
        assert_eq!(x.circulating(), 2);
        assert!(matches!(x.on_export(), Stand::Nothing));
        assert!(matches!(x.on_export(), Stand::Nothing));
        assert_eq!((x.circulating(), x.total()), (0, 3));
        // Back while two are still held: it circulates.
        assert_eq!(x.on_release(10), Some(10));
        assert_eq!(x.circulating(), 1);
        assert_eq!(x.on_release(11), Some(11));
        assert_eq!(x.circulating(), 2);
        // The last one would make three circulate: parked.
        assert_eq!(x.on_release(12), None);
        assert_eq!(x.circulating(), 2);
        // Steady export/release: the parked spare goes back and forth.
        for _ in 0..5 {
            assert!(matches!(x.on_export(), Stand::Parked(12)));
            assert_eq!(x.circulating(), 2);
            assert_eq!(x.on_release(12), None);
        }
        assert_eq!(x.total(), 3);
        // A failed spare is not counted.
        let y: Exports<u32> = Exports::new(1, 4);
        assert!(matches!(y.on_export(), Stand::New));
        y.spare_failed();
        assert_eq!((y.total(), y.circulating()), (1, 0));
    }
}
