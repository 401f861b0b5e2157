//! Build script: find (or provision) a CUDA toolkit and libclang, generate the runtime bindings
//! with bindgen, compile `cuda/*.cu` with nvcc through `cc`, and link cudart statically.
//!
//! The discovery logic lives in `build/toolkit.rs` so that `tests/cpu.rs` can test it.

#[path = "build/toolkit.rs"]
mod toolkit;

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

use toolkit::{env_nonempty, Source, Toolkit};

const ENV_VARS: &[&str] = &[
    "CUDA_HOME",
    "CUDA_PATH",
    "PINSTREAM_CUDA_ARCH",
    "PINSTREAM_NO_PROVISION",
    "PINSTREAM_PYTHON",
    "PINSTREAM_PTXAS_VERBOSE",
    "PINSTREAM_CACHE",
    "XDG_CACHE_HOME",
    "LIBCLANG_PATH",
    "NVCC_CCBIN",
    "DOCS_RS",
];

fn main() {
    for v in ENV_VARS {
        println!("cargo::rerun-if-env-changed={v}");
    }
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-changed=build/toolkit.rs");
    println!("cargo::rerun-if-changed=cuda");
    println!("cargo::rustc-check-cfg=cfg(pinstream_docs)");
    println!("cargo::rustc-check-cfg=cfg(pinstream_cuda_batch)");

    if env_nonempty("DOCS_RS").is_some() {
        // docs.rs has no CUDA: document against the committed snapshot of the bindings (13.0).
        println!("cargo::rustc-cfg=pinstream_docs");
        println!("cargo::rustc-env=PINSTREAM_TOOLKIT_ENV=");
        emit_runtime_version(13000);
        return;
    }
    if let Err(msg) = build() {
        eprintln!("\n{msg}\n");
        std::process::exit(1);
    }
}

fn build() -> Result<(), String> {
    let out_dir = PathBuf::from(env_nonempty("OUT_DIR").ok_or("OUT_DIR is not set")?);
    let no_provision = toolkit::provisioning_disabled(env_nonempty("PINSTREAM_NO_PROVISION"));

    let cache = toolkit::cache_dir(&env_nonempty);
    let tk = find_or_provision_toolkit(&out_dir, cache.as_deref(), no_provision)?;
    println!(
        "cargo::rustc-env=PINSTREAM_TOOLKIT={} ({})",
        tk.root.display(),
        tk.source.describe()
    );
    let header = tk.include.join("cuda_runtime_api.h");
    let cudart = std::fs::read_to_string(&header)
        .ok()
        .and_then(|text| toolkit::parse_cudart_version(&text))
        .ok_or_else(|| format!("pinstream: no CUDART_VERSION in {}", header.display()))?;
    emit_runtime_version(cudart);
    share_toolkit(&tk, cudart, &out_dir)?;

    let clang_args = load_libclang(&out_dir, cache.as_deref(), no_provision)?;
    share_libclang(cache.as_deref(), &clang_args);
    generate_bindings(&tk, &clang_args, &out_dir)?;
    compile_kernels(&tk, cudart, &out_dir)?;

    // Static cudart: an executable starts on a machine without a driver and gets
    // cudaErrorInsufficientDriver from its first call instead of a loader failure.
    println!("cargo::rustc-link-search=native={}", tk.lib.display());
    println!("cargo::rustc-link-lib=static=cudart_static");
    for lib in ["dl", "rt", "pthread"] {
        println!("cargo::rustc-link-lib=dylib={lib}");
    }
    Ok(())
}

/// What the library learns about the runtime it is built against: `PINSTREAM_CUDART_VERSION`
/// (the headers' `CUDART_VERSION`, for the driver diagnosis), and `cfg(pinstream_cuda_batch)`
/// where `cudaMemcpyBatchAsync` can be called.
fn emit_runtime_version(cudart: u32) {
    println!("cargo::rustc-env=PINSTREAM_CUDART_VERSION={cudart}");
    if toolkit::has_batch_copies(cudart) {
        println!("cargo::rustc-cfg=pinstream_cuda_batch");
    }
}

