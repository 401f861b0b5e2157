//! Hostile trials of issue 30 on the repository's own wiring, CPU only: the integration tests
//! became nine binaries by subject (`cargo test --test <subject>`), and every script or guide
//! that names a test executable must name one that still exists. A name that no longer exists
//! makes the command it is part of fail on the GPU machine (`.gpu/test/<name>-*` matches
//! nothing) or silently run nothing.
//!
//! `finding/...`: broke when written; `held/...`: held.

use std::path::{Path, PathBuf};

use crate::common::{ensure, trial, R};
use libtest_mimic::Trial;

/// Prefix of this module's trial names (its path in the binary).
const PREFIX: &str = "hostile30/";

pub fn trials() -> Vec<Trial> {
    vec![
        trial(
            PREFIX,
            "finding/pack_cudarc_names_test_executables_that_exist",
            pack_cudarc_names_existing_binaries,
        ),
        trial(
            PREFIX,
            "held/tests_readme_names_the_binaries_cargo_builds",
            readme_names_existing_binaries,
        ),
        trial(
            PREFIX,
            "finding/safety_ledger_and_guides_name_test_files_that_exist",
            docs_name_existing_test_files,
        ),
        trial(
            PREFIX,
            "finding/doc_examples_of_the_core_use_root_paths_that_exist",
            doc_examples_use_existing_root_paths,
        ),
    ]
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The `[[test]]` names of the top Cargo.toml.
fn test_names(root: &Path) -> Result<Vec<String>, String> {
    let toml = std::fs::read_to_string(root.join("Cargo.toml")).map_err(|e| e.to_string())?;
    let mut names = Vec::new();
    let mut in_test = false;
    for line in toml.lines() {
        let l = line.trim();
        if l.starts_with('[') {
            in_test = l == "[[test]]";
            continue;
        }
        if in_test {
            if let Some(v) = l.strip_prefix("name = ") {
                names.push(v.trim_matches('"').to_string());
            }
        }
    }
    Ok(names)
}

/// Every `.gpu/test/<name>-*` in `text`.
fn packed_names(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find(".gpu/test/") {
        rest = &rest[i + ".gpu/test/".len()..];
        let name: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() && rest[name.len()..].starts_with("-*") {
            out.push(name);
        }
    }
    out
}

/// scripts/pack-cudarc.sh packs the interop executable (the cudarc trials moved into it) and
/// ends by printing the command to run on the device: every executable it names there must be
/// one cargo builds. It still prints `.gpu/test/cudarc-*` (the binary before issue 30), so the
/// printed command fails at once on the device and never runs `to_cudarc`.
fn pack_cudarc_names_existing_binaries() -> R {
    let root = repo();
    let names = test_names(&root)?;
    let script = std::fs::read_to_string(root.join("scripts/pack-cudarc.sh"))
        .map_err(|e| format!("scripts/pack-cudarc.sh: {e}"))?;
    let named = packed_names(&script);
    ensure(!named.is_empty(), || {
        "the script names no test executable".into()
    })?;
    let missing: Vec<&String> = named.iter().filter(|n| !names.contains(n)).collect();
    ensure(missing.is_empty(), || {
        format!(
            "scripts/pack-cudarc.sh names test executables that no longer exist: {missing:?} \
             (the [[test]] targets are {names:?})"
        )
    })
}

/// tests/README.md lists the binaries by subject: each `--test <name>` it gives exists.
fn readme_names_existing_binaries() -> R {
    let root = repo();
    let names = test_names(&root)?;
    let readme = std::fs::read_to_string(root.join("tests/README.md"))
        .map_err(|e| format!("tests/README.md: {e}"))?;
    let mut bad = Vec::new();
    for w in readme.split("--test ").skip(1) {
        let name: String = w
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() && name != "vision" && !names.contains(&name) {
            bad.push(name);
        }
    }
    ensure(bad.is_empty(), || {
        format!("tests/README.md names test binaries that do not exist: {bad:?}")
    })
}

/// Every `tests/<path>.rs` (and `cli/tests/<path>.rs`) and `src/<path>.rs` that SAFETY.md (the
/// soundness ledger, which says which code and which trials back each guarantee and where they
/// live) and the guides in docs/ name, every unit-test module they cite (`a::b::tests::*`), and
/// every `.gpu/test/<name>-*` executable their commands run, exists. After issue 30, SAFETY.md
/// still maps trial prefixes to `tests/gpu.rs`, `tests/hostile_interop.rs`, ..., points the
/// kernel tables' guarantee at `src/memory/ring.rs` and `memory::ring::tests::*` (now
/// `kernels::ring`), the bounce buffers at `src/memory/bounce.rs`, the downloads' tests at
/// `memory::download::tests` (now `copy::...`); docs/development.md still runs
/// `compute-sanitizer ... .gpu/test/gpu-*` (no such executable: the command fails).
fn docs_name_existing_test_files() -> R {
    let root = repo();
    let names = test_names(&root)?;
    let mut files = vec![root.join("SAFETY.md"), root.join("README.md")];
    if let Ok(rd) = std::fs::read_dir(root.join("docs")) {
        files.extend(
            rd.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "md")),
        );
    }
    let mut bad = Vec::new();
    for f in &files {
        let Ok(text) = std::fs::read_to_string(f) else {
            continue;
        };
        let short = f.strip_prefix(&root).unwrap_or(f).display().to_string();
        for (i, _) in text.match_indices("tests/") {
            // The path as written: up to the first character that cannot be in one.
            let start = text[..i]
                .rfind(|c: char| !(c.is_ascii_alphanumeric() || "_/.-".contains(c)))
                .map_or(0, |k| k + 1);
            let end = i + text[i..]
                .find(|c: char| !(c.is_ascii_alphanumeric() || "_/.-".contains(c)))
                .unwrap_or(text.len() - i);
            let path = text[start..end].trim_end_matches('.');
            if path.ends_with(".rs")
                && !path.contains("..")
                && !path.starts_with('/')
                && !root.join(path).exists()
            {
                bad.push(format!("{short}: {path}"));
            }
        }
        for name in packed_names(&text) {
            if !names.contains(&name) {
                bad.push(format!("{short}: .gpu/test/{name}-*"));
            }
        }
        // Source files the ledger points at (`src/...rs`).
        for (i, _) in text.match_indices("src/") {
            let start = text[..i]
                .rfind(|c: char| !(c.is_ascii_alphanumeric() || "_/.-".contains(c)))
                .map_or(0, |k| k + 1);
            let end = i + text[i..]
                .find(|c: char| !(c.is_ascii_alphanumeric() || "_/.-".contains(c)))
                .unwrap_or(text.len() - i);
            let path = text[start..end].trim_end_matches('.');
            if path.ends_with(".rs")
                && !path.starts_with('/')
                && !path.contains("..")
                && !root.join(path).exists()
            {
                bad.push(format!("{short}: {path}"));
            }
        }
        // Unit tests it cites as `a::b::tests::*`: the module must exist and have tests.
        for (i, _) in text.match_indices("::tests::") {
            let start = text[..i]
                .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
                .map_or(0, |k| k + 1);
            let module = &text[start..i];
            if module.is_empty() {
                continue;
            }
            let rel = module.replace("::", "/");
            let found = [format!("src/{rel}.rs"), format!("src/{rel}/mod.rs")]
                .iter()
                .any(|p| {
                    std::fs::read_to_string(root.join(p)).is_ok_and(|t| t.contains("mod tests"))
                });
            if !found {
                bad.push(format!("{short}: unit tests {module}::tests"));
            }
        }
    }
    bad.sort();
    bad.dedup();
    ensure(bad.is_empty(), || {
        format!(
            "{} test files or executables named in the docs do not exist: {bad:#?}",
            bad.len()
        )
    })
}

