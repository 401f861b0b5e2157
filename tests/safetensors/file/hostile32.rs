//! Hostile review of issue 32's sharded checkpoints (branch wt32h): `Checkpoint::open` of
//! indexes and folders a hostile or careless writer makes. CPU only (everything here is decided
//! before the device is touched); the loads are attacked from Python
//! (python/tests/test_hostile32.py).
//!
//! Run: `cargo test -p pinstream --features safetensors --test safetensors -- file/hostile32`.

use std::path::{Path, PathBuf};

use crate::common::{ensure, trial, within, R};
use libtest_mimic::Trial;
use pinstream::safetensors::Checkpoint;
use pinstream::Error;

/// Prefix of this module's trial names (its path in the binary).
const PREFIX: &str = "file/hostile32/";

const BOUND: std::time::Duration = std::time::Duration::from_secs(120);

/// The trials of this module, named `file/hostile32/cpu/...`.
pub fn trials() -> Vec<Trial> {
    let cpu = |name: &str, f: fn() -> R| {
        let name = format!("cpu/{name}");
        let what = name.clone();
        trial(PREFIX, name, move || within(&what, BOUND, f))
    };
    vec![
        cpu(
            "one_shard_spelled_two_ways_is_one_shard",
            one_shard_spelled_two_ways,
        ),
        cpu("thousands_of_tiny_shards_no_fd_leak", thousands_of_shards),
        cpu("link_loops_and_links_to_one_file", link_loops_and_aliases),
    ]
}

/// A fresh folder, removed on drop.
struct Folder(PathBuf);

impl Folder {
    fn new(what: &str) -> Folder {
        let p = std::env::temp_dir().join(format!(
            ".pinstream-hostile32-{what}-{}-{}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::create_dir_all(&p).expect("make the test folder");
        Folder(p)
    }
}

impl Drop for Folder {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A safetensors file of U8 tensors `(name, bytes)`.
fn small_file(path: &Path, tensors: &[(&str, usize)]) {
    let mut at = 0;
    let mut entries = Vec::new();
    for (t, n) in tensors {
        entries.push(format!(
            r#""{t}":{{"dtype":"U8","shape":[{n}],"data_offsets":[{at},{}]}}"#,
            at + n
        ));
        at += n;
    }
    let mut json = format!("{{{}}}", entries.join(",")).into_bytes();
    while json.len() % 8 != 0 {
        json.push(b' ');
    }
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&json);
    bytes.extend((0..at).map(|i| (i * 7 + 3) as u8));
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d).expect("make the shard's folder");
    }
    std::fs::write(path, bytes).expect("write a small file");
}

