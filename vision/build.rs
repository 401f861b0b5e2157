//! Binds nvJPEG's header for the GPU decoder (feature `nvjpeg`, on by default).
//!
//! The library itself is loaded at run time (`dlopen` of `libnvjpeg.so.13`): its PyPI wheel has no
//! unversioned `.so` to link against, and a program must still run, decoding on the CPU, where it
//! is missing. The header comes from the toolkit pinstream built with, else from the PyPI package
//! `nvidia-nvjpeg`, provisioned into the same per-user cache as that toolkit (which also gives the
//! library at run time). libclang and the cache come from pinstream's `links` metadata
//! (`DEP_PINSTREAM_CUDA_*`), so nothing is provisioned twice.

use std::env;
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The nvJPEG built for the CUDA 13.0 runtime pinstream provisions.
const NVJPEG_PIN: &str = "nvidia-nvjpeg==13.0.4.44";
/// Its folder in the per-user cache (keyed by version, as the toolkit's is).
const NVJPEG_CACHE_NAME: &str = "nvjpeg-13.0.4.44";
/// Inside it, the header's and the library's folders.
const WHEEL_INCLUDE: &str = "nvidia/cu13/include";
const WHEEL_LIB: &str = "nvidia/cu13/lib";

/// The functions the decoder calls: the generated loader requires every one of them.
const FUNCTIONS: &str = "nvjpeg(GetProperty|CreateEx|CreateExV2|Destroy|GetHardwareDecoderInfo\
    |SetDeviceMemoryPadding|SetPinnedMemoryPadding\
    |JpegStateCreate|JpegStateDestroy\
    |DecodeBatchedInitialize|DecodeBatchedEx|DecodeBatchedPreAllocate\
    |JpegStreamCreate|JpegStreamDestroy|JpegStreamParseHeader|JpegStreamGetFrameDimensions\
    |JpegStreamGetComponentsNum|JpegStreamGetChromaSubsampling|JpegStreamGetJpegEncoding\
    |DecodeBatchedSupportedEx\
    |DecodeParamsCreate|DecodeParamsDestroy|DecodeParamsSetOutputFormat|DecodeParamsSetROI\
    |DecodeParamsSetAllowCMYK)";

fn env_nonempty(key: &str) -> Option<OsString> {
    println!("cargo::rerun-if-env-changed={key}");
    env::var_os(key).filter(|v| !v.is_empty())
}

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rustc-check-cfg=cfg(pinstream_vision_docs)");
    if env::var_os("CARGO_FEATURE_NVJPEG").is_none() {
        return;
    }
    if env_nonempty("DOCS_RS").is_some() {
        // docs.rs has no toolkit: document against the committed snapshot of the bindings.
        println!("cargo::rustc-cfg=pinstream_vision_docs");
        println!("cargo::rustc-env=PINSTREAM_NVJPEG_DIRS=");
        return;
    }
    if let Err(msg) = build() {
        eprintln!("\npinstream-vision: {msg}\n");
        std::process::exit(1);
    }
}

fn build() -> Result<(), String> {
    let out_dir = PathBuf::from(env_nonempty("OUT_DIR").ok_or("OUT_DIR is not set")?);
    let dep = |k: &str| env_nonempty(&format!("DEP_PINSTREAM_CUDA_{k}")).map(PathBuf::from);
    let cuda_include = dep("INCLUDE").ok_or(
        "pinstream's build gave no toolkit (DEP_PINSTREAM_CUDA_INCLUDE); build pinstream first",
    )?;
    let cache = dep("CACHE");
    let (include, lib_dir) = find_header(&cuda_include, cache.as_deref(), &out_dir)?;
    // Where the library is looked for at run time, before the loader's own path.
    let mut dirs: Vec<PathBuf> = lib_dir.into_iter().collect();
    dirs.extend(dep("LIB"));
    let joined = env::join_paths(&dirs).map_err(|e| format!("library folders: {e}"))?;
    println!(
        "cargo::rustc-env=PINSTREAM_NVJPEG_DIRS={}",
        joined.to_string_lossy()
    );
    bind(&include, &cuda_include, &out_dir)
}

/// The folder of `nvjpeg.h` and, where it was provisioned, the folder of its library:
/// `PINSTREAM_NVJPEG_INCLUDE`, the toolkit's include folder, the cache, or a new provision.
fn find_header(
    cuda_include: &Path,
    cache: Option<&Path>,
    out_dir: &Path,
) -> Result<(PathBuf, Option<PathBuf>), String> {
    if let Some(dir) = env_nonempty("PINSTREAM_NVJPEG_INCLUDE").map(PathBuf::from) {
        return match is_nvjpeg_13(&dir.join("nvjpeg.h")) {
            true => Ok((dir, None)),
            false => Err(format!(
                "PINSTREAM_NVJPEG_INCLUDE={} has no nvjpeg.h of nvJPEG 13 (NVJPEG_VER_MAJOR 13)",
                dir.display()
            )),
        };
    }
    let dest = match cache {
        Some(c) => c.join(NVJPEG_CACHE_NAME),
        // No per-user cache: next to the build's output, as pinstream does.
        None => out_dir.join(NVJPEG_CACHE_NAME),
    };
    // The toolkit's header only where it is nvJPEG 13's (the library loaded is libnvjpeg.so.13).
    if is_nvjpeg_13(&cuda_include.join("nvjpeg.h")) {
        return Ok((cuda_include.to_path_buf(), None));
    }
    if dest.join(WHEEL_INCLUDE).join("nvjpeg.h").is_file() {
        return Ok((dest.join(WHEEL_INCLUDE), Some(dest.join(WHEEL_LIB))));
    }
    if env_nonempty("PINSTREAM_NO_PROVISION").is_some_and(|v| v != "0") {
        return Err(format!(
            "nvjpeg.h is not in {} and PINSTREAM_NO_PROVISION is set: set \
             PINSTREAM_NVJPEG_INCLUDE, or build without the `nvjpeg` feature \
             (default-features = false)",
            cuda_include.display()
        ));
    }
    pip_install(&dest)?;
    println!(
        "cargo::warning=provisioned {NVJPEG_PIN} from PyPI (about 4 MB) into {} for the GPU \
         JPEG decoder; remove it with `rm -rf {}`",
        dest.display(),
        dest.display()
    );
    Ok((dest.join(WHEEL_INCLUDE), Some(dest.join(WHEEL_LIB))))
}

