//! Owned device-to-host results: [`Stream::download`] and [`Stream::download_into`] return a
//! [`Download`], which owns its page-locked buffer and the event of its copy, so it can be kept
//! in a struct or a queue and polled; and the blocking `to_vec` of device buffers and views.
//!
//! The host can only read a `Download`'s data through `try_get` (which says `None` until the copy
//! has finished), `wait` or the conversions, which wait first. Nothing here needs `Drop` for
//! soundness: the buffer's own tracker keeps host access and freeing behind the copy, so
//! dropping a `Download` unwaited or leaking it with `mem::forget` is safe.

use std::marker::PhantomData;
use std::sync::Arc;

use bytemuck::Pod;

use super::{memcpy, reads_writes};
use crate::error::{byte_len, try_vec, Error, Result};
use crate::event::Event;
use crate::memory::tracker;
use crate::memory::{
    DeviceBuffer, DeviceSlice, DeviceView, DeviceViewMut, HostAlloc, HostSliceMut, PinnedBuffer,
    PoolBlock,
};
use crate::stream::Stream;
use crate::sys;

mod private {
    pub trait Sealed {}
}

/// Page-locked host memory that a [`Download`] can own: a [`PinnedBuffer`] or a [`PoolBlock`]
/// (both track the GPU's use of them, so reading or freeing them waits for the copy).
pub trait DownloadTarget<T: Pod>: HostSliceMut<T> + private::Sealed {}

impl<T: Pod> private::Sealed for PinnedBuffer<T> {}
impl<T: Pod> DownloadTarget<T> for PinnedBuffer<T> {}
impl<T: Pod> private::Sealed for PoolBlock<T> {}
impl<T: Pod> DownloadTarget<T> for PoolBlock<T> {}

/// A device-to-host copy that owns its destination: `len` elements copied into the start of a
/// page-locked buffer `B`, and the event recorded after the copy. It borrows nothing (`'static`
/// and `Send` for the buffer types that are), so it can be stored and polled from anywhere — the
/// owned counterpart of PyTorch's `x.to("cpu", non_blocking=True)` plus an event, without its
/// hazard: the data can only be read once the copy has finished.
///
/// - [`is_ready`](Self::is_ready) / [`try_get`](Self::try_get) poll without blocking;
/// - [`wait`](Self::wait) blocks and gives the data (as often as you like);
/// - [`into_vec`](Self::into_vec) copies it into a `Vec`, [`into_buffer`](Self::into_buffer)
///   hands the buffer back for the next download.
///
/// Dropping it unwaited is safe: a [`PinnedBuffer`] waits for the copy before it frees its
/// memory (so that drop blocks until then), and a [`PoolBlock`] goes back to its pool, which
/// hands it out again only after the copy. Leaking it with `mem::forget` leaks the buffer.
///
/// ```no_run
/// use std::collections::VecDeque;
/// use pinstream::{Device, DeviceBuffer, Download};
/// # fn main() -> pinstream::Result<()> {
/// let dev = Device::get(0)?;
/// let stream = dev.stream()?;
/// let d = DeviceBuffer::<f32>::new(&dev, 1 << 20)?;
/// let mut results: VecDeque<Download<f32>> = VecDeque::new();
/// results.push_back(stream.download(&d)?);                // returns at once
/// while let Some(r) = results.front() {
///     match r.try_get()? {
///         Some(values) => println!("{}", values[0]),     // the copy has finished
///         None => break,                                  // not yet: do something else
///     }
///     results.pop_front();
/// }
/// # Ok(()) }
/// ```
#[must_use = "the data is only read through the Download (`wait`, `try_get`, `into_vec`)"]
pub struct Download<T: Pod, B: DownloadTarget<T> = PinnedBuffer<T>> {
    buf: B,
    len: usize,
    /// Recorded after the copy; `None` when nothing was copied. Never re-recorded: the tracker
    /// only reuses an event nobody else holds.
    event: Option<Arc<Event>>,
    _t: PhantomData<fn() -> T>,
}

impl<T: Pod, B: DownloadTarget<T>> std::fmt::Debug for Download<T, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Download")
            .field("len", &self.len)
            .field("queued", &self.event.is_some())
            .finish_non_exhaustive()
    }
}

impl<T: Pod, B: DownloadTarget<T>> Download<T, B> {
    /// Number of elements copied (the buffer may hold more).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing was copied.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the copy has finished, without blocking.
    pub fn is_ready(&self) -> Result<bool> {
        self.event.as_ref().map_or(Ok(true), |e| e.is_complete())
    }

    /// The data if the copy has finished, `None` if it is still queued or running; never
    /// blocks.
    pub fn try_get(&self) -> Result<Option<&[T]>> {
        if !self.is_ready()? {
            return Ok(None);
        }
        self.read().map(Some)
    }

