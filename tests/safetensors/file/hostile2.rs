//! Hostile review (branch hostile-feed2) of the issue 29 fixes, its safetensors part: the open /
//! `Header::read` / `resident_fraction` paths reachable without a GPU. (The image feed's part is
//! `vision`'s `feed/hostile2`; `tmp` and `watchdog` are copies of its helpers.)

use std::path::PathBuf;
use std::sync::mpsc;
use std::time::Duration;

use pinstream::safetensors::{resident_fraction, Header};
use pinstream::Error;

use crate::common::{trial, R};
use libtest_mimic::Trial;

/// Prefix of this module's trial names (its path in the binary).
const PREFIX: &str = "file/hostile2/";

/// The trials of this module, named `file/hostile2/...`: CPU trials (plain functions that panic on a failure), run everywhere.
pub fn trials() -> Vec<Trial> {
    let t = |name: &str, f: fn()| {
        trial(PREFIX, name, move || -> R {
            f();
            Ok(())
        })
    };
    vec![t(
        "safetensors_open_and_residency",
        safetensors_open_and_residency,
    )]
}

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("pinstream-hostile3-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Runs `f` on its own thread; panics (a hang) if it has not finished after a generous limit.
fn watchdog<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(120))
        .unwrap_or_else(|_| panic!("{what}: no answer after 120 s (a hang)"))
}

/// safetensors without a GPU: `Header::read` of a FIFO (must not wait for a writer), of
/// /proc/self/maps (size 0, streams data), of /dev/zero, of a directory; `resident_fraction`
/// with ranges past the end, near u64::MAX and on non-regular files.
fn safetensors_open_and_residency() {
    let root = tmp("st");
    let fifo = root.join("f.safetensors");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo on a valid C string.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let paths: Vec<PathBuf> = vec![
        fifo.clone(),
        "/proc/self/maps".into(),
        "/dev/zero".into(),
        root.clone(),
    ];
    let rs = watchdog("Header::read of non-files", {
        let paths = paths.clone();
        move || {
            paths
                .iter()
                .map(|p| Header::read(p).map(|h| h.len()))
                .collect::<Vec<_>>()
        }
    });
    for (p, r) in paths.iter().zip(&rs) {
        eprintln!("Header::read({}) = {r:?}", p.display());
        assert!(
            matches!(r, Err(Error::Io { .. }) | Err(Error::Format { .. })),
            "{}: {r:?}",
            p.display()
        );
    }
    // A real file: a header, then 1 MiB of data.
    let json = br#"{"w":{"dtype":"F32","shape":[262144],"data_offsets":[0,1048576]}}"#;
    let mut v = (json.len() as u64).to_le_bytes().to_vec();
    v.extend(json);
    v.resize(v.len() + (1 << 20), 7);
    let f = root.join("ok.safetensors");
    std::fs::write(&f, &v).unwrap();
    let h = Header::read(&f).unwrap();
    assert_eq!(h.len(), 1);
    let fl = v.len() as u64;
    let probes = [
        (0u64, fl),
        (0, u64::MAX),
        (u64::MAX, 1),
        (u64::MAX - 4096, 4096),
        (fl, 1 << 30),
        (1 << 40, 4096),
        (i64::MAX as u64, 1),
        (i64::MAX as u64 + 1, 1),
        (0, 1 << 46),
        (4095, 2),
    ];
    let fr = watchdog("resident_fraction", {
        let f = f.clone();
        move || {
            probes
                .iter()
                .map(|&(o, l)| ((o, l), resident_fraction(&f, o, l)))
                .collect::<Vec<_>>()
        }
    });
    for ((o, l), r) in fr {
        eprintln!("resident_fraction({o}, {l}) = {r:?}");
        if let Some(x) = r {
            assert!((0.0..=1.0).contains(&x), "({o}, {l}): {x}");
        }
    }
    let nf = watchdog("resident_fraction of non-files", move || {
        paths
            .iter()
            .map(|p| resident_fraction(p, 0, 4096))
            .collect::<Vec<_>>()
    });
    assert!(nf.iter().all(Option::is_none), "{nf:?}");
    // The file replaced by another of the same length after Header::read: a new header read
    // sees the new contents (no stale cache by path).
    let json2 = br#"{"z":{"dtype":"I32","shape":[262144],"data_offsets":[0,1048576]}}"#;
    let mut v2 = (json2.len() as u64).to_le_bytes().to_vec();
    v2.extend(json2);
    v2.resize(v.len(), 9);
    let tmpf = root.join("ok.new");
    std::fs::write(&tmpf, &v2).unwrap();
    std::fs::rename(&tmpf, &f).unwrap();
    let h2 = Header::read(&f).unwrap();
    assert!(h2.get("z").is_some() && h2.get("w").is_none());
    let _ = std::fs::remove_dir_all(&root);
}
