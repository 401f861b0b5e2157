//! Sharded checkpoints (issue 32): a folder of `model-0000k-of-0000n.safetensors` with or
//! without its `model.safetensors.index.json`, resolved and checked by `Checkpoint::open` and
//! loaded into one arena by `load_checkpoint`.
//!
//! CPU (run everywhere): the resolution rules (a file, an index, a folder with one index, with
//! several, without), and every way an index or a folder of shards can be wrong, each a typed
//! error naming the file and the tensor, found before any device is asked for. GPU (ignored
//! without one): random model-like shards loaded through the index, the folder and the folder
//! without its index in each `Direct` mode, every tensor byte for byte and through typed
//! views, the shards' places in the arena, DLPack export, tied names, and a shard cut after it
//! was checked.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::common::{ensure, trial, within, R};
use libtest_mimic::Trial;
use pinstream::safetensors::{
    self, Checkpoint, CheckpointKind, Direct, Dtype, Header, LoadOptions, Weights, MAX_INDEX_BYTES,
};
use pinstream::{bf16, f16, Device, Error, Stager, Stream};
use rand::rngs::SmallRng;
use rand::Rng;

use super::{byte_len, model_specs, seeded, stager, typed, write_file, Spec, Written};
use crate::common;

/// Prefix of this module's trial names (its path in the binary).
const PREFIX: &str = "file/sharded/";

const BOUND: std::time::Duration = std::time::Duration::from_secs(60);

/// The trials of this module, named `file/sharded/...`.
pub fn trials() -> Vec<Trial> {
    let no_gpu = !pinstream::available();
    let cpu = |name: &str, f: fn() -> R| {
        let name = format!("cpu/{name}");
        let what = name.clone();
        trial(PREFIX, name, move || within(&what, BOUND, f))
    };
    let mut trials = vec![
        cpu("resolution_rules", resolution_rules),
        cpu(
            "index_names_every_tensor_once",
            index_names_every_tensor_once,
        ),
        cpu("missing_shard_is_io", missing_shard_is_io),
        cpu(
            "shard_names_stay_in_the_folder",
            shard_names_stay_in_the_folder,
        ),
        cpu("index_json_violations", index_json_violations),
        cpu("huge_index_refused_unread", huge_index_refused_unread),
        cpu("folder_without_index", folder_without_index),
        cpu("special_files_do_not_block", special_files_do_not_block),
        cpu(
            "an_index_read_as_safetensors_says_so",
            index_read_as_safetensors,
        ),
    ];
    let mut gpu = |name: &str, f: fn() -> R| {
        trials.push(trial(PREFIX, format!("load/{name}"), f).with_ignored_flag(no_gpu));
    };
    gpu(
        "byte_identical_each_way_and_mode",
        byte_identical_each_way_and_mode,
    );
    gpu("one_file_as_a_checkpoint", one_file_as_a_checkpoint);
    gpu("tied_weights_keep_the_index_names", tied_names);
    gpu("into_dlpack_points_into_each_shard", into_dlpack_shards);
    gpu("shard_cut_after_open_is_io", shard_cut_after_open);
    trials
}

// ----- writing checkpoints ----------------------------------------------------------------------

/// A fresh folder under the temporary folder (or `base`), removed with its contents on drop.
struct Folder(PathBuf);