    /// Blocks until the copy has finished, then gives the data.
    pub fn wait(&self) -> Result<&[T]> {
        if let Some(ev) = &self.event {
            ev.synchronize()?;
        }
        self.read()
    }

    /// As [`wait`](Self::wait), with write access (to work on the data in place).
    pub fn wait_mut(&mut self) -> Result<&mut [T]> {
        if let Some(ev) = &self.event {
            ev.synchronize()?;
        }
        let len = self.len;
        let all = self.buf.host_write()?;
        all.get_mut(..len)
            .ok_or_else(|| short("Download::wait_mut"))
    }

    /// Waits, then copies the data into a new `Vec` (allocated fallibly: a size the host cannot
    /// give is an `Error::InvalidArgument`) and frees or returns the buffer.
    pub fn into_vec(self) -> Result<Vec<T>> {
        let data = self.wait()?;
        let mut v = try_vec("Download::into_vec", data.len())?;
        v.extend_from_slice(data);
        Ok(v)
    }

    /// Waits, then hands back the whole buffer (the data in its first [`len`](Self::len)
    /// elements), e.g. for the next [`Stream::download_into`].
    pub fn into_buffer(self) -> Result<B> {
        self.wait()?;
        Ok(self.buf)
    }

    /// The first `len` elements after the buffer's last write (the copy) has finished.
    fn read(&self) -> Result<&[T]> {
        let all = self.buf.host_read()?;
        all.get(..self.len).ok_or_else(|| short("Download"))
    }
}

/// Not reachable: `download_into` refuses a buffer shorter than the copy.
fn short(op: &'static str) -> Error {
    Error::invalid(op, "the buffer is shorter than the copy")
}

/// The checks `download_into` makes before queueing anything: the buffer holds the source, and
/// the size in bytes does not overflow.
fn download_fits<T>(op: &'static str, src: usize, dst: usize) -> Result<usize> {
    if dst < src {
        return Err(Error::LengthMismatch { op, src, dst });
    }
    byte_len::<T>(op, src)
}

impl Stream {
    /// Queues a copy of `src` into a new [`PinnedBuffer`] and returns at once with the owned
    /// result (see [`Download`]). The copy is ordered after every earlier write to `src`,
    /// whatever stream queued it.
    ///
    /// Each call allocates page-locked memory (`cudaHostAlloc` cost 0.35–0.42 s per GiB on the
    /// H100 host, BENCHMARKS.md); for repeated downloads pass a buffer you keep, or a block of a
    /// [`PinnedPool`](crate::PinnedPool), to [`download_into`](Self::download_into).
    ///
    /// ```no_run
    /// use pinstream::{kernels, Device, DeviceBuffer};
    /// # fn main() -> pinstream::Result<()> {
    /// let dev = Device::get(0)?;
    /// let stream = dev.stream()?;
    /// let mut d = DeviceBuffer::<u32>::new(&dev, 1000)?;
    /// kernels::iota(&stream, &mut d, 0, 1)?;
    /// let result = stream.download(&d.slice(10..20)?)?;   // owned, borrows nothing
    /// assert_eq!(result.wait()?[0], 10);
    /// let v: Vec<u32> = result.into_vec()?;
    /// # Ok(()) }
    /// ```
    pub fn download<T, S>(&self, src: &S) -> Result<Download<T>>
    where
        T: Pod,
        S: DeviceSlice<T> + ?Sized,
    {
        let len = src.device_region().len;
        let buf = PinnedBuffer::<T>::new(&self.device(), len, HostAlloc::DEFAULT)?;
        self.download_into(src, buf)
    }

