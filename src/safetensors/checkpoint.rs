//! A checkpoint of one or several safetensors files, resolved and checked on the host:
//! [`Checkpoint`].

use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::path::{Path, PathBuf};

use super::header::{format_error_of, Header, TensorInfo};
use super::index::{self, MAX_INDEX_BYTES};
use super::open::{io, open_regular, Opened};
use super::{LoadOptions, Weights};
use crate::error::{Error, Result};
use crate::staging::Stager;
use crate::stream::Stream;

const OP: &str = "safetensors::Checkpoint::open";
/// The format named by errors about a folder or the shards together.
const CHECKPOINT: &str = "safetensors checkpoint";

/// What a checkpoint's path named.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CheckpointKind {
    /// One safetensors file.
    File,
    /// An index (`*.json`) naming the shards.
    Index,
    /// A folder: its one `*.safetensors.index.json`, or else every `*.safetensors` in it.
    Directory,
}

/// Every tensor of the shards, in shard order and each shard's data-region order, with the
/// shard it lies in and an index by name.
#[derive(Clone, Debug, Default)]
pub(crate) struct Catalog {
    pub tensors: Vec<TensorInfo>,
    pub owner: Vec<usize>,
    pub by_name: HashMap<String, usize>,
}

impl Catalog {
    /// The tensors of `headers`; a name in two of them is `Err((first shard, second shard,
    /// name))`.
    pub(crate) fn build(
        headers: &[Header],
    ) -> std::result::Result<Catalog, (usize, usize, String)> {
        let n = headers.iter().map(Header::len).sum();
        let mut c = Catalog {
            tensors: Vec::with_capacity(n),
            owner: Vec::with_capacity(n),
            by_name: HashMap::with_capacity(n),
        };
        for (shard, h) in headers.iter().enumerate() {
            for t in h.tensors() {
                if let Some(&i) = c.by_name.get(t.name()) {
                    return Err((c.owner[i], shard, t.name().to_string()));
                }
                c.by_name.insert(t.name().to_string(), c.tensors.len());
                c.tensors.push(t.clone());
                c.owner.push(shard);
            }
        }
        Ok(c)
    }

    /// The tensor called `name` and its shard.
    pub(crate) fn get(&self, name: &str) -> Option<(&TensorInfo, usize)> {
        let &i = self.by_name.get(name)?;
        Some((self.tensors.get(i)?, *self.owner.get(i)?))
    }
}

/// A checkpoint of one or several safetensors files, as a Hugging Face user holds it: one file;
/// the index `model.safetensors.index.json` that `save_pretrained` writes beside its shards
/// `model-0000k-of-0000n.safetensors`; or the folder that holds them. [`Checkpoint::open`]
/// resolves the path, reads and checks the index and every shard's header on the host (nothing
/// on the device is touched, so a bad checkpoint is an [`Error::Format`] on any machine), and
/// keeps every shard open for [`Checkpoint::load`], which moves all of them into one device
/// arena in one call of the staging engine (every thread reads pieces of every shard).
///
/// **Resolution.** A folder is read through its `*.safetensors.index.json` where it holds
/// exactly one (several are an [`Error::Format`] naming them), else as every `*.safetensors`
/// file in it, sorted by name (folders named so are skipped; a FIFO or device named so is an
/// [`Error::Io`], refused without blocking). A path whose file name ends in `.json` is an
/// index; any other path is one safetensors file.
///
/// **The index's checks**, before anything is allocated: the index is at most
/// [`MAX_INDEX_BYTES`](super::MAX_INDEX_BYTES) of UTF-8 JSON, an object whose `weight_map`
/// maps each tensor name (once: a key given twice, at any level, is refused) to a shard file
/// name (a string, relative to the index's folder, without `..` or a root: symbolic links are
/// followed, as in the Hugging Face cache, whose snapshots link to `../../blobs/`); every
/// tensor it names is found in the shard it names; every tensor of a shard is named by the
/// index, for that shard (so no name is in two shards). A shard that is missing or cannot be
/// opened is an [`Error::Io`] naming it. Without an index, a tensor name may appear in one
/// shard only. The names are the index's keys: tied weights that `save_pretrained` stored once
/// are under the name the index gives, and no other.
///
/// A `Checkpoint` holds its shards open (one descriptor each) until it is loaded or dropped:
/// the load reads the files that were checked, whatever is put at their paths since.
///
/// ```no_run
/// use pinstream::safetensors::{Checkpoint, LoadOptions};
/// use pinstream::{Device, Stager, StagerConfig};
/// # fn main() -> pinstream::Result<()> {
/// // A folder written by `save_pretrained`, its index, or one file: all the same here.
/// let ckpt = Checkpoint::open("Llama-3.1-8B/")?; // every header checked, nothing allocated
/// println!("{} tensors in {} shards", ckpt.len(), ckpt.shards().len());
/// let dev = Device::get(0)?;
/// let stream = dev.stream()?;
/// let stager = Stager::new(&dev, StagerConfig::default())?;
/// let weights = ckpt.load(&stager, &stream, LoadOptions::default())?; // one arena
/// let emb = weights.get::<pinstream::bf16>("model.embed_tokens.weight")?;
/// # let _ = emb;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct Checkpoint {
    path: String,
    kind: CheckpointKind,
    index: Option<PathBuf>,
    files: Vec<Opened>,
    headers: Vec<Header>,
    catalog: Catalog,
    index_metadata: BTreeMap<String, String>,
}

