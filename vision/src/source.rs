//! The images of an [`ImageList`] as batches: a per-epoch seeded order (sharded by rank,
//! `drop_last`), each file read (up to the end of its image) and its header checked, its
//! random-resized crop (or the validation transform) drawn from a generator seeded by `(seed,
//! epoch, batch)` — the configuration and the source that [`ImageFeed`](crate::ImageFeed) runs,
//! on the GPU's decoders or on the loader threads behind a prefetcher (as a [`Source`]).

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use pinstream::kernels::{CropBox, Layout, Normalize, ResizeSpec, MAX_OUT_SIDE, MAX_SIDE};
use pinstream::prefetch::{HostBatch, PrefetchConfig, Source};
use pinstream::{Error, Result};

use crate::augment::{RandomResizedCrop, Rng};
use crate::dataset::ImageList;
use crate::decode;
use crate::sampler::{Batches, Sampler};

/// Where each image's crop comes from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Augment {
    /// torchvision's `RandomResizedCrop` + `RandomHorizontalFlip` (training).
    Train(RandomResizedCrop),
    /// `Resize(resize)` + `CenterCrop(out)` (validation): the output must be square.
    Val {
        /// The shorter side after the resize (256 for 224 crops).
        resize: usize,
    },
}

/// What happens to a file that cannot be read or decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BadFiles {
    /// The batch fails with an error naming the file (the default).
    Error,
    /// The file is left out of its batch (which is one sample shorter) and counted in
    /// [`ImageSource::skipped`].
    Skip,
}

/// How an [`ImageFeed`](crate::ImageFeed) (or an [`ImageSource`]) reads, orders and transforms the images.
#[derive(Clone, Debug, PartialEq)]
pub struct ImageFeedConfig {
    /// Images per batch (per rank).
    pub batch: usize,
    /// Output height and width.
    pub out: (usize, usize),
    /// Random-resized crops, or the validation transform.
    pub augment: Augment,
    /// On the 0..255 scale (`Normalize::imagenet()` by default).
    pub norm: Normalize,
    /// Output layout (`Nchw`; `Nhwc` for channels-last models).
    pub layout: Layout,
    /// Seed of the order and of the crops: the same seed and epoch give the same batches on
    /// every machine.
    pub seed: u64,
    /// Shuffle every epoch (`false`: the list's order, as for validation).
    pub shuffle: bool,
    /// This process's rank and the number of ranks (`DistributedSampler`'s semantics).
    pub rank: usize,
    /// Number of ranks.
    pub world: usize,
    /// Leave out the last batch of an epoch when it is short.
    pub drop_last: bool,
    /// Undecodable files: an error, or skipped and counted.
    pub bad_files: BadFiles,
    /// Where to start: epoch and batch within it (a checkpoint's [`ImageFeed::position`](crate::ImageFeed::position)).
    pub start: (u64, usize),
    /// The prefetcher underneath (`loader_threads` decode in parallel; with GPU decoding,
    /// `loader_threads` read and parse files and queue their decodes, and `depth` batches are
    /// kept ready). `loader_threads = 0`, this config's default, picks by where the feed
    /// decodes: [`AUTO_GPU_LOADER_THREADS`] on the GPU, [`AUTO_CPU_LOADER_THREADS`] on the CPU
    /// (see [`loader_threads`](Self::loader_threads)). Set its fields (`cfg.prefetch.depth =
    /// 3`) rather than replacing it with `PrefetchConfig { .., ..PrefetchConfig::default() }`,
    /// whose 4 loader threads then apply on both routes. A `Prefetcher` or `DryRun` of your
    /// own takes [`prefetch_config`](Self::prefetch_config), not this.
    pub prefetch: PrefetchConfig,
    /// Where JPEGs are decoded: on the GPU where it can ([`Decoding::Auto`], the default).
    pub decoding: Decoding,
    /// With GPU decoding: how many loaders may have a batch in nvJPEG's hands at once (the
    /// others read and parse meanwhile). 0, the default, picks
    /// [`AUTO_DECODES_AT_ONCE`](crate::AUTO_DECODES_AT_ONCE) (more batches in the engines' hands
    /// at once decode slower); `usize::MAX` for no limit.
    pub gpu_decodes_at_once: usize,
    /// With GPU decoding: device memory, in bytes, for keeping decoded images between epochs
    /// (0, the default: none). Taken when the feed starts. Each image is kept the first time it
    /// is decoded, while it fits; a later epoch crops it from there instead of reading and
    /// decoding its file again. Size it to the decoded dataset (height x width x 3 bytes per
    /// image: 3.27 GB for 5 000 ImageNet-sized JPEGs; per rank, the whole set, as ranks see
    /// other files every epoch). With a cache every image is decoded whole. A budget above the
    /// device's memory is `InvalidArgument`. A file changed on disk after it was kept is fed
    /// as it was. No effect where the feed decodes on the CPU
    /// ([`Decoding::Cpu`] refuses it). See `docs/image-feed.md`.
    pub gpu_cache_bytes: usize,
}

