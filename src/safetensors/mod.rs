//! Model weights to the GPU at link speed: a safetensors file into one device arena, as named,
//! typed views or DLPack tensors (feature `safetensors`).
//!
//! [`load`] reads and checks the header ([`Header`]: real JSON parsing with serde_json, duplicate
//! keys refused, every offset and size checked), allocates one arena on the device, and moves
//! the whole data region into it with one call of the staging engine (as
//! [`Stager::upload_file`]): worker threads `pread` it into pinned slots while the copy engine
//! moves earlier slots to the device. The data comes through the page cache, or with `O_DIRECT`
//! when it is cold ([`Direct`]).
//!
//! **Sharded checkpoints.** [`load_checkpoint`] takes what `save_pretrained` writes: the folder,
//! its `model.safetensors.index.json`, or one file ([`Checkpoint`] says how a path is resolved
//! and what is checked, all on the host before the device is touched). Every shard goes into
//! one arena in one call of the staging engine, every thread reading pieces of every shard; the
//! [`Weights`] answer as for one file, by the names the index gives, and [`Weights::shards`]
//! tells where each file lies in the arena.
//!
//! ```no_run
//! use pinstream::safetensors::{self, LoadOptions};
//! use pinstream::{Device, Stager, StagerConfig};
//! # fn main() -> pinstream::Result<()> {
//! let dev = Device::get(0)?;
//! let stream = dev.stream()?;
//! let stager = Stager::new(&dev, StagerConfig::default())?; // once; reuse it for every file
//! let weights = safetensors::load(&stager, &stream, "model.safetensors", LoadOptions::default())?;
//! for t in weights.iter() {
//!     println!("{}: {} {:?}", t.name(), t.dtype(), t.shape());
//! }
//! let wq = weights.get::<pinstream::bf16>("layers.0.attn.wq.weight")?; // dtype checked
//! # let _ = wq;
//! // Or hand every tensor to PyTorch, JAX, candle ... through DLPack.
//! let tensors = weights.into_dlpack()?; // Vec<(String, pinstream::dlpack::Tensor)>
//! # let _ = tensors;
//! # Ok(()) }
//! ```
//!
//! The upload is ordered on `stream`; the returned [`Weights`] may be used from any stream (the
//! arena's tracker makes later work on it wait for the upload on the GPU), and
//! [`Weights::synchronize`] waits for it on the host. For one file without a stager at hand,
//! [`load_file`] builds one (`load_file(path, 0)` is `safetensors.torch.load_file(path,
//! device="cuda:0")`).
//!
//! **The arena.** Read through the page cache, the data region starts the arena (256-byte
//! aligned), so each tensor is as aligned as its offset in the region, which the reference
//! writer makes a multiple of its element size. Read with `O_DIRECT`, which reads whole 4096-byte
//! blocks, the region sits at [`Weights::data_offset`] (its file offset modulo 4096; the bytes
//! before it are the end of the header), so tensors keep their file alignment: `Auto` reads
//! directly only files whose data region starts at a multiple of 8 (the reference writer pads
//! the header so); `Always` reads any file so. A tensor that ends up misaligned is refused by
//! the typed accessors and by [`Weights::into_dlpack`], and readable as bytes
//! ([`Weights::bytes_of`]). Each shard of a checkpoint starts its own part of the arena at a
//! multiple of 256 bytes, and is placed within it by the same rules.

mod checkpoint;
mod header;
mod index;
mod json;
mod open;
mod residency;

