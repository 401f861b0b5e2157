//! Build script: find (or provision) a CUDA toolkit and libclang, generate the runtime bindings
//! with bindgen, compile `cuda/*.cu` with nvcc through `cc`, and link cudart statically.
//!
//! The discovery logic lives in `build/toolkit.rs` so that `tests/cpu.rs` can test it.

#[path = "build/toolkit.rs"]
mod toolkit;

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

use toolkit::{Source, Toolkit};

const ENV_VARS: &[&str] = &[
    "CUDA_HOME",
    "CUDA_PATH",
    "PINSTREAM_CUDA_ARCH",
    "PINSTREAM_NO_PROVISION",
    "PINSTREAM_PYTHON",
    "PINSTREAM_PTXAS_VERBOSE",
    "LIBCLANG_PATH",
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

    if env::var_os("DOCS_RS").is_some() {
        // docs.rs has no CUDA: document against the committed snapshot of the bindings.
        println!("cargo::rustc-cfg=pinstream_docs");
        return;
    }
    if let Err(msg) = build() {
        eprintln!("\n{msg}\n");
        std::process::exit(1);
    }
}

fn build() -> Result<(), String> {
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").ok_or("OUT_DIR is not set")?);
    let no_provision = toolkit::provisioning_disabled(env::var_os("PINSTREAM_NO_PROVISION"));

    let tk = find_or_provision_toolkit(&out_dir, no_provision)?;
    println!(
        "cargo::rustc-env=PINSTREAM_TOOLKIT={} ({})",
        tk.root.display(),
        tk.source.describe()
    );

    let clang_args = load_libclang(&out_dir, no_provision)?;
    generate_bindings(&tk, &clang_args, &out_dir)?;
    compile_kernels(&tk)?;

    // Static cudart: an executable starts on a machine without a driver and gets
    // cudaErrorInsufficientDriver from its first call instead of a loader failure.
    println!("cargo::rustc-link-search=native={}", tk.lib.display());
    println!("cargo::rustc-link-lib=static=cudart_static");
    for lib in ["dl", "rt", "pthread"] {
        println!("cargo::rustc-link-lib=dylib={lib}");
    }
    Ok(())
}

fn find_or_provision_toolkit(out_dir: &Path, no_provision: bool) -> Result<Toolkit, String> {
    let get = |k: &str| env::var_os(k);
    let provisioned = toolkit::provisioned_dirs(out_dir, toolkit::CUDA_DIR_NAME);
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
    let dest = toolkit::target_dir(out_dir).join(toolkit::CUDA_DIR_NAME);
    println!(
        "cargo::warning=no CUDA toolkit found; provisioning CUDA 13.0 from PyPI into {} (PINSTREAM_NO_PROVISION=1 turns this off)",
        dest.display()
    );
    pip_install(&dest, toolkit::CUDA_PINS)
        .and_then(|()| {
            toolkit::toolkit_at(
                Source::Provisioned,
                &dest.join(toolkit::PYPI_TOOLKIT_SUBDIR),
            )
        })
        .map_err(|e| toolkit::no_toolkit_message(&rejected, Some(&e)))
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

/// `python3 -m pip install --target DEST pins...`, into a temporary folder renamed at the end
/// so that an interrupted or concurrent install never leaves a half-filled DEST.
fn pip_install(dest: &Path, pins: &[&str]) -> Result<(), String> {
    if dest.is_dir() {
        return Ok(());
    }
    let parent = dest.parent().ok_or("bad provisioning folder")?;
    std::fs::create_dir_all(parent)
        .map_err(|e| format!("cannot create {}: {e}", parent.display()))?;
    let tmp = parent.join(format!(
        ".{}.tmp-{}",
        dest.file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("provision"),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&tmp);
    let python = env::var("PINSTREAM_PYTHON").unwrap_or_else(|_| "python3".into());
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
                "could not run `{python} -m pip`: {e} (set PINSTREAM_PYTHON to a python with pip)"
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
            "`{python} -m pip install {}` failed ({}): {last}",
            pins.join(" "),
            output.status
        ));
    }
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

