//! The image feed with the GPU decoding: each loader thread reads a batch's files and parses
//! their headers, draws the crops, decodes the batch with its own [`GpuDecoder`] (the GPU's
//! JPEG engines, nvJPEG's CUDA backend or the CPU, per file) into its device arena, and runs
//! the fused resized crop from that arena into an output buffer, on its own stream. No pixel
//! goes back to the host. The consumer takes the batches in order, each ordered on its stream
//! by an event.

use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use pinstream::kernels::{self, CropBox, Layout, OutputElement, ResizeSpec};
use pinstream::memory::{DeviceBuffer, DeviceView, HostAlloc, PinnedBuffer};
use pinstream::{Error, Event, Result, Stream};

use crate::decode::{Format, ImageInfo};
use crate::gpu_cache::{GpuCache, GpuCacheStats, Kept};
use crate::nvjpeg::{GpuDecoder, Item, Nvjpeg, Plan, Region, Route};
use crate::source::{
    checked_info, file_error, read_file_ended, BadFiles, ImageSource, RouteCounts,
    AUTO_DECODES_AT_ONCE, MAX_BATCH_FILE_BYTES,
};
use crate::util::lock;

const OP: &str = "ImageFeed (GPU decoding)";

/// How often a waiting thread looks at the stop flag even without a notification.
const TICK: Duration = Duration::from_millis(50);

/// One batch's device memory: pixels, labels (and their page-locked staging), and the event
/// that marks them written.
struct Output<O: pinstream::Pod> {
    pixels: DeviceBuffer<O>,
    labels: DeviceBuffer<i64>,
    done: Event,
    /// Samples in the batch (the buffers are sized for a full one).
    n: usize,
    dims: [usize; 4],
}

struct State<O: pinstream::Pod> {
    /// The next batch index a loader claims.
    next: u64,
    /// Batches handed to the consumer.
    taken: u64,
    ready: BTreeMap<u64, Result<Output<O>>>,
    free: Vec<Output<O>>,
    /// Output buffers made so far.
    made: usize,
    stop: bool,
    /// Loaders still running.
    alive: usize,
    routes: RouteCounts,
    pacer: Pacer,
}

/// Spaces the loaders' claims evenly over a batch's decode time. Each loader decodes a whole
/// batch, so loaders that start together finish together, and a consumer faster than the feed
/// gets batches in bursts (waiting about one batch time per burst). With claims at least
/// `0.9 x period / loaders` apart, batches come out at an even cadence and the feed's rate is
/// unchanged (the loaders' own rate is `loaders / period`).
#[derive(Debug)]
struct Pacer {
    loaders: u32,
    last_claim: Option<Instant>,
    /// A running estimate of one batch's time on a loader.
    period: Option<Duration>,
}

impl Pacer {
    fn new(loaders: usize) -> Pacer {
        Pacer {
            loaders: loaders.clamp(1, u32::MAX as usize) as u32,
            last_claim: None,
            period: None,
        }
    }

    /// How long a claim at `now` must still wait (`None`: it may go now).
    fn wait(&self, now: Instant) -> Option<Duration> {
        let (last, period) = (self.last_claim?, self.period?);
        let gap = period.mul_f64(0.9) / self.loaders;
        (last + gap)
            .checked_duration_since(now)
            .filter(|d| !d.is_zero())
    }

    fn claimed(&mut self, now: Instant) {
        self.last_claim = Some(now);
    }

    /// A loader took `took` for a batch. One slow batch (a huge file, a stall) moves the
    /// estimate at most as a batch of twice the estimate would, so it cannot hold the claims
    /// back for long.
    fn finished(&mut self, took: Duration) {
        self.period = Some(match self.period {
            Some(p) => p.mul_f64(0.75) + took.min(p * 2).mul_f64(0.25),
            None => took,
        });
    }
}

struct Shared<O: pinstream::Pod> {
    state: Mutex<State<O>>,
    changed: Condvar,
    /// Turns to decode (`ImageFeedConfig::gpu_decodes_at_once`).
    turns: Turns,
    source: ImageSource,
    nv: Nvjpeg,
    /// Batches decoded ahead of the consumer, at most.
    ahead: usize,
    /// Decoded images kept between epochs (`ImageFeedConfig::gpu_cache_bytes`).
    cache: Option<GpuCache>,
}

/// `ImageFeedConfig::gpu_decodes_at_once` resolved for `loaders` loader threads: 0 for no
/// limit (the cap is at least the loaders), else the cap.
fn decodes_at_once(asked: usize, loaders: usize) -> usize {
    let cap = if asked == 0 {
        AUTO_DECODES_AT_ONCE
    } else {
        asked
    };
    if cap >= loaders {
        0
    } else {
        cap
    }
}

/// At most `max` holders at once (0: no limit): a counting semaphore whose waits wake on a
/// stop (checked every [`TICK`]).
struct Turns {
    max: usize,
    held: Mutex<usize>,
    freed: Condvar,
}