    /// As [`download`](Self::download), into a buffer you supply: a [`PinnedBuffer`] or a
    /// [`PoolBlock`] at least as long as `src`. The data lands in its first `src.len()`
    /// elements; the rest is left as it was. [`Download::into_buffer`] gives the buffer back.
    ///
    /// Errors (nothing queued; the buffer is dropped with the error): `Error::LengthMismatch`
    /// for a buffer shorter than `src`, `Error::WrongDevice` for a source on another device
    /// than the stream, `Error::InvalidArgument` for a pool block registered read-only.
    ///
    /// ```no_run
    /// use pinstream::{Device, DeviceBuffer, PinnedPool, PoolConfig};
    /// # fn main() -> pinstream::Result<()> {
    /// let dev = Device::get(0)?;
    /// let stream = dev.stream()?;
    /// let pool = PinnedPool::new(&dev, PoolConfig::default())?;
    /// let d = DeviceBuffer::<f32>::new(&dev, 4096)?;
    /// let pending = stream.download_into(&d, pool.alloc::<f32>(4096)?)?;
    /// // ... later, or on another thread:
    /// let block = pending.into_buffer()?;          // waits; reuse the block, or drop it
    /// println!("{}", block.as_slice()?[0]);
    /// # Ok(()) }
    /// ```
    pub fn download_into<T, S, B>(&self, src: &S, mut dst: B) -> Result<Download<T, B>>
    where
        T: Pod,
        S: DeviceSlice<T> + ?Sized,
        B: DownloadTarget<T>,
    {
        const OP: &str = "Stream::download_into";
        let d = src.device_region();
        self.same_device(OP, d.device)?;
        let h = dst.host_region_mut();
        let bytes = download_fits::<T>(OP, d.len, h.len)?;
        if h.read_only {
            return Err(Error::invalid(OP, "the buffer is registered read-only"));
        }
        let event = if bytes == 0 {
            None
        } else {
            // Both buffer types track their memory; a buffer without a tracker (an empty pool
            // block) is never long enough to get here, but an untracked copy must not be made.
            let Some(host) = h.tracker else {
                return Err(Error::invalid(OP, "the buffer does not track its memory"));
            };
            self.enter()?;
            let (_, event) =
                tracker::ordered_rw(self, &reads_writes(Some(d.tracker), Some(host)), || {
                    memcpy(
                        self,
                        h.ptr,
                        d.ptr,
                        bytes,
                        sys::cudaMemcpyKind::cudaMemcpyDeviceToHost,
                        "device to host (download)",
                    )
                })?;
            Some(event)
        };
        Ok(Download {
            buf: dst,
            len: d.len,
            event,
            _t: PhantomData,
        })
    }
}

/// The blocking download behind the `to_vec` methods: a fallibly allocated `Vec` filled by a
/// copy ordered after every earlier write to `src`.
fn download_vec<T: Pod, S: DeviceSlice<T> + ?Sized>(
    op: &'static str,
    src: &S,
    stream: &Stream,
) -> Result<Vec<T>> {
    let len = src.device_region().len;
    byte_len::<T>(op, len)?;
    let mut v = try_vec(op, len)?;
    // Within the capacity just reserved: no reallocation, no panic.
    v.resize(len, T::zeroed());
    stream.copy_d2h(src, &mut v[..])?.wait()?;
    Ok(v)
}

impl<T: Pod> DeviceBuffer<T> {
    /// Copies the buffer into a new `Vec` on `stream` and returns when the data is there (a
    /// plain pageable copy: for large or repeated downloads [`Stream::download_into`] a kept
    /// pinned buffer, or a [`Stager`](crate::Stager), is faster). Ordered after every earlier
    /// write to the buffer, on any stream. A size the host cannot allocate is an
    /// `Error::InvalidArgument`, not an abort.
    ///
    /// ```no_run
    /// use pinstream::{kernels, Device, DeviceBuffer};
    /// # fn main() -> pinstream::Result<()> {
    /// let dev = Device::get(0)?;
    /// let stream = dev.stream()?;
    /// let mut d = DeviceBuffer::<u32>::new(&dev, 100)?;
    /// kernels::iota(&stream, &mut d, 0, 1)?;
    /// assert_eq!(d.to_vec(&stream)?[99], 99);
    /// assert_eq!(d.slice(10..12)?.to_vec(&stream)?, [10, 11]);
    /// # Ok(()) }
    /// ```
    pub fn to_vec(&self, stream: &Stream) -> Result<Vec<T>> {
        download_vec("DeviceBuffer::to_vec", self, stream)
    }
}

impl<T: Pod> DeviceView<'_, T> {
    /// As [`DeviceBuffer::to_vec`], for the view's range.
    pub fn to_vec(&self, stream: &Stream) -> Result<Vec<T>> {
        download_vec("DeviceView::to_vec", self, stream)
    }
}

impl<T: Pod> DeviceViewMut<'_, T> {
    /// As [`DeviceBuffer::to_vec`], for the view's range.
    pub fn to_vec(&self, stream: &Stream) -> Result<Vec<T>> {
        download_vec("DeviceViewMut::to_vec", self, stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn download_fits_checks_length_and_overflow() {
        assert_eq!(download_fits::<f32>("t", 10, 10), Ok(40));
        assert_eq!(download_fits::<f32>("t", 10, 11), Ok(40));
        assert_eq!(download_fits::<u8>("t", 0, 0), Ok(0));
        assert_eq!(
            download_fits::<f32>("t", 11, 10),
            Err(Error::LengthMismatch {
                op: "t",
                src: 11,
                dst: 10
            })
        );
        assert!(matches!(
            download_fits::<u64>("t", usize::MAX / 4, usize::MAX),
            Err(Error::InvalidArgument { .. })
        ));
    }

    /// A `Download` is an owned value that can be stored and sent to another thread.
    #[test]
    fn download_is_owned_and_send() {
        fn owned_send<X: Send + Sync + 'static>() {}
        owned_send::<Download<f32>>();
        owned_send::<Download<u8, PoolBlock<u8>>>();
    }
}
