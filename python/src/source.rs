//! Host data given to `upload`: a C-contiguous buffer of a known element type (numpy arrays,
//! typed memoryviews, array.array: read through the buffer protocol with their type and
//! shape), anything with `__dlpack__` on the CPU (torch CPU tensors, pinned ones included), or
//! failing both, anything with the buffer protocol, as bytes.

use pinstream::dlpack::abi::{DLDataType, KDL_BOOL, KDL_COMPLEX, KDL_FLOAT, KDL_INT, KDL_UINT};
use pinstream::dlpack::Imported;
use pinstream::{HostKind, Stream};
use pyo3::buffer::PyUntypedBuffer;
use pyo3::prelude::*;
use pyo3::types::PyMemoryView;

use crate::capsule;
use crate::errors::{invalid, OrPy};

/// What the host memory is held by while it is read.
enum Held {
    Dlpack(Box<Imported>),
    Buffer(PyUntypedBuffer),
}

/// One host source: its memory (held), element type and shape.
pub(crate) struct Host {
    held: Held,
    pub(crate) dtype: DLDataType,
    pub(crate) shape: Vec<usize>,
}

pub(crate) const BYTE: DLDataType = DLDataType {
    code: KDL_UINT,
    bits: 8,
    lanes: 1,
};

/// The shape of an imported tensor, as sizes.
pub(crate) fn shape_of(op: &'static str, imp: &Imported) -> PyResult<Vec<usize>> {
    imp.shape()
        .iter()
        .map(|&n| usize::try_from(n).map_err(|_| invalid(op, format!("negative size {n}"))))
        .collect()
}

/// Takes hold of `x`'s host memory as bytes: through the buffer protocol where `x` has it (one
/// call, no capsule: the cheap path for many small arrays), else as [`host`] does. The dtype
/// and shape are then those of bytes.
pub(crate) fn host_bytes_first(op: &'static str, x: &Bound<'_, PyAny>) -> PyResult<Host> {
    if let Ok(buf) = PyUntypedBuffer::get(x) {
        if buf.is_c_contiguous() {
            return Ok(Host::bytes_of(buf));
        }
    }
    host(op, x)
}

/// The DLPack type of a buffer's struct-module format with native byte order (numpy's
/// exports: `<f4` or `f`, `e`, `B`, `?`, `Zd`, ...), checked against its item size; `None` for
/// anything else (big-endian, structured, pointers).
pub(crate) fn buffer_dtype(format: &[u8], item_size: usize) -> Option<DLDataType> {
    let f = match format {
        [b'<' | b'=' | b'@' | b'|', rest @ ..] => rest,
        f => f,
    };
    let (code, bits) = match f {
        b"b" => (KDL_INT, 8),
        b"B" => (KDL_UINT, 8),
        b"h" => (KDL_INT, 16),
        b"H" => (KDL_UINT, 16),
        b"i" => (KDL_INT, 32),
        b"I" => (KDL_UINT, 32),
        b"l" | b"q" => (KDL_INT, 64),
        b"L" | b"Q" => (KDL_UINT, 64),
        b"e" => (KDL_FLOAT, 16),
        b"f" => (KDL_FLOAT, 32),
        b"d" => (KDL_FLOAT, 64),
        b"?" => (KDL_BOOL, 8),
        b"Zf" => (KDL_COMPLEX, 64),
        b"Zd" => (KDL_COMPLEX, 128),
        _ => return None,
    };
    // `l` is 4 bytes on some platforms: the item size decides.
    let (code, bits) = match (f, item_size) {
        (b"l", 4) => (KDL_INT, 32),
        (b"L", 4) => (KDL_UINT, 32),
        _ => (code, bits),
    };
    (item_size * 8 == bits as usize).then_some(DLDataType {
        code,
        bits,
        lanes: 1,
    })
}

/// `x`'s buffer. Exporters that leave the strides out (ctypes arrays) are read through a
/// `memoryview` of them, which fills them in (and keeps `x` exported while it is held).
fn buffer_of(x: &Bound<'_, PyAny>) -> PyResult<PyUntypedBuffer> {
    PyUntypedBuffer::get(x).or_else(|e| {
        if x.is_instance_of::<PyMemoryView>() {
            return Err(e);
        }
        let mv = PyMemoryView::from(x).map_err(|_| e)?;
        PyUntypedBuffer::get(&mv)
    })
}

/// `x` through the buffer protocol with its element type and shape, where it exports a
/// C-contiguous buffer of a type [`buffer_dtype`] knows (numpy arrays, typed memoryviews,
/// bytes): one call, no capsule.
fn typed_buffer(x: &Bound<'_, PyAny>) -> Option<Host> {
    let buf = buffer_of(x).ok()?;
    if !buf.is_c_contiguous() {
        return None;
    }
    let dtype = buffer_dtype(buf.format().to_bytes(), buf.item_size())?;
    let shape = buf.shape().to_vec();
    Some(Host {
        held: Held::Buffer(buf),
        dtype,
        shape,
    })
}