/// What `ImageFeedConfig::gpu_decodes_at_once = 0` stands for: batches in nvJPEG's hands at
/// once, at most. Measured on H100 and H200 (7 JPEG engines), where eight loaders decoding at
/// once fed fewer images per second than four (BENCHMARKS.md, issue 31).
pub const AUTO_DECODES_AT_ONCE: usize = 4;

/// What `prefetch.loader_threads = 0` (the feed's default) stands for with GPU decoding.
/// Measured beside training steps on an H200 (BENCHMARKS.md, 2026-11-27 fifth session): two
/// loaders fed ResNet-18 at 1.14–1.15 of its ideal where four gave 1.25–1.28, and ResNet-50 no
/// worse; every loader adds nvJPEG streams that contend with the step's for the GPU's queues.
/// Alone, without a step, four feed more images per second (34 700 against 24 700): raise it
/// for a model faster than that.
pub const AUTO_GPU_LOADER_THREADS: usize = 2;

/// What `prefetch.loader_threads = 0` (the feed's default) stands for with CPU decoding: the
/// prefetcher's own default.
pub const AUTO_CPU_LOADER_THREADS: usize = 4;

/// Images decoded per route, over the feed's life.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RouteCounts {
    /// By the GPU's JPEG engines.
    pub hardware: u64,
    /// By nvJPEG's CUDA backend.
    pub cuda: u64,
    /// By the CPU decoder.
    pub cpu: u64,
}

/// Where an [`ImageFeed`](crate::ImageFeed) decodes its images.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Decoding {
    /// On the GPU where nvJPEG loads and the GPU has JPEG engines (feature `nvjpeg`), else on
    /// the CPU (saying why once, on stderr).
    #[default]
    Auto,
    /// On the GPU through nvJPEG (its engines, else its CUDA backend); an error where nvJPEG
    /// cannot be loaded or the crate was built without the `nvjpeg` feature.
    Gpu,
    /// On the loader threads' CPUs, into page-locked memory, through the prefetcher.
    Cpu,
}

impl Default for ImageFeedConfig {
    /// Batches of 256, 224 x 224 NCHW, `RandomResizedCrop` defaults, ImageNet statistics,
    /// shuffled with seed 0, one rank, no `drop_last`, bad files an error, loader threads by
    /// where the feed decodes (`prefetch.loader_threads = 0`: 2 on the GPU, 4 on the CPU).
    fn default() -> Self {
        ImageFeedConfig {
            batch: 256,
            out: (224, 224),
            augment: Augment::Train(RandomResizedCrop::default()),
            norm: Normalize::imagenet(),
            layout: Layout::Nchw,
            seed: 0,
            shuffle: true,
            rank: 0,
            world: 1,
            drop_last: false,
            bad_files: BadFiles::Error,
            start: (0, 0),
            prefetch: PrefetchConfig {
                loader_threads: 0,
                ..PrefetchConfig::default()
            },
            decoding: Decoding::Auto,
            gpu_decodes_at_once: 0,
            gpu_cache_bytes: 0,
        }
    }
}

impl ImageFeedConfig {
    /// Checks every field that does not depend on the list (sizes, transform, statistics, the
    /// prefetcher's settings, the rank and world size): an `Error::InvalidArgument` naming the
    /// field, before a thread, decoder, buffer or device context is made. [`ImageSource::new`] and
    /// [`ImageFeed::new`](crate::ImageFeed::new) call it; the rest (batches per epoch, the
    /// start) is checked against the list there.
    pub fn validate(&self) -> Result<()> {
        const OP: &str = "prefetch::ImageSource::new";
        let c = self;
        if c.batch == 0 || c.out.0 == 0 || c.out.1 == 0 {
            return Err(Error::invalid(
                OP,
                format!("batch {} and output {:?} must be > 0", c.batch, c.out),
            ));
        }
        if matches!(c.augment, Augment::Val { .. }) && c.out.0 != c.out.1 {
            return Err(Error::invalid(
                OP,
                format!(
                    "the validation transform makes square crops, not {:?}",
                    c.out
                ),
            ));
        }
        if c.out.0 > MAX_OUT_SIDE || c.out.1 > MAX_OUT_SIDE {
            return Err(Error::invalid(
                OP,
                format!(
                    "output {:?}: sides above {MAX_OUT_SIDE} are not supported",
                    c.out
                ),
            ));
        }
        if let Augment::Val { resize } = c.augment {
            // Above 1024 x the crop, a 1-pixel image's box would be under 1/1024 pixel (the
            // kernel's least box). Exact: `resize / 1024 > out` let 1024 * out + 1 ..= + 1023
            // through (issue 29, finding 12).
            let most = c.out.0.saturating_mul(1024);
            if resize < c.out.0 || resize > most {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "Resize({resize}) must be from the {}-pixel crop to 1024 times it",
                        c.out.0
                    ),
                ));
            }
        }
        // Checks the statistics for three channels (every image is decoded to RGB).
        c.norm.check(OP, 3)?;
        // The loaders and depth, for the GPU-decoding path too (the prefetcher checks them for
        // the CPU path): before a thread, decoder or buffer is made. 0 loaders is the automatic
        // choice: each of the two counts it stands for is checked with the other fields.
        c.prefetch_config(false).validate()?;
        c.prefetch_config(true).validate()?;
        // The rank within the world (the sampler's own check and error).
        Sampler::new(0).shard(c.rank, c.world)?;
        if c.gpu_cache_bytes > 0 && c.decoding == Decoding::Cpu {
            return Err(Error::invalid(
                OP,
                format!(
                    "gpu_cache_bytes {} keeps images the GPU decoded: not with Decoding::Cpu",
                    c.gpu_cache_bytes
                ),
            ));
        }
        Ok(())
    }

    /// The loader threads a feed decoding on the GPU (`gpu`) or on the CPU runs:
    /// `prefetch.loader_threads`, or where that is 0 (the default) [`AUTO_GPU_LOADER_THREADS`]
    /// or [`AUTO_CPU_LOADER_THREADS`].
    pub fn loader_threads(&self, gpu: bool) -> usize {
        match (self.prefetch.loader_threads, gpu) {
            (0, true) => AUTO_GPU_LOADER_THREADS,
            (0, false) => AUTO_CPU_LOADER_THREADS,
            (n, _) => n,
        }
    }

    /// `prefetch` with the loader threads resolved for GPU or CPU decoding: what to hand a
    /// `Prefetcher` or `DryRun` of your own running [`ImageSource::source`] (they refuse 0
    /// loader threads, the feed's default).
    pub fn prefetch_config(&self, gpu: bool) -> PrefetchConfig {
        PrefetchConfig {
            loader_threads: self.loader_threads(gpu),
            ..self.prefetch.clone()
        }
    }
}

