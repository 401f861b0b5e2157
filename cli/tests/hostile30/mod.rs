//! Hostile trials of issue 30 against the Python package's test runner, `cli/tests/python.rs`
//! (the `python` test binary of this crate, which replaced `python/tests/pytest.rs` when the
//! Python package stopped being a default member): how it reads libtest's arguments. It has one
//! test, `pytest`; it must run it unless the arguments filter it out, and must not run it when
//! they do.
//!
//! Each trial runs a private copy of the runner binary (found beside this test executable, the
//! newest `python-<hash>`; ignored where none was built) in a folder of its own, with `CARGO`
//! unset (so it builds nothing) and `PINSTREAM_PYTHON=/bin/false`: a runner that goes past its
//! filter prints something (that the extension is missing), one that filtered its test out
//! prints nothing and exits 0.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::{ensure, R};
use libtest_mimic::{Completion, Trial};

/// Prefix of this module's trial names.
const PREFIX: &str = "hostile30/";

pub fn trials() -> Vec<Trial> {
    let t = |name: &str, f: fn(&Path) -> R| {
        Trial::ignorable_test(format!("{PREFIX}{name}"), move || {
            match runner() {
            Some(bin) => f(&bin).map(|()| Completion::Completed),
            None => Ok(Completion::ignored_with(
                "no python runner beside this test (cargo test -p pinstream-cli --test python --no-run)"
                    .to_string(),
            )),
        }
        })
    };
    vec![
        t(
            "finding/python_runner_skips_pytest_when_given_test_threads_n",
            test_threads_value_is_not_a_filter,
        ),
        t(
            "finding/python_runner_runs_pytest_despite_skip_pytest",
            skip_pytest_is_honoured,
        ),
        t(
            "held/python_runner_filters_out_other_names",
            other_names_filter_out,
        ),
    ]
}

/// The newest `python-<hash>` executable in this test executable's folder (cargo's deps/).
fn runner() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let deps = exe.parent()?;
    std::fs::read_dir(deps)
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            name.starts_with("python-") && p.extension().is_none()
        })
        .filter_map(|p| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p)))
        .max_by_key(|(t, _)| *t)
        .map(|(_, p)| p)
}

/// Runs the runner with `args`; whether it went past its filter (printed anything), and its
/// status.
fn run(bin: &Path, args: &[&str]) -> Result<(bool, String), libtest_mimic::Failed> {
    // One at a time: a copy written while another trial's thread forks would be held open for
    // writing in that child, and executing it would fail (ETXTBSY).
    static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    // A private copy, in a layout of its own (`<dir>/debug/deps/`): a runner that goes on finds
    // no extension there and says so, and touches nothing of the real target dir (it would
    // remove and refill `<profile>/python-test`, which other builds share).
    let dir = std::env::temp_dir().join(format!(
        "pinstream-hostile30-{}-{}",
        std::process::id(),
        args.join("_").replace(['/', ' '], "")
    ));
    let deps = dir.join("debug/deps");
    std::fs::create_dir_all(&deps).map_err(|e| format!("{}: {e}", deps.display()))?;
    let copy = deps.join("python-0000000000000000");
    std::fs::copy(bin, &copy).map_err(|e| format!("copy {}: {e}", bin.display()))?;
    // Other trials of this binary fork too: retry while the copy is busy (ETXTBSY).
    let mut tries = 0;
    let out = loop {
        match Command::new(&copy)
            .args(args)
            .env_remove("CARGO")
            .env("PINSTREAM_PYTHON", "/bin/false")
            .output()
        {
            Err(e) if e.raw_os_error() == Some(26) && tries < 50 => {
                tries += 1;
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            r => break r.map_err(|e| format!("{}: {e}", copy.display()))?,
        }
    };
    let _ = std::fs::remove_dir_all(&dir);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let went_on = !text.trim().is_empty() || !out.status.success();
    Ok((
        went_on,
        format!("status {:?}, output {:?}", out.status, text.trim()),
    ))
}

/// `cargo test -- --test-threads 1` (libtest's option, its value as a separate argument, which
/// libtest accepts) is not a name filter: the runner must still run pytest. It takes the `1`
/// for a test name that `pytest` does not contain and reports success without running
/// anything, so the whole Python suite silently disappears from such a run.
fn test_threads_value_is_not_a_filter(bin: &Path) -> R {
    for args in [
        &["--test-threads", "1"][..],
        &["--format", "terse"][..],
        &["--skip", "nothing_called_this"][..],
    ] {
        let (went_on, what) = run(bin, args)?;
        ensure(went_on, || {
            format!("with {args:?} the runner filtered pytest out without running it: {what}")
        })?;
    }
    Ok(())
}

/// `cargo test -- --skip pytest` (or `--skip=py`, or `--ignored`) must not run pytest; the
/// runner takes `pytest` for a name filter that matches, ignores `--skip=...` and `--ignored`,
/// and runs the suite.
fn skip_pytest_is_honoured(bin: &Path) -> R {
    // `--ignored` runs only ignored tests, and `pytest` is not one.
    for args in [
        &["--skip", "pytest"][..],
        &["--ignored"][..],
        &["--skip=py"][..],
    ] {
        let (went_on, what) = run(bin, args)?;
        ensure(!went_on, || {
            format!("with {args:?} the runner still went on to run pytest: {what}")
        })?;
    }
    Ok(())
}

/// A name filter that `pytest` does not contain filters it out (the case the runner handles).
fn other_names_filter_out(bin: &Path) -> R {
    let (went_on, what) = run(bin, &["dlpack"])?;
    ensure(!went_on, || {
        format!("with the filter `dlpack` the runner still went on: {what}")
    })?;
    let (went_on, what) = run(bin, &["--list"])?;
    ensure(went_on && what.contains("pytest: test"), || {
        format!("--list: {what}")
    })
}
