//! The CPUs threads may run on, from procfs (Linux): the calling thread's, and those of this
//! process's `pinstream…` threads.

use std::collections::BTreeSet;

use libtest_mimic::Failed;

fn parse_list(list: &str) -> Result<Vec<usize>, Failed> {
    let mut cpus = Vec::new();
    for part in list.trim().split(',') {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        cpus.extend(a.trim().parse::<usize>()?..=b.trim().parse::<usize>()?);
    }
    Ok(cpus)
}

fn allowed_of(status: &str) -> Result<Vec<usize>, Failed> {
    let list = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
        .ok_or("no Cpus_allowed_list")?;
    parse_list(list)
}

/// CPUs the calling thread may run on.
pub fn thread_cpus() -> Result<Vec<usize>, Failed> {
    allowed_of(&std::fs::read_to_string("/proc/thread-self/status")?)
}

/// This process's threads whose name starts with `pinstream`: ("name (id)", CPUs allowed).
pub fn pinstream_threads() -> Result<Vec<(String, Vec<usize>)>, Failed> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc/self/task")? {
        let dir = e?.path();
        // A thread may end between the listing and the reads.
        let (Ok(comm), Ok(status)) = (
            std::fs::read_to_string(dir.join("comm")),
            std::fs::read_to_string(dir.join("status")),
        ) else {
            continue;
        };
        if comm.starts_with("pinstream") {
            let id = dir.file_name().map(|n| n.to_string_lossy().into_owned());
            out.push((
                format!("{} ({})", comm.trim(), id.unwrap_or_default()),
                allowed_of(&status)?,
            ));
        }
    }
    Ok(out)
}

/// The names ("name (id)") of this process's `pinstream…` threads now.
pub fn pinstream_thread_names() -> Result<BTreeSet<String>, Failed> {
    Ok(pinstream_threads()?.into_iter().map(|t| t.0).collect())
}

/// Fails unless there is a `pinstream…` thread not in `before`, and every such thread runs on
/// exactly `want`.
pub fn new_threads_on(before: &BTreeSet<String>, want: &[usize], what: &str) -> Result<(), Failed> {
    let new: Vec<_> = pinstream_threads()?
        .into_iter()
        .filter(|t| !before.contains(&t.0))
        .collect();
    if new.is_empty() {
        return Err(format!("{what}: no new pinstream threads").into());
    }
    for (name, cpus) in &new {
        if cpus != want {
            return Err(format!("{what}: {name} runs on {cpus:?}, not {want:?}").into());
        }
    }
    Ok(())
}
