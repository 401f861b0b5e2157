//! The machinery behind `Stager`: pinned slots with an event each, worker threads, and jobs
//! that the calling thread shares with the workers and always waits for before it returns.
//!
//! Soundness rests on one rule: a job's host addresses (the caller's borrowed slices, a file
//! descriptor) are only touched between the moment a worker joins the job — under the queue
//! lock, while the job is queued — and the moment it leaves. The caller takes the job out of the
//! queue (so no one else can join) and then waits until every worker has left, also when a
//! piece failed or panicked, before the call returns and the borrows end. Nothing of this is in
//! a `Drop` a user could skip with `mem::forget`.

use std::os::raw::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use super::plan::{Piece, Plan};
use crate::copy::{memcpy, BatchSrcAccess};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::event::Event;
use crate::memory::sealed::HostMem;
use crate::memory::{PinnedPool, PoolBlock};
use crate::stream::Stream;
use crate::sync::{lock, panic_message};
use crate::sys;

/// A pinned slot and the event recorded after the last DMA that read or wrote it.
struct Slot {
    /// A block of the stager's pool. Only given back after its last DMA: see `Drop`.
    mem: std::mem::ManuallyDrop<PoolBlock<u8>>,
    ptr: *mut u8,
    len: usize,
    event: Event,
}

// SAFETY: the slot's memory is only touched by the one thread that has claimed it (the free
// list hands each index to one claimer at a time) and by DMAs that its event tracks.
unsafe impl Send for Slot {}
// SAFETY: as above.
unsafe impl Sync for Slot {}

impl Drop for Slot {
    fn drop(&mut self) {
        match self.event.synchronize() {
            Ok(()) => {
                // SAFETY: the last DMA that touched the slot has finished (waited above), and the
                // block is given back to its pool once, here.
                unsafe { std::mem::ManuallyDrop::drop(&mut self.mem) }
            }
            // A DMA may still use it: leak it.
            Err(e) => crate::memory::tracker::leak("a staging slot", self.len, &e),
        }
    }
}

/// Timestamps of one job's steps, printed to stderr when `PINSTREAM_STAGING_TRACE` is set (a
/// diagnostic for the mid-sized copies, where overheads rival the copy).
#[derive(Debug)]
pub(crate) struct Trace {
    t0: std::time::Instant,
    events: Mutex<Vec<(std::time::Duration, u64, &'static str, usize)>>,
}

thread_local! {
    static THREAD_NO: u64 = {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        NEXT.fetch_add(1, Ordering::Relaxed)
    };
}

impl Trace {
    pub fn enabled() -> bool {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *ON.get_or_init(|| std::env::var_os("PINSTREAM_STAGING_TRACE").is_some())
    }

    fn new() -> Trace {
        Trace {
            t0: std::time::Instant::now(),
            events: Mutex::new(Vec::new()),
        }
    }

    fn mark(&self, what: &'static str, piece: usize) {
        let t = self.t0.elapsed();
        let thread = THREAD_NO.with(|n| *n);
        lock(&self.events).push((t, thread, what, piece));
    }