pub use checkpoint::{load_checkpoint, Checkpoint, CheckpointKind};
pub use header::{
    Dtype, Header, TensorInfo, KDL_COMPLEX, KDL_FLOAT8_E4M3FN, KDL_FLOAT8_E4M3FNUZ,
    KDL_FLOAT8_E5M2, KDL_FLOAT8_E5M2FNUZ, KDL_FLOAT8_E8M0FNU, MAX_HEADER_BYTES,
};
pub use index::MAX_INDEX_BYTES;
pub use residency::{resident_fraction, AUTO_DIRECT_MIN_BYTES};

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::device::Device;
use crate::dlpack::{self, Element};
use crate::error::{Error, Result};
use crate::memory::{DeviceBuffer, DeviceView, DeviceViewMut};
use crate::staging::{FilePart, FileSource, Stager, StagerConfig};
use crate::stream::Stream;
use checkpoint::Catalog;
use open::Opened;

/// `O_DIRECT` offsets are multiples of this; the arena's head margin is below it.
const BLOCK: u64 = 4096;

/// How [`load`] reads the data region.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Direct {
    /// `O_DIRECT` where the data region is large (at least [`AUTO_DIRECT_MIN_BYTES`]) and less
    /// than half of it is in the page cache (`mmap` + `mincore`, sampled on large files), else
    /// the page cache. Where the filesystem refuses `O_DIRECT` (tmpfs), at open or at the first
    /// read, the page cache.
    #[default]
    Auto,
    /// Always through the page cache (`pread`).
    Never,
    /// Always `O_DIRECT`: the page cache is neither read nor filled. Where the filesystem
    /// refuses `O_DIRECT` (tmpfs, `/dev/shm`) the load fails with [`Error::Io`] (no fallback:
    /// this mode was asked for by name).
    Always,
}

/// Options of [`load`]. `LoadOptions::default()` reads with [`Direct::Auto`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LoadOptions {
    /// Page cache or `O_DIRECT`.
    pub direct: Direct,
}

impl LoadOptions {
    /// The defaults.
    pub fn new() -> Self {
        Self::default()
    }

    /// With `direct` as the reading mode.
    pub fn direct(mut self, direct: Direct) -> Self {
        self.direct = direct;
        self
    }
}

/// The tensors of one safetensors file, or of every shard of a checkpoint ([`Checkpoint`]), in
/// one device arena: named, typed views, their byte ranges, the headers' metadata. Dropping it
/// frees the arena after its last use on the GPU.
#[derive(Debug)]
pub struct Weights {
    arena: DeviceBuffer<u8>,
    /// The path loaded (a file, an index or a folder), for messages.
    shown: String,
    /// At least one.
    shards: Vec<Shard>,
    catalog: Catalog,
    index_metadata: BTreeMap<String, String>,
}

/// One file's part of [`Weights`]: its header and where its data region lies in the arena.
#[derive(Debug)]
pub struct Shard {
    header: Header,
    offset: usize,
    direct: bool,
}

impl Shard {
    /// The file's header.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The file's path, as given (or as the index's folder and the shard's name make it).
    pub fn path(&self) -> &str {
        self.header.path()
    }

    /// Where its data region starts in the arena: a multiple of 256, plus (read with
    /// `O_DIRECT`) the region's file offset modulo 4096.
    pub fn data_offset(&self) -> usize {
        self.offset
    }

    /// Whether it was read with `O_DIRECT`.
    pub fn used_direct(&self) -> bool {
        self.direct
    }
}

/// Loads the safetensors file at `path` onto `stager`'s device, ordered on `stream` (which must
/// be of that device): the header is read and checked ([`Header`]), one arena is allocated
/// (stream-ordered, on `stream`), and the data region is moved into it with one
/// [`Stager::upload_file`], through the page cache or with `O_DIRECT` as `options.direct` says.
/// Returns when the host side is done; the device side completes asynchronously (see
/// [`Weights::synchronize`]). For a sharded checkpoint (an index or a folder), see
/// [`load_checkpoint`].
///
/// Errors: [`Error::Format`] for a file that is not valid safetensors (nothing is allocated),
/// [`Error::Io`] for a file that cannot be opened or read, is cut short while it is read, or
/// (with [`Direct::Always`]) refuses `O_DIRECT`, [`Error::OutOfMemory`] for an arena the device
/// cannot hold, [`Error::WrongDevice`] for a stream of another device than the stager's, and the
/// CUDA errors of the copies.
pub fn load(
    stager: &Stager,
    stream: &Stream,
    path: impl AsRef<Path>,
    options: LoadOptions,
) -> Result<Weights> {
    stream.same_device("safetensors::load", stager.device())?;
    // One open of the path: the header, the residency, the upload and the O_DIRECT read all go
    // through it (issue 29, finding 9).
    let path = path.as_ref();
    let file = Opened::open("safetensors::load", path)?;
    let header = Header::read_opened(path, &file)?;
    load_one(stager, stream, file, header, options)
}