/// The names at the crate root: `pub mod x;` and the names of `pub use ...;` in src/lib.rs.
fn root_names(root: &Path) -> Result<Vec<String>, String> {
    let lib = std::fs::read_to_string(root.join("src/lib.rs")).map_err(|e| e.to_string())?;
    let mut names = Vec::new();
    let mut stmt = String::new();
    for line in lib.lines() {
        let l = line.trim();
        if let Some(m) = l.strip_prefix("pub mod ") {
            names.push(m.trim_end_matches(';').to_string());
            continue;
        }
        if l.starts_with("pub use ") || !stmt.is_empty() {
            stmt.push_str(l);
            stmt.push(' ');
            if l.ends_with(';') {
                let body = stmt
                    .trim()
                    .trim_start_matches("pub use ")
                    .trim_end_matches(';');
                let list = match body.find('{') {
                    Some(i) => body[i + 1..].trim_end_matches('}').to_string(),
                    None => body.rsplit("::").next().unwrap_or("").to_string(),
                };
                for n in list.split(',') {
                    let n = n.trim();
                    let n = n.rsplit(" as ").next().unwrap_or(n).trim();
                    if !n.is_empty() && n != "self" {
                        names.push(n.to_string());
                    }
                }
                stmt.clear();
            }
        }
    }
    Ok(names)
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// Every `pinstream::<name>` in a compiled doc example (```` ``` ````, ```` ```no_run ````) of
/// the core's sources names something at the crate root. After the moves of issue 30,
/// `kernels::resized_crop`'s example still uses `pinstream::augment` (now pinstream-vision's)
/// and `driver::DriverStatus`'s example `pinstream::DriverStatus` / `DriverVerdict` (now under
/// `pinstream::driver`): both doctests fail to compile, so `cargo test` at the top (the README's
/// and CI's test command, which runs the library's doctests) fails.
fn doc_examples_use_existing_root_paths() -> R {
    let root = repo();
    let names = root_names(&root)?;
    ensure(names.iter().any(|n| n == "Stream"), || {
        format!("could not read the root names of src/lib.rs: {names:?}")
    })?;
    let mut files = Vec::new();
    rust_files(&root.join("src"), &mut files);
    files.sort();
    let mut bad = Vec::new();
    for f in &files {
        let Ok(text) = std::fs::read_to_string(f) else {
            continue;
        };
        let short = f.strip_prefix(&root).unwrap_or(f).display().to_string();
        let mut in_code = false;
        let mut compiled = false;
        for (i, line) in text.lines().enumerate() {
            let l = line.trim_start();
            let Some(doc) = l.strip_prefix("///").or_else(|| l.strip_prefix("//!")) else {
                continue;
            };
            let doc = doc.trim();
            if let Some(info) = doc.strip_prefix("```") {
                if in_code {
                    in_code = false;
                } else {
                    in_code = true;
                    let info = info.trim();
                    compiled = info.is_empty()
                        || info == "rust"
                        || info.split(',').all(|t| {
                            matches!(t.trim(), "rust" | "no_run" | "should_panic" | "edition2021")
                        });
                }
                continue;
            }
            if !(in_code && compiled) {
                continue;
            }
            for (k, _) in doc.match_indices("pinstream::") {
                let name: String = doc[k + "pinstream::".len()..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                if !name.is_empty() && !names.contains(&name) {
                    bad.push(format!("{short}:{}: pinstream::{name}", i + 1));
                }
            }
        }
    }
    ensure(bad.is_empty(), || {
        format!("doc examples use paths that are not at the crate root: {bad:#?}")
    })
}

// Public paths of db48e29 that issue 30 keeps (hostile review, finding 2): this binary does not
// compile if they stop resolving.
#[allow(unused_imports)]
use pinstream::kernels::cpu::{DenormInput as _, OutputElement as _};
#[allow(unused_imports)]
use pinstream::memory::{Download as _, DownloadTarget as _};
