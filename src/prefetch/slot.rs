//! A device slot: the buffers one batch occupies on the device, the stream that fills them and
//! the two events that hand it between the feeder and the consumer.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use bytemuck::Pod;

use super::HostBatch;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::event::Event;
use crate::kernels::{ResizeSpec, Spec};
use crate::memory::DeviceBuffer;
use crate::stream::Stream;

/// One device slot: buffers, a stream that fills them, and the two events that hand it over.
pub(crate) struct Slot<O: Pod, E: Pod> {
    pub(crate) stream: Stream,
    /// Recorded on `stream` once the batch is in `output` / `extras`.
    pub(crate) ready: Event,
    /// Recorded on the consumer's stream when the consumer is done with the batch.
    pub(crate) release: Event,
    /// Other streams that use the batch ([`DeviceBatch::record_stream`](super::DeviceBatch::record_stream)),
    /// taken when the batch is given back.
    pub(crate) users: Mutex<Vec<Stream>>,
    /// Events recorded on those streams (and on DLPack consumers' streams) when the batch was
    /// given back: the refill waits for them as for `release`.
    pub(crate) also: Vec<Event>,
    /// Events of `also` from earlier batches, already waited for by the fill that followed:
    /// recorded again rather than created anew (creating one takes the context's lock).
    pub(crate) spare_events: Vec<Event>,
    pub(crate) bufs: Option<Buffers<O, E>>,
    pub(crate) spec: Spec,
    /// The resize spec of a resized batch (then `spec` is not its shape).
    pub(crate) resize: Option<ResizeSpec>,
    pub(crate) index: u64,
    pub(crate) out_len: usize,
    pub(crate) extras_len: usize,
    pub(crate) device_bytes: Arc<AtomicUsize>,
}

pub(crate) struct Buffers<O: Pod, E: Pod> {
    pub(crate) input: DeviceBuffer<u8>,
    pub(crate) output: DeviceBuffer<O>,
    pub(crate) extras: DeviceBuffer<E>,
}

impl<O: Pod, E: Pod> Buffers<O, E> {
    fn bytes(&self) -> usize {
        self.input.byte_len() + self.output.byte_len() + self.extras.byte_len()
    }
}

impl<O: Pod, E: Pod> Slot<O, E> {
    pub(crate) fn new(device: &Device, device_bytes: Arc<AtomicUsize>) -> Result<Self> {
        Ok(Slot {
            stream: Stream::new(device)?,
            ready: Event::new(device)?,
            release: Event::new(device)?,
            users: Mutex::new(Vec::new()),
            also: Vec::new(),
            spare_events: Vec::new(),
            bufs: Some(Buffers {
                input: DeviceBuffer::new(device, 0)?,
                output: DeviceBuffer::new(device, 0)?,
                extras: DeviceBuffer::new(device, 0)?,
            }),
            spec: HostBatch::<E>::default().spec,
            resize: None,
            index: 0,
            out_len: 0,
            extras_len: 0,
            device_bytes,
        })
    }

    pub(crate) fn bufs(&self) -> Result<&Buffers<O, E>> {
        self.bufs
            .as_ref()
            .ok_or_else(|| Error::invalid("Prefetcher", "a slot lost its buffers"))
    }

    /// The streams named by `record_stream`, taken (locked only for the moment).
    pub(crate) fn take_users(&self) -> Vec<Stream> {
        std::mem::take(&mut *crate::sync::lock(&self.users))
    }

    /// An event for one more release: a spare one when there is one of `device`, else new.
    pub(crate) fn release_event(spare: &mut Vec<Event>, device: &Device) -> Result<Event> {
        match spare.iter().rposition(|e| e.device() == *device) {
            Some(i) => Ok(spare.swap_remove(i)),
            None => Event::new(device),
        }
    }

    /// Makes the slot's stream wait for every release of its last batch.
    pub(crate) fn wait_released(&self) -> Result<()> {
        self.stream.wait(&self.release)?;
        for ev in &self.also {
            self.stream.wait(ev)?;
        }
        Ok(())
    }

    /// Blocks until every release of the slot's last batch has passed.
    pub(crate) fn synchronize_released(release: &Event, also: &[Event]) -> Result<()> {
        release.synchronize()?;
        also.iter().try_for_each(Event::synchronize)
    }

    /// Grows `buf` to at least `len` elements. The old buffer may still be read by the
    /// consumer (through raw pointers the trackers cannot see): wait for its release first.
    pub(crate) fn grow<T: Pod>(
        device: &Device,
        released: (&Event, &[Event]),
        buf: &mut DeviceBuffer<T>,
        len: usize,
        bytes: &AtomicUsize,
    ) -> Result<()> {
        if buf.len() >= len {
            return Ok(());
        }
        Self::synchronize_released(released.0, released.1)?;
        let new = DeviceBuffer::<T>::new(device, len)?;
        bytes.fetch_sub(buf.byte_len(), Ordering::Relaxed);
        bytes.fetch_add(new.byte_len(), Ordering::Relaxed);
        *buf = new;
        Ok(())
    }
}

impl<O: Pod, E: Pod> Drop for Slot<O, E> {
    fn drop(&mut self) {
        // The consumer's last use and the slot's own work must be over before the buffers go.
        let waited = Self::synchronize_released(&self.release, &self.also)
            .and_then(|()| self.stream.synchronize());
        if let Some(b) = self.bufs.take() {
            self.device_bytes.fetch_sub(b.bytes(), Ordering::Relaxed);
            if let Err(e) = waited {
                crate::memory::tracker::leak("prefetch slot", b.bytes(), &e);
                std::mem::forget(b);
            }
        }
    }
}
