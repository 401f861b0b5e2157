//! Finding a CUDA toolkit and libclang, and the arguments the build passes to nvcc.
//!
//! Pure logic over an environment lookup and the file system, so that `tests/cpu.rs` can test it
//! (it includes this file with `#[path]`). `build.rs` does the I/O: running pip, nvcc, bindgen.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// The PyPI packages of the toolkit that is provisioned when none is found. nvvm must match nvcc,
/// or ptxas fails with "Unsupported .version".
pub const CUDA_PINS: &[&str] = &[
    "nvidia-cuda-nvcc==13.0.88",
    "nvidia-cuda-runtime==13.0.96",
    "nvidia-cuda-crt==13.0.88",
    "nvidia-nvvm==13.0.88",
];
/// The PyPI wheel that carries libclang for bindgen.
pub const LIBCLANG_PIN: &str = "libclang==18.1.1";
/// Folder names under the cargo target dir where the two are provisioned.
pub const CUDA_DIR_NAME: &str = "pinstream-cuda-13.0.88";
pub const LIBCLANG_DIR_NAME: &str = "pinstream-libclang-18.1.1";
/// Inside a provisioned folder, where the toolkit root and libclang live.
pub const PYPI_TOOLKIT_SUBDIR: &str = "nvidia/cu13";
pub const PYPI_LIBCLANG_SUBDIR: &str = "clang/native";

/// Machine code for these architectures, PTX for the newest (override: `PINSTREAM_CUDA_ARCH`).
pub const DEFAULT_ARCHS: &[&str] = &["75", "80", "86", "89", "90"];

/// Where a toolkit was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    CudaHome,
    CudaPath,
    NvccOnPath,
    UsrLocalCuda,
    Provisioned,
}

impl Source {
    pub fn describe(self) -> &'static str {
        match self {
            Source::CudaHome => "CUDA_HOME",
            Source::CudaPath => "CUDA_PATH",
            Source::NvccOnPath => "nvcc on PATH",
            Source::UsrLocalCuda => "/usr/local/cuda",
            Source::Provisioned => "toolkit provisioned from PyPI",
        }
    }
}

/// A usable toolkit: nvcc, the runtime headers and the static runtime library.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Toolkit {
    pub source: Source,
    pub root: PathBuf,
    pub nvcc: PathBuf,
    pub include: PathBuf,
    pub lib: PathBuf,
}

/// The places to look, in order: `CUDA_HOME`, `CUDA_PATH`, each `nvcc` on `PATH`,
/// `/usr/local/cuda`, then the provisioned folders given (roots of earlier PyPI installs).
pub fn candidates(
    env: &dyn Fn(&str) -> Option<OsString>,
    provisioned: &[PathBuf],
) -> Vec<(Source, PathBuf)> {
    let mut out = Vec::new();
    for (name, source) in [
        ("CUDA_HOME", Source::CudaHome),
        ("CUDA_PATH", Source::CudaPath),
    ] {
        if let Some(v) = env(name).filter(|v| !v.is_empty()) {
            out.push((source, PathBuf::from(v)));
        }
    }
    if let Some(path) = env("PATH") {
        for dir in std::env::split_paths(&path) {
            if dir.join("nvcc").is_file() {
                if let Some(root) = dir.parent() {
                    out.push((Source::NvccOnPath, root.to_path_buf()));
                }
            }
        }
    }
    out.push((Source::UsrLocalCuda, PathBuf::from("/usr/local/cuda")));
    for p in provisioned {
        out.push((Source::Provisioned, p.join(PYPI_TOOLKIT_SUBDIR)));
    }
    out
}

/// Checks one candidate root; `Err` says what is missing there.
pub fn toolkit_at(source: Source, root: &Path) -> Result<Toolkit, String> {
    if !root.is_dir() {
        return Err(format!(
            "{} ({}): not a directory",
            root.display(),
            source.describe()
        ));
    }
    let nvcc = root.join("bin").join("nvcc");
    if !nvcc.is_file() {
        return Err(format!("{}: no bin/nvcc", root.display()));
    }
    let include_dirs = [
        root.join("include"),
        root.join("targets/x86_64-linux/include"),
    ];
    let include = include_dirs
        .iter()
        .find(|d| d.join("cuda_runtime_api.h").is_file())
        .ok_or_else(|| format!("{}: no include/cuda_runtime_api.h", root.display()))?;
    let lib_dirs = [
        root.join("lib64"),
        root.join("lib"),
        root.join("targets/x86_64-linux/lib"),
    ];
    let lib = lib_dirs
        .iter()
        .find(|d| d.join("libcudart_static.a").is_file())
        .ok_or_else(|| {
            format!(
                "{}: no lib64/ or lib/ with libcudart_static.a",
                root.display()
            )
        })?;
    Ok(Toolkit {
        source,
        root: root.to_path_buf(),
        nvcc,
        include: include.clone(),
        lib: lib.clone(),
    })
}

/// The first usable candidate, or every reason each one was turned down.
pub fn find_toolkit(candidates: &[(Source, PathBuf)]) -> Result<Toolkit, Vec<String>> {
    let mut why = Vec::new();
    for (source, root) in candidates {
        match toolkit_at(*source, root) {
            Ok(tk) => return Ok(tk),
            Err(e) => why.push(e),
        }
    }
    Err(why)
}

