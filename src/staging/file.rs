//! `FileSource`: a file whose ranges the stager reads with `pread` straight into pinned slots.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::Path;

use super::engine::{Host, HostFile};
use crate::error::{Error, Result};

/// Why [`open_without_blocking`] failed: the message, and the OS error code where there is one.
pub(crate) struct OpenError {
    pub(crate) message: String,
    pub(crate) raw_os_error: Option<i32>,
}

/// Opens `path` read-only with `O_NONBLOCK` (and `flags`), so that opening a FIFO cannot wait
/// for a writer for ever, lets `check` refuse the file by its `fstat` (on the descriptor, not
/// the path), then clears `O_NONBLOCK` again. The one place the crate opens a file it did not
/// create: `FileSource` and safetensors use it.
pub(crate) fn open_without_blocking(
    path: &Path,
    flags: i32,
    check: impl FnOnce(&std::fs::Metadata) -> std::result::Result<(), String>,
) -> std::result::Result<(File, std::fs::Metadata), OpenError> {
    let os = |e: std::io::Error| OpenError {
        message: e.to_string(),
        raw_os_error: e.raw_os_error(),
    };
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | flags)
        .open(path)
        .map_err(os)?;
    let meta = file.metadata().map_err(os)?;
    check(&meta).map_err(|message| OpenError {
        message,
        raw_os_error: None,
    })?;
    let fd = file.as_raw_fd();
    // SAFETY: `fd` is the open descriptor `file` owns; F_GETFL / F_SETFL only read and set its
    // status flags.
    let cleared = unsafe {
        let f = libc::fcntl(fd, libc::F_GETFL);
        f >= 0 && libc::fcntl(fd, libc::F_SETFL, f & !libc::O_NONBLOCK) == 0
    };
    if !cleared {
        return Err(OpenError {
            message: format!("fcntl: {}", std::io::Error::last_os_error()),
            raw_os_error: None,
        });
    }
    Ok((file, meta))
}

/// Block size that `O_DIRECT` offsets and lengths are aligned to.
pub(crate) const DIRECT_ALIGN: u64 = 4096;

/// An open file for [`Stager::upload_file`](super::Stager::upload_file), remembering its path
/// for error messages.
#[derive(Debug)]
pub struct FileSource {
    file: File,
    path: String,
    len: u64,
    direct: bool,
}

impl FileSource {
    /// Opens `path` for reading through the page cache.
    pub fn open(path: impl AsRef<Path>) -> Result<FileSource> {
        Self::open_with(path.as_ref(), false)
    }

    /// Opens `path` with `O_DIRECT`: reads bypass the page cache (for cold data read once).
    /// Offsets given to `upload_file` must then be multiples of 4096. Filesystems without
    /// `O_DIRECT` (tmpfs, for one) give an [`Error::Io`].
    pub fn open_direct(path: impl AsRef<Path>) -> Result<FileSource> {
        Self::open_with(path.as_ref(), true)
    }

    fn open_with(path: &Path, direct: bool) -> Result<FileSource> {
        const OP: &str = "FileSource::open";
        let shown = path.display().to_string();
        let io = |message: String| Error::Io {
            op: OP,
            path: shown.clone(),
            offset: 0,
            len: 0,
            message,
        };
        let (file, meta) =
            open_without_blocking(path, if direct { libc::O_DIRECT } else { 0 }, |meta| {
                use std::os::unix::fs::FileTypeExt;
                let kind = meta.file_type();
                if kind.is_fifo() || kind.is_socket() {
                    Err(
                        "a FIFO or socket, not a file (its reads could wait for a writer for ever)"
                            .into(),
                    )
                } else {
                    Ok(())
                }
            })
            .map_err(|e| {
                if direct && e.raw_os_error == Some(libc::EINVAL) {
                    io(format!(
                        "the filesystem does not support O_DIRECT ({})",
                        e.message
                    ))
                } else {
                    io(e.message)
                }
            })?;
        let len = meta.len();
        Ok(FileSource {
            file,
            path: shown,
            len,
            direct,
        })
    }