    /// One line per step, in time order.
    pub fn print(&self, op: &str, bytes: usize) {
        let mut ev = std::mem::take(&mut *lock(&self.events));
        ev.sort_by_key(|e| e.0);
        let mut out = format!("pinstream trace: {op} {bytes} bytes\n");
        for (t, thread, what, piece) in ev {
            out.push_str(&format!(
                "  {:>9.1} us  t{thread:<3} {what:<10} {piece}\n",
                t.as_secs_f64() * 1e6
            ));
        }
        eprint!("{out}");
    }
}

/// Where a job's host side lives.
#[derive(Clone, Debug)]
pub(crate) enum Host {
    /// Host addresses in the caller's memory.
    Memory,
    /// Offsets in files, read with `pread`: each piece reads the file of its transfer
    /// ([`Piece::source`](super::plan::Piece::source); one file, or one per transfer with
    /// [`plan_per_transfer`](super::plan::plan_per_transfer)).
    Files(Vec<HostFile>),
}

/// One file of a [`Host::Files`] job.
#[derive(Clone, Debug)]
pub(crate) struct HostFile {
    pub fd: i32,
    pub path: String,
    /// Opened with `O_DIRECT`: reads are rounded up to whole blocks.
    pub direct: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Direction {
    Upload,
    Download,
}

pub(crate) struct Job {
    pub op: &'static str,
    pub direction: Direction,
    pub host: Host,
    pub stream: Stream,
    pub plan: Plan,
    /// Pieces with several runs move them with one `cudaMemcpyBatchAsync`.
    pub batch: bool,
    /// Slot fills use streaming stores (`staging::nt`).
    pub streaming: bool,
    /// Workers that may join (besides the caller).
    pub helpers: usize,
    pub trace: Option<Trace>,
    next: AtomicUsize,
    failed: AtomicBool,
    /// Set once any DMA was queued: the caller must then track the work even if it failed.
    queued: AtomicBool,
    error: Mutex<Option<Error>>,
    /// Workers inside the job.
    active: Mutex<usize>,
    left: Condvar,
    /// Recorded on the caller's stream before any piece: each worker's stream waits for it.
    start: Option<Event>,
    /// Recorded on each worker's stream after its last DMA of the job: the caller's stream
    /// waits for all of them before the job's end is tracked.
    done: Mutex<Vec<Event>>,
}

impl Job {
    pub fn new(
        op: &'static str,
        direction: Direction,
        host: Host,
        stream: Stream,
        plan: Plan,
    ) -> Job {
        Job {
            op,
            direction,
            host,
            stream,
            plan,
            batch: false,
            streaming: false,
            helpers: usize::MAX,
            trace: Trace::enabled().then(Trace::new),
            next: AtomicUsize::new(0),
            failed: AtomicBool::new(false),
            queued: AtomicBool::new(false),
            error: Mutex::new(None),
            active: Mutex::new(0),
            left: Condvar::new(),
            start: None,
            done: Mutex::new(Vec::new()),
        }
    }

    fn mark(&self, what: &'static str, piece: usize) {
        if let Some(t) = &self.trace {
            t.mark(what, piece);
        }
    }

    fn has_work(&self) -> bool {
        !self.failed.load(Ordering::Relaxed)
            && self.next.load(Ordering::Relaxed) < self.plan.pieces.len()
    }

    fn fail(&self, e: Error) {
        self.failed.store(true, Ordering::Relaxed);
        let mut slot = lock(&self.error);
        if slot.is_none() {
            *slot = Some(e);
        }
    }

    /// Whether any DMA of this job was queued.
    pub fn queued_any(&self) -> bool {
        self.queued.load(Ordering::Acquire)
    }