/// The most pixels an image may have: PIL's limit for a decompression bomb
/// (`2 * Image.MAX_IMAGE_PIXELS`); larger ones are bad files.
pub const MAX_IMAGE_PIXELS: usize = 178_956_970;

/// The largest image file read (1 GiB); larger ones are bad files.
pub const MAX_FILE_BYTES: u64 = 1 << 30;

/// Decoded bytes per byte of file beyond which a file's header is not believed (a tiny file
/// claiming a huge image): neither DEFLATE nor JPEG compresses by much more than 1000:1.
const MAX_RATIO: usize = 2048;

/// Files left out by [`BadFiles::Skip`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Skipped {
    /// How many (each time one is met: a bad file counts once per epoch).
    pub count: u64,
    /// The first 16, with why.
    pub first: Vec<(String, String)>,
}

struct Inner {
    list: ImageList,
    cfg: ImageFeedConfig,
    sampler: Sampler,
    per_epoch: usize,
    /// The batches of the last epochs asked for (an epoch's order is computed once).
    epochs: Mutex<Vec<(u64, Arc<Batches>)>>,
    skipped: AtomicU64,
    first_skipped: Mutex<Vec<(String, String)>>,
    /// Encoded bytes a batch's load holds at once ([`MAX_BATCH_FILE_BYTES`]; smaller in tests).
    held_bytes: usize,
}

/// The batches of an [`ImageList`] as a prefetcher [`Source`]: global batch `g` is batch
/// `g % per_epoch` of epoch `g / per_epoch`, counted from `config.start`, endlessly. Usable
/// with a [`Prefetcher`](pinstream::prefetch::Prefetcher) (see [`ImageFeed`](crate::ImageFeed)) and, without a GPU, a [`DryRun`](pinstream::prefetch::DryRun),
/// which resamples with the kernel's CPU reference.
#[derive(Clone)]
pub struct ImageSource {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for ImageSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImageSource")
            .field("images", &self.inner.list.len())
            .field("per_epoch", &self.inner.per_epoch)
            .finish_non_exhaustive()
    }
}

/// Bytes read of a file before its header is known (whatever metadata comes before the image's
/// size), and beyond what its image may take (see [`read_file`]).
const METADATA_BYTES: usize = 16 << 20;

/// Encoded bytes per decoded RGB byte beyond which a file is not read further: a PNG of 16-bit
/// RGBA samples stored uncompressed takes 8/3 of its RGB size, a JPEG's entropy-coded data at
/// most about 3.4 times it (blocks padded to whole MCUs aside, which `METADATA_BYTES` covers).
const ENCODED_PER_RGB: usize = 8;

/// The bytes of encoded images held at once by one batch's load ([`ImageSource::load`]): files
/// read once the batch holds this many are not kept, but read again when they are decoded, one
/// at a time. Each file is read only up to the end of its image (bytes after it, a trailer of
/// any size, are never read).
pub const MAX_BATCH_FILE_BYTES: usize = 256 << 20;

/// The bytes of the image in the file at `path`: a regular file (opened without blocking, so a
/// FIFO or device named in a list is refused, not waited on) of at most [`MAX_FILE_BYTES`],
/// read in growing chunks up to the end of its image (`decode::end_of_image`: a JPEG's
/// end-of-image marker, a PNG's image data), never past it. A file whose image does not end
/// within what its header says the image may take (8 bytes per RGB byte, plus 16 MiB of
/// metadata) is refused (`Error::Format` naming it), so that memory is bounded by the image,
/// not by the file.
pub(crate) fn read_file(op: &'static str, path: &Path) -> Result<Vec<u8>> {
    read_file_ended(op, path).map(|(bytes, _)| bytes)
}