/// A turn of [`Turns`], given back when dropped.
struct Turn<'a>(&'a Turns);

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        *lock(&self.0.held) -= 1;
        self.0.freed.notify_one();
    }
}

impl Turns {
    fn new(max: usize) -> Turns {
        Turns {
            max,
            held: Mutex::new(0),
            freed: Condvar::new(),
        }
    }

    /// Waits for a turn; an error once `stopped()` says so.
    fn take(&self, stopped: impl Fn() -> bool) -> Result<Turn<'_>> {
        let mut n = lock(&self.held);
        while self.max > 0 && *n >= self.max {
            if stopped() {
                return Err(Error::invalid(OP, "the feed stopped"));
            }
            n = self
                .freed
                .wait_timeout(n, TICK)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        *n += 1;
        Ok(Turn(self))
    }
}

/// The GPU-decoding engine of an [`ImageFeed`](crate::ImageFeed).
pub(crate) struct GpuFeed<O: OutputElement> {
    shared: Arc<Shared<O>>,
    threads: Vec<JoinHandle<()>>,
    consumer: Stream,
}

impl<O: OutputElement> GpuFeed<O> {
    /// Starts `threads` loaders, each with its own decoder and stream, on `consumer`'s device
    /// (on the CPUs `ImageFeed::new`, the caller, bound it to).
    pub(crate) fn new(consumer: &Stream, source: ImageSource, nv: Nvjpeg) -> Result<Self> {
        let cfg = source.config();
        let threads = cfg.loader_threads(true).max(1);
        let ahead = cfg.prefetch.depth.max(1) + threads;
        // Before any thread: an error here leaves nothing running.
        let cache = match cfg.gpu_cache_bytes {
            0 => None,
            n => Some(GpuCache::new(consumer, n)?),
        };
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                next: 0,
                taken: 0,
                ready: BTreeMap::new(),
                free: Vec::new(),
                made: 0,
                stop: false,
                alive: threads,
                routes: RouteCounts::default(),
                pacer: Pacer::new(threads),
            }),
            changed: Condvar::new(),
            turns: Turns::new(decodes_at_once(cfg.gpu_decodes_at_once, threads)),
            source,
            nv,
            ahead,
            cache,
        });
        let mut feed = GpuFeed {
            shared: shared.clone(),
            threads: Vec::with_capacity(threads),
            consumer: consumer.clone(),
        };
        for t in 0..threads {
            let sh = shared.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("pinstream-nvjpeg-{t}"))
                .spawn(move || loader(&sh));
            match spawned {
                Ok(h) => feed.threads.push(h),
                Err(e) => {
                    lock(&shared.state).alive -= threads - t;
                    return Err(Error::invalid(
                        OP,
                        format!("cannot start a loader thread: {e}"),
                    ));
                }
            }
        }
        Ok(feed)
    }

    /// The next batch (index `taken`), ordered on the consumer's stream.
    pub(crate) fn next(&mut self) -> Result<GpuBatch<'_, O>> {
        let sh = &*self.shared;
        let mut st = lock(&sh.state);
        let index = st.taken;
        let r = loop {
            if let Some(r) = st.ready.remove(&index) {
                break r;
            }
            if st.alive == 0 {
                return Err(Error::invalid(OP, "every loader thread stopped"));
            }
            st = sh
                .changed
                .wait_timeout(st, TICK)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        };
        st.taken += 1;
        drop(st);
        sh.changed.notify_all();
        let out = r?;
        // The consumer's work waits for the batch's on the GPU; the next write of its buffers
        // (a later batch's) waits for the consumer's reads queued up to now.
        self.consumer.wait(&out.done)?;
        Ok(GpuBatch {
            feed: self,
            out: Some(out),
            index,
        })
    }

    /// Waits up to `timeout` for [`next`](Self::next) to have something to return without
    /// waiting (a batch, an error): `true` once it has, `false` if `timeout` passed first.
    pub(crate) fn poll(&self, timeout: Duration) -> bool {
        let sh = &*self.shared;
        let deadline = Instant::now() + timeout;
        let mut st = lock(&sh.state);
        loop {
            if st.ready.contains_key(&st.taken) || st.alive == 0 {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            st = sh
                .changed
                .wait_timeout(st, (deadline - now).min(TICK))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Images decoded per route so far.
    pub(crate) fn routes(&self) -> RouteCounts {
        lock(&self.shared.state).routes
    }

    /// What the cache of decoded images holds (all zero without one).
    pub(crate) fn gpu_cache(&self) -> GpuCacheStats {
        self.shared
            .cache
            .as_ref()
            .map(GpuCache::stats)
            .unwrap_or_default()
    }

    /// The nvJPEG the loaders decode with.
    pub(crate) fn nvjpeg(&self) -> &Nvjpeg {
        &self.shared.nv
    }
}

impl<O: OutputElement> Drop for GpuFeed<O> {
    fn drop(&mut self) {
        lock(&self.shared.state).stop = true;
        self.shared.changed.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// A batch decoded on the GPU: pixels and labels on the device, ordered on the feed's stream.
/// Its buffers go back to the feed when it is dropped (later writes to them wait for the work
/// the consumer's stream has queued by then).
pub struct GpuBatch<'a, O: OutputElement> {
    feed: &'a GpuFeed<O>,
    out: Option<Output<O>>,
    index: u64,
}

impl<O: OutputElement> std::fmt::Debug for GpuBatch<'_, O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuBatch")
            .field("index", &self.index)
            .field("dims", &self.dims())
            .finish()
    }
}

impl<O: OutputElement> GpuBatch<'_, O> {
    fn out(&self) -> &Output<O> {
        self.out.as_ref().expect("taken only by drop")
    }

    /// The prefetcher-style batch index (counted from the configuration's start).
    pub fn index(&self) -> u64 {
        self.index
    }

    /// `[n, c, h, w]` (NCHW) or `[n, h, w, c]` (NHWC).
    pub fn dims(&self) -> [usize; 4] {
        self.out().dims
    }

    /// The pixels.
    pub fn pixels(&self) -> Result<DeviceView<'_, O>> {
        let o = self.out();
        let len: usize = o.dims.iter().product();
        o.pixels.slice(..len)
    }

    /// The labels, one per sample.
    pub fn labels(&self) -> Result<DeviceView<'_, i64>> {
        let o = self.out();
        o.labels.slice(..o.n)
    }

    /// PyTorch's `record_stream`: `stream` also reads the batch; its buffers are not written
    /// again before what `stream` has queued by the time the batch is dropped.
    pub fn record_stream(&self, stream: &Stream) -> Result<()> {
        let o = self.out();
        o.pixels.record_stream(stream)?;
        o.labels.record_stream(stream)
    }
}