/// Makes the toolkit usable by other crates' builds: `libcudart.so` in a provisioned toolkit
/// (the wheel has only `libcudart.so.13`; candle-kernels links `-lcudart`), the env file (in
/// `OUT_DIR`, and next to a provisioned toolkit where it stays), and the `links` metadata
/// (`DEP_PINSTREAM_CUDA_ROOT` ... for dependents' build scripts). `PINSTREAM_TOOLKIT_ENV` tells
/// the crate's own targets (`examples/toolkit_env.rs`) where the env file is.
fn share_toolkit(tk: &Toolkit, cudart: u32, out_dir: &Path) -> Result<(), String> {
    let script = toolkit::env_script(tk, cudart);
    let mut env_file = out_dir.join(toolkit::ENV_FILE_NAME);
    write_atomically(&env_file, &script)?;
    if tk.source == Source::Provisioned {
        let versioned = tk.lib.join(format!("libcudart.so.{}", cudart / 1000));
        let plain = tk.lib.join("libcudart.so");
        if versioned.is_file() && plain.symlink_metadata().is_err() {
            // Two builds may race here: the loser's EEXIST is fine.
            let _ = std::os::unix::fs::symlink(versioned.file_name().unwrap_or_default(), &plain);
        }
        // <cache>/cuda-.../nvidia/cu13 -> <cache>/cuda-.../env.sh
        let top = tk
            .root
            .ends_with(toolkit::PYPI_TOOLKIT_SUBDIR)
            .then(|| tk.root.ancestors().nth(2));
        if let Some(top) = top.flatten() {
            let shared = top.join(toolkit::ENV_FILE_NAME);
            match write_atomically(&shared, &script) {
                Ok(()) => env_file = shared,
                Err(e) => println!("cargo::warning={e}"),
            }
        }
    }
    println!(
        "cargo::rustc-env=PINSTREAM_TOOLKIT_ENV={}",
        env_file.display()
    );
    for (key, value) in toolkit::link_metadata(tk, cudart, &env_file) {
        println!("cargo::metadata={key}={value}");
    }
    Ok(())
}

/// Tells dependents' build scripts (pinstream-vision binds nvJPEG's header) the libclang this
/// build loaded (`DEP_PINSTREAM_CUDA_LIBCLANG`), the clang arguments it needs (`..._CLANG_ARGS`,
/// tab-separated) and the per-user cache folder (`..._CACHE`), so that they provision nothing
/// twice.
fn share_libclang(cache: Option<&Path>, clang_args: &[String]) {
    if let Some(lib) = clang_sys::get_library() {
        println!("cargo::metadata=libclang={}", lib.path().display());
    }
    println!("cargo::metadata=clang_args={}", clang_args.join("\t"));
    if let Some(cache) = cache {
        println!("cargo::metadata=cache={}", cache.display());
    }
}

/// Writes `path` through a temporary file and a rename, so that a reader (or a second build
/// writing the same bytes) never sees half a file.
fn write_atomically(path: &Path, text: &str) -> Result<(), String> {
    if std::fs::read_to_string(path).is_ok_and(|old| old == text) {
        return Ok(());
    }
    let tmp = path.with_extension(format!("tmp-{}", std::process::id()));
    std::fs::write(&tmp, text)
        .and_then(|()| std::fs::rename(&tmp, path))
        .map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            format!("cannot write {}: {e}", path.display())
        })
}

/// Where to provision `cache_name` / `target_name`, and whether that is in the cache: the per-user
/// cache folder if it exists or can be made (only now, when something must be fetched), else
/// the target dir, with a warning.
fn provision_target(
    cache: Option<&Path>,
    cache_name: &str,
    out_dir: &Path,
    target_name: &str,
) -> (PathBuf, bool) {
    let usable = cache.filter(|dir| match std::fs::create_dir_all(dir) {
        Ok(()) => true,
        Err(e) => {
            println!(
                "cargo::warning=cannot use {} as the toolkit cache ({e}); using the target dir",
                dir.display()
            );
            false
        }
    });
    (
        toolkit::provision_dest(usable, cache_name, out_dir, target_name),
        usable.is_some(),
    )
}

