//! Model weights to the GPU at link speed: a safetensors file into one device arena, as named,
//! typed views or DLPack tensors (feature `safetensors`).
//!
//! [`load`] reads and checks the header ([`Header`]: real JSON parsing with serde_json, duplicate
//! keys refused, every offset and size checked), allocates one arena on the device, and moves
//! the whole data region into it with one [`Stager::upload_file`] call: worker threads `pread`
//! it into pinned slots while the copy engine moves earlier slots to the device. The data
//! comes through the page cache, or with `O_DIRECT` when it is cold ([`Direct`]).
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
//! ([`Weights::bytes_of`]).

mod header;
mod open;
mod residency;

pub use header::{
    Dtype, Header, TensorInfo, KDL_COMPLEX, KDL_FLOAT8_E4M3FN, KDL_FLOAT8_E4M3FNUZ,
    KDL_FLOAT8_E5M2, KDL_FLOAT8_E5M2FNUZ, KDL_FLOAT8_E8M0FNU, MAX_HEADER_BYTES,
};
pub use residency::{resident_fraction, AUTO_DIRECT_MIN_BYTES};

use std::collections::BTreeMap;
use std::path::Path;

use crate::device::Device;
use crate::dlpack::{self, Element};
use crate::error::{Error, Result};
use crate::memory::{DeviceBuffer, DeviceView, DeviceViewMut};
use crate::staging::{Stager, StagerConfig};
use crate::stream::Stream;
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

/// The tensors of one safetensors file in one device arena: named, typed views, their byte
/// ranges, the header's metadata. Dropping it frees the arena after its last use on the GPU.
#[derive(Debug)]
pub struct Weights {
    arena: DeviceBuffer<u8>,
    /// Where the data region starts in the arena.
    pad: usize,
    header: Header,
    direct: bool,
}

/// Loads the safetensors file at `path` onto `stager`'s device, ordered on `stream` (which must
/// be of that device): the header is read and checked ([`Header`]), one arena is allocated
/// (stream-ordered, on `stream`), and the data region is moved into it with one
/// [`Stager::upload_file`], through the page cache or with `O_DIRECT` as `options.direct` says.
/// Returns when the host side is done; the device side completes asynchronously (see
/// [`Weights::synchronize`]).
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
    load_checked(stager, stream, path, file, header, options)
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
    load_checked(stager, stream, &path, file, header, options)
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
    let weights = load_checked(&stager, &stream, path, file, header, LoadOptions::default())?;
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

/// Where the data region goes in the arena, and the arena's size: for `O_DIRECT` reads
/// (`direct`) at its file offset modulo 4096, else at the start.
fn layout(op: &'static str, header: &Header, direct: bool) -> Result<(usize, usize)> {
    let pad = if direct {
        (header.data_start() % BLOCK) as usize
    } else {
        0
    };
    let too_large = || {
        Error::invalid(
            op,
            format!(
                "{}: a data region of {} bytes does not fit in this host's address space",
                header.path(),
                header.data_len()
            ),
        )
    };
    let data = usize::try_from(header.data_len()).map_err(|_| too_large())?;
    let total = data.checked_add(pad).ok_or_else(too_large)?;
    Ok((pad, total))
}

fn load_checked(
    stager: &Stager,
    stream: &Stream,
    path: &Path,
    file: Opened,
    header: Header,
    options: LoadOptions,
) -> Result<Weights> {
    // Through the descriptor opened once, never the path again: a FIFO put at the path since
    // cannot block here.
    let resident = match options.direct {
        Direct::Auto => {
            residency::resident_fraction_of(file.file(), header.data_start(), header.data_len())
        }
        _ => None,
    };
    // Auto reads directly only where that keeps the tensors aligned (a region at a multiple
    // of 8 in the file, as the reference writer pads it).
    let aligned = header.data_start() % 8 == 0;
    let direct = if residency::wants_direct(options.direct, resident, header.data_len())
        && (aligned || options.direct == Direct::Always)
    {
        match file.open_direct(path) {
            Ok(d) if d.len() == file.len() => Some(d),
            Ok(d) => return Err(changed(header.path(), file.len(), d.len())),
            // tmpfs and others refuse O_DIRECT: Auto keeps the page cache.
            Err(_) if options.direct == Direct::Auto => None,
            Err(e) => return Err(e),
        }
    } else {
        None
    };
    let (pad, total) = layout("safetensors::load", &header, direct.is_some())?;
    let mut arena = DeviceBuffer::<u8>::new_async(stream, total)?;
    let mut used_direct = false;
    if let Some(d) = &direct {
        // From the block below the data region, into the whole arena: the head margin gets the
        // header's last bytes.
        match stager.upload_file(stream, d, header.data_start() - pad as u64, &mut arena) {
            Ok(()) => used_direct = true,
            // A filesystem that opened with O_DIRECT but refuses its reads: Auto reads the whole
            // region again through the page cache (the arena's tracker orders the two uploads).
            Err(Error::Io { .. }) if options.direct == Direct::Auto => {}
            Err(e) => return Err(file.rename(e, d)),
        }
    }
    if !used_direct {
        let mut region = arena.slice_mut(pad..)?;
        stager
            .upload_file(stream, file.source(), header.data_start(), &mut region)
            .map_err(|e| file.rename(e, file.source()))?;
    }
    Ok(Weights {
        arena,
        pad,
        header,
        direct: used_direct,
    })
}

