//! Which images a training feed reads, and their labels: a folder per class in torchvision's
//! `ImageFolder` convention, or an explicit list of paths and labels.
//!
//! ```no_run
//! use pinstream_vision::dataset::ImageList;
//! let train = ImageList::folder("/data/imagenet/train")?; // train/<class>/<image>.jpg
//! println!("{} images of {} classes", train.len(), train.classes().len());
//! # Ok::<(), pinstream::Error>(())
//! ```

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use pinstream::{Error, Result};

/// File name endings taken as images (case-insensitive): the formats the loaders decode.
pub const EXTENSIONS: &[&str] = &["jpg", "jpeg", "png"];

/// Image paths and their class indices.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ImageList {
    classes: Vec<String>,
    num_classes: usize,
    items: Vec<(PathBuf, usize)>,
}

/// `Error::Io` for `path` as a whole (no offset or length).
pub(crate) fn io(op: &'static str, path: &Path, e: impl std::fmt::Display) -> Error {
    Error::Io {
        op,
        path: path.display().to_string(),
        offset: 0,
        len: 0,
        message: e.to_string(),
    }
}

fn is_image(p: &Path) -> bool {
    p.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| EXTENSIONS.iter().any(|x| e.eq_ignore_ascii_case(x)))
}

/// The most directories nested below a class directory that [`ImageList::folder`] walks into;
/// a deeper tree is refused (`Error::InvalidArgument`), as no image dataset nests so deep.
pub const MAX_DEPTH: usize = 256;

/// A directory opened for the walk (closed on drop).
struct Dir(std::os::fd::OwnedFd);

/// What a walk asked of the kernel: `path_bytes` counts the bytes of every path handed to a
/// system call, which is what the kernel's path lookups cost. The walk opens each directory
/// relative to its parent's descriptor by its name alone, so this grows with the number of
/// entries, not with their depth times it (as canonicalizing and `stat`-ing full paths did:
/// depth^2 bytes per directory, depth^3 for a chain, issue 29 finding 11).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct WalkCost {
    /// Directories opened.
    pub(crate) dirs: usize,
    /// Bytes of the paths handed to the kernel.
    pub(crate) path_bytes: usize,
}

fn c_name(name: &std::ffi::OsStr) -> std::io::Result<std::ffi::CString> {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::CString::new(name.as_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))
}

