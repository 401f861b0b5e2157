//! The GPU feeder: fills a device slot with one host batch — the pixels uploaded (staged,
//! one DMA from page-locked memory, or read from a file), the fused normalize, the extras —
//! and records the slot's `ready` event.

use bytemuck::Pod;

use super::pixels;
use super::slot::Slot;
use super::{HostBatch, Pixels};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::kernels::{self, OutputElement};
use crate::staging::Stager;
use crate::stream::Stream;

pub(crate) struct Feeder {
    pub(crate) device: Device,
    pub(crate) stager: Stager,
    /// The one stream for the single-DMA copies (pinned and resident pixels) of every slot, so
    /// that they run one after another at the link's full speed: on the slots' own streams two
    /// or three would share the link and the host memory at once, and each batch would be
    /// ready later (measured on two H200s: 1.74x one GPU with per-slot copies).
    pub(crate) upload: Stream,
}

impl Feeder {
    pub(crate) fn fill<O: OutputElement, E: Pod>(
        &self,
        slot: &mut Slot<O, E>,
        global: u64,
        batch: &HostBatch<E>,
    ) -> Result<()> {
        let bad = |message: String| Error::Loader {
            batch: global,
            message,
        };
        let (in_len, out_len) = batch.checked_lens(global)?;
        let pixels = &batch.pixels;
        match pixels {
            Pixels::Pageable(_) => {}
            Pixels::Foreign(f) => {
                f.get()
                    .map_err(|m| bad(format!("the pixels' owner panicked: {m}")))?;
                let direct = f
                    .dma_source()
                    .map_err(|m| bad(format!("the pixels' owner panicked: {m}")))?;
                if direct.is_some() {
                    // As for pinned blocks below: at most one batch per slot ahead of the GPU.
                    slot.ready.synchronize()?;
                }
            }
            Pixels::Pinned(block) => {
                if block.device() != self.device {
                    return Err(bad(format!(
                        "the pinned pixels are page-locked for {}, the prefetcher uploads to {}",
                        block.device(),
                        self.device
                    )));
                }
                // Nothing else holds the feeder back here (the stager's ring does for the
                // other kinds): keep it at most one batch per slot ahead of the GPU, so that the
                // blocks busy with a copy, and with them the pool, stay bounded however far the
                // consumer's host runs ahead. Passed at once unless the GPU is behind.
                slot.ready.synchronize()?;
            }
            Pixels::Resident { buf, offset, len } => {
                if let Some(why) = pixels::resident_foreign(buf, self.device) {
                    return Err(bad(why));
                }
                if pixels::resident_range(buf.len(), *offset, *len).is_none() {
                    return Err(bad(pixels::resident_outside(buf, *offset, *len)));
                }
            }
            Pixels::File { file, offset, len } => file
                .check_range("Prefetcher", *offset, *len)
                .map_err(|e| bad(e.to_string()))?,
        }
        let extras_len = batch.extras.len();
        // Everything the consumer did with the slot's last batch comes first.
        slot.wait_released()?;
        let b = slot
            .bufs
            .as_mut()
            .ok_or_else(|| Error::invalid("Prefetcher", "a slot lost its buffers"))?;
        let (dev, release, bytes) = (
            &self.device,
            (&slot.release, &slot.also[..]),
            &*slot.device_bytes,
        );
        Slot::<O, E>::grow(dev, release, &mut b.input, in_len, bytes)?;
        Slot::<O, E>::grow(dev, release, &mut b.output, out_len, bytes)?;
        Slot::<O, E>::grow(dev, release, &mut b.extras, extras_len, bytes)?;
        let stream = &slot.stream;
        let input = &mut b.input.slice_mut(..in_len)?;
        match pixels {
            Pixels::Pageable(v) => self.stager.upload(stream, v, input)?,
            // Its length was checked against the spec above; one that changed since is a
            // length mismatch of the upload, not a wrong copy.
            // Page-locked ones (`ForeignBytes::page_locked`, confirmed by the runtime): one DMA
            // on the upload stream, as for pinned blocks, recorded in the owner's tracker (its
            // drop waits for it); others through the staging engine.
            Pixels::Foreign(f) => {
                let owner = |m| bad(format!("the pixels' owner panicked: {m}"));
                match f.dma_source().map_err(owner)? {
                    Some(locked) => drop(self.upload.copy_h2d(&locked, input)?),
                    None => self.stager.upload(stream, f.get().map_err(owner)?, input)?,
                }
            }
            // One DMA on the upload stream, recorded in the block's event (the pool and
            // `pinned()` wait for it). The slot's input is never shown to the consumer, so the
            // copy needs no wait for `release`; the trackers order it after the slot's last
            // normalize and the next normalize after it.
            Pixels::Pinned(block) => drop(self.upload.copy_h2d(block, input)?),
            // The same from a range of a resident buffer (checked above); it only reads the
            // buffer, so other devices' copies from it run beside it; the buffer's drop and
            // writes wait for it.
            Pixels::Resident { buf, offset, len } => {
                let view = buf.slice(*offset..*offset + *len)?;
                drop(self.upload.copy_h2d(&view, input)?)
            }
            Pixels::File { file, offset, .. } => self
                .stager
                .upload_file(stream, file, *offset, input)
                .map_err(|e| match e {
                    Error::Io { .. } => bad(e.to_string()),
                    e => e,
                })?,
        }
        if extras_len > 0 {
            self.stager.upload(
                stream,
                &batch.extras,
                &mut b.extras.slice_mut(..extras_len)?,
            )?;
        }
        match &batch.resize {
            Some(r) => kernels::resized_crop::<O, _, _>(
                stream,
                &b.input.slice(..in_len)?,
                r,
                &mut b.output.slice_mut(..out_len)?,
            )?,
            None => kernels::normalize::<O, _, _>(
                stream,
                &b.input.slice(..in_len)?,
                &batch.spec,
                &mut b.output.slice_mut(..out_len)?,
                None,
            )?,
        }
        stream.record(&slot.ready)?;
        slot.spec.clone_from(&batch.spec);
        slot.resize.clone_from(&batch.resize);
        slot.index = global;
        slot.out_len = out_len;
        slot.extras_len = extras_len;
        Ok(())
    }
}
