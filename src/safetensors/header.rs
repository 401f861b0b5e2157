//! The safetensors header: its length prefix, its JSON (read with serde_json through visitors that
//! refuse duplicate keys), the element types, and the checks that make every tensor's byte range
//! lie in the data region, contiguous, without overlap or hole.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};

use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Deserializer;

use super::json::{MetadataSeed, Values};
use super::open::{Identity, Opened};
use crate::dlpack::abi::{DLDataType, KDL_BFLOAT, KDL_BOOL, KDL_FLOAT, KDL_INT, KDL_UINT};
use crate::error::{Error, Result};

/// The largest header accepted, in bytes (the reference implementation's bound).
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

// The DLPack codes of the safetensors types beyond the library's own elements, where
// `dlpack::abi` keeps every code (re-exported here, where the export uses them).
pub use crate::dlpack::abi::{
    KDL_COMPLEX, KDL_FLOAT8_E4M3FN, KDL_FLOAT8_E4M3FNUZ, KDL_FLOAT8_E5M2, KDL_FLOAT8_E5M2FNUZ,
    KDL_FLOAT8_E8M0FNU,
};

/// The path shown in errors about bytes parsed with [`Header::parse`].
const IN_MEMORY: &str = "(in memory)";
const FORMAT: &str = "safetensors";