fn find_or_provision_toolkit(
    out_dir: &Path,
    cache: Option<&Path>,
    no_provision: bool,
) -> Result<Toolkit, String> {
    let get = env_nonempty;
    let provisioned = toolkit::provisioned_locations(
        cache,
        toolkit::CACHE_CUDA_NAME,
        out_dir,
        toolkit::CUDA_DIR_NAME,
    );
    let candidates = toolkit::candidates(&get, &provisioned);
    let rejected = match toolkit::find_toolkit(&candidates) {
        Ok(tk) => {
            warn_explicit_rejections(&candidates, &tk);
            return Ok(tk);
        }
        Err(rejected) => rejected,
    };
    if no_provision {
        return Err(toolkit::no_toolkit_message(&rejected, None));
    }
    let (dest, in_cache) = provision_target(
        cache,
        toolkit::CACHE_CUDA_NAME,
        out_dir,
        toolkit::CUDA_DIR_NAME,
    );
    let fetched = pip_install(&dest, toolkit::CUDA_PINS)
        .and_then(|()| {
            toolkit::toolkit_at(
                Source::Provisioned,
                &dest.join(toolkit::PYPI_TOOLKIT_SUBDIR),
            )
        })
        .map_err(|e| toolkit::no_toolkit_message(&rejected, Some(&e)))?;
    println!(
        "cargo::warning=no CUDA toolkit found; {}",
        toolkit::provisioned_warning("CUDA 13.0 from PyPI (about 300 MB)", &dest, in_cache)
    );
    Ok(fetched)
}

/// A toolkit named by CUDA_HOME / CUDA_PATH that was passed over deserves a word.
fn warn_explicit_rejections(candidates: &[(Source, PathBuf)], chosen: &Toolkit) {
    for (source, root) in candidates {
        if root == &chosen.root {
            break;
        }
        if matches!(source, Source::CudaHome | Source::CudaPath) {
            if let Err(e) = toolkit::toolkit_at(*source, root) {
                println!(
                    "cargo::warning={} is not a usable toolkit ({e}); using {}",
                    source.describe(),
                    chosen.root.display()
                );
            }
        }
    }
}

/// `python3 -m pip install --target DEST pins...`, into a temporary folder next to DEST renamed
/// at the end, so that an interrupted or concurrent install never leaves a half-filled DEST:
/// two builds that provision at once each fill their own folder, the first rename wins and the
/// other uses the winner's copy.
fn pip_install(dest: &Path, pins: &[&str]) -> Result<(), String> {
    if dest.is_dir() {
        return Ok(());
    }
    let parent = dest.parent().ok_or("bad provisioning folder")?;
    std::fs::create_dir_all(parent)
        .map_err(|e| format!("cannot create {}: {e}", parent.display()))?;
    remove_stale_tmp(dest);
    let tmp = toolkit::provision_tmp(dest, std::process::id());
    let _ = std::fs::remove_dir_all(&tmp);
    let python = env_nonempty("PINSTREAM_PYTHON").unwrap_or_else(|| "python3".into());
    let shown = python.to_string_lossy();
    let output = Command::new(&python)
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
        ])
        .args(["--no-warn-script-location", "--no-compile", "--target"])
        .arg(&tmp)
        .args(pins)
        .output()
        .map_err(|e| {
            format!(
                "could not run `{shown} -m pip`: {e} (set PINSTREAM_PYTHON to a python with pip)"
            )
        })?;
    if !output.status.success() {
        let _ = std::fs::remove_dir_all(&tmp);
        let stderr = String::from_utf8_lossy(&output.stderr);
        let last = stderr
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("");
        return Err(format!(
            "`{shown} -m pip install {}` failed ({}): {last}",
            pins.join(" "),
            output.status
        ));
    }
    // rename(2) of a folder onto an existing non-empty one fails: the loser keeps its copy out.
    match std::fs::rename(&tmp, dest) {
        Ok(()) => Ok(()),
        // Another build script finished first: use its copy.
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

/// Removes temporary folders of `dest` left by provisioning builds that were killed: those not
/// touched for a day (a running install writes into its folder all the time).
fn remove_stale_tmp(dest: &Path) {
    let Some(parent) = dest.parent() else { return };
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| toolkit::provision_tmp_pid(dest, n))
        else {
            continue;
        };
        let old = entry
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age.as_secs() > 24 * 3600);
        if old && pid != std::process::id() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// Loads libclang for bindgen (LIBCLANG_PATH, the system, an earlier provisioned wheel, or a
