//! `PrefetchConfig`: how a prefetcher is built.

use super::loaders::Window;
use crate::error::{Error, Result};
use crate::memory::PoolConfig;
use crate::staging::StagerConfig;

/// The most [`PrefetchConfig::export_spares`]: spare slots are made only when batches are held
/// (each as large as a batch), so the bound only stops a runaway.
pub const MAX_EXPORT_SPARES: usize = 4096;

/// How a [`Prefetcher`](super::Prefetcher) is built.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrefetchConfig {
    /// Device slots: batches ready or being filled ahead of the consumer, counting the one it
    /// holds. 1..=16; 2 hides the transfer behind one step of compute.
    pub depth: usize,
    /// Threads that run the source. At least 1.
    pub loader_threads: usize,
    /// Host batches the loaders may hold (finished or being loaded) ahead of the upload. 0,
    /// the default, adapts it between 2 and `depth + loader_threads`: one more whenever the
    /// upload has to wait for a batch, one less after a run of batches with two or more
    /// finished ones waiting behind them. Loaders that keep up then hold only a few batches
    /// (host memory, and batches uploaded soon after they are written, some of them still in
    /// the CPU's cache); slow ones get the full window. A value above 0 fixes it.
    /// [`Prefetcher::loader_stats`](super::Prefetcher::loader_stats) shows the window and the waits.
    pub ahead: usize,
    /// The staging engine that uploads the pixels.
    pub stager: StagerConfig,
    /// The pinned pool behind the staging slots and the page-locked pixels of
    /// [`HostBatch::pinned`](super::HostBatch::pinned). Its `max_cached_bytes` bounds the idle blocks it keeps; the
    /// blocks in use are bounded by the batches in flight (about `(ahead + 1 + depth)` blocks
    /// as long as the longest batch, plus the staging slots).
    pub pool: PoolConfig,
    /// Runs the loader, feeder and staging threads on the CPUs next to the device (sysfs
    /// `local_cpulist`, where the OS allows them), so the page-locked memory they fill sits on
    /// the GPU's NUMA node. Nothing changes where sysfs does not say. Default: on. Not used
    /// when [`cpus`](Self::cpus) is given.
    pub numa_local: bool,
    /// The CPUs the prefetcher's threads (loaders, feeder, staging, and the threads they start)
    /// run on, whatever the calling thread's own mask. `None`, the default: where the caller
    /// may run (narrowed by `numa_local`). Give it to keep them off a training thread pinned
    /// to its own CPU (`os.sched_setaffinity(0, {cpu})` in Python): threads otherwise inherit
    /// the pinned thread's single CPU. At most [`MAX_CPUS`](super::MAX_CPUS) entries, each
    /// below it; one the OS lets the process run on at least (not narrowed by `taskset`; see
    /// [`CpuBinding`](super::CpuBinding)). Threads that exist already are not moved: the CUDA
    /// driver's (started with the device's context) and pinstream's deferred-release thread
    /// (started by the first release of an exported batch) stay where they started.
    pub cpus: Option<Vec<usize>>,
    /// Spare slots that stand in for batches handed to other libraries
    /// ([`DeviceBatch::into_dlpack`](super::DeviceBatch::into_dlpack)) until their consumers
    /// release them, so prefetching goes on at full depth meanwhile. When `depth +
    /// export_spares` batches are held, [`Prefetcher::next`](super::Prefetcher::next) returns
    /// an error (and can be called again after a release) rather than wait. Spares are made only
    /// when needed. 0..=4096; default 2.
    pub export_spares: usize,
}

impl Default for PrefetchConfig {
    fn default() -> Self {
        PrefetchConfig {
            depth: 2,
            loader_threads: 4,
            ahead: 0,
            stager: StagerConfig::default(),
            pool: PoolConfig::default(),
            numa_local: true,
            cpus: None,
            export_spares: 2,
        }
    }
}

impl PrefetchConfig {
    /// Checks every field; a bad value is an `Error::InvalidArgument` that names it.
    pub fn validate(&self) -> Result<()> {
        let bad = |reason: String| Err(Error::invalid("PrefetchConfig", reason));
        if !(1..=16).contains(&self.depth) {
            return bad(format!("depth = {} is not in 1..=16", self.depth));
        }
        if !(1..=256).contains(&self.loader_threads) {
            return bad(format!(
                "loader_threads = {} is not in 1..=256",
                self.loader_threads
            ));
        }
        if self.export_spares > MAX_EXPORT_SPARES {
            return bad(format!(
                "export_spares = {} is more than {MAX_EXPORT_SPARES}",
                self.export_spares
            ));
        }
        if let Some(cpus) = &self.cpus {
            super::affinity::check_cpus(cpus).map_err(|r| Error::invalid("PrefetchConfig", r))?;
        }
        if self.ahead > 4096 {
            return bad(format!("ahead = {} is more than 4096", self.ahead));
        }
        self.stager.validate()
    }

    pub(crate) fn window(&self) -> Window {
        match self.ahead {
            0 => Window::adaptive((self.depth + self.loader_threads) as u64),
            n => Window::fixed(n as u64),
        }
    }
}