    /// The first error, if any piece failed.
    pub fn result(&self) -> Result<()> {
        match lock(&self.error).take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

struct Queue {
    jobs: Vec<Arc<Job>>,
    shutdown: bool,
}

pub(crate) struct Shared {
    pub device: Device,
    slots: Vec<Slot>,
    /// Indices of slots nobody has claimed, oldest release first: the slot claimed next is
    /// the one whose DMA was queued longest ago (LIFO would hand out the slot whose DMA was
    /// just queued, and the claimer would wait for the whole DMA queue ahead of it).
    free: Mutex<std::collections::VecDeque<usize>>,
    slot_freed: Condvar,
    /// Slots that can still be claimed (a slot whose DMA could not be confirmed is retired).
    live: AtomicUsize,
    queue: Mutex<Queue>,
    work: Condvar,
    /// Jobs in the queue, read by spinning workers without the lock.
    pending: AtomicUsize,
    /// Events for jobs' start and done points, reused.
    events: Mutex<Vec<Event>>,
}

impl Shared {
    fn event(&self) -> Result<Event> {
        match lock(&self.events).pop() {
            Some(e) => Ok(e),
            None => Event::new(&self.device),
        }
    }

    fn give_back(&self, events: impl IntoIterator<Item = Event>) {
        lock(&self.events).extend(events);
    }
}

/// How long an idle worker polls for the next job before it sleeps: back-to-back calls then
/// find the workers awake (a wake-up through the kernel costs tens of microseconds).
const SPIN: std::time::Duration = std::time::Duration::from_micros(200);

/// The thread pool and slots of one `Stager`.
pub(crate) struct Engine {
    pub shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("device", &self.shared.device)
            .field("slots", &self.shared.slots.len())
            .field("workers", &self.workers.len())
            .finish()
    }
}

impl Engine {
    /// `slots` pinned slots of `slot_bytes` each and `workers` threads (the caller of each job
    /// is one more).
    pub fn new(
        pool: &PinnedPool,
        workers: usize,
        slots: usize,
        slot_bytes: usize,
    ) -> Result<Engine> {
        let device = &pool.device();
        let mut made = Vec::with_capacity(slots);
        for _ in 0..slots {
            let mut mem = pool.alloc::<u8>(slot_bytes)?;
            let ptr = mem.host_region_mut().ptr.cast::<u8>();
            made.push(Slot {
                mem: std::mem::ManuallyDrop::new(mem),
                ptr,
                len: slot_bytes,
                event: Event::new(device)?,
            });
        }
        let shared = Arc::new(Shared {
            device: *device,
            free: Mutex::new((0..slots).collect()),
            slots: made,
            slot_freed: Condvar::new(),
            live: AtomicUsize::new(slots),
            queue: Mutex::new(Queue {
                jobs: Vec::new(),
                shutdown: false,
            }),
            work: Condvar::new(),
            pending: AtomicUsize::new(0),
            events: Mutex::new(Vec::new()),
        });
        let mut engine = Engine {
            shared,
            workers: Vec::with_capacity(workers),
        };
        for i in 0..workers {
            let shared = engine.shared.clone();
            // Each worker queues its DMAs on its own stream, so the copy engines see several
            // streams' copies at once instead of one queue.
            let stream = Stream::new(device)?;
            let handle = std::thread::Builder::new()
                .name(format!("pinstream-stager-{}-{i}", device.ordinal()))
                .spawn(move || worker(shared, stream))
                .map_err(|e| {
                    Error::invalid("Stager::new", format!("cannot start a worker thread: {e}"))
                })?;
            engine.workers.push(handle);
        }
        Ok(engine)
    }

