//! Runs the Python package's tests (python/tests/test_*.py) with pytest, so that `cargo test`
//! at the top covers the Python package too. The package (python/) is a workspace member but
//! not a default one, so that `cargo run -- bandwidth` does not build pyo3 and the extension:
//! this test builds it (`cargo build -p pinstream-python`, same target dir and profile; the
//! shared crates are already built by then). The extension (`lib_native.so`) and the package's
//! Python sources are put together in a folder under the target dir and put on `PYTHONPATH`;
//! pytest, numpy and pillow are installed there with pip when the interpreter lacks them. GPU tests
//! are reported skipped, with the reason, without a GPU. `PINSTREAM_PYTHON` names the
//! interpreter (default `python3`).

use std::path::PathBuf;
use std::process::{Command, ExitCode};

fn main() -> ExitCode {
    match run() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("pytest: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<bool, String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // `cargo test -- --list` and friends: this runner has one test, named `pytest`.
    if args.iter().any(|a| a == "--list") {
        println!("pytest: test");
        return Ok(true);
    }
    if !selected(&args) {
        return Ok(true); // filtered out
    }
    let python = std::env::var("PINSTREAM_PYTHON").unwrap_or_else(|_| "python3".into());
    let crate_dir = PathBuf::from(env_dir("CARGO_MANIFEST_DIR")?)
        .join("..")
        .join("python");
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    // target/<profile>/deps/pytest-<hash>
    let deps = exe.parent().ok_or("no deps folder")?;
    let profile = deps.parent().ok_or("no profile folder")?;
    // Under cargo: build the extension now, with the profile of this test (`--release` when
    // the test was built so).
    if let Some(cargo) = std::env::var_os("CARGO").filter(|c| !c.is_empty()) {
        let release = profile.file_name().is_some_and(|n| n == "release");
        let mut build = Command::new(cargo);
        build
            .args(["build", "--quiet", "-p", "pinstream-python", "--lib"])
            .arg("--manifest-path")
            .arg(crate_dir.join("Cargo.toml"));
        if release {
            build.arg("--release");
        }
        let ok = build
            .status()
            .map_err(|e| format!("cargo build -p pinstream-python: {e}"))?
            .success();
        if !ok {
            return Err("cargo build -p pinstream-python failed".into());
        }
    }
    // `cargo build` uplifts the extension to the profile folder (`cargo test` of the package
    // leaves it in deps/): take the newer.
    let lib = [deps.join("lib_native.so"), profile.join("lib_native.so")]
        .into_iter()
        .filter_map(|p| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p)))
        .max_by_key(|(t, _)| *t)
        .map(|(_, p)| p)
        .ok_or_else(|| format!("no lib_native.so under {}", profile.display()));
    let lib = match lib {
        Ok(l) => l,
        // Copied away from the build (a GPU machine's pack): there the tests run against the
        // installed wheel (`python3 -m pytest python/tests`). Under cargo, a missing extension
        // is a failure.
        Err(e) if std::env::var_os("CARGO").is_none() => {
            println!("pytest: ignored ({e}; run pytest against the installed wheel)");
            return Ok(true);
        }
        Err(e) => return Err(e),
    };

    let site = profile.join("python-test");
    let pkg = site.join("pinstream");
    let _ = std::fs::remove_dir_all(&site);
    std::fs::create_dir_all(&pkg).map_err(|e| e.to_string())?;
    for entry in std::fs::read_dir(crate_dir.join("pinstream")).map_err(|e| e.to_string())? {
        let p = entry.map_err(|e| e.to_string())?.path();
        if p.extension().is_some_and(|x| x == "py") {
            let name = p.file_name().ok_or("no file name")?;
            std::fs::copy(&p, pkg.join(name)).map_err(|e| e.to_string())?;
        }
    }
    std::fs::copy(&lib, pkg.join("_native.abi3.so")).map_err(|e| e.to_string())?;

    let tools = profile.join("python-test-tools");
    let mut path = vec![site.clone()];
    // The tests' own needs: pytest, numpy, and pillow (the image tests write their JPEGs).
    const MODULES: [&str; 3] = ["pytest", "numpy", "PIL"];
    if !has_modules(&python, &[], &MODULES) {
        if !has_modules(&python, std::slice::from_ref(&tools), &MODULES) {
            eprintln!(
                "pytest: installing pytest, numpy and pillow into {}",
                tools.display()
            );
            let ok = Command::new(&python)
                .args([
                    "-m",
                    "pip",
                    "install",
                    "--quiet",
                    "--disable-pip-version-check",
                ])
                .args(["--no-warn-script-location", "--target"])
                .arg(&tools)
                .args(["pytest", "numpy", "pillow"])
                .status()
                .map_err(|e| format!("{python}: {e}"))?
                .success();
            if !ok {
                return Err("pip could not install pytest, numpy and pillow".into());
            }
        }
        path.push(tools);
    }
    let status = Command::new(&python)
        // -P and the folder as the working directory: the package comes from the folder
        // above, never from the sources (which lack the extension).
        .args(["-P", "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"])
        .arg(crate_dir.join("tests"))
        .current_dir(&site)
        .env("PYTHONPATH", join(&path))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .status()
        .map_err(|e| format!("{python}: {e}"))?;
    Ok(status.success())
}

/// Whether libtest's arguments select the one test, `pytest`, as libtest would: with filters
/// (free arguments), at least one must match it (a substring, or the whole name with
/// `--exact`); no `--skip` may match it; `--ignored` (it is not an ignored test) deselects it.
/// The values of libtest's options that take one (`--test-threads 2`, `--skip pytest`,
/// `--format json`, ...) are not filters.
fn selected(args: &[String]) -> bool {
    const NAME: &str = "pytest";
    const TAKES_VALUE: &[&str] = &[
        "--skip",
        "--test-threads",
        "--format",
        "--color",
        "--logfile",
        "--shuffle-seed",
        "-Z",
    ];
    let exact = args.iter().any(|a| a == "--exact");
    let hits = |f: &str| if exact { f == NAME } else { NAME.contains(f) };
    let (mut filters, mut skips, mut ignored_only) = (Vec::new(), Vec::new(), false);
    let mut it = args.iter().map(String::as_str);
    while let Some(a) = it.next() {
        if a == "--ignored" {
            ignored_only = true;
        } else if let Some(v) = a.strip_prefix("--skip=") {
            skips.push(v);
        } else if a == "--skip" {
            skips.extend(it.next());
        } else if TAKES_VALUE.contains(&a) {
            let _ = it.next();
        } else if !a.starts_with('-') {
            filters.push(a);
        }
    }
    !ignored_only
        && (filters.is_empty() || filters.iter().any(|f| hits(f)))
        && !skips.iter().any(|f| NAME.contains(f))
}

fn env_dir(name: &str) -> Result<String, String> {
    // Set by cargo when it runs the test; a copied binary may set it by hand.
    std::env::var(name).or_else(|_| {
        option_env!("CARGO_MANIFEST_DIR")
            .map(str::to_string)
            .ok_or_else(|| format!("{name} is not set"))
    })
}

fn has_modules(python: &str, path: &[PathBuf], modules: &[&str]) -> bool {
    let code = format!("import {}", modules.join(", "));
    Command::new(python)
        .args(["-c", &code])
        .env("PYTHONPATH", join(path))
        .output()
        .is_ok_and(|o| o.status.success())
}

fn join(paths: &[PathBuf]) -> String {
    paths
        .iter()
        .map(|p| p.display().to_string())
        .chain(std::env::var("PYTHONPATH").ok())
        .collect::<Vec<_>>()
        .join(":")
}