/// [`read_file`], and whether the image's end was found (`false`: the whole file, which the
/// decoder judges).
pub(crate) fn read_file_ended(op: &'static str, path: &Path) -> Result<(Vec<u8>, bool)> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let io = |e: String| crate::dataset::io(op, path, e);
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| io(e.to_string()))?;
    let meta = f.metadata().map_err(|e| io(e.to_string()))?;
    if !meta.is_file() {
        return Err(io("not a regular file".into()));
    }
    if meta.len() > MAX_FILE_BYTES {
        return Err(io(format!(
            "{} bytes: image files above {MAX_FILE_BYTES} bytes are not read",
            meta.len()
        )));
    }
    // At most MAX_FILE_BYTES (1 GiB): fits in usize.
    let file_len = meta.len() as usize;
    let mut bytes: Vec<u8> = Vec::new();
    // What may be read: the metadata allowance until the header is known, then what the
    // image may take.
    let mut limit = METADATA_BYTES;
    let mut info = None;
    let mut chunk = 64 << 10;
    loop {
        let target = file_len
            .min(bytes.len().saturating_add(chunk))
            .min(limit.saturating_add(1));
        let want = target.saturating_sub(bytes.len());
        bytes
            .try_reserve_exact(want)
            .map_err(|e| io(e.to_string()))?;
        let got = (&mut f)
            .take(want as u64)
            .read_to_end(&mut bytes)
            .map_err(|e| io(e.to_string()))?;
        match decode::end_of_image(&bytes) {
            decode::End::At(n) => {
                bytes.truncate(n);
                bytes.shrink_to_fit();
                return Ok((bytes, true));
            }
            decode::End::More | decode::End::Unknown => {}
        }
        // The whole file (or it was cut short since it was opened): the decoder judges it.
        if bytes.len() >= file_len || got < want {
            return Ok((bytes, false));
        }
        if info.is_none() {
            if let Ok(i) = decode::info(&bytes) {
                info = Some(i);
                limit = i
                    .rgb_len()
                    .saturating_mul(ENCODED_PER_RGB)
                    .saturating_add(METADATA_BYTES);
            }
        }
        if bytes.len() > limit {
            let (format, detail) = match info {
                Some(i) => (
                    i.format.name(),
                    format!(
                        "the {}x{} image does not end within {limit} bytes (what such an \
                         image may take, with its metadata); the file has {file_len}",
                        i.height, i.width
                    ),
                ),
                None => (
                    decode::Format::detect(&bytes).map_or("image", decode::Format::name),
                    format!(
                        "no image header within the first {METADATA_BYTES} bytes (the file \
                         has {file_len})"
                    ),
                ),
            };
            return Err(Error::Format {
                format,
                path: path.display().to_string(),
                tensor: None,
                detail,
            });
        }
        chunk = chunk.saturating_mul(2).min(64 << 20);
    }
}

/// The header of `bytes`, refused (as a format error naming `path`) where the image is larger
/// than the kernel takes ([`MAX_SIDE`]), than [`MAX_IMAGE_PIXELS`], or than the file can
/// plausibly hold.
pub(crate) fn checked_info(path: &Path, bytes: &[u8]) -> Result<decode::ImageInfo> {
    let info = decode::info(bytes).map_err(|e| file_error(path, e))?;
    let refuse = |detail: String| Error::Format {
        format: info.format.name(),
        path: path.display().to_string(),
        tensor: None,
        detail,
    };
    let (h, w) = (info.height, info.width);
    if h > MAX_SIDE || w > MAX_SIDE {
        return Err(refuse(format!(
            "{h}x{w}: sides above {MAX_SIDE} are not supported"
        )));
    }
    if h.saturating_mul(w) > MAX_IMAGE_PIXELS {
        return Err(refuse(format!(
            "{h}x{w} is more than {MAX_IMAGE_PIXELS} pixels (a decompression bomb)"
        )));
    }
    if info.rgb_len()
        > bytes
            .len()
            .saturating_mul(MAX_RATIO)
            .saturating_add(1 << 20)
    {
        return Err(refuse(format!(
            "a {h}x{w} image in {} bytes: the header is not believed",
            bytes.len()
        )));
    }
    Ok(info)
}

pub(crate) fn file_error(path: &Path, e: Error) -> Error {
    match e {
        Error::Format { format, detail, .. } => Error::Format {
            format,
            path: path.display().to_string(),
            tensor: None,
            detail,
        },
        Error::Io { op, message, .. } => Error::Io {
            op,
            path: path.display().to_string(),
            offset: 0,
            len: 0,
            message,
        },
        other => other,
    }
}