/// Whether `header` is nvJPEG 13's (`#define NVJPEG_VER_MAJOR 13`): the ABI of the library
/// loaded at run time.
fn is_nvjpeg_13(header: &Path) -> bool {
    std::fs::read_to_string(header).is_ok_and(|text| {
        text.lines().any(|l| {
            let mut w = l.split_whitespace();
            w.next() == Some("#define")
                && w.next() == Some("NVJPEG_VER_MAJOR")
                && w.next() == Some("13")
        })
    })
}

/// `python3 -m pip install --target` into a temporary sibling of `dest`, renamed at the end, so
/// that an interrupted or concurrent build never leaves half a folder.
fn pip_install(dest: &Path) -> Result<(), String> {
    let parent = dest.parent().ok_or("bad provisioning folder")?;
    std::fs::create_dir_all(parent)
        .map_err(|e| format!("cannot create {}: {e}", parent.display()))?;
    let name = dest
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("nvjpeg");
    let tmp = dest.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    let python = env_nonempty("PINSTREAM_PYTHON").unwrap_or_else(|| "python3".into());
    let out = Command::new(&python)
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
        ])
        .args([
            "--no-deps",
            "--no-compile",
            "--only-binary=:all:",
            "--target",
        ])
        .arg(&tmp)
        .arg(NVJPEG_PIN)
        .output()
        .map_err(|e| format!("could not run {python:?} -m pip: {e} (set PINSTREAM_PYTHON)"))?;
    if !out.status.success() {
        let _ = std::fs::remove_dir_all(&tmp);
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err.lines().rev().find(|l| !l.trim().is_empty());
        return Err(format!(
            "`pip install {NVJPEG_PIN}` failed ({}): {}; set PINSTREAM_NVJPEG_INCLUDE to a folder \
             with nvjpeg.h, or build without the `nvjpeg` feature",
            out.status,
            last.unwrap_or("")
        ));
    }
    match std::fs::rename(&tmp, dest) {
        Ok(()) => Ok(()),
        // Another build finished first: use its copy.
        Err(_) if dest.is_dir() => {
            let _ = std::fs::remove_dir_all(&tmp);
            Ok(())
        }
        Err(e) => Err(format!(
            "cannot move {} to {}: {e}",
            tmp.display(),
            dest.display()
        )),
    }
}

/// bindgen over `nvjpeg.h`: a loader struct (`Nvjpeg`) whose functions come from `dlopen`.
fn bind(include: &Path, cuda_include: &Path, out_dir: &Path) -> Result<(), String> {
    // The libclang pinstream's build loaded (provisioned from PyPI where the system has none).
    if env_nonempty("LIBCLANG_PATH").is_none() {
        if let Some(lib) = env_nonempty("DEP_PINSTREAM_CUDA_LIBCLANG").map(PathBuf::from) {
            if let Some(dir) = lib.parent() {
                // The build script is single-threaded: changing its environment is sound.
                env::set_var("LIBCLANG_PATH", dir);
            }
        }
    }
    let clang_args: Vec<String> = env_nonempty("DEP_PINSTREAM_CUDA_CLANG_ARGS")
        .map(|a| {
            a.to_string_lossy()
                .split('\t')
                .filter(|s| !s.is_empty())
                .map(String::from)
                .collect()
        })
        .unwrap_or_default();
    let header = include.join("nvjpeg.h");
    println!("cargo::rerun-if-changed={}", header.display());
    let bindings = bindgen::Builder::default()
        .header(header.display().to_string())
        .clang_arg(format!("-I{}", include.display()))
        .clang_arg(format!("-I{}", cuda_include.display()))
        .clang_args(clang_args)
        .allowlist_function(FUNCTIONS)
        .allowlist_type(
            "nvjpeg(Status|ChromaSubsampling|OutputFormat|Backend|JpegEncoding|Image)_t",
        )
        .allowlist_type("nvjpeg(Dev|Pinned)AllocatorV2_t")
        .allowlist_var("NVJPEG_(FLAGS_.*|MAX_COMPONENT)")
        .allowlist_type("libraryPropertyType")
        .dynamic_library_name("Nvjpeg")
        .dynamic_link_require_all(true)
        .derive_debug(true)
        .generate_comments(false)
        .layout_tests(false)
        .generate()
        .map_err(|e| format!("bindgen over {} failed: {e}", header.display()))?;
    let dest = out_dir.join("nvjpeg.rs");
    bindings
        .write_to_file(&dest)
        .map_err(|e| format!("cannot write {}: {e}", dest.display()))
}