/// As [`load`], for a header read before with [`Header::read`] (to look at the tensors or the
/// metadata first). The file is opened again: one whose length is no longer the header's
/// (changed or cut since), or another file put at the path since, is an [`Error::Io`]; a
/// FIFO, device or directory there is refused without blocking; a header parsed from memory
/// ([`Header::parse`]) names no file and is refused (`Error::InvalidArgument`).
pub fn load_header(
    stager: &Stager,
    stream: &Stream,
    header: Header,
    options: LoadOptions,
) -> Result<Weights> {
    const OP: &str = "safetensors::load";
    stream.same_device(OP, stager.device())?;
    let Some(path) = header.source().map(Path::to_path_buf) else {
        return Err(Error::invalid(
            OP,
            "the header was parsed from memory (Header::parse) and names no file",
        ));
    };
    let file = Opened::open(OP, &path)?;
    if file.len() != header.file_len() {
        return Err(changed(header.path(), header.file_len(), file.len()));
    }
    if header.identity().is_some_and(|id| id != file.identity()) {
        return Err(Error::Io {
            op: OP,
            path: header.path().to_string(),
            offset: 0,
            len: 0,
            message: "another file was put at this path after its header was read".into(),
        });
    }
    load_one(stager, stream, file, header, options)
}

/// [`load`] for one file without a stager at hand: reads the header (so that a bad file is
/// found before the device is touched), then builds a stream and a stager on device `device`
/// (`StagerConfig::from_env`) and loads with [`Direct::Auto`]. Building a stager pins its
/// slots and starts its threads: to load several files, build one and call [`load`].
///
/// Without a usable GPU: [`Error::NoDevice`] (after the header's checks).
pub fn load_file(path: impl AsRef<Path>, device: usize) -> Result<Weights> {
    // One open of the path, kept for the load (issue 29, finding 9).
    let path = path.as_ref();
    let file = Opened::open("safetensors::load_file", path)?;
    let header = Header::read_opened(path, &file)?;
    let dev = Device::get(device)?;
    let stream = dev.stream()?;
    let stager = Stager::new(&dev, StagerConfig::from_env()?)?;
    let weights = load_one(&stager, &stream, file, header, LoadOptions::default())?;
    // The stager's slots may still be read by the last DMAs: its drop waits for them.
    drop(stager);
    Ok(weights)
}

/// The file no longer has the length its header was read with.
fn changed(path: &str, then: u64, now: u64) -> Error {
    Error::Io {
        op: "safetensors::load",
        path: path.to_string(),
        offset: 0,
        len: 0,
        message: format!(
            "the file changed after its header was read: it had {then} bytes, now {now}"
        ),
    }
}