impl ImageSource {
    /// The source of `list` under `config`. `Error::InvalidArgument` for a batch of 0, an
    /// output of 0, a bad rank / world, a validation transform to a non-square output, or an
    /// epoch with no batch (fewer images per rank than a batch, with `drop_last`).
    pub fn new(list: ImageList, config: &ImageFeedConfig) -> Result<ImageSource> {
        const OP: &str = "prefetch::ImageSource::new";
        let c = config;
        c.validate()?;
        // `drop_last` as `DistributedSampler`'s too: the list cut to a multiple of the world
        // size instead of padded, so no file is in two ranks' shares.
        let mut sampler = Sampler::new(list.len())
            .shard(c.rank, c.world)?
            .drop_uneven(c.drop_last);
        if c.shuffle {
            sampler = sampler.shuffle(c.seed);
        }
        let per_epoch = sampler.batches(0, c.batch, c.drop_last)?.total();
        if per_epoch == 0 {
            return Err(Error::invalid(
                OP,
                format!(
                    "{} images ({} per rank) make no batch of {} with drop_last",
                    list.len(),
                    sampler.per_rank(),
                    c.batch
                ),
            ));
        }
        let (e, b) = c.start;
        let start_ok = b < per_epoch
            && e.checked_mul(per_epoch as u64)
                .and_then(|g| g.checked_add(b as u64))
                .and_then(|g| g.checked_add(1 << 62))
                .is_some();
        if !start_ok {
            return Err(Error::invalid(
                OP,
                format!(
                    "start {:?}: the batch must be below {per_epoch} (batches per epoch) and the \
                     position far from u64::MAX",
                    c.start
                ),
            ));
        }
        Ok(ImageSource {
            inner: Arc::new(Inner {
                list,
                cfg: c.clone(),
                sampler,
                per_epoch,
                epochs: Mutex::new(Vec::new()),
                skipped: AtomicU64::new(0),
                first_skipped: Mutex::new(Vec::new()),
                held_bytes: MAX_BATCH_FILE_BYTES,
            }),
        })
    }

    /// Batches in one epoch (of this rank).
    pub fn batches_per_epoch(&self) -> usize {
        self.inner.per_epoch
    }

    /// The most samples a batch can hold: the batch size, or this rank's share of an epoch
    /// where that is smaller (what a batch's buffers are sized for).
    pub(crate) fn largest_batch(&self) -> usize {
        self.inner.cfg.batch.min(self.inner.sampler.per_rank())
    }

    /// `(epoch, batch)` of the prefetcher's batch index `index` (counted from `config.start`).
    pub fn position(&self, index: u64) -> (u64, usize) {
        let g = self.global(index);
        let per = self.inner.per_epoch as u64;
        (g / per, (g % per) as usize)
    }

    /// The global batch number (checked in `new` to leave 2^62 batches of room).
    fn global(&self, index: u64) -> u64 {
        let (e, b) = self.inner.cfg.start;
        e.wrapping_mul(self.inner.per_epoch as u64)
            .wrapping_add(b as u64)
            .wrapping_add(index)
    }

    /// Files skipped so far ([`BadFiles::Skip`]).
    pub fn skipped(&self) -> Skipped {
        Skipped {
            count: self.inner.skipped.load(Ordering::Relaxed),
            first: crate::util::lock(&self.inner.first_skipped).clone(),
        }
    }

    /// The prefetcher source: endless (epoch after epoch).
    pub fn source(&self) -> Source<i64> {
        let me = self.clone();
        Source::new(move |i, b: &mut HostBatch<i64>| {
            me.load(i, b)
                .map(|()| true)
                .map_err(|e| Box::new(e) as pinstream::prefetch::LoadError)
        })
    }

    /// The crop of the image `info` of `path`, drawn from `rng`, checked one sample at a time
    /// (in `probe`) as the kernel will check the batch: an image that cannot be resized under
    /// this configuration is a bad file of its own, not a batch that fails as a whole (issue
    /// 29, finding 12).
    pub(crate) fn crop(
        &self,
        op: &'static str,
        path: &Path,
        info: &decode::ImageInfo,
        rng: &mut Rng,
        probe: &mut ResizeSpec,
    ) -> Result<CropBox> {
        let cfg = &self.inner.cfg;
        let (h, w) = (info.height, info.width);
        let crop = match cfg.augment {
            Augment::Train(rrc) => rrc.sample(rng, h, w),
            Augment::Val { resize } => CropBox::center(h, w, resize, cfg.out.0),
        };
        let resizable = crop.and_then(|crop| {
            probe.samples.clear();
            probe.push(0, h, w, crop);
            probe.validate(op).map(|()| crop)
        });
        resizable.map_err(|e| {
            Error::invalid(
                op,
                format!(
                    "{}: the {h}x{w} image cannot be resized under this configuration: {e}",
                    path.display()
                ),
            )
        })
    }

    /// The configuration.
    pub(crate) fn config(&self) -> &ImageFeedConfig {
        &self.inner.cfg
    }

    /// Encoded bytes a batch's load holds at once.
    pub(crate) fn held_bytes(&self) -> usize {
        self.inner.held_bytes
    }

    /// `(epoch, batch, [(path, label)])` of the prefetcher's batch `index`, and the crops'
    /// generator of that batch (what [`load`](Self::load) draws from, in file order).
    pub(crate) fn batch_files(&self, op: &'static str, index: u64) -> Result<BatchFiles> {
        let (epoch, k) = self.position(index);
        let batches = self.batches(epoch)?;
        let idx = batches
            .get(k)
            .ok_or_else(|| Error::invalid(op, format!("epoch {epoch} has no batch {k}")))?;
        let files = idx
            .iter()
            .map(|&i| (i, self.inner.list.items()[i].clone()))
            .collect();
        Ok((epoch, k, files, crop_rng(self.inner.cfg.seed, epoch, k)))
    }