#[cfg(feature = "dlpack")]
impl<O: OutputElement + pinstream::dlpack::Element> GpuBatch<'_, O> {
    /// The batch as two DLPack tensors, pixels (`dims`) and labels (`[n]`), owning its
    /// buffers until their consumers release them (the feed makes new buffers meanwhile). Hand
    /// them over with a consumer stream: it waits for the batch on the GPU, and the memory is
    /// freed only after the work that stream queued before the release.
    pub fn into_dlpack(mut self) -> Result<(pinstream::dlpack::Tensor, pinstream::dlpack::Tensor)> {
        use pinstream::dlpack::Tensor;
        let o = self
            .out
            .take()
            .ok_or_else(|| Error::invalid(OP, "the batch was given back"))?;
        {
            // Its buffers leave the feed's circle: a loader makes new ones in their place.
            let mut st = lock(&self.feed.shared.state);
            st.made -= 1;
        }
        self.feed.shared.changed.notify_all();
        let Output {
            pixels,
            labels,
            dims,
            n,
            ..
        } = o;
        let len: usize = dims.iter().product();
        let pixels = Tensor::from_device(pixels)?.slice(..len)?.reshape(&dims)?;
        let labels = Tensor::from_device(labels)?.slice(..n)?;
        Ok((pixels, labels))
    }
}

impl<O: OutputElement> Drop for GpuBatch<'_, O> {
    fn drop(&mut self) {
        if let Some(o) = self.out.take() {
            // Later writes wait for the consumer's reads queued up to now.
            let ok = o.pixels.record_stream(&self.feed.consumer).is_ok()
                && o.labels.record_stream(&self.feed.consumer).is_ok();
            let mut st = lock(&self.feed.shared.state);
            if ok {
                st.free.push(o);
            } else {
                st.made -= 1;
            }
            drop(st);
            self.feed.shared.changed.notify_all();
        }
    }
}