impl Checkpoint {
    /// Resolves `path` (a safetensors file, an index, or a folder: see [`Checkpoint`]) and
    /// checks the index and every shard's header.
    ///
    /// Errors: [`Error::Io`] for a path, index or shard that cannot be opened or read (a shard
    /// the index names that is missing names the shard, and the index and a tensor in its
    /// message), or that is not a regular file; [`Error::Format`] for a bad index, header or
    /// folder, naming the file and, where one is at fault, the tensor.
    pub fn open(path: impl AsRef<Path>) -> Result<Checkpoint> {
        let path = path.as_ref();
        let shown = path.display().to_string();
        // `stat` follows links and never blocks (a FIFO is refused when it is opened).
        let meta = std::fs::metadata(path).map_err(|e| io(OP, &shown, e.to_string()))?;
        if meta.is_dir() {
            return Checkpoint::open_dir(path);
        }
        if is_index_name(path) {
            return Checkpoint::open_index(path, &shown, CheckpointKind::Index);
        }
        let file = Opened::open(OP, path)?;
        let header = Header::read_opened(path, &file)?;
        Checkpoint::new(
            shown,
            CheckpointKind::File,
            None,
            vec![(file, header)],
            BTreeMap::new(),
        )
    }

    fn new(
        path: String,
        kind: CheckpointKind,
        index: Option<PathBuf>,
        shards: Vec<(Opened, Header)>,
        index_metadata: BTreeMap<String, String>,
    ) -> Result<Checkpoint> {
        let (files, headers): (Vec<Opened>, Vec<Header>) = shards.into_iter().unzip();
        if headers.is_empty() {
            // Callers refuse this before; a checkpoint always has a shard.
            return Err(format_error_of(CHECKPOINT, &path, None, "no shard"));
        }
        let catalog = Catalog::build(&headers).map_err(|(first, second, name)| {
            format_error_of(
                CHECKPOINT,
                headers[second].path(),
                Some(&name),
                format!(
                    "the tensor is also in {}: without an index, a tensor name may be in one \
                     shard only",
                    headers[first].path()
                ),
            )
        })?;
        Ok(Checkpoint {
            path,
            kind,
            index,
            files,
            headers,
            catalog,
            index_metadata,
        })
    }