/// Where each shard goes in the arena, and the arena's size. Shard `i`'s part starts at a
/// multiple of 256 (`base`, after the previous shard's data region); its data region at
/// `base + pad`, where `pad` is its file offset modulo 4096 for `O_DIRECT` reads (`direct[i]`:
/// whole blocks are read from the block below it, so tensors keep their file alignment), else
/// 0. Returns `(base, pad)` of each shard and the total, all checked: a size that does not fit
/// in the host's address space is an `Error::InvalidArgument`, before anything is allocated.
fn layout(
    op: &'static str,
    headers: &[&Header],
    direct: &[bool],
) -> Result<(Vec<(usize, usize)>, usize)> {
    let mut at = 0usize;
    let mut out = Vec::with_capacity(headers.len());
    for (h, &direct) in headers.iter().zip(direct) {
        let too_large = || {
            Error::invalid(
                op,
                format!(
                    "{}: a data region of {} bytes, after {at} bytes of the shards before it, \
                     does not fit in this host's address space",
                    h.path(),
                    h.data_len()
                ),
            )
        };
        let pad = if direct {
            (h.data_start() % BLOCK) as usize
        } else {
            0
        };
        let data = usize::try_from(h.data_len()).map_err(|_| too_large())?;
        let base = at
            .checked_next_multiple_of(SHARD_ALIGN)
            .ok_or_else(too_large)?;
        at = base
            .checked_add(pad)
            .and_then(|a| a.checked_add(data))
            .ok_or_else(too_large)?;
        out.push((base, pad));
    }
    Ok((out, at))
}

/// Each shard's part of the arena starts at a multiple of this (the alignment
/// `cudaMallocAsync` gives the arena itself).
const SHARD_ALIGN: usize = 256;

/// One file, already opened and its header checked.
fn load_one(
    stager: &Stager,
    stream: &Stream,
    file: Opened,
    header: Header,
    options: LoadOptions,
) -> Result<Weights> {
    let shown = header.path().to_string();
    let catalog = Catalog::build(std::slice::from_ref(&header))
        .map_err(|(_, _, name)| header::format_error(&shown, Some(&name), "appears twice"))?;
    load_shards(
        stager,
        stream,
        shown,
        vec![(file, header)],
        catalog,
        BTreeMap::new(),
        options,
    )
}