fn index(path: &Path, entries: &[(String, String)]) {
    let map: Vec<String> = entries
        .iter()
        .map(|(t, s)| format!("{t:?}: {s:?}"))
        .collect();
    std::fs::write(path, format!(r#"{{"weight_map": {{{}}}}}"#, map.join(", ")))
        .expect("write an index");
}

fn pairs(p: &[(&str, &str)]) -> Vec<(String, String)> {
    p.iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect()
}

/// An index that names one shard as `a.safetensors` for some tensors and `./a.safetensors`
/// (or `sub//b.safetensors` and `sub/./b.safetensors`) for others: one file, opened once, every
/// tensor loaded, as transformers takes it. (It was refused, first with a message that the
/// tensor was elsewhere, then naming both spellings.)
fn one_shard_spelled_two_ways() -> R {
    let d = Folder::new("spell");
    small_file(&d.0.join("a.safetensors"), &[("x", 4), ("y", 3)]);
    small_file(&d.0.join("sub/b.safetensors"), &[("z", 2), ("w", 5)]);
    let idx = d.0.join("model.safetensors.index.json");
    for (map, one, other) in [
        (
            [
                ("x", "a.safetensors"),
                ("y", "./a.safetensors"),
                ("z", "sub/b.safetensors"),
                ("w", "sub/b.safetensors"),
            ],
            "a.safetensors",
            "./a.safetensors",
        ),
        (
            [
                ("x", "a.safetensors"),
                ("y", "a.safetensors"),
                ("z", "sub//b.safetensors"),
                ("w", "sub/./b.safetensors"),
            ],
            "sub//b.safetensors",
            "sub/./b.safetensors",
        ),
    ] {
        index(&idx, &pairs(&map));
        let c = Checkpoint::open(&idx).map_err(|e| format!("{one:?} and {other:?}: {e}"))?;
        ensure(c.len() == 4 && c.shards().len() == 2, || {
            format!(
                "{one:?} and {other:?}: {} tensors in {} shards",
                c.len(),
                c.shards().len()
            )
        })?;
    }
    Ok(())
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
}

/// 3000 one-tensor shards, through an index and as a folder without one: opened (one
/// descriptor each while the checkpoint lives), every descriptor closed when it is dropped,
/// and a refused checkpoint (one shard missing at the end) leaks none either.
fn thousands_of_shards() -> R {
    const N: usize = 3000;
    let d = Folder::new("many");
    let mut entries = Vec::new();
    for k in 0..N {
        let name = format!("s{k:05}.safetensors");
        small_file(&d.0.join(&name), &[(&format!("t{k}"), 1 + k % 5)]);
        entries.push((format!("t{k}"), name));
    }
    // Without the index first: every *.safetensors.
    let before = open_fds();
    {
        let c = Checkpoint::open(&d.0).map_err(|e| e.to_string())?;
        ensure(c.shards().len() == N && c.len() == N, || {
            format!("{} shards", c.shards().len())
        })?;
    }
    ensure(open_fds() == before, || {
        format!("{} descriptors before, {} after", before, open_fds())
    })?;
    let idx = d.0.join("model.safetensors.index.json");
    index(&idx, &entries);
    {
        let c = Checkpoint::open(&d.0).map_err(|e| e.to_string())?;
        ensure(c.shards().len() == N && c.len() == N, || {
            format!("{} shards", c.shards().len())
        })?;
    }
    entries.push(("ghost".into(), "missing.safetensors".into()));
    index(&idx, &entries);
    match Checkpoint::open(&idx) {
        Err(Error::Io { path, .. }) if path.ends_with("missing.safetensors") => {}
        other => return Err(format!("a missing shard: {:?}", other.map(|c| c.len())).into()),
    }
    ensure(open_fds() == before, || {
        format!("{} descriptors before, {} after", before, open_fds())
    })
}

/// A shard that is a link loop is an `Io` error naming it (in a folder and through an index);
/// two names for one file through a link are refused (each tensor is in one shard only), never
/// loaded twice.
fn link_loops_and_aliases() -> R {
    use std::os::unix::fs::symlink;
    let d = Folder::new("links");
    small_file(&d.0.join("a.safetensors"), &[("x", 4)]);
    symlink("loop2.safetensors", d.0.join("loop1.safetensors"))?;
    symlink("loop1.safetensors", d.0.join("loop2.safetensors"))?;
    match Checkpoint::open(&d.0) {
        Err(Error::Io { path, .. }) if path.contains("loop") => {}
        other => {
            return Err(format!("a link loop in a folder: {:?}", other.map(|c| c.len())).into())
        }
    }
    let idx = d.0.join("model.safetensors.index.json");
    index(
        &idx,
        &pairs(&[("x", "a.safetensors"), ("y", "loop1.safetensors")]),
    );
    match Checkpoint::open(&idx) {
        Err(Error::Io { path, .. }) if path.contains("loop1") => {}
        other => return Err(format!("a link loop by index: {:?}", other.map(|c| c.len())).into()),
    }
    std::fs::remove_file(d.0.join("loop1.safetensors"))?;
    std::fs::remove_file(d.0.join("loop2.safetensors"))?;
    symlink("a.safetensors", d.0.join("b.safetensors"))?;
    // Folder without index: x in a and in b (the same file): refused as a tensor in two shards.
    std::fs::remove_file(&idx)?;
    match Checkpoint::open(&d.0) {
        Err(Error::Format { .. }) => {}
        other => {
            return Err(format!("one file under two names: {:?}", other.map(|c| c.len())).into())
        }
    }
    Ok(())
}