    /// A folder: its one index, or every `*.safetensors` in it.
    fn open_dir(dir: &Path) -> Result<Checkpoint> {
        let shown = dir.display().to_string();
        let mut indexes = Vec::new();
        let mut shards = Vec::new();
        let entries = std::fs::read_dir(dir).map_err(|e| io(OP, &shown, e.to_string()))?;
        for entry in entries {
            let entry = entry.map_err(|e| io(OP, &shown, e.to_string()))?;
            let name = entry.file_name();
            let name = name.as_encoded_bytes();
            let interesting =
                name.ends_with(b".safetensors.index.json") || name.ends_with(b".safetensors");
            // A folder (or a link to one) named so is neither; anything else (a FIFO too) is
            // opened, and refused there if it is not a regular file.
            if !interesting || std::fs::metadata(entry.path()).is_ok_and(|m| m.is_dir()) {
                continue;
            }
            if name.ends_with(b".safetensors.index.json") {
                indexes.push(entry.path());
            } else if name.ends_with(b".safetensors") {
                shards.push(entry.path());
            }
        }
        indexes.sort();
        shards.sort();
        match indexes.as_slice() {
            [index] => {
                let shown_index = index.display().to_string();
                return Checkpoint::open_index(index, &shown_index, CheckpointKind::Directory).map(
                    |mut c| {
                        c.path = shown;
                        c
                    },
                );
            }
            [] => {}
            several => {
                let names: Vec<String> = several
                    .iter()
                    .map(|p| {
                        p.file_name()
                            .map_or_else(String::new, |n| n.to_string_lossy().into_owned())
                    })
                    .collect();
                return Err(format_error_of(
                    CHECKPOINT,
                    &shown,
                    None,
                    format!(
                        "the folder holds {} indexes ({}): open the one to load",
                        several.len(),
                        names.join(", ")
                    ),
                ));
            }
        }
        if shards.is_empty() {
            return Err(format_error_of(
                CHECKPOINT,
                &shown,
                None,
                "the folder holds no *.safetensors.index.json and no *.safetensors file",
            ));
        }
        let mut opened = Vec::with_capacity(shards.len());
        for p in &shards {
            let file = Opened::open(OP, p)?;
            let header = Header::read_opened(p, &file)?;
            opened.push((file, header));
        }
        Checkpoint::new(
            shown,
            CheckpointKind::Directory,
            None,
            opened,
            BTreeMap::new(),
        )
    }

    /// An index and the shards it names.
    fn open_index(path: &Path, shown: &str, kind: CheckpointKind) -> Result<Checkpoint> {
        let (file, len, _) = open_regular(OP, path)?;
        let too_large = |n: u64| {
            format_error_of(
                index::FORMAT,
                shown,
                None,
                format!("the index has {n} bytes, above the limit of {MAX_INDEX_BYTES}"),
            )
        };
        if len > MAX_INDEX_BYTES {
            return Err(too_large(len));
        }
        // At most one byte more than the limit, whatever the file grew to since.
        let mut bytes = Vec::new();
        (&file)
            .take(MAX_INDEX_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| io(OP, shown, e.to_string()))?;
        if bytes.len() as u64 > MAX_INDEX_BYTES {
            return Err(too_large(bytes.len() as u64));
        }
        let index = index::parse(shown, &bytes)?;
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        // Where the index puts each tensor, and the tensors of each shard. Shards go by their
        // plain name: `./a.safetensors` and `a.safetensors` are one file, read once (the Hugging
        // Face loaders join each spelling to the folder, so they take both too).
        let mut place: HashMap<&str, String> = HashMap::with_capacity(index.weight_map.len());
        let mut by_shard: BTreeMap<String, Vec<&str>> = BTreeMap::new();
        for (t, s) in &index.weight_map {
            let plain = index::plain_shard_name(s);
            by_shard.entry(plain.clone()).or_default().push(t.as_str());
            place.insert(t.as_str(), plain);
        }
        let mut shards = Vec::with_capacity(by_shard.len());
        for (shard, tensors) in &by_shard {
            let p = dir.join(shard);
            let named_by = |e: Error| match e {
                Error::Io {
                    op,
                    path,
                    offset,
                    len,
                    message,
                } => Error::Io {
                    op,
                    path,
                    offset,
                    len,
                    message: format!(
                        "{message} (the shard that {shown} names for tensor {:?})",
                        tensors.first().copied().unwrap_or_default()
                    ),
                },
                other => other,
            };
            let file = Opened::open(OP, &p).map_err(named_by)?;
            let header = Header::read_opened(&p, &file)?;
            for t in header.tensors() {
                let detail = match place.get(t.name()) {
                    Some(s) if s == shard => continue,
                    Some(s) => format!(
                        "the index {shown} puts this tensor in {s:?}: a tensor must be in the one \
                         shard the index names for it"
                    ),
                    None => format!(
                        "the index {shown} does not name this tensor: every tensor of a shard \
                         must be in its weight map"
                    ),
                };
                return Err(format_error_of(
                    CHECKPOINT,
                    header.path(),
                    Some(t.name()),
                    detail,
                ));
            }
            if let Some(missing) = tensors.iter().find(|t| header.get(t).is_none()) {
                return Err(format_error_of(
                    index::FORMAT,
                    shown,
                    Some(missing),
                    format!(
                        "the index puts this tensor in {shard:?} ({}), which holds no tensor of \
                         that name",
                        header.path()
                    ),
                ));
            }
            shards.push((file, header));
        }
        Checkpoint::new(
            shown.to_string(),
            kind,
            Some(path.to_path_buf()),
            shards,
            index.metadata,
        )
    }

