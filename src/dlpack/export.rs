//! The C side of an export: the DLPack capsules' boxes and their deleters, which release the
//! tensor's owner after its consumer (see `Ctx`).

use super::abi::{DLManagedTensor, DLManagedTensorVersioned};
use super::owner::{Consumer, Owner};
use crate::deferred::Scope;
use crate::stream::Stream;

/// What a handed-over tensor keeps until its deleter runs.
pub(super) struct Ctx {
    pub(super) shape: Vec<i64>,
    pub(super) strides: Vec<i64>,
    pub(super) owner: Option<Box<dyn Owner>>,
    /// The consumer's stream, where it is safe to use at the release (see `hand_over`).
    pub(super) consumer: Option<Stream>,
    /// What a release without that stream waits for.
    pub(super) scope: Scope,
    /// The process that handed it over. A forked child that calls the deleter on its copy
    /// forgets it: the memory and the CUDA work are the parent's, and a lock another parent
    /// thread held at the fork would never be released in the child.
    pub(super) pid: u32,
}

impl Ctx {
    /// The consumer is done: with its stream still known, the memory's reuse is ordered after
    /// an event recorded on it (no wait); otherwise the background reaper gives the memory
    /// back once the devices involved have finished what was queued before now (the deleter
    /// never waits for the GPU, so it cannot stall behind other work or deadlock on the GIL).
    fn release(mut self) {
        if self.pid != std::process::id() {
            std::mem::forget(self);
            return;
        }
        if let Some(owner) = self.owner.take() {
            match &self.consumer {
                Some(s) => {
                    owner.release(Consumer::Stream(s));
                    drop(owner);
                }
                None => crate::deferred::defer(
                    Box::new(move || {
                        owner.release(Consumer::Nobody);
                        drop(owner);
                    }),
                    self.scope,
                ),
            }
        }
    }
}

#[repr(C)]
pub(super) struct VersionedBox {
    pub(super) managed: DLManagedTensorVersioned,
    pub(super) ctx: Ctx,
}

#[repr(C)]
pub(super) struct LegacyBox {
    pub(super) managed: DLManagedTensor,
    pub(super) ctx: Ctx,
}

/// The versioned tensor's deleter.
pub(super) unsafe extern "C" fn delete_versioned(p: *mut DLManagedTensorVersioned) {
    if p.is_null() {
        return;
    }
    // SAFETY: every `DLManagedTensorVersioned` with this deleter is the first field of a
    // `repr(C)` `VersionedBox` made by `into_versioned`; DLPack's contract has the consumer call
    // the deleter once, after which it no longer touches the struct.
    let b = unsafe { Box::from_raw(p.cast::<VersionedBox>()) };
    // A panic must not unwind into the consumer's C frames.
    let _ = crate::sync::quietly(move || b.ctx.release());
}

/// The legacy tensor's deleter.
pub(super) unsafe extern "C" fn delete_legacy(p: *mut DLManagedTensor) {
    if p.is_null() {
        return;
    }
    // SAFETY: as in `delete_versioned`, for `LegacyBox` and `into_legacy`.
    let b = unsafe { Box::from_raw(p.cast::<LegacyBox>()) };
    let _ = crate::sync::quietly(move || b.ctx.release());
}