/// Loads libclang for bindgen (LIBCLANG_PATH, the system, an earlier provisioned wheel, or a
/// fresh one) and returns the extra clang arguments it needs.
fn load_libclang(out_dir: &Path, no_provision: bool) -> Result<Vec<String>, String> {
    let first_error = match clang_sys::load() {
        Ok(()) => return Ok(builtin_header_args()),
        Err(e) => e,
    };
    if env::var_os("LIBCLANG_PATH").is_some() {
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
    for dir in toolkit::provisioned_dirs(out_dir, toolkit::LIBCLANG_DIR_NAME) {
        if let Ok(args) = use_dir(&dir) {
            return Ok(args);
        }
    }
    if no_provision {
        return Err(toolkit::no_libclang_message(&first_error, None));
    }
    let dest = toolkit::target_dir(out_dir).join(toolkit::LIBCLANG_DIR_NAME);
    println!(
        "cargo::warning=libclang not found; provisioning {} from PyPI into {}",
        toolkit::LIBCLANG_PIN,
        dest.display()
    );
    pip_install(&dest, &[toolkit::LIBCLANG_PIN])
        .and_then(|()| use_dir(&dest))
        .map_err(|e| toolkit::no_libclang_message(&first_error, Some(&e)))
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
             |EventCreateWithFlags|EventDestroy|EventRecord|EventSynchronize|EventQuery|EventElapsedTime\
             |Malloc|Free|MallocAsync|FreeAsync|MemsetAsync|MemcpyAsync|MemcpyBatchAsync\
             |HostAlloc|FreeHost|HostRegister|HostUnregister|HostGetDevicePointer|PointerGetAttributes)",
        )
        .allowlist_type("cudaError|cudaMemcpyKind|cudaDeviceAttr|cudaDeviceProp|cudaPointerAttributes|cudaMemoryType")
        // cudaMemcpyBatchAsync's attribute struct (and what it holds) comes with the function;
        // its `flags` field is a plain unsigned int, so the flag enum is named here.
        .allowlist_type("cudaMemcpyAttributes|cudaMemcpySrcAccessOrder|cudaMemLocation|cudaMemLocationType|cudaMemcpyFlags")
        .allowlist_type("pinstream_.*")
        .allowlist_function("pinstream_(normalize|denormalize)")
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

fn compile_kernels(tk: &Toolkit) -> Result<(), String> {
    let archs = match env::var("PINSTREAM_CUDA_ARCH") {
        Ok(spec) => toolkit::parse_archs(&spec)?,
        Err(_) => toolkit::DEFAULT_ARCHS
            .iter()
            .map(|s| s.to_string())
            .collect(),
    };
    let mut files: Vec<PathBuf> = std::fs::read_dir("cuda")
        .map_err(|e| format!("cannot read cuda/: {e}"))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    files.sort();

    // In CUDA mode cc takes nvcc from the NVCC variable; the C++ compiler it finds becomes
    // -ccbin. The build script is single-threaded, so setting it here is sound.
    env::set_var("NVCC", &tk.nvcc);
    let mut build = cc::Build::new();
    build
        .cuda(true)
        .cudart("none")
        .include("cuda")
        // Kernels are always optimised: -G (device debug, what cc adds in debug builds) makes
        // them orders of magnitude slower. -lineinfo keeps sanitizer reports readable.
        .debug(false)
        .opt_level(3)
        .flag("-std=c++17")
        .flag("-lineinfo")
        // The resource report stays clean: any spill or local-memory use is a warning.
        .flag("-Xptxas=-warn-spills,-warn-lmem-usage")
        .files(&files);
    if env::var_os("PINSTREAM_PTXAS_VERBOSE").is_some() {
        build.flag("-Xptxas=-v");
    }
    for flag in toolkit::gencode_flags(&archs) {
        build.flag(&flag);
    }
    build
        .try_compile("pinstream_kernels")
        .map_err(|e| format!("pinstream: nvcc ({}) failed: {e}", tk.nvcc.display()))
}