/// Every shard (opened once, its header checked; at least one) into one arena with one call of
/// the staging engine. `Auto` decides `O_DIRECT` shard by shard; where a filesystem opens with
/// `O_DIRECT` but refuses its reads, `Auto` reads every shard again through the page cache (the
/// arena's tracker orders the two uploads).
pub(crate) fn load_shards(
    stager: &Stager,
    stream: &Stream,
    shown: String,
    shards: Vec<(Opened, Header)>,
    catalog: Catalog,
    index_metadata: BTreeMap<String, String>,
    options: LoadOptions,
) -> Result<Weights> {
    const OP: &str = "safetensors::load";
    if shards.is_empty() {
        return Err(Error::invalid(OP, format!("{shown}: no shard to load")));
    }
    // Through the descriptors opened once, never the paths again: a FIFO put at a path since
    // cannot block here.
    let mut directs: Vec<Option<FileSource>> = Vec::with_capacity(shards.len());
    // How many pages `Auto` looks at in each shard: as many as for one file, or a share of a
    // smaller budget for several (mincore's cost grows with the pages looked at).
    let budget = match shards.len() {
        1 => residency::FULL_PAGES,
        n => (residency::CHECKPOINT_PAGES / n).max(residency::SHARD_PAGES),
    };
    for (file, header) in &shards {
        let resident = match options.direct {
            Direct::Auto => residency::resident_fraction_within(
                file.file(),
                header.data_start(),
                header.data_len(),
                budget,
            ),
            _ => None,
        };
        // Auto reads directly only where that keeps the tensors aligned (a region at a
        // multiple of 8 in the file, as the reference writer pads it).
        let aligned = header.data_start() % 8 == 0;
        let direct = if residency::wants_direct(options.direct, resident, header.data_len())
            && (aligned || options.direct == Direct::Always)
        {
            let path = header
                .source()
                .map_or_else(|| PathBuf::from(header.path()), Path::to_path_buf);
            match file.open_direct(&path) {
                Ok(d) if d.len() == file.len() => Some(d),
                Ok(d) => return Err(changed(header.path(), file.len(), d.len())),
                // tmpfs and others refuse O_DIRECT: Auto keeps the page cache.
                Err(_) if options.direct == Direct::Auto => None,
                Err(e) => return Err(e),
            }
        } else {
            None
        };
        directs.push(direct);
    }
    let headers: Vec<&Header> = shards.iter().map(|(_, h)| h).collect();
    let is_direct: Vec<bool> = directs.iter().map(Option::is_some).collect();
    let (places, total) = layout(OP, &headers, &is_direct)?;
    let mut arena = DeviceBuffer::<u8>::new_async(stream, total)?;
    // Errors of the stager's reads name the paths as given (not `/proc/self/fd/N`).
    let rename = |mut e: Error| {
        for ((file, _), direct) in shards.iter().zip(&directs) {
            e = file.rename(e, file.source());
            if let Some(d) = direct {
                e = file.rename(e, d);
            }
        }
        e
    };
    let parts: Vec<FilePart<'_>> = shards
        .iter()
        .zip(&directs)
        .enumerate()
        .map(|(i, (shard, direct))| match direct {
            // From the block below the data region: the head margin gets the header's last
            // bytes.
            Some(d) => FilePart {
                file: d,
                offset: shard.1.data_start() - places[i].1 as u64,
                len: places[i].1 + shard.1.data_len() as usize,
                at: places[i].0,
            },
            None => cached(shard, places[i]),
        })
        .collect();
    let any_direct = directs.iter().any(Option::is_some);
    let mut used_direct = is_direct;
    match stager.upload_files(stream, &parts, &mut arena) {
        Ok(()) => {}
        // A filesystem that opened with O_DIRECT but refuses its reads: Auto reads every shard
        // again through the page cache.
        Err(Error::Io { .. }) if any_direct && options.direct == Direct::Auto => {
            let parts: Vec<FilePart<'_>> = shards
                .iter()
                .enumerate()
                .map(|(i, shard)| cached(shard, places[i]))
                .collect();
            stager
                .upload_files(stream, &parts, &mut arena)
                .map_err(rename)?;
            used_direct.iter_mut().for_each(|d| *d = false);
        }
        Err(e) => return Err(rename(e)),
    }
    drop(parts);
    drop(directs);
    let shards = shards
        .into_iter()
        .zip(places)
        .zip(used_direct)
        .map(|(((_, header), (base, pad)), direct)| Shard {
            header,
            // A shard read through the page cache after a refused O_DIRECT read keeps the
            // place planned for that read (`cached` puts it at `base + pad`).
            offset: base + pad,
            direct,
        })
        .collect();
    Ok(Weights {
        arena,
        shown,
        shards,
        catalog,
        index_metadata,
    })
}

/// A shard's part of the upload through the page cache: its data region, to `base + pad` (the
/// layout checked that its length fits in usize).
fn cached((file, header): &(Opened, Header), (base, pad): (usize, usize)) -> FilePart<'_> {
    FilePart {
        file: file.source(),
        offset: header.data_start(),
        len: header.data_len() as usize,
        at: base + pad,
    }
}

