//! Prefetched batches as DLPack tensors ([`DeviceBatch::into_dlpack`]): the batch's slot is
//! leased out of the prefetcher's circle (`prefetch::Lease`), and each tensor holds a share of
//! the lease until its consumer releases it.

use std::sync::Arc;

use bytemuck::Pod;

use super::owner::{Consumer, Owner};
use super::{Element, Tensor, TensorParts};
use crate::error::Result;
use crate::kernels::OutputElement;
use crate::prefetch::{DeviceBatch, Lease};
use crate::stream::Stream;

/// A tensor's share of a lease.
struct LeaseOwner<S: crate::prefetch::Leased>(Arc<Lease<S>>);

impl<S: crate::prefetch::Leased> Owner for LeaseOwner<S> {
    fn sync(&self, consumer: Option<&Stream>) -> Result<()> {
        self.0.order_before(consumer)
    }

    fn release(&self, consumer: Consumer<'_>) {
        match consumer {
            Consumer::Nobody => {}
            // Without an event there, the device is waited for before the slot is reused.
            Consumer::Stream(s) => self.0.release_after(s),
        }
    }
}

impl<O: OutputElement, E: Pod + Send + 'static> DeviceBatch<'_, O, E> {
    /// Hands the batch to other libraries as two DLPack tensors, pixels and extras, that keep
    /// its slot until both are released (see [`crate::dlpack`]). The pixels are `[n, c, h, w]`
    /// (NCHW output) or `[n, h, w, c]` (NHWC) when every sample has the same output size,
    /// else flat; the extras are flat. Hand each over with
    /// [`Tensor::into_versioned`]`(Some(&stream))`: that stream waits for the batch on the
    /// GPU, and its release orders the slot's refill after it.
    ///
    /// Meanwhile a spare slot stands in for it (up to
    /// [`PrefetchConfig::export_spares`](crate::prefetch::PrefetchConfig::export_spares)), so
    /// prefetching goes on at full depth; what the consumer's stream had queued on the batch
    /// before this call is covered as by a drop.
    pub fn into_dlpack(self) -> Result<(Tensor, Tensor)>
    where
        O: Element,
        E: Element,
    {
        let b = self.lease()?;
        let part = |data: *const std::os::raw::c_void, dtype, elem, len| TensorParts {
            data: data.cast_mut(),
            device: b.device,
            dtype,
            elem,
            len,
            owner: Box::new(LeaseOwner(b.lease.clone())),
        };
        let pixels = part(b.output, O::DTYPE, std::mem::size_of::<O>(), b.out_len);
        let extras = part(b.extras, E::DTYPE, std::mem::size_of::<E>(), b.extras_len);
        let shape = b.shape.clone();
        drop(b);
        let pixels = Tensor::from_parts(pixels, super::abi::KDL_CUDA)?;
        let extras = Tensor::from_parts(extras, super::abi::KDL_CUDA)?;
        let pixels = match shape {
            Some(s) => pixels.reshape(&s)?,
            None => pixels,
        };
        Ok((pixels, extras))
    }
}