    /// Runs `job` on the calling thread and the workers; returns when no thread touches the
    /// job's host memory any more.
    pub fn execute(&self, mut job: Job) -> Arc<Job> {
        job.mark("execute", 0);
        let shared = &self.shared;
        let mut helpers = job.plan.pieces.len() > 1 && !self.workers.is_empty() && job.helpers > 0;
        if helpers {
            // Workers' streams start after everything queued on the caller's stream so far.
            match shared
                .event()
                .and_then(|e| job.stream.record(&e).map(|()| e))
            {
                Ok(e) => job.start = Some(e),
                Err(_) => helpers = false,
            }
        }
        let job = Arc::new(job);
        if helpers {
            lock(&shared.queue).jobs.push(job.clone());
            shared.pending.fetch_add(1, Ordering::Release);
            shared.work.notify_all();
            job.mark("notified", 0);
        }
        run_job(shared, &job, &job.stream, || Ok(()));
        job.mark("caller-end", 0);
        if helpers {
            // No one joins after this...
            lock(&shared.queue).jobs.retain(|j| !Arc::ptr_eq(j, &job));
            shared.pending.fetch_sub(1, Ordering::Release);
            // ...and everyone who joined has left before the caller's borrows end.
            let mut active = lock(&job.active);
            while *active > 0 {
                active = job.left.wait(active).unwrap_or_else(|e| e.into_inner());
            }
            drop(active);
            // The caller's stream continues after every worker's DMAs.
            let done = std::mem::take(&mut *lock(&job.done));
            for e in &done {
                if let Err(err) = job.stream.wait(e) {
                    // The caller's tracking cannot cover these DMAs: wait for them here.
                    if let Err(wait) = e.synchronize() {
                        job.fail(wait);
                    }
                    job.fail(err);
                }
            }
            shared.give_back(done);
            job.mark("joined", 0);
        }
        job
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        lock(&self.shared.queue).shutdown = true;
        self.shared.work.notify_all();
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
        // The slots go with the last `Arc<Shared>`, each after its last DMA (`Slot::drop`).
    }
}

fn worker(shared: Arc<Shared>, stream: Stream) {
    let _ = shared.device.make_current();
    loop {
        let until = std::time::Instant::now() + SPIN;
        while shared.pending.load(Ordering::Acquire) == 0 && std::time::Instant::now() < until {
            std::hint::spin_loop();
        }
        let job = {
            let mut q = lock(&shared.queue);
            loop {
                if q.shutdown {
                    return;
                }
                let mut joined = None;
                for job in q.jobs.iter().filter(|j| j.has_work()) {
                    // Joined under the queue lock, while the job is still queued.
                    let mut active = lock(&job.active);
                    if *active < job.helpers {
                        *active += 1;
                        joined = Some(job.clone());
                        break;
                    }
                }
                if let Some(job) = joined {
                    break job;
                }
                q = shared.work.wait(q).unwrap_or_else(|e| e.into_inner());
            }
        };
        job.mark("join", 0);
        work_on(&shared, &job, &stream);
        job.mark("leave", 0);
        let mut active = lock(&job.active);
        *active -= 1;
        job.left.notify_all();
    }
}

/// A worker's share of a job on its own stream, which first waits for the job's start and
/// afterwards records a done event for the caller.
fn work_on(shared: &Shared, job: &Job, stream: &Stream) {
    // The wait for the job's start is only queued once this worker has a piece: a worker that
    // joins as the last pieces are taken costs no runtime call.
    let start = || match &job.start {
        Some(start) => stream.wait_here(start),
        None => Ok(()),
    };
    if !run_job(shared, job, stream, start) {
        return;
    }
    let done = shared
        .event()
        .and_then(|e| stream.record_here(&e).map(|()| e));
    match done {
        Ok(e) => lock(&job.done).push(e),
        Err(e) => {
            // The caller's stream cannot be made to wait for this stream's DMAs: finish them
            // here instead. If even that fails the context is broken (sticky error) and no
            // DMA of it will run again.
            if let Err(wait) = stream.synchronize() {
                job.fail(wait);
            }
            job.fail(e);
        }
    }
}

/// Takes pieces until none is left; `first` runs before the first piece this thread takes.
/// Returns whether this thread took any piece (and so may have queued DMAs).
fn run_job(
    shared: &Shared,
    job: &Job,
    stream: &Stream,
    first: impl FnOnce() -> Result<()>,
) -> bool {
    let mut queued = false;
    let mut first = Some(first);
    loop {
        if job.failed.load(Ordering::Relaxed) {
            return queued;
        }
        let i = job.next.fetch_add(1, Ordering::Relaxed);
        let Some(piece) = job.plan.pieces.get(i) else {
            return queued;
        };
        if let Some(first) = first.take() {
            if let Err(e) = first() {
                job.fail(e);
                return queued;
            }
        }
        queued = true;
        let outcome = catch_unwind(AssertUnwindSafe(|| run_piece(shared, job, stream, piece)));
        match outcome {
            Ok(Ok(())) => {}
            Ok(Err(e)) => job.fail(e),
            Err(panic) => job.fail(Error::Panicked {
                op: job.op,
                message: panic_message(&*panic),
            }),
        }
    }
}

/// A claimed slot; back to the free list on drop unless retired.
struct Claim<'a> {
    shared: &'a Shared,
    index: usize,
    retired: bool,
}

impl Claim<'_> {
    fn slot(&self) -> &Slot {
        &self.shared.slots[self.index]
    }