/// fresh one) and returns the extra clang arguments it needs.
fn load_libclang(
    out_dir: &Path,
    cache: Option<&Path>,
    no_provision: bool,
) -> Result<Vec<String>, String> {
    // clang-sys searches only LIBCLANG_PATH when it is set, even to nothing: an empty one is
    // unset, as for every variable here.
    if env_nonempty("LIBCLANG_PATH").is_none() {
        // The build script is single-threaded, so changing the environment here is sound.
        env::remove_var("LIBCLANG_PATH");
    }
    let first_error = match clang_sys::load() {
        Ok(()) => return Ok(builtin_header_args()),
        Err(e) => e,
    };
    if env_nonempty("LIBCLANG_PATH").is_some() {
        // An explicit LIBCLANG_PATH that does not work is the user's to fix: say so.
        return Err(toolkit::no_libclang_message(
            &format!("LIBCLANG_PATH is set but unusable: {first_error}"),
            Some("not tried, because LIBCLANG_PATH is set"),
        ));
    }
    let use_dir = |dir: &Path| -> Result<Vec<String>, String> {
        env::set_var("LIBCLANG_PATH", dir.join(toolkit::PYPI_LIBCLANG_SUBDIR));
        clang_sys::load()?;
        Ok(builtin_header_args())
    };
    for dir in toolkit::provisioned_locations(
        cache,
        toolkit::CACHE_LIBCLANG_NAME,
        out_dir,
        toolkit::LIBCLANG_DIR_NAME,
    ) {
        if let Ok(args) = use_dir(&dir) {
            return Ok(args);
        }
    }
    if no_provision {
        return Err(toolkit::no_libclang_message(&first_error, None));
    }
    let (dest, in_cache) = provision_target(
        cache,
        toolkit::CACHE_LIBCLANG_NAME,
        out_dir,
        toolkit::LIBCLANG_DIR_NAME,
    );
    let args = pip_install(&dest, &[toolkit::LIBCLANG_PIN])
        .and_then(|()| use_dir(&dest))
        .map_err(|e| toolkit::no_libclang_message(&first_error, Some(&e)))?;
    println!(
        "cargo::warning=libclang not found; {}",
        toolkit::provisioned_warning(
            &format!("{} from PyPI (about 60 MB)", toolkit::LIBCLANG_PIN),
            &dest,
            in_cache
        )
    );
    Ok(args)
}

/// The PyPI libclang wheel lacks clang's builtin headers (stddef.h ...): borrow the C compiler's.
fn builtin_header_args() -> Vec<String> {
    let has_builtins = clang_sys::get_library()
        .and_then(|lib| lib.path().parent().map(Path::to_path_buf))
        .map(|dir| {
            std::fs::read_dir(dir.join("clang"))
                .map(|rd| {
                    rd.flatten()
                        .any(|v| v.path().join("include/stddef.h").is_file())
                })
                .unwrap_or(false)
        })
        .unwrap_or(false);
    if has_builtins {
        return Vec::new();
    }
    let cc = cc::Build::new().get_compiler();
    match Command::new(cc.path())
        .arg("-print-file-name=include")
        .output()
    {
        Ok(o) if o.status.success() => {
            let dir = String::from_utf8_lossy(&o.stdout).trim().to_string();
            vec!["-isystem".into(), dir]
        }
        _ => Vec::new(),
    }
}