/// Takes hold of `x`'s host memory: a typed C-contiguous buffer where `x` has one (the cheap
/// path), else its CPU DLPack export, else its bytes.
pub(crate) fn host(op: &'static str, x: &Bound<'_, PyAny>) -> PyResult<Host> {
    if let Some(h) = typed_buffer(x) {
        return Ok(h);
    }
    if x.hasattr("__dlpack__")? {
        if x.hasattr("__dlpack_device__")? {
            let (kind, _id): (i32, i32) = x.call_method0("__dlpack_device__")?.extract()?;
            if !matches!(kind, 1 | 3) {
                return Err(invalid(
                    op,
                    format!(
                        "the source is not in host memory (DLPack device type {kind}); \
                         upload takes CPU arrays"
                    ),
                ));
            }
        }
        let imp = capsule::import_for(op, x, None)?;
        let shape = shape_of(op, &imp)?;
        let dtype = imp.dtype();
        // Checked now, so that the error comes before anything is allocated.
        imp.host_bytes().py_err()?;
        return Ok(Host {
            held: Held::Dlpack(Box::new(imp)),
            dtype,
            shape,
        });
    }
    let buf = buffer_of(x).map_err(|_| {
        invalid(
            op,
            format!(
                "a {} has neither __dlpack__ nor the buffer protocol",
                x.get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_default()
            ),
        )
    })?;
    if !buf.is_c_contiguous() {
        return Err(invalid(op, "the buffer is not C-contiguous"));
    }
    Ok(Host::bytes_of(buf))
}

impl Host {
    /// A C-contiguous buffer as a one-dimensional byte source.
    fn bytes_of(buf: PyUntypedBuffer) -> Host {
        let len = buf.len_bytes();
        Host {
            held: Held::Buffer(buf),
            dtype: BYTE,
            shape: vec![len],
        }
    }

    /// The bytes, and whether they are page-locked. Called outside the GIL.
    pub(crate) fn bytes(&self) -> pinstream::Result<(&[u8], HostKind)> {
        match &self.held {
            Held::Dlpack(imp) => {
                let h = imp.host_bytes()?;
                let kind = h.kind();
                Ok((h.into_slice()?, kind))
            }
            Held::Buffer(b) => {
                let len = b.len_bytes();
                if len == 0 {
                    return Ok((&[], HostKind::Pageable));
                }
                // SAFETY: the buffer is exported (held by `self`) and C-contiguous (checked),
                // `len_bytes` long from `buf_ptr`; it is only read.
                let s = unsafe { std::slice::from_raw_parts(b.buf_ptr().cast::<u8>(), len) };
                Ok((s, HostKind::Pageable))
            }
        }
    }

    /// Copies the bytes into `dst` and returns when the source is free again: page-locked
    /// memory with one copy on `stream`, anything else through the staging engine.
    pub(crate) fn upload(
        &self,
        stager: &pinstream::Stager,
        stream: &Stream,
        dst: &mut pinstream::DeviceBuffer<u8>,
    ) -> pinstream::Result<()> {
        match &self.held {
            Held::Dlpack(imp) if imp.host_bytes()?.kind() == HostKind::Pinned => {
                let h = imp.host_bytes()?;
                stream.copy_h2d(&h, dst)?.wait().map(drop)
            }
            _ => stager.upload(stream, self.bytes()?.0, dst),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffer_formats_map_to_their_dlpack_types() {
        let t = |f: &str, size| buffer_dtype(f.as_bytes(), size).map(|d| (d.code, d.bits));
        assert_eq!(t("<f", 4), Some((KDL_FLOAT, 32)));
        assert_eq!(t("f", 4), Some((KDL_FLOAT, 32)));
        assert_eq!(t("=e", 2), Some((KDL_FLOAT, 16)));
        assert_eq!(t("B", 1), Some((KDL_UINT, 8)));
        assert_eq!(t("|b", 1), Some((KDL_INT, 8)));
        assert_eq!(t("?", 1), Some((KDL_BOOL, 8)));
        assert_eq!(t("<q", 8), Some((KDL_INT, 64)));
        assert_eq!(t("l", 8), Some((KDL_INT, 64)));
        assert_eq!(t("l", 4), Some((KDL_INT, 32)));
        assert_eq!(t("L", 4), Some((KDL_UINT, 32)));
        assert_eq!(t("Zd", 16), Some((KDL_COMPLEX, 128)));
        // Big-endian, a size that disagrees, structured, pointers, empty: not typed.
        assert_eq!(t(">f", 4), None);
        assert_eq!(t("!i", 4), None);
        assert_eq!(t("f", 8), None);
        assert_eq!(t("i", 8), None);
        assert_eq!(t("T{f:x:}", 4), None);
        assert_eq!(t("P", 8), None);
        assert_eq!(t("", 1), None);
        assert_eq!(t("2f", 8), None);
    }
}
