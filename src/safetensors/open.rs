//! A safetensors file opened once: the path is looked up by one `open(2)` (which never blocks,
//! and is refused unless it gives a regular file), and everything after — the header, the
//! page-cache residency, the upload, the `O_DIRECT` read — goes through that descriptor (or a
//! re-open of it through `/proc/self/fd`, which names the same inode, never the path again).
//!
//! Before (issue 29, finding 9), `load` opened the path up to four times: a FIFO swapped in
//! between the checked open and `resident_fraction`'s plain `File::open` blocked the load for
//! ever, and a regular file swapped in was read with the first file's header.

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;

use crate::error::{Error, Result};
use crate::staging::FileSource;

/// Which file a descriptor is, and which version of it: `(st_dev, st_ino)` and the change time
/// `(st_ctime, st_ctime_nsec)`. A file deleted and made again often gets the same inode number
/// back at once; its change time differs (as it does for a file written since).
pub(crate) type Identity = (u64, u64, i64, i64);

/// `Error::Io` for the whole of `path` (no offset, no length).
pub(crate) fn io(op: &'static str, path: &str, message: impl Into<String>) -> Error {
    Error::Io {
        op,
        path: path.to_string(),
        offset: 0,
        len: 0,
        message: message.into(),
    }
}

/// Opens `path` read-only without blocking (`O_NONBLOCK`: a FIFO's open would wait for a writer),
/// refuses anything but a regular file (looked at with `fstat` on the descriptor, not on the
/// path), and clears `O_NONBLOCK` again. Returns the file, its length and its identity.
pub(crate) fn open_regular(op: &'static str, path: &Path) -> Result<(File, u64, Identity)> {
    let shown = path.display().to_string();
    let (file, meta) = crate::staging::open_without_blocking(path, 0, |meta| {
        if meta.file_type().is_file() {
            Ok(())
        } else {
            Err(format!(
                "not a regular file ({:?}): a FIFO, socket or device could block or never end",
                meta.file_type()
            ))
        }
    })
    .map_err(|e| io(op, &shown, e.message))?;
    Ok((
        file,
        meta.len(),
        (meta.dev(), meta.ino(), meta.ctime(), meta.ctime_nsec()),
    ))
}

/// A safetensors file opened once (see the module's documentation).
#[derive(Debug)]
pub(crate) struct Opened {
    /// The checked descriptor: residency (`mmap` + `mincore`) and re-opens go through it.
    file: File,
    /// The same inode, for the stager's reads (through the page cache).
    source: FileSource,
    /// The path as given, for messages.
    shown: String,
    len: u64,
    identity: Identity,
}

impl Opened {
    /// Opens `path` once (see [`open_regular`]).
    pub(crate) fn open(op: &'static str, path: &Path) -> Result<Opened> {
        let (file, len, identity) = open_regular(op, path)?;
        let shown = path.display().to_string();
        let source = Self::reopen(&file, &shown, false, || FileSource::open(path))?;
        if source.len() != len {
            return Err(io(
                op,
                &shown,
                format!(
                    "the file changed while it was opened: {len} bytes, then {}",
                    source.len()
                ),
            ));
        }
        Ok(Opened {
            file,
            source,
            shown,
            len,
            identity,
        })
    }

    /// A [`FileSource`] of `file`'s inode: opened through `/proc/self/fd/N` (the same inode, not
    /// the path again); where `/proc` is not mounted, `fallback` (the path, as before). Errors
    /// name `shown`, not the `/proc` path.
    fn reopen(
        file: &File,
        shown: &str,
        direct: bool,
        fallback: impl FnOnce() -> Result<FileSource>,
    ) -> Result<FileSource> {
        let proc = format!("/proc/self/fd/{}", file.as_raw_fd());
        if !Path::new("/proc/self/fd").is_dir() {
            return fallback();
        }
        let r = if direct {
            FileSource::open_direct(&proc)
        } else {
            FileSource::open(&proc)
        };
        r.map_err(|e| renamed(e, &proc, shown))
    }

    /// The stager's source (page cache).
    pub(crate) fn source(&self) -> &FileSource {
        &self.source
    }

    /// The checked descriptor.
    pub(crate) fn file(&self) -> &File {
        &self.file
    }

    /// The path as given.
    pub(crate) fn shown(&self) -> &str {
        &self.shown
    }

    /// The file's length at open.
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// `(st_dev, st_ino, st_ctime, st_ctime_nsec)` of the file.
    pub(crate) fn identity(&self) -> Identity {
        self.identity
    }

    /// The same inode with `O_DIRECT` (a new open file description: the flag must not change
    /// the page-cache reads). `path` is the fallback where `/proc` is not mounted.
    pub(crate) fn open_direct(&self, path: &Path) -> Result<FileSource> {
        Self::reopen(&self.file, &self.shown, true, || {
            FileSource::open_direct(path)
        })
    }

    /// Errors of the stager's reads name the path as given (not `/proc/self/fd/N`).
    pub(crate) fn rename(&self, e: Error, source: &FileSource) -> Error {
        renamed(e, source.path(), &self.shown)
    }
}

/// `e` with `from` (a `/proc/self/fd` path) replaced by `to` in its path.
pub(crate) fn renamed(e: Error, from: &str, to: &str) -> Error {
    match e {
        Error::Io {
            op,
            path,
            offset,
            len,
            message,
        } if path == from => Error::Io {
            op,
            path: to.to_string(),
            offset,
            len,
            message,
        },
        Error::Format {
            format,
            path,
            tensor,
            detail,
        } if path == from => Error::Format {
            format,
            path: to.to_string(),
            tensor,
            detail,
        },
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_path_lookup_and_errors_name_the_path() {
        let p = std::env::temp_dir().join(format!(
            "pinstream-opened-{}-{}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::write(&p, b"0123456789").unwrap();
        let o = Opened::open("t", &p).unwrap();
        // The path is gone (or replaced): the opened file still reads the first inode.
        std::fs::remove_file(&p).unwrap();
        std::fs::write(&p, b"another file, longer").unwrap();
        assert_eq!(o.len(), 10);
        assert_eq!(o.source().len(), 10);
        assert_eq!(o.shown(), p.display().to_string());
        let e = o.source().read_range("t", 5, 100).unwrap_err();
        let e = o.rename(e, o.source());
        assert!(
            matches!(&e, Error::Io { path, .. } if *path == p.display().to_string()),
            "{e:?}"
        );
        assert_ne!(
            o.identity(),
            open_regular("t", &p).unwrap().2,
            "a new file at the same path is another inode"
        );
        std::fs::remove_file(&p).unwrap();
        // A directory and a device are refused (without blocking).
        assert!(matches!(
            Opened::open("t", &std::env::temp_dir()),
            Err(Error::Io { .. })
        ));
        assert!(matches!(
            Opened::open("t", Path::new("/dev/zero")),
            Err(Error::Io { .. })
        ));
    }
}