impl Folder {
    fn new(base: &Path, what: &str) -> Folder {
        let p = base.join(format!(
            ".pinstream-sharded-{what}-{}-{}",
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

/// A checkpoint written as `save_pretrained` does: shards named `model-0000k-of-0000n`, their
/// files, and (where asked) the index.
struct Sharded {
    folder: Folder,
    shards: Vec<Written>,
    index: Option<PathBuf>,
}

impl Sharded {
    /// Every tensor: its shard's index, and (name, dtype, shape, byte range in the shard's
    /// region).
    fn tensors(&self) -> impl Iterator<Item = (usize, &WrittenTensor)> {
        self.shards
            .iter()
            .enumerate()
            .flat_map(|(i, s)| s.tensors.iter().map(move |t| (i, t)))
    }
}

/// A tensor as `Written` lists it: name, dtype, shape, byte range in the data region.
type WrittenTensor = (String, Dtype, Vec<usize>, std::ops::Range<usize>);

fn shard_name(k: usize, n: usize) -> String {
    format!("model-{:05}-of-{:05}.safetensors", k + 1, n)
}

/// Writes `groups` (one list of tensors per shard) into a new folder under `base`, with an
/// index where `with_index`.
fn write_sharded(
    base: &Path,
    groups: Vec<Vec<Spec>>,
    with_index: bool,
    rng: &mut SmallRng,
    seed: u64,
) -> Sharded {
    let folder = Folder::new(base, "ckpt");
    let n = groups.len();
    let mut shards = Vec::new();
    let mut map = Vec::new();
    for (k, specs) in groups.into_iter().enumerate() {
        let mut w = write_file(base, specs, true, rng, seed);
        let to = folder.0.join(shard_name(k, n));
        std::fs::rename(&w.path, &to).expect("move the shard");
        w.path = to;
        for t in &w.tensors {
            map.push(format!("{:?}: {:?}", t.0, shard_name(k, n)));
        }
        shards.push(w);
    }
    let index = with_index.then(|| {
        let total: usize = shards.iter().map(|s| s.data().len()).sum();
        let p = folder.0.join("model.safetensors.index.json");
        let json = format!(
            "{{\n  \"metadata\": {{\"total_size\": {total}, \"format\": \"pt\"}},\n  \
             \"weight_map\": {{\n    {}\n  }}\n}}\n",
            map.join(",\n    ")
        );
        std::fs::write(&p, json).expect("write the index");
        p
    });
    Sharded {
        folder,
        shards,
        index,
    }
}

/// A small file of `tensors` (U8, F32 ...) with a data region of their sizes, in `dir/name`.
fn small_file(dir: &Path, name: &str, tensors: &[(&str, Dtype, usize)]) -> PathBuf {
    let mut at = 0;
    let mut entries = Vec::new();
    for (t, d, n) in tensors {
        let bytes = n * d.bits() / 8;
        entries.push(format!(
            r#""{t}":{{"dtype":"{d}","shape":[{n}],"data_offsets":[{at},{}]}}"#,
            at + bytes
        ));
        at += bytes;
    }
    let mut json = format!("{{{}}}", entries.join(",")).into_bytes();
    while json.len() % 8 != 0 {
        json.push(b' ');
    }
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&json);
    bytes.extend((0..at).map(|i| (i * 5 + 1) as u8));
    let p = dir.join(name);
    std::fs::write(&p, bytes).expect("write a small file");
    p
}

/// An index of `entries` (tensor, shard) at `dir/name`.
fn small_index(dir: &Path, name: &str, entries: &[(&str, &str)]) -> PathBuf {
    let map: Vec<String> = entries
        .iter()
        .map(|(t, s)| format!("{t:?}: {s:?}"))
        .collect();
    let p = dir.join(name);
    std::fs::write(
        &p,
        format!(
            r#"{{"metadata": {{"total_size": 1}}, "weight_map": {{{}}}}}"#,
            map.join(", ")
        ),
    )
    .expect("write an index");
    p
}

/// `Checkpoint::open(path)` must be a `Format` error of `format`, naming `file` (a suffix of
/// its path) and `tensor`, its message holding each of `needles`.
fn format_error(
    what: &str,
    path: &Path,
    format: &str,
    file: &Path,
    tensor: Option<&str>,
    needles: &[&str],
) -> R {
    match Checkpoint::open(path) {
        Err(e @ Error::Format { .. }) => {
            let text = e.to_string();
            let Error::Format {
                format: f,
                path: p,
                tensor: t,
                ..
            } = &e
            else {
                unreachable!()
            };
            ensure(
                *f == format
                    && Path::new(p) == file
                    && t.as_deref() == tensor
                    && needles.iter().all(|n| text.contains(n)),
                || {
                    format!(
                        "{what}: want {format} at {} tensor {tensor:?} with {needles:?}, got \
                         {f} at {p} tensor {t:?}: {text}",
                        file.display()
                    )
                },
            )
        }
        other => Err(format!(
            "{what}: want a Format error, got {:?}",
            other.map(|c| c.len())
        )
        .into()),
    }
}

// ----- CPU trials -------------------------------------------------------------------------------

/// A file, an index, a folder with its index (stray shards beside it ignored), a folder
/// without one (every *.safetensors, sorted), a folder with two indexes, an empty folder.
fn resolution_rules() -> R {
    let d = Folder::new(&std::env::temp_dir(), "resolve");
    let a = small_file(
        &d.0,
        "model-00001-of-00002.safetensors",
        &[("x", Dtype::U8, 3), ("y", Dtype::F32, 2)],
    );
    small_file(
        &d.0,
        "model-00002-of-00002.safetensors",
        &[("z", Dtype::I64, 1)],
    );
    // Not named by the index: ignored where the index is used.
    small_file(&d.0, "consolidated.safetensors", &[("x", Dtype::U8, 3)]);
    std::fs::write(d.0.join("config.json"), "{}")?;
    let idx = small_index(
        &d.0,
        "model.safetensors.index.json",
        &[
            ("z", "model-00002-of-00002.safetensors"),
            ("x", "model-00001-of-00002.safetensors"),
            ("y", "model-00001-of-00002.safetensors"),
        ],
    );
    // One file.
    let c = Checkpoint::open(&a)?;
    ensure(
        c.kind() == CheckpointKind::File && c.shards().len() == 1 && c.index_path().is_none(),
        || format!("a file: {c:?}"),
    )?;
    let names: Vec<&str> = c.names().collect();
    ensure(names == ["x", "y"], || format!("{names:?}"))?;
    // The index, and the folder through it.
    for (path, kind) in [
        (&idx, CheckpointKind::Index),
        (&d.0, CheckpointKind::Directory),
    ] {
        let c = Checkpoint::open(path)?;
        let names: Vec<&str> = c.names().collect();
        let shards: Vec<&str> = c.shards().iter().map(Header::path).collect();
        ensure(
            c.kind() == kind
                && c.index_path() == Some(idx.as_path())
                && names == ["x", "y", "z"]
                && shards.len() == 2
                && shards[0].ends_with("model-00001-of-00002.safetensors")
                && shards[1].ends_with("model-00002-of-00002.safetensors")
                && c.index_metadata().get("total_size").map(String::as_str) == Some("1")
                && c.data_len() == 3 + 8 + 8
                && c.shard_of("z").is_some_and(|h| h.path() == shards[1])
                && c.get("y").is_some_and(|t| t.dtype() == Dtype::F32),
            || format!("{}: {kind:?}: {names:?} {shards:?} {c:?}", path.display()),
        )?;
    }
    // Without the index: every *.safetensors, sorted, and then "x" is in two of them.
    std::fs::remove_file(&idx)?;
    format_error(
        "a folder whose shards share a name",
        &d.0,
        "safetensors checkpoint",
        &d.0.join("model-00001-of-00002.safetensors"),
        Some("x"),
        &["consolidated.safetensors", "one shard only"],
    )?;
    std::fs::remove_file(d.0.join("consolidated.safetensors"))?;
    let c = Checkpoint::open(&d.0)?;
    let names: Vec<&str> = c.names().collect();
    ensure(
        c.kind() == CheckpointKind::Directory
            && c.index_path().is_none()
            && names == ["x", "y", "z"],
        || format!("a folder without index: {names:?}"),
    )?;
    // Two indexes: refused, naming both.
    small_index(
        &d.0,
        "a.safetensors.index.json",
        &[("x", "model-00001-of-00002.safetensors")],
    );
    small_index(
        &d.0,
        "b.safetensors.index.json",
        &[("z", "model-00002-of-00002.safetensors")],
    );
    format_error(
        "two indexes",
        &d.0,
        "safetensors checkpoint",
        &d.0,
        None,
        &["a.safetensors.index.json", "b.safetensors.index.json"],
    )?;
    // An empty folder, and one of other files only.
    let e = Folder::new(&std::env::temp_dir(), "empty");
    format_error(
        "an empty folder",
        &e.0,
        "safetensors checkpoint",
        &e.0,
        None,
        &["no *.safetensors"],
    )?;
    std::fs::write(e.0.join("pytorch_model.bin"), b"x")?;
    format_error(
        "no safetensors",
        &e.0,
        "safetensors checkpoint",
        &e.0,
        None,
        &["no *.safetensors"],
    )?;
    // A path that is not there.
    match Checkpoint::open(e.0.join("nothing")) {
        Err(Error::Io { path, .. }) if path.ends_with("nothing") => Ok(()),
        other => Err(format!("a missing path: {:?}", other.map(|c| c.len())).into()),
    }
}

/// Every tensor the index names is found once, in the shard it names; every tensor of a shard
/// is named there. Each violation names the file and the tensor.
fn index_names_every_tensor_once() -> R {
    let d = Folder::new(&std::env::temp_dir(), "names");
    let (s1, s2) = ("s1.safetensors", "s2.safetensors");
    let p1 = small_file(&d.0, s1, &[("a", Dtype::U8, 4), ("b", Dtype::U8, 4)]);
    let p2 = small_file(&d.0, s2, &[("c", Dtype::U8, 4), ("a", Dtype::U8, 4)]);
    let idx = |entries: &[(&str, &str)]| small_index(&d.0, "i.safetensors.index.json", entries);
    // A tensor of a shard that the index does not name.
    let p = idx(&[("a", s1), ("b", s1), ("c", s2)]);
    format_error(
        "a tensor in two shards (the index names the first)",
        &p,
        "safetensors checkpoint",
        &p2,
        Some("a"),
        &["puts this tensor in \"s1.safetensors\""],
    )?;
    let p = idx(&[("a", s2), ("b", s1), ("c", s2)]);
    format_error(
        "a tensor in two shards (the index names the second)",
        &p,
        "safetensors checkpoint",
        &p1,
        Some("a"),
        &["puts this tensor in \"s2.safetensors\""],
    )?;
    let only1 = small_file(
        &d.0,
        "t1.safetensors",
        &[("a", Dtype::U8, 4), ("extra", Dtype::F32, 1)],
    );
    let p = small_index(&d.0, "j.safetensors.index.json", &[("a", "t1.safetensors")]);
    format_error(
        "a tensor the index does not name",
        &p,
        "safetensors checkpoint",
        &only1,
        Some("extra"),
        &["does not name this tensor"],
    )?;
    // A tensor the index puts in a shard that does not hold it.
    let p = small_index(
        &d.0,
        "k.safetensors.index.json",
        &[
            ("a", "t1.safetensors"),
            ("extra", "t1.safetensors"),
            ("ghost", "t1.safetensors"),
        ],
    );
    format_error(
        "a tensor the shard lacks",
        &p,
        "safetensors index",
        &p,
        Some("ghost"),
        &["holds no tensor of that name", "t1.safetensors"],
    )?;
    // The same file under two spellings is one shard, read once (as the Hugging Face loaders
    // take it): both its tensors, one shard.
    let p = small_index(
        &d.0,
        "l.safetensors.index.json",
        &[("a", "t1.safetensors"), ("extra", "./t1.safetensors")],
    );
    let c = Checkpoint::open(&p)?;
    ensure(c.len() == 2 && c.shards().len() == 1, || {
        format!(
            "two spellings of one shard: {} tensors in {} shards",
            c.len(),
            c.shards().len()
        )
    })?;
    // And the good index of these two shards.
    std::fs::remove_file(&p2)?;
    small_file(&d.0, s2, &[("c", Dtype::U8, 4)]);
    let c = Checkpoint::open(idx(&[("a", s1), ("b", s1), ("c", s2)]))?;
    ensure(c.len() == 3, || format!("{} tensors", c.len()))
}

/// A shard the index names that is not there: `Error::Io` naming the shard, the index and a
/// tensor of it.
fn missing_shard_is_io() -> R {
    let d = Folder::new(&std::env::temp_dir(), "missing");
    small_file(&d.0, "s1.safetensors", &[("a", Dtype::U8, 4)]);
    let p = small_index(
        &d.0,
        "model.safetensors.index.json",
        &[("a", "s1.safetensors"), ("b", "s2.safetensors")],
    );
    for path in [&p, &d.0] {
        match Checkpoint::open(path) {
            Err(Error::Io {
                path: at, message, ..
            }) => ensure(
                at.ends_with("s2.safetensors")
                    && message.contains("model.safetensors.index.json")
                    && message.contains("\"b\""),
                || format!("{at}: {message}"),
            )?,
            other => return Err(format!("a missing shard: {:?}", other.map(|c| c.len())).into()),
        }
    }
    Ok(())
}

/// Shard names that leave the index's folder by their words (`..`, an absolute path) are
/// refused even where the file is there and valid; a symbolic link inside the folder to a file
/// outside it is followed (the Hugging Face cache's layout).
fn shard_names_stay_in_the_folder() -> R {
    let outer = Folder::new(&std::env::temp_dir(), "outer");
    let inner = outer.0.join("snap");
    std::fs::create_dir(&inner)?;
    let blob = small_file(&outer.0, "blob", &[("w", Dtype::F32, 2)]);
    small_file(&outer.0, "x.safetensors", &[("w", Dtype::F32, 2)]);
    for (shard, why) in [
        ("../x.safetensors", "climbs out"),
        (blob.to_str().ok_or("path")?, "absolute"),
        ("", "empty"),
    ] {
        let p = small_index(&inner, "model.safetensors.index.json", &[("w", shard)]);
        format_error(shard, &p, "safetensors index", &p, Some("w"), &[why])?;
    }
    // A link to the blob, named as a shard.
    std::os::unix::fs::symlink("../blob", inner.join("model.safetensors"))?;
    let p = small_index(
        &inner,
        "model.safetensors.index.json",
        &[("w", "model.safetensors")],
    );
    let c = Checkpoint::open(&p)?;
    ensure(c.len() == 1 && c.get("w").is_some(), || format!("{c:?}"))?;
    // And the folder through its index.
    let c = Checkpoint::open(&inner)?;
    ensure(
        c.kind() == CheckpointKind::Directory && c.len() == 1,
        || format!("{c:?}"),
    )
}

/// Non-string values, duplicate keys, a missing or empty weight map, JSON that is not JSON:
/// `Error::Format` of the index, naming the tensor where one is at fault.
fn index_json_violations() -> R {
    let d = Folder::new(&std::env::temp_dir(), "json");
    small_file(
        &d.0,
        "s.safetensors",
        &[("w", Dtype::U8, 1), ("v", Dtype::U8, 1)],
    );
    let p = d.0.join("model.safetensors.index.json");
    let cases: [(&str, Option<&str>, &str); 9] = [
        (
            r#"{"weight_map": {"w": 3, "v": "s.safetensors"}}"#,
            Some("w"),
            "must be a file name",
        ),
        (
            r#"{"weight_map": {"w": null, "v": "s.safetensors"}}"#,
            Some("w"),
            "must be a file name",
        ),
        (
            r#"{"weight_map": {"w": "s.safetensors", "v": "s.safetensors", "w": "s.safetensors"}}"#,
            Some("w"),
            "appears twice",
        ),
        (
            r#"{"weight_map": {"w": "s.safetensors"}, "weight_map": {"v": "s.safetensors"}}"#,
            None,
            "\"weight_map\" appears twice",
        ),
        (
            r#"{"metadata": {"total_size": 1, "total_size": 2}, "weight_map": {"w": "s.safetensors", "v": "s.safetensors"}}"#,
            None,
            "appears twice",
        ),
        (r#"{"metadata": {}}"#, None, "no \"weight_map\""),
        (r#"{"weight_map": {}}"#, None, "names no tensor"),
        (r#"{"weight_map": ["s.safetensors"]}"#, None, "not valid"),
        ("not json at all", None, "not valid"),
    ];
    for (json, tensor, needle) in cases {
        std::fs::write(&p, json)?;
        for path in [&p, &d.0] {
            format_error(json, path, "safetensors index", &p, tensor, &[needle])?;
        }
    }
    Ok(())
}

/// An index above `MAX_INDEX_BYTES` (a sparse file) is refused by its size, unread.
fn huge_index_refused_unread() -> R {
    let d = Folder::new(&std::env::temp_dir(), "huge");
    let p = d.0.join("model.safetensors.index.json");
    let f = std::fs::File::create(&p)?;
    f.set_len(MAX_INDEX_BYTES + 1)?;
    drop(f);
    format_error(
        "a huge index",
        &p,
        "safetensors index",
        &p,
        None,
        &["above the limit"],
    )
}

/// Without an index: every `*.safetensors` in name order; a bad shard is the shard's error; a
/// name in two shards is refused.
fn folder_without_index() -> R {
    let d = Folder::new(&std::env::temp_dir(), "noindex");
    small_file(&d.0, "b.safetensors", &[("b1", Dtype::U8, 1)]);
    small_file(
        &d.0,
        "a.safetensors",
        &[("a1", Dtype::U8, 1), ("a2", Dtype::F32, 1)],
    );
    small_file(&d.0, "c.safetensors", &[]);
    let c = Checkpoint::open(&d.0)?;
    let names: Vec<&str> = c.names().collect();
    ensure(names == ["a1", "a2", "b1"] && c.shards().len() == 3, || {
        format!("{names:?}")
    })?;
    // A shard with a bad header: the shard's Format error.
    let bad = d.0.join("d.safetensors");
    let mut b = 30u64.to_le_bytes().to_vec();
    b.extend_from_slice(br#"{"q":{"dtype":"Q8","shape":[1],"data_offsets":[0,1]}}"#);
    std::fs::write(&bad, &b)?;
    match Checkpoint::open(&d.0) {
        Err(Error::Format { path, .. }) if path.ends_with("d.safetensors") => {}
        other => return Err(format!("a bad shard: {:?}", other.map(|c| c.len())).into()),
    }
    std::fs::remove_file(&bad)?;
    small_file(&d.0, "d.safetensors", &[("b1", Dtype::U8, 1)]);
    format_error(
        "a name in two shards",
        &d.0,
        "safetensors checkpoint",
        &d.0.join("d.safetensors"),
        Some("b1"),
        &["b.safetensors"],
    )
}

/// A FIFO named as a shard, as the index, or among a folder's shards: refused (`Error::Io`)
/// without waiting for a writer; a folder named like an index is read as a folder.
fn special_files_do_not_block() -> R {
    let d = Folder::new(&std::env::temp_dir(), "fifo");
    let fifo = |p: &Path| -> R {
        let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes())?;
        // SAFETY: a valid NUL-terminated path.
        let rc = unsafe { libc::mkfifo(c.as_ptr(), 0o600) };
        ensure(rc == 0, || {
            format!("mkfifo: {}", std::io::Error::last_os_error())
        })
    };
    small_file(&d.0, "a.safetensors", &[("a", Dtype::U8, 1)]);
    fifo(&d.0.join("b.safetensors"))?;
    match Checkpoint::open(&d.0) {
        Err(Error::Io { path, .. }) if path.ends_with("b.safetensors") => {}
        other => {
            return Err(format!("a FIFO among the shards: {:?}", other.map(|c| c.len())).into())
        }
    }
    let idx = d.0.join("model.safetensors.index.json");
    fifo(&idx)?;
    match Checkpoint::open(&idx) {
        Err(Error::Io { .. }) => {}
        other => return Err(format!("a FIFO as the index: {:?}", other.map(|c| c.len())).into()),
    }
    std::fs::remove_file(&idx)?;
    let p = small_index(
        &d.0,
        "model.safetensors.index.json",
        &[("a", "a.safetensors"), ("b", "b.safetensors")],
    );
    match Checkpoint::open(&p) {
        Err(Error::Io { path, .. }) if path.ends_with("b.safetensors") => {}
        other => {
            return Err(format!("a FIFO named by the index: {:?}", other.map(|c| c.len())).into())
        }
    }
    // Folders named like an index or a shard: a folder is read as one, and one inside a
    // checkpoint's folder is not taken for its index or a shard.
    let parent = Folder::new(&std::env::temp_dir(), "dirs");
    let dir = parent.0.join("x.safetensors.index.json");
    std::fs::create_dir(&dir)?;
    small_file(&dir, "a.safetensors", &[("a", Dtype::U8, 1)]);
    std::fs::create_dir(dir.join("y.safetensors.index.json"))?;
    std::fs::create_dir(dir.join("z.safetensors"))?;
    let c = Checkpoint::open(&dir)?;
    ensure(
        c.kind() == CheckpointKind::Directory && c.shards().len() == 1 && c.index_path().is_none(),
        || format!("{c:?}"),
    )
}

/// `Header::read` (and `load`) of an index: the error says it looks like JSON.
fn index_read_as_safetensors() -> R {
    let d = Folder::new(&std::env::temp_dir(), "asjson");
    let p = small_index(
        &d.0,
        "model.safetensors.index.json",
        &[("a", "a.safetensors")],
    );
    match Header::read(&p) {
        Err(e @ Error::Format { .. }) => {
            ensure(e.to_string().contains("looks like JSON"), || e.to_string())
        }
        other => Err(format!("an index as safetensors: {:?}", other.map(|h| h.len())).into()),
    }
}

// ----- GPU trials -------------------------------------------------------------------------------

/// Splits `specs` into `n` shards (a spread of sizes, each shard at least one tensor).
fn split(specs: Vec<Spec>, n: usize, rng: &mut SmallRng) -> Vec<Vec<Spec>> {
    let mut groups: Vec<Vec<Spec>> = (0..n).map(|_| Vec::new()).collect();
    for (i, s) in specs.into_iter().enumerate() {
        let k = if i < n { i } else { rng.random_range(0..n) };
        groups[k].push(s);
    }
    groups
}

/// Everything about a loaded checkpoint against its files: names (shard by shard), each
/// shard's place (256-aligned, apart) and region, every tensor's bytes and typed view, read on
/// `reader`.
fn check_sharded(w: &Weights, ck: &Sharded, stager: &Stager, reader: &Stream) -> R {
    let seed = ck.shards.first().map_or(0, |s| s.seed);
    let want: Vec<&str> = ck.tensors().map(|(_, t)| t.0.as_str()).collect();
    let names: Vec<&str> = w.names().collect();
    ensure(names == want, || format!("names {names:?}, want {want:?}"))?;
    ensure(w.shards().len() == ck.shards.len(), || {
        format!("{} shards, want {}", w.shards().len(), ck.shards.len())
    })?;
    let mut end = 0;
    for (i, (s, f)) in w.shards().iter().zip(&ck.shards).enumerate() {
        // At a multiple of 256, plus its file offset modulo 4096 where it was read (or meant
        // to be read, before a refused O_DIRECT read) with O_DIRECT.
        let margin = s.data_offset() % 256;
        ensure(
            (margin == 0 || margin == f.data_start % 256) && s.data_offset() >= end,
            || format!("shard {i} at {}, after {end}", s.data_offset()),
        )?;
        ensure(!s.used_direct() || margin == f.data_start % 256, || {
            format!("shard {i} read directly at {}", s.data_offset())
        })?;
        end = s.data_offset() + f.data().len();
        ensure(Path::new(s.path()) == f.path, || {
            format!("{} for {}", s.path(), f.path.display())
        })?;
        let mut region = vec![0u8; f.data().len()];
        stager.download(reader, &w.shard_bytes(i)?, &mut region)?;
        common::same(&format!("shard {i}'s region"), &region, f.data(), seed)?;
    }
    ensure(w.arena().len() == end, || {
        format!("arena of {} bytes, regions end at {end}", w.arena().len())
    })?;
    ensure(
        w.shards().len() == 1 || matches!(w.bytes(), Err(Error::InvalidArgument { .. })),
        || "bytes() of several shards must be refused".into(),
    )?;
    ensure(
        matches!(
            w.shard_bytes(w.shards().len()),
            Err(Error::InvalidArgument { .. })
        ),
        || "a shard past the end".into(),
    )?;
    for (k, (name, dtype, shape, range)) in ck.tensors() {
        let info = w.info(name)?;
        ensure(
            info.dtype() == *dtype && info.shape() == &shape[..] && info.data_offsets() == *range,
            || format!("{name}: {info:?}, want {dtype} {shape:?} {range:?}"),
        )?;
        let want = &ck.shards[k].data()[range.clone()];
        let bytes = w.bytes_of(name)?.to_vec(reader)?;
        common::same(&format!("bytes of {name}"), &bytes, want, seed)?;
        match dtype {
            Dtype::F32 => typed::<f32>(w, reader, name, want, seed)?,
            Dtype::F16 => typed::<f16>(w, reader, name, want, seed)?,
            Dtype::BF16 => typed::<bf16>(w, reader, name, want, seed)?,
            Dtype::F64 => typed::<f64>(w, reader, name, want, seed)?,
            Dtype::I64 => typed::<i64>(w, reader, name, want, seed)?,
            Dtype::I32 => typed::<i32>(w, reader, name, want, seed)?,
            Dtype::U8 => typed::<u8>(w, reader, name, want, seed)?,
            _ => {}
        }
    }
    ensure(
        matches!(w.info("no such tensor"), Err(Error::InvalidArgument { .. })),
        || "a missing name".into(),
    )
}

fn scratch_dirs() -> Vec<PathBuf> {
    super::scratch_dirs()
}

/// A model-like checkpoint in 1, 3 and 5 shards (tensors of tens of MiB, small ones, empty
/// ones, many dtypes), through the index, the folder and the folder without its index, each
/// `Direct` mode, on the working directory's filesystem and the temporary one.
fn byte_identical_each_way_and_mode() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let reader = dev.stream()?;
    let stager = stager(&dev)?;
    let mut report = Vec::new();
    for dir in scratch_dirs() {
        for n in [1, 3, 5] {
            let (mut rng, seed) = seeded();
            let specs = model_specs(&mut rng);
            let ck = write_sharded(&dir, split(specs, n, &mut rng), true, &mut rng, seed);
            let index = ck.index.clone().ok_or("no index")?;
            for mode in [Direct::Never, Direct::Auto, Direct::Always] {
                for (what, path) in [("index", &index), ("folder", &ck.folder.0)] {
                    let opts = LoadOptions::new().direct(mode);
                    let w = match safetensors::load_checkpoint(&stager, &stream, path, opts) {
                        Ok(w) => w,
                        Err(Error::Io { message, .. })
                            if mode == Direct::Always && message.contains("O_DIRECT") =>
                        {
                            report.push(format!("{}: Always refused", dir.display()));
                            continue;
                        }
                        Err(e) => return Err(format!("{mode:?} {what} of {n}: {e}").into()),
                    };
                    ensure(
                        w.index_metadata().get("format").map(String::as_str) == Some("pt"),
                        || format!("index metadata {:?}", w.index_metadata()),
                    )?;
                    check_sharded(&w, &ck, &stager, &reader).map_err(|e| {
                        format!(
                            "{mode:?}, {what} of {n} shards in {}: {}",
                            dir.display(),
                            e.message().unwrap_or("failed")
                        )
                    })?;
                    report.push(format!(
                        "{}: {n} shards, {what}, {mode:?}: ok (direct {:?})",
                        dir.display(),
                        w.shards()
                            .iter()
                            .map(|s| s.used_direct())
                            .collect::<Vec<_>>()
                    ));
                }
            }
            // The folder without its index.
            std::fs::remove_file(&index)?;
            let w = safetensors::load_checkpoint(
                &stager,
                &stream,
                &ck.folder.0,
                LoadOptions::default(),
            )?;
            ensure(w.index_metadata().is_empty(), || {
                "no index, no metadata".into()
            })?;
            check_sharded(&w, &ck, &stager, &reader)?;
        }
    }
    println!("{}", report.join("\n"));
    Ok(())
}

/// A single file through `load_checkpoint` is the same as through `load`: one shard at the
/// same place, the same bytes.
fn one_file_as_a_checkpoint() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let stager = stager(&dev)?;
    let (mut rng, seed) = seeded();
    let specs: Vec<Spec> = model_specs(&mut rng)
        .into_iter()
        .filter(|s| byte_len(s.dtype, &s.shape) < 1 << 20)
        .collect();
    let f = write_file(&std::env::temp_dir(), specs, true, &mut rng, seed);
    for mode in [Direct::Never, Direct::Auto] {
        let opts = LoadOptions::new().direct(mode);
        let a = safetensors::load(&stager, &stream, &f.path, opts.clone())?;
        let b = safetensors::load_checkpoint(&stager, &stream, &f.path, opts)?;
        ensure(
            a.data_offset() == b.data_offset()
                && a.arena().len() == b.arena().len()
                && a.names().eq(b.names())
                && b.shards().len() == 1,
            || format!("{mode:?}: load and load_checkpoint of one file differ"),
        )?;
        let (x, y) = (a.bytes()?.to_vec(&stream)?, b.bytes()?.to_vec(&stream)?);
        common::same("the data region", &y, &x, seed)?;
        common::same("against the file", &y, f.data(), seed)?;
    }
    Ok(())
}

/// `save_pretrained` stores a tied weight once and lists it in the index under the name it
/// kept: the names are exactly the index's keys (no alias added, none lost).
fn tied_names() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let stager = stager(&dev)?;
    let d = Folder::new(&std::env::temp_dir(), "tied");
    small_file(
        &d.0,
        "model-00001-of-00002.safetensors",
        &[
            ("model.embed_tokens.weight", Dtype::F32, 64),
            ("model.layers.0.w", Dtype::F32, 16),
        ],
    );
    small_file(
        &d.0,
        "model-00002-of-00002.safetensors",
        &[("model.norm.weight", Dtype::F32, 8)],
    );
    small_index(
        &d.0,
        "model.safetensors.index.json",
        &[
            ("model.norm.weight", "model-00002-of-00002.safetensors"),
            (
                "model.embed_tokens.weight",
                "model-00001-of-00002.safetensors",
            ),
            ("model.layers.0.w", "model-00001-of-00002.safetensors"),
        ],
    );
    let w = safetensors::load_checkpoint(&stager, &stream, &d.0, LoadOptions::default())?;
    let mut names: Vec<&str> = w.names().collect();
    names.sort_unstable();
    ensure(
        names
            == [
                "model.embed_tokens.weight",
                "model.layers.0.w",
                "model.norm.weight",
            ],
        || format!("{names:?}"),
    )?;
    ensure(
        matches!(w.info("lm_head.weight"), Err(Error::InvalidArgument { .. })),
        || "an alias the index does not give".into(),
    )?;
    let e = w.get::<f32>("model.embed_tokens.weight")?.to_vec(&stream)?;
    ensure(e.len() == 64, || format!("{} elements", e.len()))?;
    let t = w.into_dlpack()?;
    ensure(t.len() == 3, || format!("{} tensors", t.len()))
}

/// `into_dlpack` of a checkpoint: every tensor, in name order, pointing into its shard's
/// region.
fn into_dlpack_shards() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let stager = stager(&dev)?;
    let (mut rng, seed) = seeded();
    let specs: Vec<Spec> = model_specs(&mut rng)
        .into_iter()
        .filter(|s| byte_len(s.dtype, &s.shape) < 1 << 20)
        .collect();
    let ck = write_sharded(
        &std::env::temp_dir(),
        split(specs, 4, &mut rng),
        true,
        &mut rng,
        seed,
    );
    let w = safetensors::load_checkpoint(&stager, &stream, &ck.folder.0, LoadOptions::default())?;
    let base = w.arena().as_device_ptr() as usize;
    let offsets: Vec<usize> = w.shards().iter().map(|s| s.data_offset()).collect();
    let tensors = w.into_dlpack()?;
    ensure(tensors.len() == ck.tensors().count(), || {
        format!("{} tensors", tensors.len())
    })?;
    for ((name, t), (k, (want, _, _, range))) in tensors.iter().zip(ck.tensors()) {
        ensure(name == want, || format!("{name} against {want}"))?;
        if !range.is_empty() {
            ensure(
                t.data_ptr() as usize == base + offsets[k] + range.start,
                || {
                    format!(
                        "{name}: at {:p}, want shard {k} + {}",
                        t.data_ptr(),
                        range.start
                    )
                },
            )?;
        }
    }
    drop(tensors);
    stream.synchronize()?;
    Ok(())
}

/// A shard cut after `Checkpoint::open` checked it: the load is an `Error::Io` naming that
/// shard; the stager works afterwards.
fn shard_cut_after_open() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let stager = stager(&dev)?;
    let (mut rng, seed) = seeded();
    let specs = vec![
        Spec {
            name: "a".into(),
            dtype: Dtype::F16,
            shape: vec![3 << 20],
        },
        Spec {
            name: "b".into(),
            dtype: Dtype::U8,
            shape: vec![1001],
        },
        Spec {
            name: "c".into(),
            dtype: Dtype::F32,
            shape: vec![1 << 20],
        },
    ];
    let ck = write_sharded(
        &std::env::current_dir()?,
        split(specs, 3, &mut rng),
        true,
        &mut rng,
        seed,
    );
    for mode in [Direct::Never, Direct::Auto] {
        let c = Checkpoint::open(&ck.folder.0)?;
        let cut = &ck.shards[0];
        std::fs::OpenOptions::new()
            .write(true)
            .open(&cut.path)?
            .set_len((cut.data_start + (1 << 20)) as u64)?;
        match c.load(&stager, &stream, LoadOptions::new().direct(mode)) {
            Err(Error::Io { path, .. }) => ensure(Path::new(&path) == cut.path, || {
                format!(
                    "{mode:?}: the error names {path}, not {}",
                    cut.path.display()
                )
            })?,
            other => {
                return Err(
                    format!("{mode:?}: a cut shard gave {:?}", other.map(|w| w.len())).into(),
                )
            }
        }
        // Whole again.
        std::fs::write(&cut.path, &cut.bytes)?;
    }
    let w = safetensors::load_checkpoint(&stager, &stream, &ck.folder.0, LoadOptions::default())?;
    check_sharded(&w, &ck, &stager, &stream)?;
    let _ = std::io::stdout().flush();
    Ok(())
}