/// The cargo target dir that holds `out_dir` (`<target>/[<triple>/]<profile>/build/<pkg>/out`):
/// the outermost ancestor with cargo's `CACHEDIR.TAG`, so that nested target dirs (trybuild's
/// `target/tests/trybuild`) share one provisioned toolkit; else four levels up.
pub fn target_dir(out_dir: &Path) -> PathBuf {
    out_dir
        .ancestors()
        .filter(|a| a.join("CACHEDIR.TAG").is_file())
        .last()
        .map(Path::to_path_buf)
        .or_else(|| out_dir.ancestors().nth(4).map(Path::to_path_buf))
        .unwrap_or_else(|| out_dir.to_path_buf())
}

/// Every earlier provisioned folder named `name` in the ancestors of `out_dir`, outermost first.
pub fn provisioned_dirs(out_dir: &Path, name: &str) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = out_dir
        .ancestors()
        .map(|a| a.join(name))
        .filter(|d| d.is_dir())
        .collect();
    found.reverse();
    found
}

/// Whether `PINSTREAM_NO_PROVISION` turns provisioning off (any value but empty, `0`, `false`).
pub fn provisioning_disabled(value: Option<OsString>) -> bool {
    match value {
        None => false,
        Some(v) => {
            let v = v.to_string_lossy().trim().to_ascii_lowercase();
            !(v.is_empty() || v == "0" || v == "false" || v == "no")
        }
    }
}

/// Parses `PINSTREAM_CUDA_ARCH` ("90", "sm_90", "75,86;90a", "compute_90" ...) into bare
/// architecture numbers like "90" or "90a"; `Err` names the bad entry.
pub fn parse_archs(spec: &str) -> Result<Vec<String>, String> {
    let mut out: Vec<String> = Vec::new();
    for raw in spec.split([',', ';', ' ']).filter(|s| !s.trim().is_empty()) {
        let s = raw.trim().to_ascii_lowercase();
        let s = s
            .strip_prefix("sm_")
            .or_else(|| s.strip_prefix("compute_"))
            .unwrap_or(&s)
            .to_string();
        let digits = s.trim_end_matches(['a', 'f']);
        let ok = (2..=3).contains(&digits.len())
            && digits.bytes().all(|b| b.is_ascii_digit())
            && s.len() - digits.len() <= 1;
        if !ok {
            return Err(format!(
                "PINSTREAM_CUDA_ARCH: `{raw}` is not an architecture (write e.g. 90, sm_90 or 75,86,90)"
            ));
        }
        if !out.contains(&s) {
            out.push(s);
        }
    }
    if out.is_empty() {
        return Err("PINSTREAM_CUDA_ARCH is empty (write e.g. 90 or 75,86,90)".into());
    }
    Ok(out)
}

/// nvcc `-gencode` flags: machine code (SASS) for every architecture, and PTX for the last one
/// given so that a newer GPU can still JIT it.
pub fn gencode_flags(archs: &[String]) -> Vec<String> {
    let mut flags: Vec<String> = archs
        .iter()
        .map(|a| format!("-gencode=arch=compute_{a},code=sm_{a}"))
        .collect();
    if let Some(newest) = archs.last() {
        flags.push(format!(
            "-gencode=arch=compute_{newest},code=compute_{newest}"
        ));
    }
    flags
}

/// The one message printed when no toolkit can be had.
pub fn no_toolkit_message(rejected: &[String], provision_error: Option<&str>) -> String {
    let mut msg = String::from(
        "pinstream: no CUDA toolkit found (nvcc, cuda_runtime_api.h and libcudart_static.a are needed).\n",
    );
    if !rejected.is_empty() {
        msg.push_str("  looked at:\n");
        for r in rejected {
            msg.push_str(&format!("    - {r}\n"));
        }
    }
    match provision_error {
        Some(e) => msg.push_str(&format!("  provisioning from PyPI failed: {e}\n")),
        None => msg.push_str("  provisioning from PyPI is off (PINSTREAM_NO_PROVISION is set).\n"),
    }
    msg.push_str(&format!(
        "  fix: set CUDA_HOME to a CUDA 12/13 toolkit, or let the build fetch one (needs python3 with pip and \
         network access), or install it yourself:\n    python3 -m pip install --target DIR {}\n  and set CUDA_HOME=DIR/{}",
        CUDA_PINS.join(" "),
        PYPI_TOOLKIT_SUBDIR
    ));
    msg
}

/// The one message printed when libclang (for bindgen) cannot be had.
pub fn no_libclang_message(load_error: &str, provision_error: Option<&str>) -> String {
    let mut msg = format!(
        "pinstream: libclang (needed by bindgen for the CUDA runtime bindings) was not found: {load_error}\n"
    );
    match provision_error {
        Some(e) => msg.push_str(&format!("  provisioning from PyPI failed: {e}\n")),
        None => msg.push_str("  provisioning from PyPI is off (PINSTREAM_NO_PROVISION is set).\n"),
    }
    msg.push_str(&format!(
        "  fix: install libclang (Debian: apt install libclang-dev), or set LIBCLANG_PATH to the folder \
         holding libclang.so, or: python3 -m pip install --target DIR {LIBCLANG_PIN} and set \
         LIBCLANG_PATH=DIR/{PYPI_LIBCLANG_SUBDIR}"
    ));
    msg
}