macro_rules! dtypes {
    ($($(#[$doc:meta])* $v:ident = $name:literal, $bits:expr, $dl:expr;)*) => {
        /// A safetensors element type: every one the reference implementation
        /// (huggingface/safetensors) knows. Data is little-endian, tensors C-ordered.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        #[non_exhaustive]
        pub enum Dtype {
            $($(#[$doc])* $v,)*
        }

        impl Dtype {
            /// Every type, in the reference implementation's order.
            pub const ALL: &'static [Dtype] = &[$(Dtype::$v),*];

            /// The name the header uses (`"F32"`, `"F8_E4M3"` ...).
            pub fn name(self) -> &'static str {
                match self {
                    $(Dtype::$v => $name,)*
                }
            }

            /// The type a header names, or `None` for an unknown name.
            pub fn from_name(name: &str) -> Option<Dtype> {
                match name {
                    $($name => Some(Dtype::$v),)*
                    _ => None,
                }
            }

            /// Bits per element (4 and 6 for the packed `F4` and `F6_*` types).
            pub fn bits(self) -> usize {
                match self {
                    $(Dtype::$v => $bits,)*
                }
            }

            /// The DLPack type of one element, or `None` for the sub-byte types (`F4`,
            /// `F6_E2M3`, `F6_E3M2`), which DLPack cannot describe element by element.
            pub fn to_dlpack(self) -> Option<DLDataType> {
                let dl: Option<(u8, u8)> = match self {
                    $(Dtype::$v => $dl,)*
                };
                dl.map(|(code, bits)| DLDataType { code, bits, lanes: 1 })
            }
        }
    };
}

dtypes! {
    /// Boolean, one byte each (DLPack `kDLBool`, 8 bits).
    Bool = "BOOL", 8, Some((KDL_BOOL, 8));
    /// 4-bit float (OCP MX FP4, e2m1), two per byte.
    F4 = "F4", 4, None;
    /// 6-bit float (OCP MX FP6, e2m3), packed.
    F6E2M3 = "F6_E2M3", 6, None;
    /// 6-bit float (OCP MX FP6, e3m2), packed.
    F6E3M2 = "F6_E3M2", 6, None;
    /// Unsigned byte.
    U8 = "U8", 8, Some((KDL_UINT, 8));
    /// Signed byte.
    I8 = "I8", 8, Some((KDL_INT, 8));
    /// 8-bit float e5m2 (DLPack `kDLFloat8_e5m2`).
    F8E5M2 = "F8_E5M2", 8, Some((KDL_FLOAT8_E5M2, 8));
    /// 8-bit float e4m3, finite with NaN (DLPack `kDLFloat8_e4m3fn`).
    F8E4M3 = "F8_E4M3", 8, Some((KDL_FLOAT8_E4M3FN, 8));
    /// 8-bit exponent-only scale (OCP MX E8M0; DLPack `kDLFloat8_e8m0fnu`).
    F8E8M0 = "F8_E8M0", 8, Some((KDL_FLOAT8_E8M0FNU, 8));
    /// 8-bit float e4m3, finite, unsigned zero (DLPack `kDLFloat8_e4m3fnuz`).
    F8E4M3Fnuz = "F8_E4M3FNUZ", 8, Some((KDL_FLOAT8_E4M3FNUZ, 8));
    /// 8-bit float e5m2, finite, unsigned zero (DLPack `kDLFloat8_e5m2fnuz`).
    F8E5M2Fnuz = "F8_E5M2FNUZ", 8, Some((KDL_FLOAT8_E5M2FNUZ, 8));
    /// Signed 16-bit integer.
    I16 = "I16", 16, Some((KDL_INT, 16));
    /// Unsigned 16-bit integer.
    U16 = "U16", 16, Some((KDL_UINT, 16));
    /// IEEE half precision.
    F16 = "F16", 16, Some((KDL_FLOAT, 16));
    /// bfloat16.
    BF16 = "BF16", 16, Some((KDL_BFLOAT, 16));
    /// Signed 32-bit integer.
    I32 = "I32", 32, Some((KDL_INT, 32));
    /// Unsigned 32-bit integer.
    U32 = "U32", 32, Some((KDL_UINT, 32));
    /// IEEE single precision.
    F32 = "F32", 32, Some((KDL_FLOAT, 32));
    /// Complex of two `F32` (DLPack `kDLComplex`, 64 bits).
    C64 = "C64", 64, Some((KDL_COMPLEX, 64));
    /// IEEE double precision.
    F64 = "F64", 64, Some((KDL_FLOAT, 64));
    /// Signed 64-bit integer.
    I64 = "I64", 64, Some((KDL_INT, 64));
    /// Unsigned 64-bit integer.
    U64 = "U64", 64, Some((KDL_UINT, 64));
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl Dtype {
    /// The alignment a typed view of this type needs: its size in bytes where that is a power
    /// of two, at most 16 (1 for the sub-byte types).
    pub fn align(self) -> usize {
        let bytes = (self.bits() / 8).max(1);
        1 << bytes.trailing_zeros().min(4)
    }
}

/// One tensor of a safetensors file: its name, element type, shape and bytes in the data region.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    name: String,
    dtype: Dtype,
    shape: Vec<usize>,
    range: Range<usize>,
}

impl TensorInfo {
    /// The tensor's name (its key in the header).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its element type.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// Its shape (empty for a scalar).
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Its elements: the product of the shape (checked against the byte range when parsed).
    pub fn elements(&self) -> usize {
        // Cannot overflow: the header's checks computed it with checked arithmetic.
        self.shape.iter().product()
    }

    /// Its bytes, relative to the start of the data region (the header's `data_offsets`).
    pub fn data_offsets(&self) -> Range<usize> {
        self.range.clone()
    }

    /// Its size in bytes.
    pub fn byte_len(&self) -> usize {
        self.range.end - self.range.start
    }
}

/// A parsed and checked safetensors header: every tensor, sorted by offset (the order of the
/// data region; empty tensors at the same offset by name), and the `__metadata__` strings.
///
/// Checks, following the reference implementation (huggingface/safetensors): the length prefix
/// is at most [`MAX_HEADER_BYTES`] and fits in the file; the header is UTF-8 JSON, an object;
/// no key appears twice (at any level: serde_json's `Value` would keep the last one silently);
/// `__metadata__` maps strings to strings; every other key is a tensor with a known `dtype`, a
/// `shape` of non-negative integers and `data_offsets` `[begin, end]` with `begin <= end`, whose
/// shape times the element size (checked arithmetic, whole bytes) is `end - begin`; sorted by
/// offset the tensors cover the data region (file length − 8 − N) from 0 to its end with no
/// overlap and no hole. Fields of a tensor other than those three are ignored, as the reference
/// does. Every violation is an [`Error::Format`] naming the file and, where there is one, the
/// tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    path: String,
    /// The file it was read from (`None` for `parse`).
    source: Option<PathBuf>,
    /// That file's `(st_dev, st_ino)`: a load of this header refuses another file put at the
    /// same path since.
    identity: Option<Identity>,
    header_len: u64,
    file_len: u64,
    tensors: Vec<TensorInfo>,
    index: HashMap<String, usize>,
    metadata: BTreeMap<String, String>,
}

impl Header {
    /// Reads and checks the header of the file at `path` (the length prefix and the JSON; the
    /// data region is not read).
    pub fn read(path: impl AsRef<Path>) -> Result<Header> {
        let path = path.as_ref();
        Header::read_opened(path, &Opened::open("safetensors::Header::read", path)?)
    }

    /// As [`read`](Self::read), from a file opened once ([`Opened`]; its length as it was at
    /// open), which `path` named.
    pub(crate) fn read_opened(path: &Path, file: &Opened) -> Result<Header> {
        const OP: &str = "safetensors::Header::read";
        let shown = file.shown();
        let file_len = file.len();
        let src = file.source();
        let head = src
            .read_range(OP, 0, file_len.min(8) as usize)
            .map_err(|e| file.rename(e, src))?;
        let n = header_len(shown, prefix_of(shown, file_len, &head)?, file_len)?;
        // `n` is at most MAX_HEADER_BYTES: it fits in usize.
        let json = src
            .read_range(OP, 8, n as usize)
            .map_err(|e| file.rename(e, src))?;
        let mut h = parse_json(shown, &json, n, file_len)?;
        h.source = Some(path.to_path_buf());
        h.identity = Some(file.identity());
        Ok(h)
    }

    /// `(st_dev, st_ino)` of the file it was read from.
    pub(crate) fn identity(&self) -> Option<Identity> {
        self.identity
    }

    /// Parses and checks a header from memory: `bytes` starts at the file's first byte and
    /// holds at least the length prefix and the JSON (it may hold the whole file, or less);
    /// `file_len` is the whole file's length. Errors name the path `(in memory)`.
    pub fn parse(bytes: &[u8], file_len: u64) -> Result<Header> {
        let n = header_len(IN_MEMORY, prefix_of(IN_MEMORY, file_len, bytes)?, file_len)?;
        let json = bytes
            .get(8..)
            .and_then(|b| b.get(..n as usize))
            .ok_or_else(|| {
                format_error(
                    IN_MEMORY,
                    None,
                    format!(
                    "the header is {n} bytes, but only {} bytes after the length prefix were given",
                    bytes.len().saturating_sub(8)
                ),
                )
            })?;
        parse_json(IN_MEMORY, json, n, file_len)
    }

    /// The file's path, as given (`(in memory)` for [`parse`](Self::parse)), for messages.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The file it was read from (`None` for a header parsed from memory).
    pub fn source(&self) -> Option<&Path> {
        self.source.as_deref()
    }

    /// N: the JSON's length in bytes (after the 8-byte prefix).
    pub fn header_len(&self) -> u64 {
        self.header_len
    }

    /// Where the data region starts in the file: 8 + N.
    pub fn data_start(&self) -> u64 {
        8 + self.header_len
    }

    /// The data region's length: the file's length − 8 − N, which the tensors cover exactly.
    pub fn data_len(&self) -> u64 {
        self.file_len - self.data_start()
    }

    /// The file's length when the header was read.
    pub fn file_len(&self) -> u64 {
        self.file_len
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether the file holds no tensor.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// Every tensor, in the order of the data region.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The tensor called `name`.
    pub fn get(&self, name: &str) -> Option<&TensorInfo> {
        self.index.get(name).and_then(|&i| self.tensors.get(i))
    }

    /// The `__metadata__` strings (empty where the header has none).
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }
}

pub(crate) fn format_error(path: &str, tensor: Option<&str>, detail: impl Into<String>) -> Error {
    format_error_of(FORMAT, path, tensor, detail)
}

/// `Error::Format` of `format` (`safetensors`, `safetensors index` ...).
pub(crate) fn format_error_of(
    format: &'static str,
    path: &str,
    tensor: Option<&str>,
    detail: impl Into<String>,
) -> Error {
    Error::Format {
        format,
        path: path.to_string(),
        tensor: tensor.map(str::to_string),
        detail: detail.into(),
    }
}

/// The 8 bytes of the length prefix, or an error for a file shorter than that.
fn prefix_of(path: &str, file_len: u64, bytes: &[u8]) -> Result<[u8; 8]> {
    let short = || {
        format_error(
            path,
            None,
            format!(
                "the file has {file_len} bytes, fewer than the 8 of the header's length prefix"
            ),
        )
    };
    if file_len < 8 {
        return Err(short());
    }
    bytes
        .get(..8)
        .and_then(|b| <[u8; 8]>::try_from(b).ok())
        .ok_or_else(short)
}

/// N from the prefix, checked against the bound and the file's length.
fn header_len(path: &str, prefix: [u8; 8], file_len: u64) -> Result<u64> {
    let n = u64::from_le_bytes(prefix);
    if n > MAX_HEADER_BYTES {
        // A JSON file (a sharded checkpoint's index) read as safetensors: say so.
        let json = if prefix[0] == b'{' {
            " (the file starts with '{': it looks like JSON, such as a sharded checkpoint's \
             index, which `load_checkpoint` reads)"
        } else {
            ""
        };
        return Err(format_error(
            path,
            None,
            format!("the header length {n} is above the limit of {MAX_HEADER_BYTES} bytes{json}"),
        ));
    }
    if n.checked_add(8).is_none_or(|end| end > file_len) {
        return Err(format_error(
            path,
            None,
            format!("the header of {n} bytes does not fit in the file's {file_len} bytes"),
        ));
    }
    Ok(n)
}

/// A tensor's entry as the JSON has it, before the checks.
struct RawInfo {
    dtype: String,
    shape: Vec<u64>,
    offsets: (u64, u64),
}

struct Raw {
    metadata: BTreeMap<String, String>,
    tensors: Vec<(String, RawInfo)>,
}

fn parse_json(path: &str, json: &[u8], n: u64, file_len: u64) -> Result<Header> {
    let text = std::str::from_utf8(json)
        .map_err(|e| format_error(path, None, format!("the header is not UTF-8 ({e})")))?;
    // The tensor being read when an error happens, to name it in the error.
    let current = RefCell::new(None::<String>);
    let mut de = serde_json::Deserializer::from_str(text);
    let raw = HeaderSeed { current: &current }
        .deserialize(&mut de)
        .and_then(|raw| de.end().map(|()| raw))
        .map_err(|e| {
            format_error(
                path,
                current.borrow().as_deref(),
                format!("the header is not valid: {e}"),
            )
        })?;
    check(path, raw, n, file_len)
}

/// The checks on sizes and offsets, and the sorted tensor list.
fn check(path: &str, raw: Raw, n: u64, file_len: u64) -> Result<Header> {
    // `n + 8 <= file_len` was checked with the prefix.
    let data_len = file_len - 8 - n;
    let mut tensors = Vec::with_capacity(raw.tensors.len());
    for (name, info) in raw.tensors {
        let bad = |detail: String| format_error(path, Some(&name), detail);
        let dtype = Dtype::from_name(&info.dtype).ok_or_else(|| {
            let known: Vec<&str> = Dtype::ALL.iter().map(|d| d.name()).collect();
            bad(format!(
                "unknown dtype {:?} (known: {})",
                info.dtype,
                known.join(", ")
            ))
        })?;
        let (begin, end) = info.offsets;
        if end < begin {
            return Err(bad(format!(
                "data_offsets [{begin}, {end}] end before they begin"
            )));
        }
        if end > data_len {
            return Err(bad(format!(
                "data_offsets [{begin}, {end}] reach beyond the data region's {data_len} bytes"
            )));
        }
        // Within the data region, which is within the file: they fit in usize where the file
        // is addressable; refuse them otherwise (a 32-bit host).
        let to_usize = |v: u64| {
            usize::try_from(v)
                .map_err(|_| bad(format!("offset {v} does not fit in this host's usize")))
        };
        let range = to_usize(begin)?..to_usize(end)?;
        let mut shape = Vec::with_capacity(info.shape.len());
        let mut elements = 1usize;
        for &d in &info.shape {
            let d = usize::try_from(d).ok();
            let product = d.and_then(|d| elements.checked_mul(d).map(|p| (d, p)));
            let Some((d, p)) = product else {
                return Err(bad(format!(
                    "shape {:?}: the number of elements overflows",
                    info.shape
                )));
            };
            shape.push(d);
            elements = p;
        }
        let bits = elements.checked_mul(dtype.bits()).ok_or_else(|| {
            bad(format!(
                "shape {:?} of {dtype}: the size in bits overflows",
                info.shape
            ))
        })?;
        if bits % 8 != 0 {
            return Err(bad(format!(
                "shape {:?} of {dtype} is {bits} bits, not whole bytes",
                info.shape
            )));
        }
        if bits / 8 != range.len() {
            return Err(bad(format!(
                "shape {:?} of {dtype} is {} bytes, but data_offsets [{begin}, {end}] span {}",
                info.shape,
                bits / 8,
                range.len()
            )));
        }
        tensors.push(TensorInfo {
            name,
            dtype,
            shape,
            range,
        });
    }
    // Sorted by offset (ties, which only empty tensors can have without overlapping, by name),
    // they must tile the data region.
    tensors.sort_by(|a, b| {
        (a.range.start, a.range.end, &a.name).cmp(&(b.range.start, b.range.end, &b.name))
    });
    let mut expected = 0usize;
    let mut previous: Option<&str> = None;
    for t in &tensors {
        if t.range.start != expected {
            let detail = match previous {
                Some(p) if t.range.start < expected => format!(
                    "data_offsets [{}, {}] overlap tensor {p:?}, which ends at {expected}",
                    t.range.start, t.range.end
                ),
                Some(p) => format!(
                    "data_offsets [{}, {}] leave a hole: bytes {expected}..{} after tensor {p:?} \
                     belong to no tensor",
                    t.range.start, t.range.end, t.range.start
                ),
                None => format!(
                    "data_offsets [{}, {}]: the first tensor must start at 0 (bytes 0..{} belong \
                     to no tensor)",
                    t.range.start, t.range.end, t.range.start
                ),
            };
            return Err(format_error(path, Some(&t.name), detail));
        }
        expected = t.range.end;
        previous = Some(&t.name);
    }
    if expected as u64 != data_len {
        return Err(format_error(
            path,
            previous,
            format!(
                "the tensors end at byte {expected} of the data region, which has {data_len} \
                 bytes (file length {file_len} - 8 - header length {n}): {} bytes belong to no \
                 tensor",
                data_len - expected as u64
            ),
        ));
    }
    let index = tensors
        .iter()
        .enumerate()
        .map(|(i, t)| (t.name.clone(), i))
        .collect();
    Ok(Header {
        path: path.to_string(),
        source: None,
        identity: None,
        header_len: n,
        file_len,
        tensors,
        index,
        metadata: raw.metadata,
    })
}

/// The top level: an object of tensors and `__metadata__`, no key twice.
struct HeaderSeed<'c> {
    current: &'c RefCell<Option<String>>,
}

impl<'de> DeserializeSeed<'de> for HeaderSeed<'_> {
    type Value = Raw;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<Raw, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for HeaderSeed<'_> {
    type Value = Raw;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object of tensors and \"__metadata__\"")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<Raw, A::Error> {
        let mut seen = HashSet::new();
        let mut metadata = None;
        let mut tensors = Vec::new();
        while let Some(key) = map.next_key::<String>()? {
            *self.current.borrow_mut() = (key != "__metadata__").then(|| key.clone());
            if !seen.insert(key.clone()) {
                return Err(de::Error::custom(format!("the key {key:?} appears twice")));
            }
            if key == "__metadata__" {
                metadata = map.next_value_seed(MetadataSeed {
                    field: "__metadata__",
                    values: Values::Strings,
                })?;
            } else {
                let info = map.next_value_seed(InfoSeed)?;
                tensors.push((key, info));
            }
            *self.current.borrow_mut() = None;
        }
        Ok(Raw {
            metadata: metadata.unwrap_or_default(),
            tensors,
        })
    }
}