/// A loader thread: claims batch indices in order, never more than `ahead` past the consumer.
fn loader<O: OutputElement>(sh: &Shared<O>) {
    let mut work = match Work::new(&sh.nv) {
        Ok(w) => Some(w),
        Err(e) => {
            // Reported at the next index this thread would have claimed.
            let mut st = lock(&sh.state);
            let i = st.next;
            st.next += 1;
            st.ready.insert(i, Err(e));
            None
        }
    };
    loop {
        let (index, out) = {
            let mut st = lock(&sh.state);
            loop {
                if st.stop || work.is_none() {
                    st.alive -= 1;
                    drop(st);
                    sh.changed.notify_all();
                    return;
                }
                let cap = sh.ahead;
                let mut tick = TICK;
                if st.next < st.taken + cap as u64 && (!st.free.is_empty() || st.made < cap) {
                    match st.pacer.wait(Instant::now()) {
                        None => break,
                        Some(d) => tick = d.min(TICK),
                    }
                }
                st = sh
                    .changed
                    .wait_timeout(st, tick)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
            let i = st.next;
            st.next += 1;
            st.pacer.claimed(Instant::now());
            let out = st.free.pop();
            if out.is_none() {
                st.made += 1;
            }
            (i, out)
        };
        let w = work.as_mut().expect("checked above");
        let started = Instant::now();
        let r = catch_unwind(AssertUnwindSafe(|| w.batch(sh, index, out)));
        let took = started.elapsed();
        let r = match r {
            Ok(r) => r,
            Err(p) => Err(Error::Panicked {
                op: OP,
                message: crate::util::panic_message(&*p),
            }),
        };
        let mut st = lock(&sh.state);
        if r.is_err() {
            // The output buffer went with the failed batch.
            st.made -= 1;
        } else {
            st.pacer.finished(took);
        }
        if let Ok((_, counts)) = &r {
            st.routes.hardware += counts.hardware;
            st.routes.cuda += counts.cuda;
            st.routes.cpu += counts.cpu;
        }
        st.ready.insert(index, r.map(|(o, _)| o));
        drop(st);
        sh.changed.notify_all();
    }
}

/// A loader's own decoder, arena and page-locked staging.
struct Work {
    decoder: GpuDecoder,
    arena: Option<DeviceBuffer<u8>>,
    /// The files' bytes, page-locked, as nvJPEG reads them (see [`Work::stage_into`]).
    bitstreams: Option<PinnedBuffer<u8>>,
    /// The labels on their way to the device (kept here, not in the batch: a batch handed out
    /// through DLPack would take it along, and every batch would allocate page-locked memory).
    labels_host: Option<PinnedBuffer<i64>>,
}

/// One file of a batch: read (its bytes, or `None` to read again), its crop and plan.
struct File {
    /// Its index in the dataset's list.
    item: usize,
    path: PathBuf,
    label: usize,
    bytes: Option<Vec<u8>>,
    crop: CropBox,
    plan: Plan,
    offset: usize,
    /// Where the cache keeps it (then it is neither read nor decoded: `plan` is the whole
    /// image).
    kept: Option<Kept>,
}

impl Work {
    fn new(nv: &Nvjpeg) -> Result<Work> {
        Ok(Work {
            decoder: nv.decoder()?,
            arena: None,
            bitstreams: None,
            labels_host: None,
        })
    }

    /// `files` copied one after another into the page-locked staging (grown as needed), and
    /// where each starts; `None` where page-locked memory cannot be had (the files are then
    /// decoded from where they are).
    ///
    /// Why: the hardware backend copies each bitstream to the device itself. From pageable
    /// memory each of those copies goes through the driver's own staging under its lock, and
    /// every other thread's launches wait for that lock (a training loop's: measured at twice
    /// the launch time while the feed ran). From page-locked memory they are plain DMAs.
    ///
    /// The staging is written again only once the decoder's stream is idle: `decode` waits for
    /// every copy it queued on every way out, and this waits again in case it did not return.
    fn stage_into<'s>(
        slot: &'s mut Option<PinnedBuffer<u8>>,
        stream: &Stream,
        files: &[&[u8]],
    ) -> Option<(&'s [u8], Vec<usize>)> {
        let total = files
            .iter()
            .try_fold(0usize, |t, f| t.checked_add(f.len()))?;
        let len = staging_len(total)?;
        // Whatever the way out of the last decode (a panic caught by the loader included),
        // nothing queued may still read the staging: an idle stream answers at once.
        stream.synchronize().ok()?;
        if slot.as_ref().is_none_or(|b| b.len() < total) {
            *slot = None;
            *slot = PinnedBuffer::new(&stream.device(), len, HostAlloc::DEFAULT).ok();
        }
        let buf = slot.as_mut()?.as_mut_slice().ok()?;
        let starts = pack(buf, files)?;
        Some((&buf[..total], starts))
    }

    /// The region of the image a crop box reads (the filter stops at the box's edges, widened
    /// to whole pixels), and the box in that region's coordinates.
    fn region(crop: &CropBox, h: usize, w: usize) -> Option<(Region, CropBox)> {
        if !crop.clamp_to_box {
            return None;
        }
        let top = (crop.top.floor().max(0.0) as usize).min(h - 1);
        let left = (crop.left.floor().max(0.0) as usize).min(w - 1);
        let bottom = ((crop.top + crop.height).ceil() as usize).clamp(top + 1, h);
        let right = ((crop.left + crop.width).ceil() as usize).clamp(left + 1, w);
        let r = Region {
            top,
            left,
            height: bottom - top,
            width: right - left,
        };
        let mut shifted = *crop;
        shifted.top -= top as f32;
        shifted.left -= left as f32;
        Some((r, shifted))
    }

    fn batch<O: OutputElement>(
        &mut self,
        sh: &Shared<O>,
        index: u64,
        out: Option<Output<O>>,
    ) -> Result<(Output<O>, RouteCounts)> {
        let src = &sh.source;
        let cfg = src.config();
        let (epoch, k, list, mut rng) = src.batch_files(OP, index)?;
        let bad = |path: &std::path::Path, e: Error| -> Result<()> {
            if cfg.bad_files == BadFiles::Skip {
                src.skip(path, &e);
                Ok(())
            } else {
                Err(file_error(path, e))
            }
        };
        let mut probe = ResizeSpec::new(3, cfg.out.0, cfg.out.1, cfg.norm.clone())
            .layouts(Layout::Nhwc, cfg.layout);
        // Read, check, crop and plan every file, in order (the crops drawn as the CPU path
        // draws them).
        let mut files: Vec<File> = Vec::with_capacity(list.len());
        let (mut offset, mut held) = (0usize, 0usize);
        let cache = sh.cache.as_ref();
        for (item, (path, label)) in list {
            if let Some(k) = cache.and_then(|c| c.get(item)) {
                // Kept: the crop drawn as for the file (the same draws), from the kept pixels.
                let info = ImageInfo {
                    height: k.height,
                    width: k.width,
                    format: Format::Jpeg,
                };
                let crop = match src.crop(OP, &path, &info, &mut rng, &mut probe) {
                    Ok(c) => c,
                    Err(e) => {
                        bad(&path, e)?;
                        continue;
                    }
                };
                files.push(File {
                    item,
                    path,
                    label,
                    bytes: None,
                    crop,
                    plan: Plan {
                        route: Route::Hardware,
                        height: k.height,
                        width: k.width,
                        region: Region::full(k.height, k.width),
                    },
                    offset,
                    kept: Some(k),
                });
                offset = offset.checked_add(k.len()).ok_or_else(|| {
                    Error::invalid(OP, "the batch's decoded size overflows usize")
                })?;
                continue;
            }
            let read = read_file_ended(OP, &path)
                .and_then(|(b, ended)| checked_info(&path, &b).map(|i| (b, i, ended)));
            let (bytes, info, ended) = match read {
                Ok(x) => x,
                Err(e) => {
                    bad(&path, e)?;
                    continue;
                }
            };
            let (h, w) = (info.height, info.width);
            let crop = match src.crop(OP, &path, &info, &mut rng, &mut probe) {
                Ok(c) => c,
                Err(e) => {
                    bad(&path, e)?;
                    continue;
                }
            };
            // With a cache every image is decoded whole, not only its crop's region (so that
            // kept or not, its crop is taken in the same coordinates: the same pixels,
            // whatever was kept when).
            let whole = cache.is_some();
            let (region, crop) = match Self::region(&crop, h, w).filter(|_| !whole) {
                Some((r, c)) => (Some(r), c),
                None => (None, crop),
            };
            let plan = match self.decoder.plan_known(&bytes, info, ended, region) {
                Ok(p) => p,
                Err(e) => {
                    bad(&path, e)?;
                    continue;
                }
            };
            // The box in the coordinates of what is decoded (the region, widened to whole MCUs,
            // or the whole image).
            let crop = {
                let mut c = crop;
                if let Some(r) = region {
                    c.top += r.top as f32;
                    c.left += r.left as f32;
                }
                c.top -= plan.region.top as f32;
                c.left -= plan.region.left as f32;
                c
            };
            let kept = match held.checked_add(bytes.len()) {
                Some(n) if n <= src.held_bytes() => {
                    held = n;
                    Some(bytes)
                }
                _ => None,
            };
            let len = plan.region.rgb_len();
            files.push(File {
                item,
                path,
                label,
                bytes: kept,
                crop,
                plan,
                offset,
                kept: None,
            });
            offset = offset
                .checked_add(len)
                .ok_or_else(|| Error::invalid(OP, "the batch's decoded size overflows usize"))?;
        }
        if files.is_empty() {
            return Err(Error::invalid(
                OP,
                format!("every file of epoch {epoch}'s batch {k} was left out as undecodable"),
            ));
        }
        // A batch of kept images only has nothing to decode: no arena for it.
        let all_kept = files.iter().all(|f| f.kept.is_some());
        if !all_kept && self.arena.as_ref().is_none_or(|a| a.len() < offset) {
            self.arena = None;
            // Stream-ordered (no device-wide synchronization, as cudaMalloc / cudaFree would
            // cost every other loader), with room to spare: random crops vary the size.
            let len = offset.saturating_mul(2);
            self.arena = Some(DeviceBuffer::<u8>::new_async(self.decoder.stream(), len)?);
        }
        // `None` only for a batch of kept images only, which never uses it.
        let mut arena = self.arena.as_mut();
        let no_arena = || Error::invalid(OP, "no arena for a batch with images to decode");
        // Decode in groups of at most `held_bytes` of files (files not kept are read again).
        // Kept images are ready; the rest are decoded.
        let mut ok: Vec<bool> = files.iter().map(|f| f.kept.is_some()).collect();
        let mut counts = RouteCounts::default();
        let mut start = 0;
        while start < files.len() {
            let mut end = start;
            let mut bytes: Vec<Vec<u8>> = Vec::new();
            let mut total = 0usize;
            while end < files.len() {
                if files[end].kept.is_some() {
                    // Not read, not decoded (an empty entry is left out below).
                    bytes.push(Vec::new());
                    end += 1;
                    continue;
                }
                let b = match files[end].bytes.take() {
                    Some(b) => b,
                    None => match read_again(&files[end].path) {
                        Ok(b) => b,
                        Err(e) => {
                            bad(&files[end].path, e)?;
                            bytes.push(Vec::new());
                            end += 1;
                            continue;
                        }
                    },
                };
                total = total.saturating_add(b.len());
                bytes.push(b);
                end += 1;
                if total >= src.held_bytes() {
                    break;
                }
            }
            let idx: Vec<usize> = (start..end)
                .filter(|&i| !bytes[i - start].is_empty())
                .collect();
            if idx.is_empty() {
                // Nothing to decode (kept images, files that could not be read again).
                start = end;
                continue;
            }
            let datas: Vec<&[u8]> = idx.iter().map(|&i| &bytes[i - start][..]).collect();
            let staged = Self::stage_into(&mut self.bitstreams, self.decoder.stream(), &datas);
            let items: Vec<Item<'_>> = idx
                .iter()
                .enumerate()
                .map(|(k, &i)| Item {
                    data: match &staged {
                        Some((buf, starts)) => &buf[starts[k]..starts[k] + datas[k].len()],
                        None => datas[k],
                    },
                    plan: files[i].plan,
                    offset: files[i].offset,
                })
                .collect();
            let results = {
                let _turn = sh.turns.take(|| lock(&sh.state).stop)?;
                let arena = arena.as_deref_mut().ok_or_else(no_arena)?;
                self.decoder.decode(&items, arena)?
            };
            for (&i, r) in idx.iter().zip(results) {
                match r {
                    // The decode must write what was planned (a file changed in between: bad).
                    Ok(p) if p.region == files[i].plan.region => {
                        ok[i] = true;
                        match p.route {
                            Route::Hardware => counts.hardware += 1,
                            Route::Cuda => counts.cuda += 1,
                            Route::Cpu => counts.cpu += 1,
                        }
                    }
                    Ok(_) => bad(
                        &files[i].path,
                        Error::invalid(OP, "the file changed while its batch was read"),
                    )?,
                    Err(e) => bad(&files[i].path, e)?,
                }
            }
            start = end;
        }
        let stream = self.decoder.stream().clone();
        // Every image of the batch kept: cropped straight from the cache. Else the kept ones
        // are copied beside the decoded ones, and cropped from the arena with them.
        let from_cache = cache.filter(|_| all_kept);
        let mut served = 0;
        if let Some(c) = cache {
            let hits: Vec<(Kept, usize)> = files
                .iter()
                .filter_map(|f| f.kept.map(|k| (k, f.offset)))
                .collect();
            served = hits.len();
            if from_cache.is_none() && !hits.is_empty() {
                let arena = arena.as_deref_mut().ok_or_else(no_arena)?;
                c.copy_out(&stream, arena, &hits)?;
            }
            // Keep what was decoded whole, while it fits.
            let whole: Vec<(usize, usize, usize, usize)> = files
                .iter()
                .zip(&ok)
                .filter(|(f, &ok)| {
                    ok && f.kept.is_none()
                        && f.plan.region == Region::full(f.plan.height, f.plan.width)
                })
                .map(|(f, _)| (f.item, f.plan.height, f.plan.width, f.offset))
                .collect();
            if !whole.is_empty() {
                let arena = arena.as_deref().ok_or_else(no_arena)?;
                // Not kept (an error, which leaves them out): the batch itself is whole.
                if let Err(e) = c.keep(&stream, arena, &whole) {
                    c.note_failure(&e);
                }
            }
        }
        let mut spec = ResizeSpec::new(3, cfg.out.0, cfg.out.1, cfg.norm.clone())
            .layouts(Layout::Nhwc, cfg.layout);
        let mut labels = Vec::with_capacity(files.len());
        for (f, _) in files.iter().zip(&ok).filter(|(_, &ok)| ok) {
            let at = match (from_cache, f.kept) {
                (Some(_), Some(k)) => k.offset,
                _ => f.offset,
            };
            spec.push(at, f.plan.region.height, f.plan.region.width, f.crop);
            labels.push(f.label as i64);
        }
        if labels.is_empty() {
            return Err(Error::invalid(
                OP,
                format!("every file of epoch {epoch}'s batch {k} was left out as undecodable"),
            ));
        }
        let mut out = match out {
            Some(o) => o,
            None => output::<O>(
                self.decoder.stream(),
                src.largest_batch(),
                spec.sample_len()?,
            )?,
        };
        let n = labels.len();
        let (c, (h, w)) = (spec.out_channels(), cfg.out);
        out.dims = match cfg.layout {
            Layout::Nhwc => [n, h, w, c],
            _ => [n, c, h, w],
        };
        out.n = n;
        let len = spec.output_len()?;
        let mut pixels = out.pixels.slice_mut(..len)?;
        match from_cache {
            Some(c) => {
                c.with_buffer(|buf| kernels::resized_crop(&stream, buf, &spec, &mut pixels))?
            }
            None => {
                let arena = arena.as_deref().ok_or_else(no_arena)?;
                kernels::resized_crop(&stream, arena, &spec, &mut pixels)?
            }
        }
        if let Some(c) = cache {
            c.served(served);
        }
        if self.labels_host.as_ref().is_none_or(|h| h.len() < n) {
            let most = src.largest_batch().max(n);
            self.labels_host = Some(PinnedBuffer::new(
                &stream.device(),
                most,
                HostAlloc::DEFAULT,
            )?);
        }
        let labels_host = self.labels_host.as_mut().expect("made above");
        // Waits for the previous batch's copy from it (tracked), if still queued.
        labels_host.as_mut_slice()?[..n].copy_from_slice(&labels);
        let host = labels_host.slice(..n)?;
        stream.copy_h2d(&host, &mut out.labels.slice_mut(..n)?)?;
        stream.record(&out.done)?;
        Ok((out, counts))
    }
}

