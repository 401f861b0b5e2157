//! Finding a CUDA toolkit and libclang, and the arguments the build passes to nvcc.
//!
//! Pure logic over an environment lookup and the file system, so that `tests/cpu.rs` can test it
//! (it includes this file with `#[path]`). `build.rs` does the I/O: running pip, nvcc, bindgen.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// The PyPI packages of the toolkit that is provisioned when none is found. nvvm must match nvcc,
/// or ptxas fails with "Unsupported .version". CCCL (`nv/target`, `cuda/std`, cub, thrust: 3 MB)
/// is not needed by pinstream's kernels but by most others' (candle's), which can build with this
/// toolkit through its env file (`ENV_FILE_NAME`).
pub const CUDA_PINS: &[&str] = &[
    "nvidia-cuda-nvcc==13.0.88",
    "nvidia-cuda-runtime==13.0.96",
    "nvidia-cuda-crt==13.0.88",
    "nvidia-nvvm==13.0.88",
    "nvidia-cuda-cccl==13.0.85",
];
/// The PyPI wheel that carries libclang for bindgen.
pub const LIBCLANG_PIN: &str = "libclang==18.1.1";
/// Folder names in the per-user cache (`cache_dir`) where the two are provisioned, keyed by
/// version: a new pin gets a new folder, never a half-updated old one.
pub const CACHE_CUDA_NAME: &str = "cuda-13.0.88-cccl-13.0.85";
/// The same for the libclang wheel.
pub const CACHE_LIBCLANG_NAME: &str = "libclang-18.1.1";
/// Folder names under the cargo target dir: where builds before the per-user cache put them
/// (still looked for, so existing checkouts do not download again), and where a build puts
/// them when there is no usable cache folder.
pub const CUDA_DIR_NAME: &str = "pinstream-cuda-13.0.88-cccl-13.0.85";
pub const LIBCLANG_DIR_NAME: &str = "pinstream-libclang-18.1.1";
/// Inside a provisioned folder, where the toolkit root and libclang live.
pub const PYPI_TOOLKIT_SUBDIR: &str = "nvidia/cu13";
pub const PYPI_LIBCLANG_SUBDIR: &str = "clang/native";
/// The shell file, next to a provisioned toolkit's `nvidia/` folder (and in the build's
/// `OUT_DIR` for any toolkit), that points other crates' build scripts at the toolkit.
pub const ENV_FILE_NAME: &str = "env.sh";
/// The compute capability the env file gives `CUDA_COMPUTE_CAP` where that is unset and there is
/// no `nvidia-smi` to ask (candle-kernels and bindgen_cuda build for one architecture): PTX for
/// 8.0 runs on every GPU since the A100, compiled at load time.
pub const ENV_DEFAULT_COMPUTE_CAP: &str = "80";

/// Machine code for these architectures where the toolkit has them, PTX for the newest of them
/// (override: `PINSTREAM_CUDA_ARCH`): T4 (75), A100 (80), A10 / RTX 30 (86), L4 / RTX 40 (89),
/// H100 / H200 (90), B200 (100), RTX 50 (120).
pub const DEFAULT_ARCHS: &[&str] = &["75", "80", "86", "89", "90", "100", "120"];

/// The first CUDA version (`CUDART_VERSION` encoding) whose nvcc builds each architecture in
/// `DEFAULT_ARCHS`: the fallback when `nvcc --list-gpu-code` cannot be asked.
pub const ARCH_SINCE: &[(&str, u32)] = &[
    ("75", 10000),
    ("80", 11000),
    ("86", 11010),
    ("89", 11080),
    ("90", 11080),
    ("100", 12080),
    ("120", 12080),
];

