//! `Gate`: holds streams on a flag in mapped pinned memory while work is queued behind it, so
//! that the host's enqueue time stays out of what the events measure.

use std::sync::Mutex;
use std::time::Duration;

use crate::device::Device;
use crate::error::Result;
use crate::memory::{HostAlloc, PinnedBuffer};
use crate::stream::Stream;

/// A flag the GPU polls. `close(&stream)` queues a kernel that waits for it; `open()` lets every
/// waiting stream go. A kernel that waits longer than the timeout gives up and marks the gate
/// as timed out (the measurement then included enqueue time, and says so).
#[derive(Debug)]
pub struct Gate {
    flag: PinnedBuffer<u32>,
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

// SAFETY: the flag is only touched through volatile loads and stores; the stream list is
// behind a mutex.
unsafe impl Send for Gate {}
// SAFETY: as above.
unsafe impl Sync for Gate {}

impl Gate {
    /// A gate usable by streams on any device (portable, mapped pinned memory).
    pub fn new(device: &Device, timeout: Duration) -> Result<Gate> {
        let flag = PinnedBuffer::<u32>::new(device, 2, HostAlloc::MAPPED | HostAlloc::PORTABLE)?;
        let device_ptr = flag.mapped_device_ptr()?;
        Ok(Gate {
            flag,
            device_ptr,
            timeout,
            state: Mutex::new(State::default()),
        })
    }

    /// Arms the gate (if open) and holds `stream` at it. Re-arming first waits for the streams
    /// of the previous round, so no earlier gate kernel can see the flag drop back to zero.
    pub fn close(&self, stream: &Stream) -> Result<()> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if !st.armed {
            for s in st.streams.drain(..) {
                s.synchronize()?;
            }
            self.flag.store_volatile(0, 0);
            self.flag.store_volatile(1, 0);
            st.armed = true;
        }
        crate::kernels::gate(stream, self.device_ptr, self.timeout)?;
        st.streams.push(stream.clone());
        Ok(())
    }

    /// Lets every held stream go. Returns false if any of them had already timed out.
    pub fn open(&self) -> bool {
        self.flag.store_volatile(0, 1);
        self.state.lock().unwrap_or_else(|e| e.into_inner()).armed = false;
        self.flag.load_volatile(1) == 0
    }

    /// Whether a gate kernel gave up waiting since the gate was last armed.
    pub fn timed_out(&self) -> bool {
        self.flag.load_volatile(1) != 0
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        // The kernels read the flag: let them go and finish before the memory is freed.
        self.flag.store_volatile(0, 1);
        let st = std::mem::take(&mut *self.state.lock().unwrap_or_else(|e| e.into_inner()));
        for s in st.streams {
            let _ = s.synchronize();
        }
    }
}