/// The staging to make for `total` bytes of files: room to grow into (the next power of two,
/// at least 1 MiB), up to a batch's usual most; `None` for nothing to stage or more than
/// [`MAX_BATCH_FILE_BYTES`] (a group of huge files, decoded from where it is: the staging never
/// holds more).
fn staging_len(total: usize) -> Option<usize> {
    if total == 0 || total > MAX_BATCH_FILE_BYTES {
        return None;
    }
    let grown = total
        .checked_next_power_of_two()
        .unwrap_or(total)
        .max(1 << 20);
    Some(grown.min(MAX_BATCH_FILE_BYTES))
}

/// A planned file's bytes read again for its decode (it was not kept): an error where it can
/// no longer be read or was emptied meanwhile, so that the policy for bad files (an error
/// naming it, or skipped and counted) applies, rather than the file silently falling out of
/// its batch.
fn read_again(path: &std::path::Path) -> Result<Vec<u8>> {
    let (b, _) = read_file_ended(OP, path)?;
    if b.is_empty() {
        return Err(crate::dataset::io(
            OP,
            path,
            "the file was emptied after its batch was planned",
        ));
    }
    Ok(b)
}

/// `files` one after another at the start of `buf`: where each starts, or `None` where they do
/// not fit.
fn pack(buf: &mut [u8], files: &[&[u8]]) -> Option<Vec<usize>> {
    let mut starts = Vec::with_capacity(files.len());
    let mut at = 0usize;
    for f in files {
        let end = at.checked_add(f.len()).filter(|&e| e <= buf.len())?;
        buf[at..end].copy_from_slice(f);
        starts.push(at);
        at = end;
    }
    Some(starts)
}