impl Weights {
    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.catalog.tensors.len()
    }

    /// Whether the file (or every shard) held no tensor.
    pub fn is_empty(&self) -> bool {
        self.catalog.tensors.is_empty()
    }

    /// The tensors' names, in the order of the data region (shard by shard for a checkpoint).
    pub fn names(&self) -> impl Iterator<Item = &str> + '_ {
        self.catalog.tensors.iter().map(TensorInfo::name)
    }

    /// Every tensor's name, dtype, shape and byte range (relative to its shard's data region),
    /// in the order of [`names`](Self::names).
    pub fn iter(&self) -> std::slice::Iter<'_, TensorInfo> {
        self.catalog.tensors.iter()
    }

    /// The tensor called `name`, or `Error::InvalidArgument` naming it.
    pub fn info(&self, name: &str) -> Result<&TensorInfo> {
        self.find(name).map(|(t, _)| t)
    }

    /// The tensor called `name` and where it starts in the arena.
    fn find(&self, name: &str) -> Result<(&TensorInfo, usize)> {
        self.catalog
            .get(name)
            .and_then(|(t, s)| Some((t, self.shards.get(s)?.offset + t.data_offsets().start)))
            .ok_or_else(|| {
                Error::invalid(
                    "safetensors::Weights",
                    format!("{}: no tensor named {name:?}", self.shown),
                )
            })
    }

    /// The file of the tensor called `name` (for messages).
    fn path_of(&self, name: &str) -> &str {
        self.catalog
            .get(name)
            .and_then(|(_, s)| self.shards.get(s))
            .map_or(self.shown.as_str(), Shard::path)
    }

    /// The header: tensors, metadata, sizes. For a checkpoint of several shards, the first
    /// shard's ([`shards`](Self::shards) has every one).
    pub fn header(&self) -> &Header {
        // Every Weights is built with at least one shard.
        &self.shards[0].header
    }

    /// Every file loaded, in the order of the arena (one for [`load`]).
    pub fn shards(&self) -> &[Shard] {
        &self.shards
    }

    /// The header's `__metadata__` strings (the first shard's, for a checkpoint of several:
    /// `save_pretrained` writes the same into each).
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        self.header().metadata()
    }

    /// A checkpoint index's `metadata` (`total_size` ...; see
    /// [`Checkpoint::index_metadata`]). Empty where no index was read.
    pub fn index_metadata(&self) -> &BTreeMap<String, String> {
        &self.index_metadata
    }

    /// Whether the data region (of any shard) was read with `O_DIRECT`.
    pub fn used_direct(&self) -> bool {
        self.shards.iter().any(|s| s.direct)
    }

    /// The tensor's byte offset in the arena, checked for a typed view of `T`.
    fn typed<T: Element>(&self, op: &'static str, name: &str) -> Result<(usize, usize)> {
        let (t, offset) = self.find(name)?;
        if t.dtype().to_dlpack() != Some(T::DTYPE) {
            return Err(Error::invalid(
                op,
                format!(
                    "{}: tensor {name:?} is {}, not {}",
                    self.path_of(name),
                    t.dtype(),
                    crate::dlpack::dtype_name(T::DTYPE)
                ),
            ));
        }
        if t.elements() == 0 {
            // No element to align: a view of nothing at the arena's (aligned) start.
            return Ok((0, 0));
        }
        let align = std::mem::align_of::<T>();
        if offset % align != 0 {
            return Err(Error::invalid(
                op,
                format!(
                    "{}: tensor {name:?} starts at byte {} of the data region, which is not a \
                     multiple of its {align}-byte alignment (read it with bytes_of)",
                    self.path_of(name),
                    t.data_offsets().start
                ),
            ));
        }
        Ok((offset, t.elements()))
    }

    /// A read-only typed view of the tensor called `name`, its elements in C order.
    ///
    /// Errors (`Error::InvalidArgument`): no such tensor; a dtype other than `T`'s (`BOOL`, the
    /// `F8_*`, `F4`, `F6_*` and `C64` tensors have no `Element` type here: read them with
    /// [`bytes_of`](Self::bytes_of)); a tensor not aligned for `T` in the file. (An empty
    /// tensor's view has no elements wherever it lies.)
    pub fn get<T: Element>(&self, name: &str) -> Result<DeviceView<'_, T>> {
        let (offset, len) = self.typed::<T>("safetensors::Weights::get", name)?;
        self.arena.view_as(offset, len)
    }

    /// As [`get`](Self::get), writable.
    pub fn get_mut<T: Element>(&mut self, name: &str) -> Result<DeviceViewMut<'_, T>> {
        let (offset, len) = self.typed::<T>("safetensors::Weights::get_mut", name)?;
        self.arena.view_as_mut(offset, len)
    }

    /// The bytes of the tensor called `name`, whatever its dtype.
    pub fn bytes_of(&self, name: &str) -> Result<DeviceView<'_, u8>> {
        let (t, offset) = self.find(name)?;
        self.arena.slice(offset..offset + t.byte_len())
    }

    /// The whole data region (every tensor, back to back), as the file has it. A checkpoint of
    /// several shards has one region per shard, apart in the arena: `Error::InvalidArgument`
    /// (see [`shard_bytes`](Self::shard_bytes)).
    pub fn bytes(&self) -> Result<DeviceView<'_, u8>> {
        match self.shards.as_slice() {
            [_] => self.shard_bytes(0),
            several => Err(Error::invalid(
                "safetensors::Weights::bytes",
                format!(
                    "{}: {} shards have one data region each: read them with shard_bytes",
                    self.shown,
                    several.len()
                ),
            )),
        }
    }

    /// The data region of shard `i` (of [`shards`](Self::shards)), as its file has it;
    /// `Error::InvalidArgument` for a shard that is not there.
    pub fn shard_bytes(&self, i: usize) -> Result<DeviceView<'_, u8>> {
        let s = self.shards.get(i).ok_or_else(|| {
            Error::invalid(
                "safetensors::Weights::shard_bytes",
                format!("{}: no shard {i} of {}", self.shown, self.shards.len()),
            )
        })?;
        // The layout checked that the region fits in usize.
        let len = s.header.data_len() as usize;
        self.arena.slice(s.offset..s.offset + len)
    }

    /// The arena: the data region from [`data_offset`](Self::data_offset) on, after a head
    /// margin of less than 4096 bytes (for a checkpoint, each shard's region at its
    /// [`Shard::data_offset`]).
    pub fn arena(&self) -> &DeviceBuffer<u8> {
        &self.arena
    }

    /// Where the data region starts in the arena (the file's data offset modulo 4096); the
    /// first shard's, for a checkpoint.
    pub fn data_offset(&self) -> usize {
        self.shards[0].offset
    }

    /// Blocks until the upload (and every later use of the arena) has finished.
    pub fn synchronize(&self) -> Result<()> {
        self.arena.synchronize()
    }

    /// Every tensor as a writable DLPack tensor of its shape and dtype, in the order of
    /// [`names`](Self::names), all sharing the arena: it is freed when the last of them is
    /// released (or dropped). `BOOL` is `kDLBool` (8 bits), `F8_E4M3` `kDLFloat8_e4m3fn`,
    /// `F8_E5M2` `kDLFloat8_e5m2`, `F8_E8M0` `kDLFloat8_e8m0fnu`, the `FNUZ` types theirs, `C64`
    /// `kDLComplex` 64 bits (the codes of `dlpack.h` 1.3). The packed sub-byte types (`F4`,
    /// `F6_E2M3`, `F6_E3M2`), which DLPack cannot describe element by element, are exported
    /// as their bytes: `uint8` of shape `[byte_len]` (the [`TensorInfo`] says what they are).
    ///
    /// Errors (`Error::InvalidArgument`, nothing exported, the arena freed): a tensor that is
    /// not aligned to its element size in the file (named in the error).
    pub fn into_dlpack(self) -> Result<Vec<(String, dlpack::Tensor)>> {
        const OP: &str = "safetensors::Weights::into_dlpack";
        let mut parts = Vec::with_capacity(self.len());
        for (t, &s) in self.catalog.tensors.iter().zip(&self.catalog.owner) {
            let shard = self.shards.get(s).ok_or_else(|| {
                Error::invalid(
                    OP,
                    format!("{}: tensor {:?} has no shard", self.shown, t.name()),
                )
            })?;
            let offset = shard.offset + t.data_offsets().start;
            let part = match t.dtype().to_dlpack() {
                Some(dtype) => {
                    if t.byte_len() > 0 && offset % t.dtype().align() != 0 {
                        return Err(Error::invalid(
                            OP,
                            format!(
                                "{}: tensor {:?} ({}) starts at byte {} of the data region, not \
                                 a multiple of its {}-byte alignment",
                                shard.path(),
                                t.name(),
                                t.dtype(),
                                t.data_offsets().start,
                                t.dtype().align()
                            ),
                        ));
                    }
                    dlpack::Part {
                        offset,
                        dtype,
                        shape: t.shape().to_vec(),
                    }
                }
                None => dlpack::Part::of::<u8>(offset, &[t.byte_len()]),
            };
            parts.push(part);
        }
        let Weights { arena, catalog, .. } = self;
        let tensors = dlpack::Tensor::from_device(arena)?.split(&parts)?;
        Ok(catalog
            .tensors
            .into_iter()
            .map(|t| t.name().to_string())
            .zip(tensors)
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_keeps_file_alignment() {
        let json = br#"{"a":{"dtype":"U8","shape":[3],"data_offsets":[0,3]}}"#;
        let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(json);
        bytes.extend_from_slice(&[1, 2, 3]);
        let h = Header::parse(&bytes, bytes.len() as u64).unwrap();
        let (places, total) = layout("t", &[&h], &[true]).unwrap();
        let pad = places[0].1;
        assert_eq!(places[0].0, 0);
        assert_eq!(pad as u64, 8 + json.len() as u64);
        assert_eq!(total, pad + 3);
        // Through the page cache the region starts the arena.
        assert_eq!(layout("t", &[&h], &[false]).unwrap(), (vec![(0, 0)], 3));
    }

    /// Several shards: each part starts at a multiple of 256 after the previous region, the
    /// regions keep their file alignment (O_DIRECT) and never overlap; the arena ends at the
    /// last region's end.
    #[test]
    fn layout_of_shards() {
        let file = |n: usize| {
            let json = format!(r#"{{"a":{{"dtype":"U8","shape":[{n}],"data_offsets":[0,{n}]}}}}"#);
            let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
            bytes.extend_from_slice(json.as_bytes());
            bytes.resize(bytes.len() + n, 7);
            Header::parse(&bytes, bytes.len() as u64).unwrap()
        };
        let hs = [file(3), file(1000), file(0), file(256), file(5000)];
        let refs: Vec<&Header> = hs.iter().collect();
        for direct in [[false; 5], [true; 5], [true, false, true, false, true]] {
            let (places, total) = layout("t", &refs, &direct).unwrap();
            let mut end = 0;
            for ((h, &(base, pad)), d) in hs.iter().zip(&places).zip(direct) {
                assert_eq!(base % 256, 0);
                assert!(base >= end, "{places:?}");
                let want = if d {
                    (h.data_start() % 4096) as usize
                } else {
                    0
                };
                assert_eq!(pad, want);
                end = base + pad + h.data_len() as usize;
            }
            assert_eq!(total, end);
        }
        // Sizes that do not fit are refused, not wrapped: sixteen regions of 2^60 bytes (headers
        // parsed with a claimed file length).
        let n = 1u64 << 60;
        let json = format!(r#"{{"a":{{"dtype":"U8","shape":[{n}],"data_offsets":[0,{n}]}}}}"#);
        let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(json.as_bytes());
        let huge = Header::parse(&bytes, 8 + json.len() as u64 + n).unwrap();
        assert!(layout("t", &[&huge; 15], &[false; 15]).is_ok());
        assert!(matches!(
            layout("t", &[&huge; 16], &[false; 16]),
            Err(Error::InvalidArgument { .. })
        ));
    }

    #[test]
    fn options_build() {
        assert_eq!(LoadOptions::default().direct, Direct::Auto);
        assert_eq!(
            LoadOptions::new().direct(Direct::Always).direct,
            Direct::Always
        );
    }
}