    /// The slot's DMA could not be confirmed finished: it is never handed out again.
    fn retire(&mut self, e: &Error) {
        self.retired = true;
        self.shared.live.fetch_sub(1, Ordering::AcqRel);
        self.shared.slot_freed.notify_all();
        crate::memory::tracker::leak("a staging slot (retired)", self.slot().len, e);
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        if !self.retired {
            lock(&self.shared.free).push_back(self.index);
            self.shared.slot_freed.notify_one();
        }
    }
}

fn claim<'a>(shared: &'a Shared, op: &'static str) -> Result<Claim<'a>> {
    let mut free = lock(&shared.free);
    loop {
        if let Some(index) = free.pop_front() {
            return Ok(Claim {
                shared,
                index,
                retired: false,
            });
        }
        if shared.live.load(Ordering::Acquire) == 0 {
            return Err(Error::invalid(
                op,
                "every staging slot was retired after a failed wait for the GPU",
            ));
        }
        free = shared
            .slot_freed
            .wait(free)
            .unwrap_or_else(|e| e.into_inner());
    }
}

fn run_piece(shared: &Shared, job: &Job, stream: &Stream, piece: &Piece) -> Result<()> {
    let index = piece.segments.start;
    job.mark("piece", index);
    let mut claim = claim(shared, job.op)?;
    let slot = claim.slot();
    job.mark("claimed", index);
    // The previous DMA on this slot (from any job, on any stream) is over before the host
    // touches it.
    if let Err(e) = slot.event.synchronize() {
        claim.retire(&e);
        return Err(e);
    }
    job.mark("synced", index);
    let segments = &job.plan.segments[piece.segments.clone()];
    let runs = &job.plan.runs[piece.runs.clone()];
    match job.direction {
        Direction::Upload => {
            for s in segments {
                fill(job, slot, piece.source, s.host, s.slot_off, s.len)?;
            }
            job.mark("filled", index);
            let queued = queue_runs(
                job,
                stream,
                slot,
                runs,
                sys::cudaMemcpyKind::cudaMemcpyHostToDevice,
            );
            after_dma(&mut claim, stream)?;
            job.mark("queued", index);
            queued
        }
        Direction::Download => {
            let queued = queue_runs(
                job,
                stream,
                slot,
                runs,
                sys::cudaMemcpyKind::cudaMemcpyDeviceToHost,
            );
            after_dma(&mut claim, stream)?;
            queued?;
            job.mark("queued", index);
            let slot = claim.slot();
            if let Err(e) = slot.event.synchronize() {
                claim.retire(&e);
                return Err(e);
            }
            job.mark("landed", index);
            for s in segments {
                // SAFETY: `s.host..+len` lies in the caller's destination slice, borrowed
                // mutably for the whole call (the caller waits for every worker before it
                // returns), and pieces never overlap on the host side; the slot range lies in
                // the slot (checked by the planner) and its DMA has finished (waited above).
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        slot.ptr.add(s.slot_off),
                        s.host as usize as *mut u8,
                        s.len,
                    )
                };
            }
            job.mark("copied", index);
            Ok(())
        }
    }
}

/// Queues the piece's DMAs; stops at the first failure.
fn queue_runs(
    job: &Job,
    stream: &Stream,
    slot: &Slot,
    runs: &[super::plan::Run],
    kind: sys::cudaMemcpyKind,
) -> Result<()> {
    if job.batch && runs.len() > 1 {
        return queue_batch(job, stream, slot, runs, kind);
    }
    for r in runs {
        // The slot side stays inside the slot (the planner keeps `slot_off + len <= piece`).
        let at = slot.ptr.wrapping_add(r.slot_off).cast::<c_void>();
        let dev = r.dev as usize as *mut c_void;
        let (dst, src) = match kind {
            sys::cudaMemcpyKind::cudaMemcpyHostToDevice => (dev, at.cast_const()),
            _ => (at, dev.cast_const()),
        };
        memcpy(stream, dst, src, r.len, kind, "staged")?;
        job.queued.store(true, Ordering::Release);
    }
    Ok(())
}

/// The piece's runs as one `cudaMemcpyBatchAsync` in stream order.
fn queue_batch(
    job: &Job,
    stream: &Stream,
    slot: &Slot,
    runs: &[super::plan::Run],
    kind: sys::cudaMemcpyKind,
) -> Result<()> {
    let mut dsts = Vec::with_capacity(runs.len());
    let mut srcs = Vec::with_capacity(runs.len());
    let mut sizes = Vec::with_capacity(runs.len());
    for r in runs {
        let at = slot.ptr.wrapping_add(r.slot_off).cast::<c_void>();
        let dev = r.dev as usize as *mut c_void;
        let (dst, src) = match kind {
            sys::cudaMemcpyKind::cudaMemcpyHostToDevice => (dev, at.cast_const()),
            _ => (at, dev.cast_const()),
        };
        dsts.push(dst);
        srcs.push(src);
        sizes.push(r.len);
    }
    // SAFETY: as for one run in `queue_runs`: each slot range lies in the claimed slot, whose
    // event (recorded after this batch) guards its reuse; each device range lies in a
    // destination (or source) the caller holds borrowed and tracked, the runs of a piece never
    // overlap, and stream order (`BatchSrcAccess::Stream`) keeps the batch after the stream's
    // wait for the job's start.
    let queued = unsafe {
        crate::copy::memcpy_batch(stream, &dsts, &srcs, &sizes, kind, BatchSrcAccess::Stream)
    };
    if queued.is_ok() {
        job.queued.store(true, Ordering::Release);
    }
    queued
}

