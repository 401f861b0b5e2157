//! Finding and loading `libnvjpeg.so.13` at run time, once per process.
//!
//! `PINSTREAM_NVJPEG` (a file or a folder) is the only place tried where it is set. Otherwise,
//! in order: the folder the build provisioned it into (the per-user cache, beside pinstream's
//! toolkit), the build's toolkit, `CUDA_HOME` / `CUDA_PATH`, `/usr/local/cuda/lib64` and
//! `/usr/local/cuda-13*/lib64`, then the loader's own path (`LD_LIBRARY_PATH`, the system's). A
//! machine without it gets the reason, once on stderr and from [`unavailable`], and decodes on
//! the CPU.

use std::path::PathBuf;
use std::sync::OnceLock;

use super::sys;

/// The library's file name: the CUDA 13 ABI (the wheel ships no unversioned name).
pub const LIBRARY: &str = "libnvjpeg.so.13";

/// The loaded library, or why there is none.
static LOADED: OnceLock<Result<sys::Nvjpeg, String>> = OnceLock::new();

/// Where to look, most specific first (the loader's own search comes last, by name only).
fn candidates() -> Vec<PathBuf> {
    let mut out = Vec::new();
    let built = option_env!("PINSTREAM_NVJPEG_DIRS").unwrap_or("");
    out.extend(std::env::split_paths(built).map(|d| d.join(LIBRARY)));
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(root) = std::env::var_os(var).filter(|v| !v.is_empty()) {
            out.push(PathBuf::from(root).join("lib64").join(LIBRARY));
        }
    }
    out.push(PathBuf::from("/usr/local/cuda/lib64").join(LIBRARY));
    // Versioned toolkits (`/usr/local/cuda-13.0`), newest name first.
    let mut versioned: Vec<PathBuf> = std::fs::read_dir("/usr/local")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("cuda-13"))
        })
        .collect();
    versioned.sort();
    out.extend(
        versioned
            .into_iter()
            .rev()
            .map(|d| d.join("lib64").join(LIBRARY)),
    );
    out
}

fn load() -> Result<sys::Nvjpeg, String> {
    // An explicit choice is the only one tried: a wrong path is an error, not a silent fallback
    // to another copy.
    if let Some(p) = std::env::var_os("PINSTREAM_NVJPEG").filter(|v| !v.is_empty()) {
        let p = PathBuf::from(p);
        let path = if p.is_dir() { p.join(LIBRARY) } else { p };
        // SAFETY: as below.
        return unsafe { sys::Nvjpeg::new(&path) }.map_err(|e| {
            format!(
                "nvJPEG could not be loaded from PINSTREAM_NVJPEG={} ({e}), so JPEGs decode on \
                 the CPU",
                path.display()
            )
        });
    }
    let mut tried = Vec::new();
    for path in candidates() {
        if !path.is_file() {
            continue;
        }
        // SAFETY: loading runs the library's initializers; libnvjpeg's only open libcuda (no
        // other code of this process runs in them). Every symbol the bindings name is resolved
        // here with the type bindgen took from a header of the same ABI (`libnvjpeg.so.13`: the
        // build binds only an nvJPEG 13 header).
        match unsafe { sys::Nvjpeg::new(&path) } {
            Ok(lib) => return Ok(lib),
            Err(e) => tried.push(format!("{}: {e}", path.display())),
        }
    }
    // SAFETY: as above, for the loader's own search path.
    match unsafe { sys::Nvjpeg::new(LIBRARY) } {
        Ok(lib) => Ok(lib),
        Err(e) => {
            tried.push(format!("{LIBRARY} on the loader's path: {e}"));
            Err(format!(
                "nvJPEG ({LIBRARY}) could not be loaded, so JPEGs decode on the CPU. Install the \
                 PyPI package nvidia-nvjpeg (13.0.x) or a CUDA 13 toolkit, or point \
                 PINSTREAM_NVJPEG at the library. Tried: {}",
                tried.join("; ")
            ))
        }
    }
}

/// The library, loaded on first use; the error says why there is none (it is printed to stderr
/// the first time).
pub(crate) fn library() -> Result<&'static sys::Nvjpeg, &'static str> {
    let loaded = LOADED.get_or_init(|| {
        let r = load();
        if let Err(why) = &r {
            eprintln!("pinstream-vision: {why}");
        }
        r
    });
    loaded.as_ref().map_err(String::as_str)
}

/// Why nvJPEG cannot be used in this process, or `None` where it loads.
pub fn unavailable() -> Option<&'static str> {
    library().err()
}