fn generate_bindings(tk: &Toolkit, clang_args: &[String], out_dir: &Path) -> Result<(), String> {
    let bindings = bindgen::Builder::default()
        .header("cuda/bindings.h")
        .clang_arg("-Icuda")
        .clang_arg(format!("-I{}", tk.include.display()))
        .clang_args(clang_args)
        .allowlist_function(
            "cuda(GetErrorName|GetErrorString|GetLastError|PeekAtLastError\
             |GetDeviceCount|SetDevice|GetDevice|DeviceGetAttribute|GetDeviceProperties\
             |DeviceGetPCIBusId|DeviceSynchronize|DeviceGetStreamPriorityRange\
             |DriverGetVersion|RuntimeGetVersion|MemGetInfo\
             |StreamCreateWithPriority|StreamDestroy|StreamSynchronize|StreamQuery|StreamWaitEvent\
             |StreamGetPriority|StreamGetDevice\
             |EventCreateWithFlags|EventDestroy|EventRecord|EventSynchronize|EventQuery|EventElapsedTime\
             |Malloc|Free|MallocAsync|FreeAsync|MallocFromPoolAsync\
             |MemPoolCreate|MemPoolSetAttribute|MemPoolGetAttribute|MemPoolTrimTo|MemsetAsync|MemcpyAsync|MemcpyBatchAsync|MemcpyPeerAsync\
             |DeviceCanAccessPeer|DeviceEnablePeerAccess\
             |HostAlloc|FreeHost|HostRegister|HostUnregister|HostGetDevicePointer|PointerGetAttributes)",
        )
        .allowlist_type("cudaError|cudaMemcpyKind|cudaDeviceAttr|cudaDeviceProp|cudaPointerAttributes|cudaMemoryType")
        // cudaMemcpyBatchAsync's attribute struct (and what it holds) comes with the function;
        // its `flags` field is a plain unsigned int, so the flag enum is named here.
        .allowlist_type("cudaMemPoolProps|cudaMemPoolAttr|cudaMemAllocationType|cudaMemAllocationHandleType")
        .allowlist_type("cudaMemcpyAttributes|cudaMemcpySrcAccessOrder|cudaMemLocation|cudaMemLocationType|cudaMemcpyFlags")
        .allowlist_type("pinstream_.*")
        .allowlist_function("pinstream_(normalize|denormalize|resized_crop)")
        .allowlist_var("PINSTREAM_.*")
        .allowlist_var(
            "cuda(StreamNonBlocking|EventDefault|EventDisableTiming|EventBlockingSync\
             |HostAlloc(Default|Portable|Mapped|WriteCombined)\
             |HostRegister(Default|Portable|Mapped|IoMemory|ReadOnly))",
        )
        .rustified_enum("cudaError|cudaMemcpyKind|cudaDeviceAttr")
        .derive_debug(true)
        .generate_comments(false)
        .layout_tests(true)
        .generate()
        .map_err(|e| format!("pinstream: bindgen over cuda_runtime_api.h failed: {e}"))?;
    let dest = out_dir.join("cuda_runtime.rs");
    bindings
        .write_to_file(&dest)
        .map_err(|e| format!("cannot write {}: {e}", dest.display()))
}

/// The architectures `nvcc --list-gpu-code` names (CUDA 11.0 and newer); `None` if it cannot say.
fn nvcc_gpu_codes(nvcc: &Path) -> Option<Vec<String>> {
    let out = Command::new(nvcc).arg("--list-gpu-code").output().ok()?;
    if !out.status.success() {
        return None;
    }
    let list = toolkit::parse_gpu_code_list(&String::from_utf8_lossy(&out.stdout));
    (!list.is_empty()).then_some(list)
}

/// Whether to hand nvcc the C++ compiler `cc` found (`-ccbin`). nvcc refuses host compilers
/// newer than it knows (CUDA 11.8 wants gcc 11 at most; Debian's bookworm has gcc 12), so a
/// one-line probe asks it first; if it refuses and nvcc's own default works (Debian's toolkit
/// brings a wrapper for gcc 11), that default is used. `NVCC_CCBIN` (nvcc's variable) always
/// wins: then no `-ccbin` is passed.
fn pass_ccbin(tk: &Toolkit, out_dir: &Path) -> bool {
    if env_nonempty("NVCC_CCBIN").is_some() {
        return false;
    }
    let probe = out_dir.join("pinstream_ccbin_probe.cu");
    if std::fs::write(&probe, "int pinstream_probe;\n").is_err() {
        return true;
    }
    let accepts = |ccbin: Option<&Path>| -> bool {
        let mut cmd = Command::new(&tk.nvcc);
        if let Some(c) = ccbin {
            cmd.arg(format!("-ccbin={}", c.display()));
        }
        cmd.args(["-std=c++17", "-E", "-o", "/dev/null"])
            .arg(&probe)
            .output()
            .is_ok_and(|o| o.status.success())
    };
    let cxx = cc::Build::new().cpp(true).get_compiler();
    if accepts(Some(cxx.path())) || !accepts(None) {
        return true;
    }
    println!(
        "cargo::warning=nvcc ({}) refuses the C++ compiler {}; using nvcc's default host compiler \
         (set NVCC_CCBIN to choose one)",
        tk.nvcc.display(),
        cxx.path().display()
    );
    false
}