/// The first runtime (`CUDART_VERSION`) whose `cudaMemcpyBatchAsync` has the signature the crate
/// calls (12.8 and 12.9 have it with an extra `failIdx` argument).
pub const BATCH_SINCE: u32 = 13000;

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
    // Debian's and Ubuntu's nvidia-cuda-toolkit (CUDA_HOME=/usr) keep it in the multiarch folder.
    let lib_dirs = [
        root.join("lib64"),
        root.join("lib"),
        root.join("targets/x86_64-linux/lib"),
        root.join("lib/x86_64-linux-gnu"),
    ];
    let lib = lib_dirs
        .iter()
        .find(|d| d.join("libcudart_static.a").is_file())
        .ok_or_else(|| {
            format!(
                "{}: no lib64/, lib/ or lib/x86_64-linux-gnu/ with libcudart_static.a",
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

/// The per-user folder for provisioned toolkits: `PINSTREAM_CACHE`, else
/// `$XDG_CACHE_HOME/pinstream`, else `$HOME/.cache/pinstream`. Empty values count as unset, and a
/// relative `XDG_CACHE_HOME` is ignored (the XDG spec says so); `None` when nothing applies.
pub fn cache_dir(env: &dyn Fn(&str) -> Option<OsString>) -> Option<PathBuf> {
    let get = |k: &str| env(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(dir) = get("PINSTREAM_CACHE") {
        return Some(dir);
    }
    if let Some(xdg) = get("XDG_CACHE_HOME").filter(|p| p.is_absolute()) {
        return Some(xdg.join("pinstream"));
    }
    get("HOME").map(|home| home.join(".cache").join("pinstream"))
}

/// Where to look for a copy provisioned earlier, in order: `cache/cache_name` (the per-user
/// cache), then every `target_name` folder in the ancestors of `out_dir` (where builds put
/// them before the cache), outermost first. Only folders that exist are returned.
pub fn provisioned_locations(
    cache: Option<&Path>,
    cache_name: &str,
    out_dir: &Path,
    target_name: &str,
) -> Vec<PathBuf> {
    let mut found: Vec<PathBuf> = cache
        .map(|c| c.join(cache_name))
        .filter(|d| d.is_dir())
        .into_iter()
        .collect();
    found.extend(provisioned_dirs(out_dir, target_name));
    found
}

/// Where a new copy goes: `cache/cache_name` where there is a cache folder, else the cargo
/// target dir's `target_name` (as before the cache).
pub fn provision_dest(
    cache: Option<&Path>,
    cache_name: &str,
    out_dir: &Path,
    target_name: &str,
) -> PathBuf {
    match cache {
        Some(c) => c.join(cache_name),
        None => target_dir(out_dir).join(target_name),
    }
}

/// The temporary folder a provisioning process `pid` fills before renaming it to `dest`: a
/// hidden sibling of `dest` (same file system, so the rename is atomic).
pub fn provision_tmp(dest: &Path, pid: u32) -> PathBuf {
    let name = dest
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("provision");
    dest.with_file_name(format!(".{name}.tmp-{pid}"))
}

/// Whether `entry` (a file name in the folder of `dest`) is some process's temporary folder for
/// `dest` (see `provision_tmp`), and of which pid.
pub fn provision_tmp_pid(dest: &Path, entry: &str) -> Option<u32> {
    let name = dest.file_name()?.to_str()?;
    entry
        .strip_prefix('.')?
        .strip_prefix(name)?
        .strip_prefix(".tmp-")?
        .parse()
        .ok()
}

/// The cargo warning printed after provisioning into `dest`: where it went, what uses it, how
/// to remove it.
pub fn provisioned_warning(what: &str, dest: &Path, in_cache: bool) -> String {
    if in_cache {
        format!(
            "provisioned {what} into {} (per-user cache, shared by every project that uses \
             pinstream; PINSTREAM_CACHE moves it). Remove it with `rm -rf {}`; a later build \
             that needs it fetches it again. PINSTREAM_NO_PROVISION=1 turns fetching off.",
            dest.display(),
            dest.display()
        )
    } else {
        format!(
            "provisioned {what} into {} (no per-user cache folder: set PINSTREAM_CACHE, \
             XDG_CACHE_HOME or HOME to share it between projects). It goes with `cargo clean`. \
             PINSTREAM_NO_PROVISION=1 turns fetching off.",
            dest.display()
        )
    }
}

/// The cargo target dir that holds `out_dir` (`<target>/[<triple>/]<profile>/build/<pkg>/out`):
/// the outermost ancestor with cargo's `CACHEDIR.TAG`, so that nested target dirs (such as
/// trybuild's `target/tests/trybuild`) share one provisioned toolkit; else four levels up.
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

/// An environment variable's value with an empty one treated as unset (`CUDA_HOME=` or
/// `LIBCLANG_PATH=` on a command line means "not given", not "given as nothing"). The build
/// script reads every variable through [`env_nonempty`].
pub fn nonempty(value: Option<OsString>) -> Option<OsString> {
    value.filter(|v| !v.is_empty())
}

/// `std::env::var_os(key)`, with an empty value treated as unset (see [`nonempty`]).
pub fn env_nonempty(key: &str) -> Option<OsString> {
    nonempty(std::env::var_os(key))
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

/// `CUDART_VERSION` (e.g. 13000 for 13.0) from the text of `cuda_runtime_api.h`.
pub fn parse_cudart_version(header: &str) -> Option<u32> {
    header.lines().find_map(|line| {
        let mut words = line.split_whitespace();
        if words.next()? != "#define" || words.next()? != "CUDART_VERSION" {
            return None;
        }
        words.next()?.parse().ok()
    })
}

/// "13.0" from 13000.
pub fn version_name(cudart: u32) -> String {
    format!("{}.{}", cudart / 1000, (cudart % 1000) / 10)
}

/// The architecture numbers in the output of `nvcc --list-gpu-code` ("sm_75\nsm_80 ..."), in
/// its order; entries that are not `sm_NN` are skipped.
pub fn parse_gpu_code_list(text: &str) -> Vec<String> {
    text.split_whitespace()
        .filter_map(|w| w.strip_prefix("sm_"))
        .filter(|a| !a.is_empty() && a.bytes().all(|b| b.is_ascii_alphanumeric()))
        .map(str::to_string)
        .collect()
}

/// Whether the toolkit builds `arch` ("90", "90a", "100f"): by `supported` (from
/// `nvcc --list-gpu-code`, which lists plain numbers only) when known, else by `ARCH_SINCE` and
/// `cudart`. Architectures unknown to both are assumed to build (nvcc then says if not).
pub fn arch_supported(arch: &str, supported: Option<&[String]>, cudart: u32) -> bool {
    let digits = arch.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    match supported {
        Some(list) if !list.is_empty() => list.iter().any(|s| s == digits),
        _ => ARCH_SINCE
            .iter()
            .find(|(a, _)| *a == digits)
            .is_none_or(|(_, since)| cudart >= *since),
    }
}

/// The architectures to build: `requested` (from `PINSTREAM_CUDA_ARCH`) when given, each checked
/// against the toolkit (`Err` names the ones it lacks and what it has); else `DEFAULT_ARCHS` less
/// those the toolkit lacks (never empty: if it lacks them all, its newest listed one).
pub fn select_archs(
    requested: Option<Vec<String>>,
    supported: Option<&[String]>,
    cudart: u32,
) -> Result<Vec<String>, String> {
    if let Some(req) = requested {
        let missing: Vec<&str> = req
            .iter()
            .filter(|a| !arch_supported(a, supported, cudart))
            .map(String::as_str)
            .collect();
        if missing.is_empty() {
            return Ok(req);
        }
        let has = supported.map_or_else(|| "?".to_string(), |s| s.join(", "));
        return Err(format!(
            "PINSTREAM_CUDA_ARCH asks for {}, which the CUDA {} toolkit cannot build (it builds: {has})",
            missing.join(", "),
            version_name(cudart)
        ));
    }
    let mut out: Vec<String> = DEFAULT_ARCHS
        .iter()
        .filter(|a| arch_supported(a, supported, cudart))
        .map(|a| a.to_string())
        .collect();
    if out.is_empty() {
        if let Some(newest) = supported.and_then(|s| s.last()) {
            out.push(newest.clone());
        }
    }
    if out.is_empty() {
        return Err(format!(
            "the CUDA {} toolkit builds none of {} (set PINSTREAM_CUDA_ARCH)",
            version_name(cudart),
            DEFAULT_ARCHS.join(", ")
        ));
    }
    Ok(out)
}

/// Whether this toolkit's runtime has `cudaMemcpyBatchAsync` as the crate calls it.
pub fn has_batch_copies(cudart: u32) -> bool {
    cudart >= BATCH_SINCE
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
        "  fix: set CUDA_HOME to a CUDA toolkit (11.8 or newer), or let the build fetch one (needs python3 with pip and \
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

/// `value` quoted for a POSIX shell.
pub fn shell_quote(value: &str) -> String {
    format!("'{}'", value.replace('\'', "'\\''"))
}

/// The `links` metadata the build script emits (`cargo::metadata=KEY=VALUE`), which the build
/// scripts of crates that depend on pinstream read as `DEP_PINSTREAM_CUDA_<KEY>`.
pub fn link_metadata(tk: &Toolkit, cudart: u32, env_file: &Path) -> Vec<(&'static str, String)> {
    let mut out = vec![
        ("root", tk.root.display().to_string()),
        ("include", tk.include.display().to_string()),
        ("lib", tk.lib.display().to_string()),
        ("nvcc", tk.nvcc.display().to_string()),
        ("version", cudart.to_string()),
        ("env", env_file.display().to_string()),
    ];
    // CUDA 13 keeps CCCL in include/cccl (nvcc adds it by itself; other compilers need it).
    let cccl = tk.include.join("cccl");
    if cccl.is_dir() {
        out.push(("cccl_include", cccl.display().to_string()));
    }
    out
}

/// The text of the env file for `tk`: the variables other crates' build scripts read to find a
/// toolkit (cudarc: `CUDA_HOME`/`CUDA_PATH`/`CUDA_ROOT`/`CUDA_TOOLKIT_ROOT_DIR` and `nvcc` on
/// `PATH` or `CUDARC_CUDA_VERSION`; candle-kernels' cudaforge: `NVCC`/`CUDA_HOME` and
/// `CUDA_COMPUTE_CAP` or `nvidia-smi`; bindgen_cuda: `CUDA_PATH`/`nvcc` on `PATH`), and the
/// library path for running what they build. Only a function of the toolkit, so that builds
/// that write it at once write the same bytes.
pub fn env_script(tk: &Toolkit, cudart: u32) -> String {
    let q = |p: &Path| shell_quote(&p.display().to_string());
    let (major, minor) = (cudart / 1000, (cudart % 1000) / 10);
    let root = q(&tk.root);
    let bin = q(&tk.root.join("bin"));
    let lib = q(&tk.lib);
    format!(
        "# Written by pinstream's build script: the CUDA {major}.{minor} toolkit it built with \
         ({source}).\n\
         # Source it (`. FILE`) before building crates that look for a toolkit themselves (cudarc,\n\
         # candle-core's `cuda` feature, bindgen_cuda).\n\
         export CUDA_HOME={root}\n\
         export CUDA_PATH={root}\n\
         export CUDA_ROOT={root}\n\
         export CUDA_TOOLKIT_ROOT_DIR={root}\n\
         export NVCC={nvcc}\n\
         export CUDARC_CUDA_VERSION={major}0{minor}0\n\
         export PATH={bin}\"${{PATH:+:$PATH}}\"\n\
         export LIBRARY_PATH={lib}\"${{LIBRARY_PATH:+:$LIBRARY_PATH}}\"\n\
         export LD_LIBRARY_PATH={lib}\"${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}\"\n\
         # One architecture for crates that build for one: the GPU's where nvidia-smi can say,\n\
         # else {cap} (PTX that every GPU since the A100 compiles at load time). Set it to yours.\n\
         if [ -z \"${{CUDA_COMPUTE_CAP:-}}\" ] && ! command -v nvidia-smi >/dev/null 2>&1; then\n\
         \x20   export CUDA_COMPUTE_CAP={cap}\n\
         fi\n",
        source = tk.source.describe(),
        nvcc = q(&tk.nvcc),
        cap = ENV_DEFAULT_COMPUTE_CAP,
    )
}
