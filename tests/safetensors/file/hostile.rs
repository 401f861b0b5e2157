//! A hostile caller against `pinstream::safetensors` (feature `safetensors`): crafted files whose
//! header lies, special files in place of a file (a FIFO, a directory, devices, symlinks, a
//! socket), sizes and offsets near the integer limits, nesting deep enough to overflow a
//! recursive parser, and (GPU) files that change size while they are loaded. Every attack must
//! end in a typed error (`Error::Format` for a bad header, `Error::Io` for a file that cannot be
//! read, `Error::NoDevice` without a GPU after the header's checks) within a bound: no panic, no
//! hang, no abort, no allocation sized by the file's claims before they are checked.
//!
//! - `finding/...`: attacks that broke the API when written (each names the cause; it passes
//!   since its fix).
//! - `held/...`: attacks the API withstood, kept as regression tests.
//!
//! `cpu/` trials need no GPU; `gpu/` ones are ignored where there is none. The trials that may
//! abort the process (a stack overflow) run in a child process of this executable.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::{ensure, within, R};
use libtest_mimic::Trial;
use pinstream::safetensors::{self, Direct, Header, LoadOptions, MAX_HEADER_BYTES};
use pinstream::{Device, Error, FileSource, Stager, StagerConfig};

use crate::common::trial;

/// Prefix of this module's trial names (its path in the binary).
const PREFIX: &str = "file/hostile/";

/// Set in a child process: the name of the trial body it runs.
const CHILD: &str = "PINSTREAM_HOSTILE_ST_CHILD";

const BOUND: Duration = Duration::from_secs(60);

type Body = fn() -> R;

/// The largest single allocation asked for since the last [`largest_allocation_reset`]: the
/// trials bound what a hostile file makes the library allocate by this count, not by a clock.
static LARGEST_ALLOCATION: AtomicUsize = AtomicUsize::new(0);

struct Counting;

