//! `Gate`: holds streams on a flag in mapped pinned memory while work is queued behind it, so
//! that the host's enqueue time stays out of what the events measure. The kernel is
//! `pinstream_gate` in `cuda/`.

use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use crate::device::Device;
use crate::error::Result;
use crate::memory::{HostAlloc, PinnedBuffer};
use crate::stream::Stream;

/// A flag the GPU polls. `close(&stream)` queues a kernel that waits for it; `open()` lets every
/// waiting stream go. A kernel that waits longer than the timeout gives up and marks the gate
/// as timed out (the measurement then included enqueue time, and says so).
///
/// Queue at most about a hundred operations behind a closed gate: a stream's queue is finite,
/// and a host blocked on a full queue behind the gate can only wait for the timeout. One gate
/// may hold streams of several devices and be used from several threads. See the
/// [module](crate::timing) for a timed loop.
#[derive(Debug)]
pub struct Gate {
    /// Word 0: open (host writes, kernels poll); word 1: timed out (kernels write). Host access
    /// only through atomics. Not dropped if the kernels could not be waited for (leaked).
    flag: ManuallyDrop<PinnedBuffer<u32>>,
    device_ptr: *mut u32,
    timeout: Duration,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    armed: bool,
    /// Streams with a gate kernel queued since the last re-arm.
    streams: Vec<Stream>,
}

// SAFETY: the host touches the flag words only through atomics (`PinnedBuffer::as_atomics`),
// the stream list is behind a mutex, and `device_ptr` is a device address the host never
// dereferences.
unsafe impl Send for Gate {}
// SAFETY: as above.
unsafe impl Sync for Gate {}

impl Gate {
    /// A gate usable by streams on any device (portable, mapped pinned memory).
    pub fn new(device: &Device, timeout: Duration) -> Result<Gate> {
        let flag = PinnedBuffer::<u32>::new(device, 2, HostAlloc::MAPPED | HostAlloc::PORTABLE)?;
        let device_ptr = flag.mapped_device_ptr()?;
        Ok(Gate {
            flag: ManuallyDrop::new(flag),
            device_ptr,
            timeout,
            state: Mutex::new(State::default()),
        })
    }

    fn word(&self, i: usize) -> &AtomicU32 {
        &self.flag.as_atomics()[i]
    }

    /// Arms the gate (if open) and holds `stream` at it. Re-arming first waits for the streams
    /// of the previous round, so no earlier gate kernel can see the flag drop back to zero; if
    /// one of those waits fails, the gate stays open and keeps the streams it could not wait
    /// for (they are waited for again next time, and on drop).
    pub fn close(&self, stream: &Stream) -> Result<()> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if !st.armed {
            let mut failed = Vec::new();
            let mut first_err = None;
            for s in st.streams.drain(..) {
                if let Err(e) = s.synchronize() {
                    first_err.get_or_insert(e);
                    failed.push(s);
                }
            }
            if let Some(e) = first_err {
                st.streams = failed;
                return Err(e);
            }
            self.word(0).store(0, Ordering::SeqCst);
            self.word(1).store(0, Ordering::SeqCst);
            st.armed = true;
        }
        crate::kernels::gate(stream, self.device_ptr, self.timeout)?;
        st.streams.push(stream.clone());
        Ok(())
    }

    /// Lets every held stream go. Returns false if any of them had already timed out.
    pub fn open(&self) -> bool {
        self.word(0).store(1, Ordering::SeqCst);
        self.state.lock().unwrap_or_else(|e| e.into_inner()).armed = false;
        self.word(1).load(Ordering::SeqCst) == 0
    }

    /// Whether a gate kernel gave up waiting since the gate was last armed.
    pub fn timed_out(&self) -> bool {
        self.word(1).load(Ordering::SeqCst) != 0
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        // The kernels read the flag: let them go and finish before the memory is freed.
        self.word(0).store(1, Ordering::SeqCst);
        let st = std::mem::take(&mut *self.state.lock().unwrap_or_else(|e| e.into_inner()));
        let mut waited = Ok(());
        for s in st.streams {
            if let Err(e) = s.synchronize() {
                waited = Err(e);
            }
        }
        match waited {
            // SAFETY: dropped once, here; no gate kernel can still read it (all waited for).
            Ok(()) => unsafe { ManuallyDrop::drop(&mut self.flag) },
            Err(e) => crate::memory::tracker::leak("gate flag (pinned, mapped)", 8, &e),
        }
    }
}