/// Records the slot's event after its DMAs; if that fails, waits for the stream instead, and
/// retires the slot if even that fails.
fn after_dma(claim: &mut Claim<'_>, stream: &Stream) -> Result<()> {
    let recorded = stream.record_here(&claim.slot().event);
    if let Err(e) = recorded {
        if let Err(wait) = stream.synchronize() {
            claim.retire(&wait);
        }
        return Err(e);
    }
    Ok(())
}

/// A host copy, with streaming stores when the job asks for them.
///
/// # Safety
/// As `std::ptr::copy_nonoverlapping(src, dst, len)`.
unsafe fn host_copy(streaming: bool, dst: *mut u8, src: *const u8, len: usize) {
    if streaming {
        // SAFETY: the caller's contract is `nt::copy`'s.
        unsafe { super::nt::copy(dst, src, len) }
    } else {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
    }
}

/// Copies `len` bytes of the job's host side at `host` into the slot at `slot_off`: from the
/// caller's memory, or from the file of transfer `source` (the piece's).
fn fill(
    job: &Job,
    slot: &Slot,
    source: usize,
    host: u64,
    slot_off: usize,
    len: usize,
) -> Result<()> {
    let dst = slot.ptr.wrapping_add(slot_off);
    match &job.host {
        Host::Memory => {
            // SAFETY: `host..+len` lies in the caller's source slice, borrowed for the whole
            // call (the caller waits for every worker before it returns); the slot range lies in
            // the slot, which this thread has claimed and whose last DMA has finished.
            unsafe { host_copy(job.streaming, dst, host as usize as *const u8, len) };
            Ok(())
        }
        Host::Files(files) => {
            // A single file serves every transfer of the job; several, one transfer each.
            let file = if files.len() == 1 {
                files.first()
            } else {
                files.get(source)
            };
            let Some(HostFile { fd, path, direct }) = file else {
                return Err(Error::invalid(
                    job.op,
                    format!(
                        "a piece of transfer {source} in a job of {} files",
                        files.len()
                    ),
                ));
            };
            // With O_DIRECT the read length must be whole blocks; the slot has room (its size
            // and every piece are multiples of 4096).
            let want = if *direct {
                len.next_multiple_of(4096).min(slot.len - slot_off)
            } else {
                len
            };
            let mut done = 0usize;
            while done < len {
                let at = host + done as u64;
                let Ok(off) = libc::off_t::try_from(at) else {
                    return Err(io_error(
                        job,
                        path,
                        at,
                        len - done,
                        "offset too large".into(),
                    ));
                };
                // SAFETY: the destination range lies in the claimed slot (`want <= slot.len -
                // slot_off`); `fd` is open for the whole call (the caller's `FileSource` is
                // borrowed until every worker has left).
                let n = unsafe { libc::pread(*fd, dst.add(done).cast(), want - done, off) };
                if n < 0 {
                    let err = std::io::Error::last_os_error();
                    if err.kind() == std::io::ErrorKind::Interrupted {
                        continue;
                    }
                    return Err(io_error(job, path, at, len - done, err.to_string()));
                }
                if n == 0 {
                    return Err(io_error(
                        job,
                        path,
                        at,
                        len - done,
                        format!("the file ends at byte {at}"),
                    ));
                }
                done += n as usize;
            }
            Ok(())
        }
    }
}

fn io_error(job: &Job, path: &str, offset: u64, len: usize, message: String) -> Error {
    Error::Io {
        op: job.op,
        path: path.to_string(),
        offset,
        len,
        message,
    }
}