// SAFETY: every call is forwarded unchanged to the system allocator; the counter only records
// the requested sizes.
unsafe impl std::alloc::GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        LARGEST_ALLOCATION.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller's contract for `alloc` is `System.alloc`'s.
        unsafe { std::alloc::System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        LARGEST_ALLOCATION.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: as for `alloc`.
        unsafe { std::alloc::System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, new: usize) -> *mut u8 {
        LARGEST_ALLOCATION.fetch_max(new, Ordering::Relaxed);
        // SAFETY: `ptr` / `layout` came from this allocator, which is `System`.
        unsafe { std::alloc::System.realloc(ptr, layout, new) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        // SAFETY: `ptr` / `layout` came from this allocator, which is `System`.
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn largest_allocation_reset() {
    LARGEST_ALLOCATION.store(0, Ordering::Relaxed);
}

fn largest_allocation() -> usize {
    LARGEST_ALLOCATION.load(Ordering::Relaxed)
}

/// Bodies that may abort the process: run by [`in_child`].
const CHILD_BODIES: &[(&str, Body)] = &[("deep_nesting", deep_nesting)];

/// A child process of one of these trials (this executable again, with the variable set): runs
/// its part and returns true, or exits; false in the test runner.
pub fn child_mode() -> bool {
    if let Ok(name) = std::env::var(CHILD) {
        let code = match CHILD_BODIES.iter().find(|(n, _)| *n == name) {
            Some((_, body)) => match body() {
                Ok(()) => 0,
                Err(e) => {
                    eprintln!("child {name}: {e:?}");
                    1
                }
            },
            None => 3,
        };
        std::process::exit(code);
    }
    false
}

/// The trials of this module, named `file/hostile/...`.
pub fn trials() -> Vec<Trial> {
    let no_gpu = !pinstream::available();
    let cpu = |name: &str, f: Body| {
        let name = format!("cpu/{name}");
        let what = name.clone();
        trial(PREFIX, name, move || within(&what, BOUND, f))
    };
    let mut trials = vec![
        // Findings.
        cpu("finding/fifo_open_blocks_forever", fifo_is_refused),
        cpu(
            "finding/resident_fraction_of_a_fifo_blocks_forever",
            resident_fraction_of_a_fifo,
        ),
        // Held.
        cpu("held/special_files_are_io_or_format_errors", special_files),
        cpu("held/length_prefix_lies", length_prefix_lies),
        cpu(
            "held/offsets_shapes_and_dtypes_near_the_limits",
            near_limits,
        ),
        cpu("held/deep_nesting_never_overflows_the_stack", || {
            in_child("deep_nesting", BOUND)
        }),
        cpu(
            "held/sparse_file_with_the_largest_header",
            sparse_largest_header,
        ),
        cpu("held/many_empty_tensors", many_empty_tensors),
        cpu(
            "held/load_file_checks_the_header_first",
            load_file_header_first,
        ),
    ];
    let mut gpu = |name: &str, f: Body| {
        let name = format!("gpu/{name}");
        let what = name.clone();
        trials.push(trial(PREFIX, name, move || within(&what, BOUND, f)).with_ignored_flag(no_gpu));
    };
    gpu(
        "held/file_shrinks_while_loading",
        file_shrinks_while_loading,
    );
    gpu("held/file_grows_after_header", file_grows_after_header);
    gpu(
        "finding/fifo_or_file_swapped_in_after_the_header",
        swapped_after_the_header,
    );
    gpu("held/odd_dtypes_into_dlpack", odd_dtypes_into_dlpack);
    trials
}

// ---------------------------------------------------------------------------------------------
// Helpers.

/// A path under the temporary folder, removed (with whatever is there) on drop.
struct Temp(PathBuf);

impl Temp {
    fn new(name: &str) -> Temp {
        let p = std::env::temp_dir().join(format!(
            "pinstream-hostile-st-{name}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_file(&p);
        let _ = std::fs::remove_dir_all(&p);
        Temp(p)
    }
}

impl Drop for Temp {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The bytes of a file: the length prefix, `json` padded with spaces to a multiple of 8, then
/// `data` bytes.
fn file_bytes(json: &str, data: usize) -> Vec<u8> {
    let mut j = json.as_bytes().to_vec();
    while j.len() % 8 != 0 {
        j.push(b' ');
    }
    let mut out = (j.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&j);
    out.extend((0..data).map(|i| (i * 7 + 3) as u8));
    out
}

fn write(path: &Path, bytes: &[u8]) -> R {
    let mut f = std::fs::File::create(path).map_err(|e| format!("{}: {e}", path.display()))?;
    f.write_all(bytes).map_err(|e| format!("write: {e}"))?;
    Ok(())
}

/// `Header::read` of `path` must be a typed error (`Io` or `Format`).
fn refused(what: &str, path: &Path) -> R {
    match Header::read(path) {
        Err(Error::Io { .. } | Error::Format { .. }) => Ok(()),
        other => Err(format!("{what}: expected Io or Format, got {other:?}").into()),
    }
}

/// Runs `CHILD_BODIES[name]` in a child process of this executable: a crash or a hang there
/// is a failure here, not the end of the run.
fn in_child(name: &str, bound: Duration) -> R {
    let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
    let mut child = Command::new(exe)
        .env(CHILD, name)
        .env("RUST_BACKTRACE", "0")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("spawn: {e}"))?;
    let t = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().map_err(|e| format!("wait: {e}"))? {
            break Some(s);
        }
        if t.elapsed() > bound {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = std::io::Read::read_to_string(&mut e, &mut err);
    }
    match status {
        Some(s) if s.success() => Ok(()),
        Some(s) => Err(format!("child {name}: {s} ({})", err.trim()).into()),
        None => Err(format!("child {name}: HUNG past {bound:?}").into()),
    }
}

// ---------------------------------------------------------------------------------------------
// Findings.

/// Runs `f` on a FIFO made for it. Whether a call blocked is counted, not timed: a writer comes
/// only after a generous watchdog (30 s), and if its non-blocking open succeeds then, a reader
/// was still blocked in open(2): that is a hang, and an error here (after the writer has
/// unblocked it, so that the stuck thread does not outlive the trial).
fn on_a_fifo<T: std::fmt::Debug>(
    name: &str,
    f: impl FnOnce(&Path) -> T,
) -> Result<T, libtest_mimic::Failed> {
    let t = Temp::new(name);
    on_a_fifo_at(&t.0, f)
}

/// [`on_a_fifo`] with the FIFO made at `path` (which must not exist).
fn on_a_fifo_at<T: std::fmt::Debug>(
    path: &Path,
    f: impl FnOnce(&Path) -> T,
) -> Result<T, libtest_mimic::Failed> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|e| format!("path: {e}"))?;
    // SAFETY: a valid NUL-terminated path.
    let rc = unsafe { libc::mkfifo(c.as_ptr(), 0o600) };
    ensure(rc == 0, || {
        format!("mkfifo: {}", std::io::Error::last_os_error())
    })?;
    let done = Arc::new(AtomicBool::new(false));
    let unblocked = Arc::new(AtomicUsize::new(0));
    let unblock = {
        let (done, unblocked, path) = (done.clone(), unblocked.clone(), path.to_path_buf());
        std::thread::spawn(move || {
            let t0 = Instant::now();
            while !done.load(Ordering::Acquire) {
                if t0.elapsed() > Duration::from_secs(30) {
                    // O_NONBLOCK: fails at once (ENXIO) while no reader waits; succeeds only
                    // where a reader is still in open(2).
                    let w = std::fs::OpenOptions::new()
                        .write(true)
                        .custom_flags(libc::O_NONBLOCK)
                        .open(&path);
                    if w.is_ok() {
                        unblocked.fetch_add(1, Ordering::AcqRel);
                    }
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };
    let result = f(path);
    done.store(true, Ordering::Release);
    let _ = unblock.join();
    let unblocked = unblocked.load(Ordering::Acquire);
    ensure(unblocked == 0, || {
        format!("a call on a FIFO blocked in open(2) until a writer came: {result:?}")
    })?;
    Ok(result)
}

/// FINDING (hang): a FIFO in place of the file. `FileSource::open` opened it with a plain
/// `open(O_RDONLY)`, which blocks until a writer opens the other end: `Header::read`,
/// `load_file` (and Python's `load_safetensors`, the GIL released but Ctrl-C powerless) never
/// returned. A FIFO is now refused at the open (`Error::Io`), which no longer blocks.
fn fifo_is_refused() -> R {
    let results = on_a_fifo("fifo", |p| {
        (
            FileSource::open(p).map(|_| ()),
            Header::read(p).map(|_| ()),
            safetensors::load_file(p, 0).map(|_| ()),
        )
    })?;
    ensure(
        matches!(
            results,
            (
                Err(Error::Io { .. }),
                Err(Error::Io { .. }),
                Err(Error::Io { .. })
            )
        ),
        || format!("a FIFO: {results:?}"),
    )
}

/// FINDING (hang, issue 29 finding 9): `resident_fraction` opened the path with a plain
/// `File::open`, which blocks on a FIFO until a writer comes (for ever if none does); `load`
/// (with `Direct::Auto`) called it on the path again after its checked open, so a FIFO swapped
/// in between hung the load. It now opens without blocking and looks only at a regular file:
/// `None` for a FIFO (and for anything else that is not a regular file).
fn resident_fraction_of_a_fifo() -> R {
    let r = on_a_fifo("fifo-resident", |p| {
        (
            safetensors::resident_fraction(p, 0, 4096),
            safetensors::resident_fraction(p, 4096, 1 << 30),
        )
    })?;
    ensure(r == (None, None), || format!("a FIFO: {r:?}"))?;
    for dev in ["/dev/zero", "/dev/null"] {
        let r = safetensors::resident_fraction(Path::new(dev), 0, 4096);
        ensure(r.is_none(), || format!("{dev}: {r:?}"))?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Held.

/// A directory, devices, symlinks to them, a dangling symlink, a symlink loop, an empty file, a
/// `/proc` file (length 0, contents on read), a UNIX socket: each a typed error.
fn special_files() -> R {
    let dir = Temp::new("dir");
    std::fs::create_dir(&dir.0).map_err(|e| format!("mkdir: {e}"))?;
    refused("a directory", &dir.0)?;
    for dev in [
        "/dev/null",
        "/dev/zero",
        "/dev/urandom",
        "/proc/self/status",
    ] {
        if Path::new(dev).exists() {
            refused(dev, Path::new(dev))?;
        }
    }
    let link = Temp::new("zero-link");
    std::os::unix::fs::symlink("/dev/zero", &link.0).map_err(|e| format!("symlink: {e}"))?;
    refused("a symlink to /dev/zero", &link.0)?;
    let dangling = Temp::new("dangling");
    std::os::unix::fs::symlink(dir.0.join("nothing-here"), &dangling.0)
        .map_err(|e| format!("symlink: {e}"))?;
    refused("a dangling symlink", &dangling.0)?;
    let (a, b) = (Temp::new("loop-a"), Temp::new("loop-b"));
    std::os::unix::fs::symlink(&b.0, &a.0).map_err(|e| format!("symlink: {e}"))?;
    std::os::unix::fs::symlink(&a.0, &b.0).map_err(|e| format!("symlink: {e}"))?;
    refused("a symlink loop", &a.0)?;
    let empty = Temp::new("empty");
    write(&empty.0, &[])?;
    refused("an empty file", &empty.0)?;
    let sock = Temp::new("sock");
    let listener = std::os::unix::net::UnixListener::bind(&sock.0);
    if listener.is_ok() {
        refused("a UNIX socket", &sock.0)?;
    }
    // `load_file` on each: the header's error, whether or not there is a GPU.
    for p in [&dir.0, &link.0, &empty.0] {
        let r = safetensors::load_file(p, 0);
        ensure(
            matches!(r, Err(Error::Io { .. } | Error::Format { .. })),
            || format!("load_file({}): {r:?}", p.display()),
        )?;
    }
    drop(listener);
    Ok(())
}

/// The 8-byte length prefix: every value from 0 to `u64::MAX` that does not describe the file
/// is a `Format` error, and nothing of the claimed size is allocated first (a prefix of
/// `MAX_HEADER_BYTES` on a 16-byte file returns at once).
fn length_prefix_lies() -> R {
    let t = Temp::new("prefix");
    let body = b"{}      ";
    for (n, ok) in [
        (0u64, false),
        (1, false),
        (7, false),
        (8, true), // "{}" padded: a file with no tensor
        (9, false),
        (MAX_HEADER_BYTES, false),
        (MAX_HEADER_BYTES + 1, false),
        (u64::MAX - 7, false),
        (u64::MAX, false),
    ] {
        let mut bytes = n.to_le_bytes().to_vec();
        bytes.extend_from_slice(body);
        write(&t.0, &bytes)?;
        largest_allocation_reset();
        let r = Header::read(&t.0);
        // Nothing of the claimed size is allocated: bounded by bytes, not by a clock.
        let largest = largest_allocation();
        ensure(largest < 1 << 20, || {
            format!("prefix {n}: an allocation of {largest} bytes for a 16-byte file")
        })?;
        match (&r, ok) {
            (Ok(h), true) => ensure(h.is_empty() && h.data_len() == 0, || format!("{h:?}"))?,
            (Err(Error::Format { .. }), false) => {}
            _ => return Err(format!("prefix {n}: {r:?}").into()),
        }
    }
    // Shorter than the prefix itself.
    for len in 0..8 {
        write(&t.0, &vec![1u8; len])?;
        let r = Header::read(&t.0);
        ensure(matches!(r, Err(Error::Format { .. })), || {
            format!("{len} bytes: {r:?}")
        })?;
    }
    Ok(())
}

/// Offsets, shapes and dtypes at and past the limits of u64 / usize: each a `Format` error
/// naming the tensor (not a panic from an overflow, not an allocation of the claimed size).
fn near_limits() -> R {
    let t = Temp::new("limits");
    let max = u64::MAX;
    let cases: Vec<(String, usize)> = vec![
        (format!(r#"{{"a":{{"dtype":"U8","shape":[{max}],"data_offsets":[0,{max}]}}}}"#), 8),
        (format!(r#"{{"a":{{"dtype":"U8","shape":[1],"data_offsets":[{max},{max}]}}}}"#), 8),
        (format!(r#"{{"a":{{"dtype":"U8","shape":[0],"data_offsets":[{max},{max}]}}}}"#), 0),
        (format!(r#"{{"a":{{"dtype":"F64","shape":[{},8],"data_offsets":[0,8]}}}}"#, max / 8 + 1), 8),
        (r#"{"a":{"dtype":"U8","shape":[4294967296,4294967296,2],"data_offsets":[0,8]}}"#.into(), 8),
        (r#"{"a":{"dtype":"F32","shape":[0,18446744073709551615,2],"data_offsets":[0,8]}}"#.into(), 8),
        (r#"{"a":{"dtype":"U8","shape":[18446744073709551616],"data_offsets":[0,8]}}"#.into(), 8),
        (r#"{"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,8]}}"#.into(), 8),
        (r#"{"a":{"dtype":"U8","shape":[1.5],"data_offsets":[0,8]}}"#.into(), 8),
        (r#"{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,-8]}}"#.into(), 8),
        (r#"{"a":{"dtype":"U8","shape":[8],"data_offsets":[8,0]}}"#.into(), 8),
        (r#"{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8,8]}}"#.into(), 8),
        (r#"{"a":{"dtype":"U8","shape":[8],"data_offsets":[0]}}"#.into(), 8),
        (r#"{"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}}"#.into(), 2),
        (r#"{"a":{"dtype":"F6_E2M3","shape":[5],"data_offsets":[0,4]}}"#.into(), 4),
        (r#"{"a":{"dtype":"f32","shape":[2],"data_offsets":[0,8]}}"#.into(), 8),
        (r#"{"a":{"dtype":32,"shape":[2],"data_offsets":[0,8]}}"#.into(), 8),
        (r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8],"dtype":"U8"}}"#.into(), 8),
        (r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}"#.into(), 8),
        (r#"{"__metadata__":{"k":1},"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}}"#.into(), 8),
        (r#"{"__metadata__":[],"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}}"#.into(), 8),
        (r#"{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}} trailing"#.into(), 8),
        (r#"[{"a":1}]"#.into(), 0),
        ("\u{feff}{}".into(), 0),
        ("{\"a\":{\"dtype\":\"U8\",\"shape\":[8],\"data_offsets\":[0,8]}}\0".into(), 8),
    ];
    for (json, data) in cases {
        write(&t.0, &file_bytes(&json, data))?;
        let r = Header::read(&t.0);
        ensure(matches!(r, Err(Error::Format { .. })), || {
            format!("{json} + {data} bytes: {r:?}")
        })?;
    }
    // Not UTF-8.
    let mut bytes = 8u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{\"\xff\":1}  ");
    write(&t.0, &bytes)?;
    let r = Header::read(&t.0);
    ensure(matches!(r, Err(Error::Format { .. })), || {
        format!("not UTF-8: {r:?}")
    })
}

/// Nesting a recursive parser would overflow its stack on: in an ignored field of a tensor
/// (skipped, as the reference skips unknown fields), in `__metadata__`, in the shape, at the
/// top (a `Format` error). Run in a child process: a stack overflow aborts.
fn deep_nesting() -> R {
    let t = Temp::new("deep");
    let deep = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
    let deep_obj = |n: usize| format!("{}1{}", "{\"k\":".repeat(n), "}".repeat(n));
    let n = 1_000_000;
    let cases = [
        format!(
            r#"{{"a":{{"dtype":"U8","shape":[8],"data_offsets":[0,8],"x":{}}}}}"#,
            deep(n)
        ),
        format!(
            r#"{{"a":{{"dtype":"U8","shape":[8],"data_offsets":[0,8],"x":{}}}}}"#,
            deep_obj(n)
        ),
        format!(
            r#"{{"__metadata__":{},"a":{{"dtype":"U8","shape":[8],"data_offsets":[0,8]}}}}"#,
            deep(n)
        ),
        format!(
            r#"{{"a":{{"dtype":"U8","shape":{},"data_offsets":[0,8]}}}}"#,
            deep(n)
        ),
        deep(n),
    ];
    for (i, json) in cases.iter().enumerate() {
        write(&t.0, &file_bytes(json, 8))?;
        let r = Header::read(&t.0);
        // The first two nest inside a field the format ignores (as the reference does): a valid
        // header. The others put the nesting where a tensor or the metadata must be.
        let fine = match (i < 2, &r) {
            (true, Ok(h)) => h.len() == 1,
            (false, Err(Error::Format { .. })) => true,
            _ => false,
        };
        ensure(fine, || format!("{}...: {r:?}", &json[..40]))?;
    }
    Ok(())
}

/// A sparse file whose prefix claims the largest header allowed: the header (zeros) is read
/// and refused as a `Format` error, the file's holes cost no disk.
fn sparse_largest_header() -> R {
    let t = Temp::new("sparse");
    let f = std::fs::File::create(&t.0).map_err(|e| format!("create: {e}"))?;
    std::os::unix::fs::FileExt::write_all_at(&f, &MAX_HEADER_BYTES.to_le_bytes(), 0)
        .map_err(|e| format!("write: {e}"))?;
    f.set_len(8 + MAX_HEADER_BYTES + 4096)
        .map_err(|e| format!("set_len: {e}"))?;
    drop(f);
    let r = Header::read(&t.0);
    ensure(matches!(r, Err(Error::Format { .. })), || format!("{r:?}"))
}

/// 100 000 empty tensors at offset 0 and one byte tensor: parsed, ordered by name, no
/// quadratic blow-up (which, at 10^10 steps, the trial's watchdog would report as a hang; no
/// clock is asserted).
fn many_empty_tensors() -> R {
    let t = Temp::new("many");
    let n = 100_000;
    let mut json = String::from("{");
    for i in (0..n).rev() {
        json.push_str(&format!(
            r#""t{i:06}":{{"dtype":"F32","shape":[0,7],"data_offsets":[0,0]}},"#
        ));
    }
    json.push_str(r#""z":{"dtype":"U8","shape":[3],"data_offsets":[0,3]}}"#);
    write(&t.0, &file_bytes(&json, 3))?;
    let h = Header::read(&t.0)?;
    ensure(h.len() == n + 1, || format!("{} tensors", h.len()))?;
    ensure(
        h.tensors()[0].name() == "t000000" && h.tensors()[n].name() == "z",
        || "not ordered by offset, then name".into(),
    )
}

/// `load_file` reads the header before it asks for a device: a bad file is `Format` on any
/// machine; a good one is `NoDevice` without a GPU.
fn load_file_header_first() -> R {
    let t = Temp::new("first");
    write(
        &t.0,
        &file_bytes(
            r#"{"a":{"dtype":"U8","shape":[9],"data_offsets":[0,8]}}"#,
            8,
        ),
    )?;
    let r = safetensors::load_file(&t.0, 0);
    ensure(matches!(r, Err(Error::Format { .. })), || format!("{r:?}"))?;
    write(
        &t.0,
        &file_bytes(
            r#"{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}}"#,
            8,
        ),
    )?;
    let r = safetensors::load_file(&t.0, usize::MAX);
    ensure(
        matches!(
            r,
            Err(Error::NoDevice { .. } | Error::InvalidArgument { .. })
        ),
        || format!("device usize::MAX: {r:?}"),
    )?;
    if !pinstream::available() {
        let r = safetensors::load_file(&t.0, 0);
        ensure(matches!(r, Err(Error::NoDevice { .. })), || {
            format!("{r:?}")
        })?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// GPU.

/// A 256 MiB file cut to a few KiB by another thread while it is loaded (page cache, and
/// O_DIRECT where the filesystem has it): an `Io` error, or (if the load won the race) the
/// right bytes; never a panic, a hang, or garbage reported as success.
fn file_shrinks_while_loading() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let stager = Stager::new(&dev, StagerConfig::default())?;
    let t = Temp::new("shrink");
    let len: usize = 256 << 20;
    let json = format!(r#"{{"w":{{"dtype":"U8","shape":[{len}],"data_offsets":[0,{len}]}}}}"#);
    for direct in [Direct::Never, Direct::Auto] {
        for delay_ms in [0u64, 2, 10, 40] {
            write(&t.0, &file_bytes(&json, len))?;
            let header = Header::read(&t.0)?;
            let path = t.0.clone();
            let cutter = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(delay_ms));
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(&path)
                    .and_then(|f| f.set_len(4096))
            });
            let r = safetensors::load_header(
                &stager,
                &stream,
                header,
                LoadOptions::new().direct(direct),
            );
            cutter
                .join()
                .map_err(|_| "the cutter panicked")?
                .map_err(|e| format!("truncate: {e}"))?;
            match r {
                Err(Error::Io { .. }) => {}
                Ok(w) => {
                    // The load won the race: every byte must be the file's.
                    w.synchronize()?;
                    let mut got = vec![0u8; len];
                    stream.copy_d2h(&w.bytes()?, &mut got[..])?.wait()?;
                    let want = file_bytes(&json, len);
                    let data = &want[want.len() - len..];
                    ensure(got == data, || {
                        format!("{direct:?} +{delay_ms} ms: a load that succeeded has wrong bytes")
                    })?;
                }
                Err(e) => {
                    return Err(format!("{direct:?} +{delay_ms} ms: {e:?}").into());
                }
            }
        }
    }
    Ok(())
}

/// A file that grows after its header was read: `load_header` refuses it (the length changed)
/// rather than load a data region that no longer ends where the header says.
/// FINDING (hang, issue 29 finding 9): `load_header` with a header read before, after a FIFO
/// (or another file) was put at its path. The load opened the path again for the residency
/// with a plain `File::open`, which blocks on a FIFO for ever; another regular file of the same
/// length was read with the first file's header. The path is now opened once per load, without
/// blocking, and the file must be the one the header was read from.
fn swapped_after_the_header() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let stager = Stager::new(&dev, StagerConfig::default())?;
    let t = Temp::new("swap");
    let bytes = file_bytes(
        r#"{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}}"#,
        8,
    );
    write(&t.0, &bytes)?;
    let header = Header::read(&t.0)?;
    // Another file of the same length at the same path.
    std::fs::remove_file(&t.0).map_err(|e| format!("remove: {e}"))?;
    write(&t.0, &bytes)?;
    let r = safetensors::load_header(&stager, &stream, header.clone(), LoadOptions::new());
    ensure(matches!(r, Err(Error::Io { .. })), || {
        format!("another file at the path: {r:?}")
    })?;
    // A FIFO at the path: refused, without blocking.
    std::fs::remove_file(&t.0).map_err(|e| format!("remove: {e}"))?;
    let r = on_a_fifo_at(&t.0, |_| {
        safetensors::load_header(&stager, &stream, header, LoadOptions::new()).map(|_| ())
    })?;
    ensure(matches!(r, Err(Error::Io { .. })), || {
        format!("a FIFO: {r:?}")
    })
}

fn file_grows_after_header() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let stager = Stager::new(&dev, StagerConfig::default())?;
    let t = Temp::new("grow");
    write(
        &t.0,
        &file_bytes(
            r#"{"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}}"#,
            8,
        ),
    )?;
    let header = Header::read(&t.0)?;
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(&t.0)
        .map_err(|e| format!("open: {e}"))?;
    f.write_all(&[9; 100]).map_err(|e| format!("append: {e}"))?;
    drop(f);
    let r = safetensors::load_header(&stager, &stream, header, LoadOptions::new());
    ensure(matches!(r, Err(Error::Io { .. })), || format!("{r:?}"))
}

/// Every dtype at odd but aligned offsets, empty tensors between them, packed sub-byte types:
/// `into_dlpack` gives one tensor each (sub-byte ones as bytes), or refuses a misaligned one
/// with the arena freed; nothing panics.
fn odd_dtypes_into_dlpack() -> R {
    let dev = Device::get(0)?;
    let stream = dev.stream()?;
    let stager = Stager::new(&dev, StagerConfig::default())?;
    let t = Temp::new("odd");
    // 1 BOOL, then an empty C64, 1 F4 pair byte, 2 bytes pad of U8, then C64 at 8.
    let json = r#"{"a":{"dtype":"BOOL","shape":[1],"data_offsets":[0,1]},
        "e":{"dtype":"C64","shape":[0,3],"data_offsets":[1,1]},
        "f":{"dtype":"F4","shape":[2],"data_offsets":[1,2]},
        "p":{"dtype":"U8","shape":[6],"data_offsets":[2,8]},
        "c":{"dtype":"C64","shape":[2],"data_offsets":[8,24]},
        "s":{"dtype":"F8_E8M0","shape":[],"data_offsets":[24,25]}}"#;
    write(&t.0, &file_bytes(json, 25))?;
    let w = safetensors::load(&stager, &stream, &t.0, LoadOptions::new())?;
    let pad = w.data_offset();
    let tensors = w.into_dlpack();
    match (pad % 8 == 0, tensors) {
        (true, Ok(ts)) => ensure(ts.len() == 6, || format!("{} tensors", ts.len()))?,
        // The data region starts where the header ends: a C64 at 8 is aligned only where the
        // region is (the header is padded to 8 here, so it is).
        (false, Err(Error::InvalidArgument { .. })) => {}
        (aligned, r) => return Err(format!("pad {pad} (aligned {aligned}): {r:?}").into()),
    }
    // A misaligned C64: refused, the arena freed (no panic, no leak reported as success).
    let json = r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},
        "c":{"dtype":"C64","shape":[1],"data_offsets":[4,12]}}"#;
    write(&t.0, &file_bytes(json, 12))?;
    let w = safetensors::load(&stager, &stream, &t.0, LoadOptions::new())?;
    let r = w.into_dlpack();
    ensure(matches!(r, Err(Error::InvalidArgument { .. })), || {
        format!("misaligned C64: {:?}", r.map(|v| v.len()))
    })
}