impl Dir {
    /// Opens the directory `name` (a whole path for the class directory, else one name)
    /// relative to `parent` (the working directory where `None`), following links; anything
    /// but a directory is refused by `O_DIRECTORY` without being waited on.
    fn open(
        parent: Option<&Dir>,
        name: &std::ffi::OsStr,
        cost: &mut WalkCost,
    ) -> std::io::Result<Dir> {
        use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
        let c = c_name(name)?;
        cost.dirs += 1;
        cost.path_bytes += c.as_bytes().len();
        let at = parent.map_or(libc::AT_FDCWD, |p| p.0.as_raw_fd());
        // SAFETY: `at` is AT_FDCWD or a descriptor `parent` owns, open for the call; `c` is a
        // NUL-terminated name that outlives it.
        let fd = unsafe {
            libc::openat(
                at,
                c.as_ptr(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC | libc::O_NONBLOCK,
            )
        };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` was just opened here and is owned by nothing else.
        Ok(Dir(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// `(st_dev, st_ino)` of the directory.
    fn identity(&self) -> std::io::Result<(u64, u64)> {
        use std::os::fd::AsRawFd;
        // SAFETY: an all-zero `stat` is a valid value of the plain C struct.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: the descriptor is open (owned by `self`); `st` is writable for the call.
        if unsafe { libc::fstat(self.0.as_raw_fd(), &mut st) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok((st.st_dev, st.st_ino))
    }

    /// The names in the directory (not `.` and `..`).
    fn names(&self) -> std::io::Result<Vec<std::ffi::OsString>> {
        use std::os::fd::AsRawFd;
        use std::os::unix::ffi::OsStrExt;
        // A duplicate for `fdopendir`, which takes its descriptor over (closed by `closedir`).
        // SAFETY: F_DUPFD_CLOEXEC on a descriptor `self` owns makes a new one.
        let dup = unsafe { libc::fcntl(self.0.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 0) };
        if dup < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `dup` is an open directory descriptor owned by nothing else; on success the
        // stream owns it.
        let dir = unsafe { libc::fdopendir(dup) };
        if dir.is_null() {
            let e = std::io::Error::last_os_error();
            // SAFETY: `fdopendir` failed, so `dup` is still ours to close.
            unsafe { libc::close(dup) };
            return Err(e);
        }
        struct Stream(*mut libc::DIR);
        impl Drop for Stream {
            fn drop(&mut self) {
                // SAFETY: the stream was opened by `fdopendir` above and is closed only here.
                unsafe { libc::closedir(self.0) };
            }
        }
        let stream = Stream(dir);
        // The duplicate shares the offset with `self`: start from the first entry.
        // SAFETY: `stream.0` is an open directory stream.
        unsafe { libc::rewinddir(stream.0) };
        let mut out = Vec::new();
        loop {
            // readdir reports an error only through errno: clear it first.
            // SAFETY: errno is this thread's; writing it is what the C API expects.
            unsafe { *libc::__errno_location() = 0 };
            // SAFETY: `stream.0` is an open directory stream, used by this thread only.
            let ent = unsafe { libc::readdir(stream.0) };
            if ent.is_null() {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error().is_some_and(|c| c != 0) {
                    return Err(e);
                }
                break;
            }
            // SAFETY: `ent` points to the entry `readdir` returned, valid until the next call
            // on the stream; `d_name` is NUL-terminated. The name is copied out at once.
            let name = unsafe { std::ffi::CStr::from_ptr((*ent).d_name.as_ptr()) };
            let b = name.to_bytes();
            if b != b"." && b != b".." {
                out.push(std::ffi::OsStr::from_bytes(b).to_os_string());
            }
        }
        Ok(out)
    }

    /// `stat` of `name` in the directory, following links (`None` where that fails: a dangling
    /// link, a name removed since).
    fn stat(&self, name: &std::ffi::OsStr, cost: &mut WalkCost) -> Option<libc::stat> {
        use std::os::fd::AsRawFd;
        let c = c_name(name).ok()?;
        cost.path_bytes += c.as_bytes().len();
        // SAFETY: an all-zero `stat` is a valid value of the plain C struct.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: the descriptor is open (owned by `self`); `c` is NUL-terminated; `st` is
        // writable for the call.
        let rc = unsafe { libc::fstatat(self.0.as_raw_fd(), c.as_ptr(), &mut st, 0) };
        (rc == 0).then_some(st)
    }
}

/// Every image file under `dir` (opened already, at `path`, `depth` directories below its class
/// directory), sorted within each directory as `os.walk` + `sorted` would visit them; symbolic
/// links followed, each directory visited once (by device and inode: a link cycle ends). The
/// work is linear in the entries: every directory is opened by its name relative to its
/// parent's descriptor.
fn walk(
    dir: &Dir,
    path: &Path,
    depth: usize,
    seen: &mut HashSet<(u64, u64)>,
    out: &mut Vec<PathBuf>,
    cost: &mut WalkCost,
) -> Result<()> {
    const OP: &str = "dataset::ImageList::folder";
    if !seen.insert(dir.identity().map_err(|e| io(OP, path, e))?) {
        return Ok(());
    }
    let mut files = Vec::new();
    let mut dirs = Vec::new();
    for name in dir.names().map_err(|e| io(OP, path, e))? {
        // Follows links: a link to a directory is a directory.
        match dir.stat(&name, cost) {
            Some(st) if st.st_mode & libc::S_IFMT == libc::S_IFDIR => dirs.push(name),
            Some(st)
                if st.st_mode & libc::S_IFMT == libc::S_IFREG && is_image(Path::new(&name)) =>
            {
                files.push(name)
            }
            _ => {} // other files, dangling links, sockets: not images
        }
    }
    files.sort();
    dirs.sort();
    out.extend(files.into_iter().map(|f| path.join(f)));
    for d in dirs {
        let sub = path.join(&d);
        if depth >= MAX_DEPTH {
            return Err(Error::invalid(
                OP,
                format!(
                    "{}: directories nested more than {MAX_DEPTH} deep below the class \
                     directory (dataset::MAX_DEPTH)",
                    sub.display()
                ),
            ));
        }
        let child = Dir::open(Some(dir), &d, cost).map_err(|e| io(OP, &sub, e))?;
        walk(&child, &sub, depth + 1, seen, out, cost)?;
    }
    Ok(())
}

/// The images of one class directory, and what the walk cost.
fn walk_class(class_dir: &Path) -> Result<(Vec<PathBuf>, WalkCost)> {
    const OP: &str = "dataset::ImageList::folder";
    let mut cost = WalkCost::default();
    let dir =
        Dir::open(None, class_dir.as_os_str(), &mut cost).map_err(|e| io(OP, class_dir, e))?;
    let mut files = Vec::new();
    walk(
        &dir,
        class_dir,
        0,
        &mut HashSet::new(),
        &mut files,
        &mut cost,
    )?;
    Ok((files, cost))
}

impl ImageList {
    /// torchvision's `ImageFolder(root)`: each directory of `root` is a class (sorted by name,
    /// labelled 0, 1, ...), and every `.jpg` / `.jpeg` / `.png` below it (up to [`MAX_DEPTH`]
    /// directories deep, sorted) an image of it. `Error::Io` when `root` cannot be read or has
    /// no class directory, `Error::InvalidArgument` when a class holds no image (as torchvision
    /// refuses) or directories nested deeper than [`MAX_DEPTH`]. The walk is linear in the
    /// number of entries, however deep they lie.
    pub fn folder(root: impl AsRef<Path>) -> Result<ImageList> {
        const OP: &str = "dataset::ImageList::folder";
        let root = root.as_ref();
        let mut classes = Vec::new();
        for entry in std::fs::read_dir(root).map_err(|e| io(OP, root, e))? {
            let entry = entry.map_err(|e| io(OP, root, e))?;
            let path = entry.path();
            if std::fs::metadata(&path).is_ok_and(|m| m.is_dir()) {
                let name = entry
                    .file_name()
                    .to_str()
                    .map(str::to_owned)
                    .ok_or_else(|| io(OP, &path, "the class directory's name is not UTF-8"))?;
                classes.push(name);
            }
        }
        if classes.is_empty() {
            return Err(io(OP, root, "no class directories"));
        }
        classes.sort();
        let mut items = Vec::new();
        for (label, class) in classes.iter().enumerate() {
            let (files, _) = walk_class(&root.join(class))?;
            if files.is_empty() {
                return Err(Error::invalid(
                    OP,
                    format!(
                        "class {class:?} of {} holds no image ({})",
                        root.display(),
                        EXTENSIONS.join(", ")
                    ),
                ));
            }
            items.extend(files.into_iter().map(|p| (p, label)));
        }
        Ok(ImageList {
            num_classes: classes.len(),
            classes,
            items,
        })
    }

    /// An explicit list of `(path, label)` (the classes have no names). Nothing is read here:
    /// a missing or undecodable file is reported when it is loaded. `Error::InvalidArgument`
    /// for a label of `usize::MAX` (no class count holds it).
    pub fn from_pairs(items: Vec<(PathBuf, usize)>) -> Result<ImageList> {
        let num_classes = match items.iter().map(|&(_, l)| l).max() {
            None => 0,
            Some(l) => l.checked_add(1).ok_or_else(|| {
                Error::invalid("dataset::ImageList::from_pairs", format!("label {l}"))
            })?,
        };
        Ok(ImageList {
            classes: Vec::new(),
            num_classes,
            items,
        })
    }

    /// Class names (a label indexes them) of a folder; empty for a list of pairs.
    pub fn classes(&self) -> &[String] {
        &self.classes
    }

    /// Number of classes: the folder's, or the largest label + 1.
    pub fn num_classes(&self) -> usize {
        self.num_classes
    }

    /// Every `(path, label)`, in order.
    pub fn items(&self) -> &[(PathBuf, usize)] {
        &self.items
    }

    /// Number of images.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Whether it holds no image.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "pinstream-dataset-{name}-{}-{:x}",
            std::process::id(),
            crate::augment::Rng::new(std::process::id() as u64, 0).next_u64()
        ));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn touch(p: &Path) {
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, b"x").unwrap();
    }

    #[test]
    fn folder_follows_image_folder() {
        let root = tmp("folder");
        for f in [
            "dog/b.JPG",
            "dog/a.png",
            "dog/sub/c.jpeg",
            "dog/notes.txt",
            "cat/z.jpg",
            "ant/x.png",
        ] {
            touch(&root.join(f));
        }
        std::fs::write(root.join("README.txt"), b"not a class").unwrap();
        let l = ImageList::folder(&root).unwrap();
        assert_eq!(l.classes(), ["ant", "cat", "dog"]);
        let got: Vec<(String, usize)> = l
            .items()
            .iter()
            .map(|(p, c)| (p.strip_prefix(&root).unwrap().display().to_string(), *c))
            .collect();
        assert_eq!(
            got,
            [
                ("ant/x.png".to_string(), 0),
                ("cat/z.jpg".to_string(), 1),
                ("dog/a.png".to_string(), 2),
                ("dog/b.JPG".to_string(), 2),
                ("dog/sub/c.jpeg".to_string(), 2),
            ]
        );
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn bad_folders_are_typed_errors() {
        let root = tmp("bad");
        assert!(matches!(
            ImageList::folder(&root),
            Err(Error::Io { .. }) // no class directories
        ));
        assert!(matches!(
            ImageList::folder(root.join("missing")),
            Err(Error::Io { .. })
        ));
        touch(&root.join("a/x.jpg"));
        std::fs::create_dir_all(root.join("b")).unwrap();
        touch(&root.join("b/readme.txt"));
        assert!(matches!(
            ImageList::folder(&root),
            Err(Error::InvalidArgument { .. }) // class b holds no image
        ));
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[cfg(unix)]
    #[test]
    fn link_cycles_end() {
        let root = tmp("cycle");
        touch(&root.join("a/x.jpg"));
        std::os::unix::fs::symlink(root.join("a"), root.join("a/loop")).unwrap();
        let l = ImageList::folder(&root).unwrap();
        assert_eq!(l.len(), 1);
        std::fs::remove_dir_all(&root).unwrap();
    }

    /// Issue 29, finding 11: the walk's kernel work is linear in the entries however deep they
    /// lie. A chain of `MAX_DEPTH` nested directories costs the kernel a few bytes of path per
    /// directory (each opened by its one-byte name relative to its parent), where
    /// canonicalizing and `stat`-ing full paths cost about depth^2 / 2 bytes per level.
    #[test]
    fn a_deep_chain_costs_linear_work() {
        let root = tmp("chain");
        let mut deep = root.join("a");
        for _ in 0..MAX_DEPTH {
            deep.push("d");
        }
        touch(&deep.join("x.jpg"));
        touch(&root.join("a/y.png"));
        let class = root.join("a");
        let (files, cost) = walk_class(&class).unwrap();
        assert_eq!(files, [class.join("y.png"), deep.join("x.jpg")]);
        assert_eq!(cost.dirs, MAX_DEPTH + 1);
        // The class directory's path once, then per directory its name (open + stat) and per
        // file its name.
        let linear = class.as_os_str().len() + 2 * MAX_DEPTH + 2 * "x.jpg".len();
        assert!(
            cost.path_bytes <= linear,
            "{} path bytes for a chain of {MAX_DEPTH} (linear: {linear})",
            cost.path_bytes
        );
        // One level more is refused, naming the path.
        touch(&deep.join("d/z.jpg"));
        let e = ImageList::folder(&root).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn explicit_pairs_count_classes_by_label() {
        let l = ImageList::from_pairs(vec![("a.jpg".into(), 2), ("b.jpg".into(), 0)]).unwrap();
        assert_eq!((l.num_classes(), l.len()), (3, 2));
        assert!(l.classes().is_empty());
        assert!(ImageList::from_pairs(Vec::new()).unwrap().is_empty());
        assert!(ImageList::from_pairs(vec![("a.jpg".into(), usize::MAX)]).is_err());
    }
}
