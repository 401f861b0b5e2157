//! Which images a training feed reads, and their labels: a folder per class in torchvision's
//! `ImageFolder` convention, or an explicit list of paths and labels.
//!
//! ```no_run
//! use pinstream::dataset::ImageList;
//! let train = ImageList::folder("/data/imagenet/train")?; // train/<class>/<image>.jpg
//! println!("{} images of {} classes", train.len(), train.classes().len());
//! # Ok::<(), pinstream::Error>(())
//! ```

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

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

/// Every image file under `dir`, sorted within each directory as `os.walk` + `sorted` would
/// visit them; symbolic links followed, each directory visited once (a link cycle ends).
fn walk(dir: &Path, seen: &mut HashSet<PathBuf>, out: &mut Vec<PathBuf>) -> Result<()> {
    const OP: &str = "dataset::ImageList::folder";
    let real = std::fs::canonicalize(dir).map_err(|e| io(OP, dir, e))?;
    if !seen.insert(real) {
        return Ok(());
    }
    let mut files = Vec::new();
    let mut dirs = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| io(OP, dir, e))? {
        let entry = entry.map_err(|e| io(OP, dir, e))?;
        let path = entry.path();
        // Follows links: a link to a directory is a directory.
        match std::fs::metadata(&path) {
            Ok(m) if m.is_dir() => dirs.push(path),
            Ok(m) if m.is_file() && is_image(&path) => files.push(path),
            _ => {} // other files, dangling links, sockets: not images
        }
    }
    files.sort();
    dirs.sort();
    out.extend(files);
    for d in dirs {
        walk(&d, seen, out)?;
    }
    Ok(())
}

impl ImageList {
    /// torchvision's `ImageFolder(root)`: each directory of `root` is a class (sorted by name,
    /// labelled 0, 1, ...), and every `.jpg` / `.jpeg` / `.png` below it (any depth, sorted) an
    /// image of it. `Error::Io` when `root` cannot be read or has no class directory,
    /// `Error::InvalidArgument` when a class holds no image (as torchvision refuses).
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
            let mut files = Vec::new();
            walk(&root.join(class), &mut HashSet::new(), &mut files)?;
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

    #[test]
    fn explicit_pairs_count_classes_by_label() {
        let l = ImageList::from_pairs(vec![("a.jpg".into(), 2), ("b.jpg".into(), 0)]).unwrap();
        assert_eq!((l.num_classes(), l.len()), (3, 2));
        assert!(l.classes().is_empty());
        assert!(ImageList::from_pairs(Vec::new()).unwrap().is_empty());
        assert!(ImageList::from_pairs(vec![("a.jpg".into(), usize::MAX)]).is_err());
    }
}