    /// The file's size when it was opened.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the file was empty when it was opened.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The path it was opened with.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Whether it reads with `O_DIRECT`.
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// Refuses a range outside the file (as it was at open), or misaligned for `O_DIRECT`.
    pub(crate) fn check_range(&self, op: &'static str, offset: u64, bytes: usize) -> Result<()> {
        if self.direct && offset % DIRECT_ALIGN != 0 {
            return Err(Error::invalid(
                op,
                format!(
                    "{}: offset {offset} is not a multiple of {DIRECT_ALIGN}, which O_DIRECT needs",
                    self.path
                ),
            ));
        }
        let end = offset.checked_add(bytes as u64);
        if end.is_none_or(|e| e > self.len) {
            return Err(Error::Io {
                op,
                path: self.path.clone(),
                offset,
                len: bytes,
                message: format!("the file has only {} bytes", self.len),
            });
        }
        Ok(())
    }

    /// Reads `len` bytes from `offset` into a new vector, through the page cache or (for an
    /// `O_DIRECT` file) whole blocks into a block-aligned buffer. For checking and debugging:
    /// uploads read ranges straight into the stager's slots instead. Refuses what
    /// [`check_range`](Self::check_range) refuses; a failed or short read is an [`Error::Io`];
    /// a length the host cannot allocate is an [`Error::InvalidArgument`].
    pub(crate) fn read_range(&self, op: &'static str, offset: u64, len: usize) -> Result<Vec<u8>> {
        self.check_range(op, offset, len)?;
        let io = |at: u64, message: String| Error::Io {
            op,
            path: self.path.clone(),
            offset: at,
            len,
            message,
        };
        // The range is inside the file, but the file may be huge (a sparse file of a TiB): a
        // length beyond the machine's memory is refused, and the buffer comes from a fallible
        // allocation, so a size the host cannot give is an error (`Error::InvalidArgument`, as
        // for every host allocation), not an abort.
        if let Some(total) = crate::memory::pool::physical_memory() {
            if len > total {
                return Err(Error::invalid(
                    op,
                    format!(
                        "{}: {len} bytes at offset {offset} are more than the machine's {total} \
                         bytes of memory",
                        self.path
                    ),
                ));
            }
        }
        if !self.direct {
            let mut out = crate::error::try_vec::<u8>(op, len)?;
            out.resize(len, 0);
            self.file
                .read_exact_at(&mut out, offset)
                .map_err(|e| io(offset, e.to_string()))?;
            return Ok(out);
        }
        // O_DIRECT wants the buffer, the offset (checked above) and the length in whole blocks.
        let align = DIRECT_ALIGN as usize;
        let span = len
            .checked_next_multiple_of(align)
            .ok_or_else(|| io(offset, "the length overflows".into()))?;
        let total = span
            .checked_add(align)
            .ok_or_else(|| io(offset, "the length overflows".into()))?;
        let mut buf = crate::error::try_vec::<u8>(op, total)?;
        buf.resize(total, 0);
        let skip = buf.as_ptr().align_offset(align);
        if skip >= align {
            return Err(io(offset, "no block-aligned buffer".into()));
        }
        let mut done = 0usize;
        while done < len {
            let at = offset + done as u64;
            match self.file.read_at(&mut buf[skip + done..skip + span], at) {
                Ok(0) => return Err(io(at, format!("the file ends at byte {at}"))),
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(io(at, e.to_string())),
            }
        }
        buf.copy_within(skip..skip + len, 0);
        buf.truncate(len);
        Ok(buf)
    }

    pub(crate) fn host(&self) -> Host {
        Host::Files(vec![self.host_file()])
    }

    /// This file as one of a job's files.
    pub(crate) fn host_file(&self) -> HostFile {
        HostFile {
            fd: self.file.as_raw_fd(),
            path: self.path.clone(),
            direct: self.direct,
        }
    }
}