/// A batch's device memory, sized for `batch` samples of `sample` elements (stream-ordered on
/// the loader's `stream`).
fn output<O: OutputElement>(stream: &Stream, batch: usize, sample: usize) -> Result<Output<O>> {
    let device = &stream.device();
    let len = batch
        .checked_mul(sample)
        .ok_or_else(|| Error::invalid(OP, "the batch's output size overflows usize"))?;
    Ok(Output {
        pixels: DeviceBuffer::new_async(stream, len)?,
        labels: DeviceBuffer::new_async(stream, batch)?,
        done: Event::new(device)?,
        n: 0,
        dims: [0; 4],
    })
}

#[cfg(test)]
mod tests {
    use super::{
        decodes_at_once, pack, read_again, staging_len, Pacer, Turns, AUTO_DECODES_AT_ONCE,
        MAX_BATCH_FILE_BYTES,
    };

    /// A file read again for its decode: its bytes, or an error naming it when it was emptied
    /// or removed after planning (never an empty result that would drop it unreported).
    #[test]
    fn read_again_refuses_emptied_files() {
        let dir = std::env::temp_dir().join(format!("pinstream-read-again-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("a.jpg");
        std::fs::write(&f, b"\xff\xd8 some bytes").unwrap();
        assert_eq!(read_again(&f).unwrap(), b"\xff\xd8 some bytes");
        std::fs::write(&f, b"").unwrap();
        let e = read_again(&f).unwrap_err().to_string();
        assert!(e.contains("emptied") && e.contains("a.jpg"), "{e}");
        std::fs::remove_file(&f).unwrap();
        let e = read_again(&f).unwrap_err().to_string();
        assert!(e.contains("a.jpg"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The staging's size: at least what is asked, a power of two from 1 MiB, never above
    /// MAX_BATCH_FILE_BYTES; nothing for an empty group or one above it.
    #[test]
    fn staging_len_grows_within_the_cap() {
        const MIB: usize = 1 << 20;
        assert_eq!(staging_len(0), None);
        assert_eq!(staging_len(1), Some(MIB));
        assert_eq!(staging_len(MIB), Some(MIB));
        assert_eq!(staging_len(MIB + 1), Some(2 * MIB));
        assert_eq!(staging_len(28 * MIB), Some(32 * MIB));
        assert_eq!(
            staging_len(MAX_BATCH_FILE_BYTES - 1),
            Some(MAX_BATCH_FILE_BYTES)
        );
        assert_eq!(
            staging_len(MAX_BATCH_FILE_BYTES),
            Some(MAX_BATCH_FILE_BYTES)
        );
        assert_eq!(staging_len(MAX_BATCH_FILE_BYTES + 1), None);
        assert_eq!(staging_len(usize::MAX), None);
        for total in [1, 3 * MIB + 7, 100 * MIB, MAX_BATCH_FILE_BYTES] {
            assert!(staging_len(total).unwrap() >= total);
        }
    }

    /// The bitstreams' staging layout: files back to back (empty ones included) over poisoned
    /// bytes, the rest untouched, and `None` where they do not fit (the files are then decoded
    /// from where they are).
    #[test]
    fn pack_lays_files_back_to_back() {
        let files: [&[u8]; 4] = [b"abc", b"", b"defgh", b"i"];
        let mut buf = vec![0xEEu8; 12];
        assert_eq!(pack(&mut buf, &files), Some(vec![0, 3, 3, 8]));
        assert_eq!(&buf[..9], b"abcdefghi");
        assert!(buf[9..].iter().all(|&b| b == 0xEE));
        let mut exact = vec![0xEEu8; 9];
        assert_eq!(pack(&mut exact, &files), Some(vec![0, 3, 3, 8]));
        assert_eq!(&exact[..], b"abcdefghi");
        assert_eq!(pack(&mut [0u8; 8], &files), None);
        assert_eq!(pack(&mut [], &[]), Some(vec![]));
    }

    /// 0 picks the automatic cap, which is no cap where the loaders are fewer; any cap at least
    /// the loaders is no cap; `usize::MAX` is no cap.
    #[test]
    fn decodes_at_once_resolves_auto_and_no_limit() {
        assert_eq!(decodes_at_once(0, 8), AUTO_DECODES_AT_ONCE);
        assert_eq!(decodes_at_once(0, AUTO_DECODES_AT_ONCE), 0);
        assert_eq!(decodes_at_once(0, 2), 0);
        assert_eq!(decodes_at_once(3, 8), 3);
        assert_eq!(decodes_at_once(8, 8), 0);
        assert_eq!(decodes_at_once(usize::MAX, 16), 0);
        assert_eq!(decodes_at_once(1, 1), 0);
        assert_eq!(decodes_at_once(1, 2), 1);
    }
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::time::{Duration, Instant};

    /// No more than `max` holders at once, counted (not timed): 6 threads x 200 turns of 2.
    /// 0 is no limit; a stop wakes a waiter with an error.
    #[test]
    fn turns_limit_holders_and_wake_on_stop() {
        let turns = Turns::new(2);
        let (now, most) = (AtomicUsize::new(0), AtomicUsize::new(0));
        std::thread::scope(|s| {
            for _ in 0..6 {
                s.spawn(|| {
                    for _ in 0..200 {
                        let _t = turns.take(|| false).unwrap();
                        let n = now.fetch_add(1, Ordering::SeqCst) + 1;
                        most.fetch_max(n, Ordering::SeqCst);
                        std::thread::yield_now();
                        now.fetch_sub(1, Ordering::SeqCst);
                    }
                });
            }
        });
        assert!(most.load(Ordering::SeqCst) <= 2, "{most:?} holders at once");
        assert_eq!(*turns.held.lock().unwrap(), 0);
        let free = Turns::new(0);
        let all: Vec<_> = (0..100).map(|_| free.take(|| false).unwrap()).collect();
        assert_eq!(all.len(), 100);
        let one = Turns::new(1);
        let held = one.take(|| false).unwrap();
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            let waiter = s.spawn(|| one.take(|| stop.load(Ordering::SeqCst)).map(|_| ()));
            stop.store(true, Ordering::SeqCst);
            assert!(waiter.join().unwrap().is_err());
        });
        drop(held);
        assert!(
            one.take(|| true).is_ok(),
            "a free turn is taken even when stopped"
        );
    }

    /// Claims are spaced by 0.9 x the period over the loaders once a period is known; the
    /// first claims (no estimate yet) are not held back. Times are given, not measured.
    #[test]
    fn pacer_spaces_claims_over_the_period() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut p = Pacer::new(8);
        assert_eq!(p.wait(t0), None);
        p.claimed(t0);
        assert_eq!(p.wait(t0), None, "no period yet");
        p.finished(ms(80));
        // Gap: 0.9 x 80 ms / 8 = 9 ms after the last claim.
        assert_eq!(p.wait(t0), Some(ms(9)));
        assert_eq!(p.wait(t0 + ms(4)), Some(ms(5)));
        assert_eq!(p.wait(t0 + ms(9)), None);
        assert_eq!(p.wait(t0 + ms(50)), None);
        // The estimate follows the batches' times: 0.75 x 80 + 0.25 x 160 = 100 ms.
        p.finished(ms(160));
        p.claimed(t0 + ms(100));
        assert_eq!(p.wait(t0 + ms(100)), Some(Duration::from_micros(11_250)));
        // An outlier counts as twice the estimate: 0.75 x 100 + 0.25 x 200 = 125 ms, not 15 s.
        p.finished(Duration::from_secs(60));
        assert_eq!(p.period, Some(ms(125)));
        // One loader: the gap is 0.9 of the period.
        let mut one = Pacer::new(1);
        one.claimed(t0);
        one.finished(ms(10));
        assert_eq!(one.wait(t0), Some(ms(9)));
        assert_eq!(Pacer::new(0).loaders, 1);
    }
}