    fn batches(&self, epoch: u64) -> Result<Arc<Batches>> {
        let inner = &self.inner;
        if let Some((_, b)) = crate::util::lock(&inner.epochs)
            .iter()
            .find(|(e, _)| *e == epoch)
        {
            return Ok(b.clone());
        }
        // Computed outside the lock (a shuffle of the whole list); two threads may both
        // compute one epoch, which gives the same batches.
        let b = Arc::new(
            inner
                .sampler
                .batches(epoch, inner.cfg.batch, inner.cfg.drop_last)?,
        );
        let mut cache = crate::util::lock(&inner.epochs);
        if !cache.iter().any(|(e, _)| *e == epoch) {
            if cache.len() >= 3 {
                cache.remove(0);
            }
            cache.push((epoch, b.clone()));
        }
        Ok(b)
    }

    pub(crate) fn skip(&self, path: &Path, why: &Error) {
        self.inner.skipped.fetch_add(1, Ordering::Relaxed);
        let mut first = crate::util::lock(&self.inner.first_skipped);
        if first.len() < 16 {
            first.push((path.display().to_string(), why.to_string()));
        }
    }

    /// Fills `b` with the prefetcher's batch `index`: reads its files, decodes them into
    /// `b.pinned(..)` (page-locked memory in a prefetcher, ordinary memory elsewhere), draws
    /// the crops and sets `b.resize` and the labels. What the source does on a loader thread;
    /// public so that a test can build the same batch on its own thread.
    pub fn load(&self, index: u64, b: &mut HostBatch<i64>) -> Result<()> {
        const OP: &str = "prefetch::ImageSource::load";
        let inner = &self.inner;
        let cfg = &inner.cfg;
        let (epoch, k) = self.position(index);
        let batches = self.batches(epoch)?;
        let idx = batches
            .get(k)
            .ok_or_else(|| Error::invalid(OP, format!("epoch {epoch} has no batch {k}")))?;
        // Read every file and its header first: the batch's length, then one block. The
        // encoded bytes are kept up to `held_bytes` for the batch; files read beyond that are
        // read again when they are decoded, one at a time (issue 29, finding 10).
        let mut files = Vec::with_capacity(idx.len());
        let mut total = 0usize;
        let mut held = 0usize;
        for &i in idx {
            let (path, label) = &inner.list.items()[i];
            let read = read_file(OP, path).and_then(|bytes| {
                let info = checked_info(path, &bytes)?;
                Ok((bytes, info))
            });
            match read {
                Ok((bytes, info)) => {
                    total = total.checked_add(info.rgb_len()).ok_or_else(|| {
                        Error::invalid(OP, "the batch's decoded size overflows usize")
                    })?;
                    let kept = match held.checked_add(bytes.len()) {
                        Some(h) if h <= inner.held_bytes => {
                            held = h;
                            Some(bytes)
                        }
                        _ => None,
                    };
                    files.push((path, *label, kept, info));
                }
                Err(e) if cfg.bad_files == BadFiles::Skip => self.skip(path, &e),
                Err(e) => return Err(e),
            }
        }
        let px = b.pinned(total)?;
        let mut spec = ResizeSpec::new(3, cfg.out.0, cfg.out.1, cfg.norm.clone())
            .layouts(Layout::Nhwc, cfg.layout);
        // One sample at a time, checked as the feeder will check the batch: an image that
        // cannot be resized under this configuration is a bad file of its own, not a batch
        // that fails as a whole (issue 29, finding 12).
        let mut probe = ResizeSpec::new(3, cfg.out.0, cfg.out.1, cfg.norm.clone())
            .layouts(Layout::Nhwc, cfg.layout);
        let mut labels = Vec::with_capacity(files.len());
        let mut rng = crop_rng(cfg.seed, epoch, k);
        let mut offset = 0;
        for (path, label, kept, info) in &mut files {
            let len = info.rgb_len();
            let dst = &mut px[offset..offset + len];
            // Read again where it was not kept; the file must still hold the same image.
            let bytes = match kept.take() {
                Some(b) => Ok(b),
                None => read_file(OP, path).and_then(|b| {
                    if checked_info(path, &b)? == *info {
                        Ok(b)
                    } else {
                        Err(crate::dataset::io(
                            OP,
                            path,
                            "the file changed while its batch was read",
                        ))
                    }
                }),
            };
            let decoded = bytes
                .and_then(|bytes| {
                    decode::decode_rgb_into(&bytes, dst).map_err(|e| file_error(path, e))
                })
                .and_then(|_| self.crop(OP, path, info, &mut rng, &mut probe));
            match decoded {
                Ok(crop) => {
                    spec.push(offset, info.height, info.width, crop);
                    labels.push(*label as i64);
                }
                Err(e) => {
                    if cfg.bad_files != BadFiles::Skip {
                        return Err(e);
                    }
                    // Written in full all the same: the block must not show old data.
                    dst.fill(0);
                    self.skip(path, &e);
                }
            }
            offset += len;
        }
        if spec.samples.is_empty() {
            return Err(Error::invalid(
                OP,
                format!("every file of epoch {epoch}'s batch {k} was left out as undecodable"),
            ));
        }
        b.resize = Some(spec);
        b.extras.clear();
        b.extras.extend(labels);
        Ok(())
    }
}

