//! What keeps an exported tensor's memory alive and gives it back ([`Owner`]): pinstream's
//! device buffers, packed batches and page-locked memory, with the consumer's work ordered
//! before the memory's next use.

use std::marker::PhantomData;
use std::sync::Arc;

use super::Element;
use crate::device::Device;
use crate::error::Result;
use crate::memory::sealed::{DeviceMem, HostMem};
use crate::memory::tracker::{self, Access};
use crate::memory::DeviceBuffer;
#[cfg(feature = "staging")]
use crate::staging::PackedBatch;
use crate::stream::Stream;

/// Who consumes an exported tensor.
pub(crate) enum Consumer<'a> {
    /// The tensor was never handed over: nothing but pinstream used it.
    Nobody,
    /// The consumer's stream, named at the handover (and known to be the same stream still:
    /// see `Ctx`).
    Stream(&'a Stream),
}

/// What keeps an exported tensor's memory alive, and gives it back.
pub(crate) trait Owner: Send + Sync + 'static {
    /// At the handover: orders `consumer` (on the GPU) or the host after the producer's work
    /// on the memory.
    fn sync(&self, consumer: Option<&Stream>) -> Result<()>;
    /// When the consumer releases the tensor (any thread, exactly once): orders the memory's
    /// next use or free after the consumer's work. Dropping `self` afterwards gives it back.
    fn release(&self, consumer: Consumer<'_>);
    /// Whether several tensors may share this owner ([`Tensor::split`]): `release` may then
    /// run once per tensor, and the memory goes back when the last one drops the owner.
    fn shareable(&self) -> bool {
        false
    }
}

/// One owner shared by the tensors of a [`Tensor::split`].
pub(super) struct Shared(pub(super) Arc<dyn Owner>);

impl Owner for Shared {
    fn sync(&self, consumer: Option<&Stream>) -> Result<()> {
        self.0.sync(consumer)
    }
    fn release(&self, consumer: Consumer<'_>) {
        self.0.release(consumer)
    }
    fn shareable(&self) -> bool {
        true
    }
}

/// Orders the memory's next use after what the consumer queued, or waits for the device when
/// that is not known; leaks the owner when even that fails (nobody can say when the memory is
/// free again).
pub(super) fn release_tracked(
    t: &tracker::Tracker,
    device: Device,
    bytes: usize,
    consumer: Consumer<'_>,
) -> bool {
    let ordered = match consumer {
        Consumer::Nobody => Ok(()),
        Consumer::Stream(s) => t.record_use(s, Access::Write).or_else(|_| s.synchronize()),
    };
    match ordered.or_else(|_| device.synchronize()) {
        Ok(()) => true,
        Err(e) => {
            tracker::leak("memory exported through DLPack", bytes, &e);
            false
        }
    }
}

/// Device memory an exported tensor keeps alive: a buffer, or a packed upload's arena.
pub(super) trait DeviceHeld: Send + Sync + 'static {
    /// The memory's tracker, device and size in bytes.
    fn held(&self) -> (&tracker::Tracker, Device, usize);
}

impl<T: Element> DeviceHeld for DeviceBuffer<T> {
    fn held(&self) -> (&tracker::Tracker, Device, usize) {
        let r = self.device_region();
        (r.tracker, r.device, self.byte_len())
    }
}

#[cfg(feature = "staging")]
impl DeviceHeld for PackedBatch {
    fn held(&self) -> (&tracker::Tracker, Device, usize) {
        self.arena().held()
    }
}

pub(super) struct DeviceOwner<H: DeviceHeld>(pub(super) Arc<H>);

impl<H: DeviceHeld> Owner for DeviceOwner<H> {
    fn sync(&self, consumer: Option<&Stream>) -> Result<()> {
        match consumer {
            Some(s) => self.0.held().0.record_use(s, Access::Write),
            None => Ok(()),
        }
    }
    fn release(&self, consumer: Consumer<'_>) {
        let (t, device, bytes) = self.0.held();
        if !release_tracked(t, device, bytes, consumer) {
            // Keep the memory alive for ever rather than free it under the consumer.
            std::mem::forget(self.0.clone());
        }
    }
    fn shareable(&self) -> bool {
        true
    }
}

/// Page-locked memory behind a tensor: a [`PinnedBuffer`] or a [`PoolBlock`], and its device.
pub(super) struct PinnedOwner<T: Element, B: HostMem<T> + Send + Sync>(
    pub(super) Arc<B>,
    pub(super) Device,
    pub(super) PhantomData<T>,
);

impl<T: Element, B: HostMem<T> + Send + Sync + 'static> Owner for PinnedOwner<T, B> {
    fn sync(&self, consumer: Option<&Stream>) -> Result<()> {
        // Host consumers read it as soon as they have it: wait for every GPU use here.
        let _ = consumer;
        match self.0.host_region().tracker {
            Some(t) => t.synchronize(),
            None => Ok(()),
        }
    }
    fn release(&self, consumer: Consumer<'_>) {
        let r = self.0.host_region();
        let bytes = r.len * std::mem::size_of::<T>();
        let ok = match r.tracker {
            Some(t) => release_tracked(t, self.1, bytes, consumer),
            None => true,
        };
        if !ok {
            std::mem::forget(self.0.clone());
        }
    }
    fn shareable(&self) -> bool {
        true
    }
}