fn compile_kernels(tk: &Toolkit, cudart: u32, out_dir: &Path) -> Result<(), String> {
    let requested = match env_nonempty("PINSTREAM_CUDA_ARCH") {
        Some(spec) => {
            let spec = spec
                .to_str()
                .ok_or("pinstream: PINSTREAM_CUDA_ARCH is not UTF-8")?;
            Some(toolkit::parse_archs(spec)?)
        }
        None => None,
    };
    let supported = nvcc_gpu_codes(&tk.nvcc);
    let archs = toolkit::select_archs(requested, supported.as_deref(), cudart)
        .map_err(|e| format!("pinstream: {e}"))?;

    let mut files: Vec<PathBuf> = std::fs::read_dir("cuda")
        .map_err(|e| format!("cannot read cuda/: {e}"))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    files.sort();

    // In CUDA mode cc takes nvcc from the NVCC variable; the C++ compiler it finds becomes
    // -ccbin. The build script is single-threaded here (the compile threads start below), so
    // setting it is sound.
    env::set_var("NVCC", &tk.nvcc);
    let ccbin = pass_ccbin(tk, out_dir);
    let mut build = cc::Build::new();
    build.ccbin(ccbin);
    build
        .cuda(true)
        .cudart("none")
        .include("cuda")
        // Kernels are always optimised: -G (device debug, what cc adds in debug builds) makes
        // them orders of magnitude slower. -lineinfo keeps sanitizer reports readable.
        .debug(false)
        .opt_level(3)
        .flag("-std=c++17")
        .flag("-lineinfo");
    // ptxas's resource report (registers, spills, local memory per kernel), and a warning for
    // any spill or local-memory use, only when asked: the few known spills would otherwise be
    // printed as cargo warnings by every build of every dependent crate.
    if env_nonempty("PINSTREAM_PTXAS_VERBOSE").is_some() {
        build.flag("-Xptxas=-v");
        build.flag("-Xptxas=-warn-spills,-warn-lmem-usage");
    }
    for flag in toolkit::gencode_flags(&archs) {
        build.flag(&flag);
    }
    // One library per .cu file: cc compiles several CUDA files in one build as relocatable
    // device code (--device-c), and that costs registers (crop_rows<f16, 3>: 76 instead of 60)
    // and measured 11 % of its speed on the H100. No kernel calls across files.
    //
    // The files compile side by side, as many at once as cargo's jobs (NUM_JOBS), each nvcc
    // single-threaded: the same commands as before nvcc's own --threads was tried. That flag
    // also threads the device-link step cc runs, where one clean build failed with "nvlink
    // fatal: Could not read file .../tmpxft_..._dlink.reg.c" (on a nearly full disk, so the
    // cause is not certain); this way is as fast on 2 cores.
    let jobs = env::var("NUM_JOBS")
        .ok()
        .and_then(|j| j.parse::<usize>().ok())
        .unwrap_or(1)
        .clamp(1, files.len().max(1));
    let mut named = Vec::with_capacity(files.len());
    for file in &files {
        let stem = file
            .file_stem()
            .and_then(|s| s.to_str())
            .ok_or_else(|| format!("odd file name in cuda/: {}", file.display()))?;
        named.push((file.clone(), format!("pinstream_kernels_{stem}")));
    }
    let compile = |(file, lib): &(PathBuf, String)| -> Result<(), String> {
        build.clone().file(file).try_compile(lib).map_err(|e| {
            format!(
                "pinstream: nvcc ({}) failed on {}: {e}\n  if nvcc refuses the host compiler \
                 (\"unsupported GNU version\"), set NVCC_CCBIN to one it supports (CUDA 11.8: \
                 g++-11)",
                tk.nvcc.display(),
                file.display()
            )
        })
    };
    // The largest files first, so that the last to start is a short one.
    named.sort_by_key(|(f, _)| std::cmp::Reverse(std::fs::metadata(f).map_or(0, |m| m.len())));
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results: Vec<Result<(), String>> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..jobs)
            .map(|_| {
                s.spawn(|| {
                    let mut out = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(item) = named.get(i) else {
                            return out;
                        };
                        out.push(compile(item));
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| {
                w.join().unwrap_or_else(|_| {
                    vec![Err("pinstream: a kernel build thread panicked".into())]
                })
            })
            .collect()
    });
    results.into_iter().collect()
}