impl Weights {
    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.header.len()
    }

    /// Whether the file held no tensor.
    pub fn is_empty(&self) -> bool {
        self.header.is_empty()
    }

    /// The tensors' names, in the order of the data region.
    pub fn names(&self) -> impl Iterator<Item = &str> + '_ {
        self.header.tensors().iter().map(TensorInfo::name)
    }

    /// Every tensor's name, dtype, shape and byte range, in the order of the data region.
    pub fn iter(&self) -> std::slice::Iter<'_, TensorInfo> {
        self.header.tensors().iter()
    }

    /// The tensor called `name`, or `Error::InvalidArgument` naming it.
    pub fn info(&self, name: &str) -> Result<&TensorInfo> {
        self.header.get(name).ok_or_else(|| {
            Error::invalid(
                "safetensors::Weights",
                format!("{}: no tensor named {name:?}", self.header.path()),
            )
        })
    }

    /// The header: tensors, metadata, sizes.
    pub fn header(&self) -> &Header {
        &self.header
    }

    /// The header's `__metadata__` strings.
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        self.header.metadata()
    }

    /// Whether the data region was read with `O_DIRECT`.
    pub fn used_direct(&self) -> bool {
        self.direct
    }

    /// The tensor's byte offset in the arena, checked for a typed view of `T`.
    fn typed<T: Element>(&self, op: &'static str, name: &str) -> Result<(usize, usize)> {
        let t = self.info(name)?;
        if t.dtype().to_dlpack() != Some(T::DTYPE) {
            return Err(Error::invalid(
                op,
                format!(
                    "{}: tensor {name:?} is {}, not {}",
                    self.header.path(),
                    t.dtype(),
                    crate::dlpack::dtype_name(T::DTYPE)
                ),
            ));
        }
        if t.elements() == 0 {
            // No element to align: a view of nothing at the arena's (aligned) start.
            return Ok((0, 0));
        }
        let offset = self.pad + t.data_offsets().start;
        let align = std::mem::align_of::<T>();
        if offset % align != 0 {
            return Err(Error::invalid(
                op,
                format!(
                    "{}: tensor {name:?} starts at byte {} of the data region, which is not a \
                     multiple of its {align}-byte alignment (read it with bytes_of)",
                    self.header.path(),
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
        let r = self.info(name)?.data_offsets();
        self.arena.slice(self.pad + r.start..self.pad + r.end)
    }

    /// The whole data region (every tensor, back to back), as the file has it.
    pub fn bytes(&self) -> Result<DeviceView<'_, u8>> {
        self.arena.slice(self.pad..)
    }

    /// The arena: the data region from [`data_offset`](Self::data_offset) on, after a head
    /// margin of less than 4096 bytes.
    pub fn arena(&self) -> &DeviceBuffer<u8> {
        &self.arena
    }

    /// Where the data region starts in the arena (the file's data offset modulo 4096).
    pub fn data_offset(&self) -> usize {
        self.pad
    }

    /// Blocks until the upload (and every later use of the arena) has finished.
    pub fn synchronize(&self) -> Result<()> {
        self.arena.synchronize()
    }

    /// Every tensor as a writable DLPack tensor of its shape and dtype, in the order of the data
    /// region, all sharing the arena: it is freed when the last of them is released (or
    /// dropped). `BOOL` is `kDLBool` (8 bits), `F8_E4M3` `kDLFloat8_e4m3fn`, `F8_E5M2`
    /// `kDLFloat8_e5m2`, `F8_E8M0` `kDLFloat8_e8m0fnu`, the `FNUZ` types theirs, `C64`
    /// `kDLComplex` 64 bits (the codes of `dlpack.h` 1.3). The packed sub-byte types (`F4`,
    /// `F6_E2M3`, `F6_E3M2`), which DLPack cannot describe element by element, are exported
    /// as their bytes: `uint8` of shape `[byte_len]` (the [`TensorInfo`] says what they are).
    ///
    /// Errors (`Error::InvalidArgument`, nothing exported, the arena freed): a tensor that is
    /// not aligned to its element size in the file (named in the error).
    pub fn into_dlpack(self) -> Result<Vec<(String, dlpack::Tensor)>> {
        const OP: &str = "safetensors::Weights::into_dlpack";
        let mut parts = Vec::with_capacity(self.len());
        for t in self.header.tensors() {
            let offset = self.pad + t.data_offsets().start;
            let part = match t.dtype().to_dlpack() {
                Some(dtype) => {
                    if t.byte_len() > 0 && offset % t.dtype().align() != 0 {
                        return Err(Error::invalid(
                            OP,
                            format!(
                                "{}: tensor {:?} ({}) starts at byte {} of the data region, not \
                                 a multiple of its {}-byte alignment",
                                self.header.path(),
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
        let Weights { arena, header, .. } = self;
        let tensors = dlpack::Tensor::from_device(arena)?.split(&parts)?;
        Ok(header
            .tensors()
            .iter()
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
        let (pad, total) = layout("t", &h, true).unwrap();
        assert_eq!(pad as u64, 8 + json.len() as u64);
        assert_eq!(total, pad + 3);
        // Through the page cache the region starts the arena.
        assert_eq!(layout("t", &h, false).unwrap(), (0, 3));
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