    /// The path as given, for messages.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// What the path named.
    pub fn kind(&self) -> CheckpointKind {
        self.kind
    }

    /// The index that named the shards, where one did.
    pub fn index_path(&self) -> Option<&Path> {
        self.index.as_deref()
    }

    /// The index's `metadata` (`total_size` ...): strings as they are, other values as compact
    /// JSON (`"123"`). Empty without an index.
    pub fn index_metadata(&self) -> &BTreeMap<String, String> {
        &self.index_metadata
    }

    /// Every shard's header, in the order of the arena (sorted by file name; one for a file).
    pub fn shards(&self) -> &[Header] {
        &self.headers
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.catalog.tensors.len()
    }

    /// Whether the shards hold no tensor.
    pub fn is_empty(&self) -> bool {
        self.catalog.tensors.is_empty()
    }

    /// The tensors' names, shard by shard, each in the order of its data region.
    pub fn names(&self) -> impl Iterator<Item = &str> + '_ {
        self.catalog.tensors.iter().map(TensorInfo::name)
    }

    /// Every tensor, in the order of [`names`](Self::names); byte ranges are relative to its
    /// shard's data region.
    pub fn iter(&self) -> std::slice::Iter<'_, TensorInfo> {
        self.catalog.tensors.iter()
    }

    /// The tensor called `name`.
    pub fn get(&self, name: &str) -> Option<&TensorInfo> {
        self.catalog.get(name).map(|(t, _)| t)
    }

    /// The header of the shard that holds the tensor called `name`.
    pub fn shard_of(&self, name: &str) -> Option<&Header> {
        self.catalog
            .get(name)
            .and_then(|(_, s)| self.headers.get(s))
    }

    /// The bytes of every tensor together: the sum of the shards' data regions.
    pub fn data_len(&self) -> u64 {
        self.headers
            .iter()
            .fold(0u64, |a, h| a.saturating_add(h.data_len()))
    }

    /// Loads every shard onto `stager`'s device into one arena, ordered on `stream`, as
    /// [`load`](super::load) does for one file: each shard's data region starts 256-byte
    /// aligned (at its file offset modulo 4096 after that where it is read with `O_DIRECT`,
    /// which [`Direct::Auto`](super::Direct::Auto) decides shard by shard), and one call of the
    /// staging engine reads every shard, each thread taking pieces of any of them. The arena's
    /// size is computed with checked arithmetic before it is allocated; its allocation fails
    /// with [`Error::OutOfMemory`] where the device cannot hold it.
    pub fn load(self, stager: &Stager, stream: &Stream, options: LoadOptions) -> Result<Weights> {
        stream.same_device("safetensors::load_checkpoint", stager.device())?;
        let shards = self.files.into_iter().zip(self.headers).collect();
        super::load_shards(
            stager,
            stream,
            self.path,
            shards,
            self.catalog,
            self.index_metadata,
            options,
        )
    }
}

/// A path whose file name ends in `.json` is an index.
fn is_index_name(path: &Path) -> bool {
    path.file_name()
        .is_some_and(|n| n.as_encoded_bytes().ends_with(b".json"))
}

/// [`Checkpoint::open`] then [`Checkpoint::load`]: a safetensors file, a sharded checkpoint's
/// index, or a folder, into one device arena. See [`Checkpoint`] for how the path is resolved
/// and what is checked (all of it before the device is touched).
pub fn load_checkpoint(
    stager: &Stager,
    stream: &Stream,
    path: impl AsRef<Path>,
    options: LoadOptions,
) -> Result<Weights> {
    stream.same_device("safetensors::load_checkpoint", stager.device())?;
    Checkpoint::open(path)?.load(stager, stream, options)
}