/// A tensor's entry: `dtype`, `shape`, `data_offsets`, each once.
struct InfoSeed;

impl<'de> DeserializeSeed<'de> for InfoSeed {
    type Value = RawInfo;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<RawInfo, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for InfoSeed {
    type Value = RawInfo;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an object with \"dtype\", \"shape\" and \"data_offsets\"")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<RawInfo, A::Error> {
        let mut dtype = None;
        let mut shape = None;
        let mut offsets = None;
        let mut others = HashSet::new();
        while let Some(key) = map.next_key::<String>()? {
            // Name the field in errors about its value.
            fn field<E: de::Error>(name: &str) -> impl FnOnce(E) -> E + '_ {
                move |e| de::Error::custom(format!("{name:?}: {e}"))
            }
            let twice = match key.as_str() {
                "dtype" => dtype
                    .replace(map.next_value::<String>().map_err(field("dtype"))?)
                    .is_some(),
                "shape" => shape
                    .replace(map.next_value::<Vec<u64>>().map_err(field("shape"))?)
                    .is_some(),
                "data_offsets" => offsets
                    .replace(
                        map.next_value_seed(OffsetsSeed)
                            .map_err(field("data_offsets"))?,
                    )
                    .is_some(),
                _ => {
                    map.next_value::<IgnoredAny>()?;
                    !others.insert(key.clone())
                }
            };
            if twice {
                return Err(de::Error::custom(format!("the key {key:?} appears twice")));
            }
        }
        Ok(RawInfo {
            dtype: dtype.ok_or_else(|| de::Error::missing_field("dtype"))?,
            shape: shape.ok_or_else(|| de::Error::missing_field("shape"))?,
            offsets: offsets.ok_or_else(|| de::Error::missing_field("data_offsets"))?,
        })
    }
}