/// `(epoch, batch, [(index in the list, (path, label))], the crops' generator)` of one batch.
pub(crate) type BatchFiles = (u64, usize, Vec<(usize, (std::path::PathBuf, usize))>, Rng);

/// The crops' own generator for (epoch, batch): a seed apart from the shuffle's, and a stream
/// mixed from both numbers (no two batches share one).
fn crop_rng(seed: u64, epoch: u64, k: usize) -> Rng {
    Rng::new(
        seed ^ 0x6372_6f70_7321_5eed,
        crate::augment::mix(epoch, k as u64),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The feed's default `loader_threads = 0` stands for 2 loaders decoding on the GPU and 4
    /// (the prefetcher's own default) on the CPU, and validates; an explicit count is kept on
    /// both routes, and 0 with a bad depth is refused.
    #[test]
    fn loader_threads_default_by_route() {
        let d = ImageFeedConfig::default();
        assert_eq!(d.prefetch.loader_threads, 0);
        assert_eq!(d.loader_threads(true), AUTO_GPU_LOADER_THREADS);
        assert_eq!(d.loader_threads(false), AUTO_CPU_LOADER_THREADS);
        assert_eq!((AUTO_GPU_LOADER_THREADS, AUTO_CPU_LOADER_THREADS), (2, 4));
        assert_eq!(d.prefetch_config(false).loader_threads, 4);
        assert_eq!(d.prefetch_config(true).loader_threads, 2);
        assert_eq!(
            AUTO_CPU_LOADER_THREADS,
            PrefetchConfig::default().loader_threads
        );
        // What a Prefetcher or DryRun of one's own accepts; the raw field (0) it refuses.
        assert!(d.prefetch_config(false).validate().is_ok());
        assert!(d.prefetch.validate().is_err());
        assert!(d.validate().is_ok());
        let mut three = ImageFeedConfig::default();
        three.prefetch.loader_threads = 3;
        assert_eq!(
            (three.loader_threads(true), three.loader_threads(false)),
            (3, 3)
        );
        let mut deep = ImageFeedConfig::default();
        deep.prefetch.depth = 17;
        assert!(matches!(
            deep.validate(),
            Err(Error::InvalidArgument { .. })
        ));
    }

    /// `validate` checks the settings alone, without a list or a device: the default, the
    /// Python binding's 1024 export spares, and the prefetcher's bounds; a bad field is refused
    /// with the same error `ImageSource::new` gives.
    #[test]
    fn config_validates_without_a_list() {
        let ok = ImageFeedConfig::default();
        assert!(ok.validate().is_ok());
        let mut py = ImageFeedConfig::default();
        py.prefetch.export_spares = 1024;
        assert!(py.validate().is_ok(), "{:?}", py.validate());
        let list = || ImageList::from_pairs(vec![("a.jpg".into(), 0)]).unwrap();
        for bad in [
            ImageFeedConfig {
                batch: 0,
                ..Default::default()
            },
            ImageFeedConfig {
                out: (224, 100),
                augment: Augment::Val { resize: 256 },
                ..Default::default()
            },
            ImageFeedConfig {
                prefetch: PrefetchConfig {
                    export_spares: pinstream::prefetch::MAX_EXPORT_SPARES + 1,
                    ..Default::default()
                },
                ..Default::default()
            },
            ImageFeedConfig {
                prefetch: PrefetchConfig {
                    depth: 0,
                    ..Default::default()
                },
                ..Default::default()
            },
            ImageFeedConfig {
                rank: 0,
                world: 0,
                ..Default::default()
            },
            ImageFeedConfig {
                rank: 3,
                world: 2,
                ..Default::default()
            },
        ] {
            let e = bad.validate().unwrap_err();
            assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
            let e2 = ImageSource::new(list(), &bad).unwrap_err();
            assert_eq!(e.to_string(), e2.to_string());
        }
    }

    fn png(w: u32, h: u32) -> Vec<u8> {
        let img = image::RgbImage::from_pixel(w, h, image::Rgb([10, 20, 30]));
        let mut v = Vec::new();
        img.write_to(&mut std::io::Cursor::new(&mut v), image::ImageFormat::Png)
            .unwrap();
        v
    }

    fn tmp(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!(
            "pinstream-images-{name}-{}-{:x}",
            std::process::id(),
            Rng::new(std::process::id() as u64, 7).next_u64()
        ));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(d.join("a")).unwrap();
        d
    }

    fn jpeg(w: u32, h: u32) -> Vec<u8> {
        let img = image::RgbImage::from_fn(w, h, |x, y| image::Rgb([x as u8 * 9, y as u8, 77]));
        let mut v = Vec::new();
        img.write_to(&mut std::io::Cursor::new(&mut v), image::ImageFormat::Jpeg)
            .unwrap();
        v
    }

    /// `bytes`, then a sparse hole up to `len` bytes (no disk, no page cache until read).
    fn with_trailer(path: &Path, bytes: &[u8], len: u64) {
        std::fs::write(path, bytes).unwrap();
        std::fs::OpenOptions::new()
            .write(true)
            .open(path)
            .unwrap()
            .set_len(len)
            .unwrap();
    }

    /// Issue 29, finding 10: a valid image followed by a trailer (here a sparse GiB) is read up
    /// to the end of its image, not whole: the bytes held are the image's, counted exactly.
    /// Before, `read_file` read the whole file (a GiB per file, batch x file size per load).
    #[test]
    fn files_are_read_up_to_the_end_of_their_image() {
        let root = tmp("trailers");
        for (name, bytes) in [("a/j.jpg", jpeg(3, 2)), ("a/p.png", png(2, 3))] {
            let p = root.join(name);
            with_trailer(&p, &bytes, MAX_FILE_BYTES - 1);
            let got = read_file("test", &p).unwrap();
            assert!(
                got.len() <= bytes.len() && got.len() + 64 >= bytes.len(),
                "{name}: {} bytes read of a {}-byte image",
                got.len(),
                bytes.len()
            );
            assert_eq!(
                decode::decode_rgb(&got).unwrap(),
                decode::decode_rgb(&bytes).unwrap()
            );
        }
        // A 1x1 PNG whose image data comes only after 40 MiB (an ancillary chunk): refused at
        // what a 1-pixel image may take, naming the file.
        let p = root.join("a/late.png");
        let mut head = png(1, 1)[..33].to_vec(); // signature + IHDR
        head.extend((40u32 << 20).to_be_bytes());
        head.extend(b"zzZz");
        with_trailer(&p, &head, 60 << 20);
        let e = read_file("test", &p).unwrap_err();
        assert!(
            matches!(&e, Error::Format { path, .. } if path.ends_with("late.png")),
            "{e:?}"
        );
        std::fs::remove_dir_all(&root).unwrap();
    }

    /// Issue 29, finding 10: a batch holds at most `held_bytes` of encoded images; files read
    /// past that are read again when decoded, to the same pixels.
    #[test]
    fn a_batch_over_its_byte_budget_reads_files_again() {
        let root = tmp("budget");
        let mut items = Vec::new();
        for k in 0..6u32 {
            let p = root.join(format!("a/{k}.jpg"));
            std::fs::write(&p, jpeg(20 + k, 11 + k)).unwrap();
            items.push((p, k as usize));
        }
        let list = ImageList::from_pairs(items).unwrap();
        let c = ImageFeedConfig {
            batch: 6,
            out: (8, 8),
            shuffle: false,
            ..ImageFeedConfig::default()
        };
        let whole = ImageSource::new(list.clone(), &c).unwrap();
        let mut a = HostBatch::<i64>::default();
        whole.load(0, &mut a).unwrap();
        for budget in [0, 1500] {
            let mut src = ImageSource::new(list.clone(), &c).unwrap();
            Arc::get_mut(&mut src.inner).unwrap().held_bytes = budget;
            let mut b = HostBatch::<i64>::default();
            src.load(0, &mut b).unwrap();
            assert_eq!(b.extras, a.extras);
            assert_eq!(b.resize, a.resize);
            let n = a.resize.as_ref().unwrap().input_extent().unwrap();
            assert_eq!(b.pixels.read().unwrap()[..n], a.pixels.read().unwrap()[..n]);
        }
        std::fs::remove_dir_all(&root).unwrap();
    }

    /// Issue 29, finding 12: an image that cannot be resized under the configuration (here a
    /// 1-pixel image under a `Resize` that `new` now refuses, set behind its back) is a bad
    /// file of its own: skipped under `BadFiles::Skip` (the batch validates without it), an
    /// error naming it otherwise. Before, its sample went into the batch, whose validation in
    /// the feeder then failed as a whole.
    #[test]
    fn an_image_that_cannot_be_resized_is_a_bad_file() {
        let root = tmp("unresizable");
        let (tiny, good) = (root.join("a/0.png"), root.join("a/1.png"));
        std::fs::write(&tiny, png(1, 1)).unwrap();
        std::fs::write(&good, png(40, 30)).unwrap();
        let list = ImageList::from_pairs(vec![(tiny.clone(), 0), (good.clone(), 1)]).unwrap();
        for bad_files in [BadFiles::Skip, BadFiles::Error] {
            let c = ImageFeedConfig {
                batch: 2,
                out: (8, 8),
                augment: Augment::Val { resize: 8 * 1024 },
                shuffle: false,
                bad_files,
                ..ImageFeedConfig::default()
            };
            let mut src = ImageSource::new(list.clone(), &c).unwrap();
            Arc::get_mut(&mut src.inner).unwrap().cfg.augment = Augment::Val {
                resize: 8 * 1024 + 1,
            };
            let mut b = HostBatch::<i64>::default();
            let r = src.load(0, &mut b);
            match bad_files {
                BadFiles::Skip => {
                    r.unwrap();
                    assert_eq!(b.extras, [1]);
                    assert_eq!(src.skipped().count, 1);
                    assert!(src.skipped().first[0].0.ends_with("0.png"));
                    b.resize.as_ref().unwrap().validate("test").unwrap();
                }
                BadFiles::Error => {
                    let e = r.unwrap_err();
                    assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
                    assert!(e.to_string().contains("0.png"), "{e}");
                }
            }
        }
        std::fs::remove_dir_all(&root).unwrap();
    }
}