/// `data_offsets`: exactly two non-negative integers.
struct OffsetsSeed;

impl<'de> DeserializeSeed<'de> for OffsetsSeed {
    type Value = (u64, u64);
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> std::result::Result<(u64, u64), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for OffsetsSeed {
    type Value = (u64, u64);

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("\"data_offsets\" as [begin, end]")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> std::result::Result<(u64, u64), A::Error> {
        let begin = seq
            .next_element::<u64>()?
            .ok_or_else(|| de::Error::invalid_length(0, &self))?;
        let end = seq
            .next_element::<u64>()?
            .ok_or_else(|| de::Error::invalid_length(1, &self))?;
        if seq.next_element::<IgnoredAny>()?.is_some() {
            return Err(de::Error::invalid_length(3, &self));
        }
        Ok((begin, end))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    /// A file: the prefix, `json` padded with spaces to a multiple of 8, then `data` bytes.
    fn file(json: &str, data: usize) -> Vec<u8> {
        let mut j = json.as_bytes().to_vec();
        while j.len() % 8 != 0 {
            j.push(b' ');
        }
        let mut out = (j.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(&j);
        out.extend((0..data).map(|i| i as u8));
        out
    }

    fn parse(bytes: &[u8]) -> Result<Header> {
        Header::parse(bytes, bytes.len() as u64)
    }

    /// The error of parsing `json` with `data` bytes: a `Format` error, its tensor and text.
    fn refused(json: &str, data: usize) -> (Option<String>, String) {
        match parse(&file(json, data)) {
            Err(e @ Error::Format { .. }) => {
                let text = e.to_string();
                let Error::Format { tensor, .. } = e else {
                    unreachable!()
                };
                (tensor, text)
            }
            other => panic!("{json} with {data} bytes: expected Error::Format, got {other:?}"),
        }
    }

    fn assert_refused(json: &str, data: usize, tensor: Option<&str>, needles: &[&str]) {
        let (t, text) = refused(json, data);
        assert_eq!(t.as_deref(), tensor, "{json}: {text}");
        for n in needles {
            assert!(text.contains(n), "{json}: missing {n:?} in {text}");
        }
        assert!(text.contains("not a valid safetensors file"), "{text}");
    }

    #[test]
    fn a_valid_header_parses() {
        let json = r#"{"__metadata__":{"format":"pt","note":"x"},
            "b":{"dtype":"F32","shape":[2,3],"data_offsets":[8,32]},
            "a":{"dtype":"I64","shape":[1],"data_offsets":[0,8]},
            "e":{"dtype":"F16","shape":[0,5],"data_offsets":[32,32]},
            "s":{"dtype":"BF16","shape":[],"data_offsets":[32,34], "extra": {"ignored": [1, 2]}},
            "bits":{"dtype":"F4","shape":[3,2],"data_offsets":[34,37]}}"#;
        let bytes = file(json, 37);
        let h = parse(&bytes).unwrap();
        assert_eq!(h.len(), 5);
        let names: Vec<&str> = h.tensors().iter().map(|t| t.name()).collect();
        assert_eq!(names, ["a", "b", "e", "s", "bits"]);
        let b = h.get("b").unwrap();
        assert_eq!(
            (
                b.dtype(),
                b.shape(),
                b.data_offsets(),
                b.elements(),
                b.byte_len()
            ),
            (Dtype::F32, &[2, 3][..], 8..32, 6, 24)
        );
        assert_eq!(h.get("s").unwrap().shape(), &[] as &[usize]);
        assert_eq!(h.get("s").unwrap().elements(), 1);
        assert_eq!(h.get("e").unwrap().byte_len(), 0);
        assert!(h.get("nope").is_none());
        assert_eq!(h.metadata()["format"], "pt");
        assert_eq!(h.data_len(), 37);
        assert_eq!(h.data_start() + h.data_len(), bytes.len() as u64);
        assert_eq!(h.header_len() % 8, 0);
        assert_eq!(h.path(), "(in memory)");
        // More bytes than the header, less than the file: fine.
        assert_eq!(
            Header::parse(&bytes[..bytes.len() - 5], bytes.len() as u64).unwrap(),
            h
        );
    }

    #[test]
    fn empty_and_null_metadata() {
        let h = parse(&file("{}", 0)).unwrap();
        assert!(h.is_empty() && h.metadata().is_empty() && h.data_len() == 0);
        let h = parse(&file(r#" {"__metadata__": null} "#, 0)).unwrap();
        assert!(h.is_empty());
    }

    #[test]
    fn every_dtype_round_trips_its_name() {
        assert_eq!(Dtype::ALL.len(), 22);
        for &d in Dtype::ALL {
            assert_eq!(Dtype::from_name(d.name()), Some(d));
            assert_eq!(d.to_string(), d.name());
            match d.to_dlpack() {
                Some(dl) => assert_eq!(usize::from(dl.bits), d.bits()),
                None => assert!(d.bits() < 8),
            }
        }
        assert_eq!(Dtype::from_name("f32"), None);
        assert_eq!(Dtype::F8E4M3.to_dlpack().unwrap().code, 10);
        assert_eq!(Dtype::F8E5M2.to_dlpack().unwrap().code, 12);
        assert_eq!(Dtype::Bool.to_dlpack().unwrap().code, KDL_BOOL);
        assert_eq!(
            (Dtype::F64.align(), Dtype::C64.align(), Dtype::U8.align()),
            (8, 8, 1)
        );
        assert_eq!(Dtype::F4.align(), 1);
    }

    #[test]
    fn length_prefix_violations() {
        for short in [&[][..], &[1, 0, 0][..]] {
            let e = Header::parse(short, short.len() as u64).unwrap_err();
            assert!(e.to_string().contains("fewer than the 8"), "{e}");
        }
        // Above the limit.
        let mut b = (MAX_HEADER_BYTES + 1).to_le_bytes().to_vec();
        b.extend_from_slice(b"{}");
        let e = parse(&b).unwrap_err();
        assert!(e.to_string().contains("above the limit"), "{e}");
        // u64::MAX does not wrap.
        let mut b = u64::MAX.to_le_bytes().to_vec();
        b.extend_from_slice(b"{}");
        assert!(matches!(parse(&b), Err(Error::Format { .. })));
        // Longer than the file.
        let mut b = 100u64.to_le_bytes().to_vec();
        b.extend_from_slice(b"{}");
        let e = parse(&b).unwrap_err();
        assert!(
            e.to_string()
                .contains("does not fit in the file's 10 bytes"),
            "{e}"
        );
        // The file is long enough but not all of the header was given.
        let bytes = file("{}", 0);
        let e = Header::parse(&bytes[..9], 16).unwrap_err();
        assert!(e.to_string().contains("only 1 bytes"), "{e}");
    }

    #[test]
    fn json_violations() {
        assert_refused("[1, 2]", 0, None, &["a JSON object"]);
        assert_refused("\"x\"", 0, None, &["a JSON object"]);
        assert_refused("{", 0, None, &["not valid"]);
        assert_refused("{} {}", 0, None, &["trailing"]);
        assert_refused(r#"{"__metadata__": {"a": 1}}"#, 0, None, &["\"a\""]);
        assert_refused(r#"{"__metadata__": [1]}"#, 0, None, &["object of strings"]);
        let b = [&2u64.to_le_bytes()[..], &[0xff, 0xfe]].concat();
        let e = parse(&b).unwrap_err();
        assert!(e.to_string().contains("not UTF-8"), "{e}");
        // Deep nesting: skipped without recursion in an ignored field, an error (not a stack
        // overflow) elsewhere.
        let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        let ignored =
            format!(r#"{{"w": {{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":{deep}}}}}"#);
        assert!(parse(&file(&ignored, 1)).is_ok());
        for json in [
            format!(r#"{{"w": {{"dtype":"U8","shape":{deep},"data_offsets":[0,1]}}}}"#),
            format!(r#"{{"__metadata__": {deep}}}"#),
            format!(r#"{{"w": {deep}}}"#),
            deep.clone(),
        ] {
            match parse(&file(&json, 1)) {
                Err(Error::Format { .. }) => {}
                other => panic!("deep nesting: {:?}", other.map(|h| h.len())),
            }
        }
        // An entry that is not an object, or lacks a field.
        assert_refused(r#"{"w": 3}"#, 0, Some("w"), &["an object with"]);
        assert_refused(
            r#"{"w": {"dtype":"U8","shape":[1]}}"#,
            1,
            Some("w"),
            &["data_offsets"],
        );
        assert_refused(
            r#"{"w": {"dtype":"U8","data_offsets":[0,1]}}"#,
            1,
            Some("w"),
            &["shape"],
        );
        assert_refused(
            r#"{"w": {"shape":[1],"data_offsets":[0,1]}}"#,
            1,
            Some("w"),
            &["dtype"],
        );
        // Wrong kinds of numbers.
        for bad in ["[-1]", "[1.5]", "[18446744073709551616]", "\"2\""] {
            let json = format!(r#"{{"w": {{"dtype":"U8","shape":{bad},"data_offsets":[0,1]}}}}"#);
            assert_refused(&json, 1, Some("w"), &["not valid"]);
        }
        for bad in ["[0]", "[0,1,2]", "[0,-1]", "{}"] {
            let json = format!(r#"{{"w": {{"dtype":"U8","shape":[1],"data_offsets":{bad}}}}}"#);
            assert_refused(&json, 1, Some("w"), &["data_offsets"]);
        }
    }

    #[test]
    fn duplicate_keys_are_refused() {
        let t = r#"{"dtype":"U8","shape":[1],"data_offsets":[0,1]}"#;
        let u = r#"{"dtype":"U8","shape":[1],"data_offsets":[1,2]}"#;
        assert_refused(
            &format!(r#"{{"w": {t}, "w": {u}}}"#),
            2,
            Some("w"),
            &["\"w\" appears twice"],
        );
        assert_refused(
            r#"{"__metadata__": {}, "__metadata__": {}}"#,
            0,
            None,
            &["\"__metadata__\" appears twice"],
        );
        assert_refused(
            r#"{"__metadata__": {"k": "a", "k": "b"}}"#,
            0,
            None,
            &["\"k\" appears twice"],
        );
        for inner in [
            r#"{"dtype":"U8","dtype":"I8","shape":[1],"data_offsets":[0,1]}"#,
            r#"{"dtype":"U8","shape":[1],"shape":[1],"data_offsets":[0,1]}"#,
            r#"{"dtype":"U8","shape":[1],"data_offsets":[0,1],"data_offsets":[0,1]}"#,
            r#"{"dtype":"U8","x":1,"x":2,"shape":[1],"data_offsets":[0,1]}"#,
        ] {
            assert_refused(
                &format!(r#"{{"w": {inner}}}"#),
                1,
                Some("w"),
                &["appears twice"],
            );
        }
        // An escaped spelling of the same key is the same key.
        assert_refused(
            &format!(r#"{{"w": {t}, "\u0077": {u}}}"#),
            2,
            Some("w"),
            &["appears twice"],
        );
    }

    #[test]
    fn dtype_and_size_violations() {
        assert_refused(
            r#"{"w": {"dtype":"F7","shape":[1],"data_offsets":[0,1]}}"#,
            1,
            Some("w"),
            &["unknown dtype \"F7\"", "F8_E4M3"],
        );
        assert_refused(
            r#"{"w": {"dtype":"F32","shape":[2],"data_offsets":[0,4]}}"#,
            4,
            Some("w"),
            &["is 8 bytes", "span 4"],
        );
        assert_refused(
            r#"{"w": {"dtype":"F4","shape":[3],"data_offsets":[0,1]}}"#,
            1,
            Some("w"),
            &["12 bits, not whole bytes"],
        );
        // Products that overflow usize, in elements and in bits.
        let huge = u64::MAX / 2;
        assert_refused(
            &format!(r#"{{"w": {{"dtype":"U8","shape":[{huge},4],"data_offsets":[0,0]}}}}"#),
            0,
            Some("w"),
            &["overflows"],
        );
        assert_refused(
            &format!(r#"{{"w": {{"dtype":"F64","shape":[{huge}],"data_offsets":[0,0]}}}}"#),
            0,
            Some("w"),
            &["overflows"],
        );
        // A zero dimension makes an empty tensor however large the others.
        parse(&file(
            &format!(r#"{{"w": {{"dtype":"F64","shape":[{huge},0],"data_offsets":[0,0]}}}}"#),
            0,
        ))
        .unwrap();
    }

    #[test]
    fn offset_violations() {
        let t = |name: &str, b: u64, e: u64| {
            format!(
                r#""{name}":{{"dtype":"U8","shape":[{}],"data_offsets":[{b},{e}]}}"#,
                e.saturating_sub(b)
            )
        };
        // Reversed.
        assert_refused(
            r#"{"w": {"dtype":"U8","shape":[0],"data_offsets":[4,2]}}"#,
            4,
            Some("w"),
            &["end before they begin"],
        );
        // Overlap.
        assert_refused(
            &format!("{{{},{}}}", t("a", 0, 8), t("b", 4, 12)),
            12,
            Some("b"),
            &["overlap tensor \"a\""],
        );
        // Hole in the middle and at the start.
        assert_refused(
            &format!("{{{},{}}}", t("a", 0, 4), t("b", 6, 8)),
            8,
            Some("b"),
            &["hole", "bytes 4..6"],
        );
        assert_refused(
            &format!("{{{}}}", t("a", 2, 8)),
            8,
            Some("a"),
            &["start at 0"],
        );
        // Beyond the data region, and short of its end.
        assert_refused(
            &format!("{{{}}}", t("a", 0, 8)),
            6,
            Some("a"),
            &["beyond the data region's 6 bytes"],
        );
        assert_refused(
            &format!("{{{},{}}}", t("a", 0, 4), t("b", 4, 8)),
            9,
            Some("b"),
            &[
                "end at byte 8",
                "has 9 bytes",
                "1 bytes belong to no tensor",
            ],
        );
        assert_refused("{}", 3, None, &["has 3 bytes"]);
        // Empty tensors may sit anywhere between others (at one offset, listed by name); the
        // same range twice may not.
        let h = parse(&file(
            &format!(
                "{{{},{},{},{}}}",
                t("z", 4, 4),
                t("a", 0, 4),
                t("y", 4, 4),
                t("b", 4, 8)
            ),
            8,
        ))
        .unwrap();
        let names: Vec<&str> = h.tensors().iter().map(|t| t.name()).collect();
        assert_eq!(names, ["a", "y", "z", "b"]);
        assert_refused(
            &format!("{{{},{}}}", t("a", 0, 4), t("b", 0, 4)),
            4,
            Some("b"),
            &["overlap"],
        );
        // An empty tensor inside another one.
        assert_refused(
            &format!("{{{},{},{}}}", t("a", 0, 8), t("z", 4, 4), t("b", 8, 9)),
            9,
            Some("z"),
            &["overlap"],
        );
    }

    /// A random valid file: tensors of random dtypes and shapes, back to back.
    fn random_file(rng: &mut SmallRng) -> Vec<u8> {
        let n = rng.random_range(0..8);
        let mut entries = Vec::new();
        let mut at = 0usize;
        for i in 0..n {
            let d = Dtype::ALL[rng.random_range(0..Dtype::ALL.len())];
            let rank = rng.random_range(0..4);
            let mut shape: Vec<usize> = (0..rank).map(|_| rng.random_range(0..5)).collect();
            // Whole bytes for the sub-byte types.
            if d.bits() < 8 {
                shape.push(8);
            }
            let bytes = shape.iter().product::<usize>() * d.bits() / 8;
            entries.push(format!(
                r#""t{i}":{{"dtype":"{d}","shape":{shape:?},"data_offsets":[{at},{}]}}"#,
                at + bytes
            ));
            at += bytes;
        }
        if rng.random_bool(0.5) {
            entries.push(r#""__metadata__":{"format":"pt"}"#.into());
        }
        file(&format!("{{{}}}", entries.join(",")), at)
    }

    /// Random valid files parse; mutated ones (bytes changed, inserted, removed, the file cut or
    /// lengthened, JSON tokens spliced in) give `Ok` or an error, never a panic.
    #[test]
    fn mutated_headers_never_panic() {
        let seed = rand::random::<u64>();
        let mut rng = SmallRng::seed_from_u64(seed);
        let tokens: [&[u8]; 12] = [
            b"{",
            b"}",
            b"[",
            b"]",
            b",",
            b":",
            b"\"",
            b"-1",
            b"18446744073709551615",
            b"1e400",
            b"\"dtype\"",
            b"\"data_offsets\"",
        ];
        let (mut ok, mut refused) = (0, 0);
        for round in 0..20_000 {
            let mut b = random_file(&mut rng);
            if round % 10 == 0 {
                parse(&b).unwrap_or_else(|e| panic!("seed {seed}: a valid file refused: {e}"));
            }
            for _ in 0..rng.random_range(1..4) {
                let len = b.len();
                match rng.random_range(0..8) {
                    0 if len > 0 => {
                        let i = rng.random_range(0..len);
                        b[i] = rng.random();
                    }
                    1 => {
                        let i = rng.random_range(0..=len);
                        b.insert(i, rng.random());
                    }
                    2 if len > 0 => {
                        b.remove(rng.random_range(0..len));
                    }
                    3 => {
                        let i = rng.random_range(8.min(len)..=len);
                        let t = tokens[rng.random_range(0..tokens.len())];
                        drop(b.splice(i..i, t.iter().copied()));
                    }
                    4 => b.truncate(rng.random_range(0..=len)),
                    // Valid JSON, wrong numbers: a digit of the header changed.
                    5 => {
                        let digits: Vec<usize> = (8.min(len)..len)
                            .filter(|&i| b[i].is_ascii_digit())
                            .collect();
                        if !digits.is_empty() {
                            let i = digits[rng.random_range(0..digits.len())];
                            b[i] = b'0' + rng.random_range(0..10u8);
                        }
                    }
                    // Valid JSON, another dtype.
                    6 if len >= 8 => {
                        let key = b"\"dtype\":\"";
                        let at = b.windows(key.len()).position(|w| w == key);
                        if let Some(from) = at.map(|a| a + key.len()) {
                            if let Some(end) = b[from..].iter().position(|&c| c == b'"') {
                                let d = Dtype::ALL[rng.random_range(0..Dtype::ALL.len())];
                                drop(b.splice(from..from + end, d.name().bytes()));
                                // Keep the length prefix right where it can be.
                                let n = u64::from_le_bytes(b[..8].try_into().unwrap());
                                let new_n = n as i64 + d.name().len() as i64 - end as i64;
                                b[..8].copy_from_slice(&(new_n.max(0) as u64).to_le_bytes());
                            }
                        }
                    }
                    _ => {
                        // A header length anywhere, including huge.
                        if len >= 8 {
                            let v: u64 = if rng.random_bool(0.5) {
                                rng.random_range(0..len as u64 + 16)
                            } else {
                                rng.random()
                            };
                            b[..8].copy_from_slice(&v.to_le_bytes());
                        }
                    }
                }
            }
            // Sometimes claim a different file length than the bytes given.
            let file_len = if rng.random_bool(0.2) {
                rng.random_range(0..b.len() as u64 + 64)
            } else {
                b.len() as u64
            };
            match Header::parse(&b, file_len) {
                Ok(h) => {
                    ok += 1;
                    // Whatever parsed is consistent.
                    let mut at = 0;
                    for t in h.tensors() {
                        assert_eq!(t.data_offsets().start, at, "seed {seed}");
                        at = t.data_offsets().end;
                    }
                    assert_eq!(at as u64, h.data_len(), "seed {seed}");
                }
                Err(Error::Format { .. }) => refused += 1,
                Err(e) => panic!("seed {seed}: not a Format error: {e:?}"),
            }
        }
        println!("seed {seed}: {ok} mutated files parsed, {refused} refused");
        assert!(
            refused > 1000,
            "seed {seed}: the mutations hardly ever broke anything"
        );
    }
}
