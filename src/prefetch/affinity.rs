//! CPU affinity for the prefetcher's threads: binding the calling
//! thread to them for a while, so that threads it spawns (which inherit the mask) and the
//! page-locked memory they first touch stay on the GPU's NUMA node, or on the CPUs the caller
//! chose ([`PrefetchConfig::cpus`](super::PrefetchConfig::cpus), [`CpuBinding`]).

use std::marker::PhantomData;

use crate::device::topology::SET_SIZE;
use crate::error::{Error, Result};

fn empty_set() -> libc::cpu_set_t {
    // SAFETY: `cpu_set_t` is a plain bit array; all zeros is the empty set.
    unsafe { std::mem::zeroed() }
}

fn current() -> Result<libc::cpu_set_t> {
    let mut set = empty_set();
    // SAFETY: `set` is a valid, writable `cpu_set_t` of the size passed; pid 0 is this thread.
    let r = unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    if r != 0 {
        return Err(Error::invalid(
            "sched_getaffinity",
            std::io::Error::last_os_error().to_string(),
        ));
    }
    Ok(set)
}

fn apply(set: &libc::cpu_set_t) -> Result<()> {
    // SAFETY: `set` is a valid `cpu_set_t` of the size passed; pid 0 is this thread.
    let r = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), set) };
    if r != 0 {
        return Err(Error::invalid(
            "sched_setaffinity",
            std::io::Error::last_os_error().to_string(),
        ));
    }
    Ok(())
}

/// The calling thread bound to some CPUs until it drops, when its earlier mask comes back.
#[derive(Debug)]
pub(crate) struct Bound {
    saved: libc::cpu_set_t,
}

impl Drop for Bound {
    fn drop(&mut self) {
        // Best effort: a mask that was valid a moment ago.
        let _ = apply(&self.saved);
    }
}

/// The most entries [`PrefetchConfig::cpus`](super::PrefetchConfig::cpus) may have, and one past
/// the highest CPU it may name: what the OS's CPU set holds (`CPU_SETSIZE`).
pub const MAX_CPUS: usize = SET_SIZE;

/// Why a CPU list cannot be used, checked without the OS: empty, longer than [`MAX_CPUS`], or
/// naming a CPU at or past it.
pub(crate) fn check_cpus(cpus: &[usize]) -> std::result::Result<(), String> {
    if cpus.is_empty() {
        return Err("cpus is empty (None runs the threads where the caller may run)".into());
    }
    if cpus.len() > MAX_CPUS {
        return Err(format!(
            "cpus has {} entries, more than {MAX_CPUS}",
            cpus.len()
        ));
    }
    if let Some(&c) = cpus.iter().find(|&&c| c >= MAX_CPUS) {
        return Err(format!(
            "cpus names CPU {c}, past the last one ({})",
            MAX_CPUS - 1
        ));
    }
    Ok(())
}

/// The calling thread bound to exactly the CPUs it was given, until this drops, when its
/// earlier mask comes back. Threads it starts meanwhile keep the mask: this is how a
/// prefetcher's or an image feed's threads are put on chosen CPUs (for example, off the CPU
/// the training thread was pinned to).
///
/// Not `Send`: the mask it restores is its own thread's. Bindings nest: drop them in the
/// reverse order of making them, as scopes do (each restores the mask it found, so dropping an
/// outer one first leaves the thread on the mask the inner one found). A binding that is never
/// dropped (`mem::forget`) leaves the thread, and every thread it starts later, bound.
///
/// The CPUs are not narrowed by the process's own affinity (`taskset`, `numactl
/// --physcpubind`, a job scheduler's binding): the threads go where they are told. Only CPUs
/// outside the process's cgroup cpuset (a container's CPUs) are left out, by the OS.
#[derive(Debug)]
pub struct CpuBinding {
    _bound: Bound,
    _not_send: PhantomData<*const ()>,
}

impl CpuBinding {
    /// Binds the calling thread to `cpus` (any order, repeats allowed), whatever its own mask
    /// is now: CPUs outside the process's cgroup cpuset (a container's) are left out by the
    /// OS. An `Error::InvalidArgument` when the list is empty, too long, names a CPU at or past
    /// [`MAX_CPUS`], or names none the OS lets this process run on (none that exists, or none
    /// in its cpuset); nothing changes then.
    pub fn bind(cpus: &[usize]) -> Result<CpuBinding> {
        check_cpus(cpus).map_err(|r| Error::invalid("CpuBinding::bind", r))?;
        let saved = current()?;
        let mut set = empty_set();
        for &c in cpus {
            // SAFETY: `c < SET_SIZE` was checked above, so it is inside the bit array.
            unsafe { libc::CPU_SET(c, &mut set) };
        }
        apply(&set).map_err(|_| {
            Error::invalid(
                "CpuBinding::bind",
                format!("none of cpus {cpus:?} is one this process may run on"),
            )
        })?;
        Ok(CpuBinding {
            _bound: Bound { saved },
            _not_send: PhantomData,
        })
    }
}

/// Binds the calling thread to those of `cpus` it may run on now. `Ok(None)` (nothing changed)
/// when none of them are allowed (a container's cpuset, say) or the list is empty.
pub(crate) fn bind(cpus: &[usize]) -> Result<Option<Bound>> {
    let saved = current()?;
    let mut set = empty_set();
    let mut any = false;
    for &c in cpus {
        // SAFETY: `c < SET_SIZE` is checked, so both stay inside the bit array.
        if c < SET_SIZE && unsafe { libc::CPU_ISSET(c, &saved) } {
            // SAFETY: as above.
            unsafe { libc::CPU_SET(c, &mut set) };
            any = true;
        }
    }
    if !any {
        return Ok(None);
    }
    apply(&set)?;
    Ok(Some(Bound { saved }))
}

/// CPUs of the calling thread's mask.
#[cfg(test)]
pub(crate) fn allowed() -> Result<Vec<usize>> {
    let set = current()?;
    // SAFETY: every index is below SET_SIZE.
    Ok((0..SET_SIZE)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_binding_is_exact_and_checked() {
        let before = allowed().unwrap();
        let last = *before.last().unwrap();
        {
            // Narrow first (as a training thread pinned to one CPU), then bind to another set:
            // the binding is not narrowed by the caller's own mask.
            let _narrow = bind(&[before[0]]).unwrap();
            let b = CpuBinding::bind(&[last, last]).unwrap();
            assert_eq!(allowed().unwrap(), vec![last]);
            let inner = std::thread::spawn(|| allowed().unwrap()).join().unwrap();
            assert_eq!(inner, vec![last]);
            drop(b);
            assert_eq!(allowed().unwrap(), vec![before[0]]);
        }
        assert_eq!(allowed().unwrap(), before);
        for bad in [
            vec![],
            vec![MAX_CPUS],
            vec![0, usize::MAX],
            vec![0; MAX_CPUS + 1],
        ] {
            let e = CpuBinding::bind(&bad).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument { .. }), "{bad:?}: {e}");
            assert_eq!(allowed().unwrap(), before);
        }
        // A CPU the machine does not have (below MAX_CPUS): refused by the OS, typed.
        if before.len() < MAX_CPUS - 1 {
            let e = CpuBinding::bind(&[MAX_CPUS - 1]).unwrap_err();
            assert!(e.to_string().contains("may run on"), "{e}");
            assert_eq!(allowed().unwrap(), before);
        }
    }

    #[test]
    fn bind_restores_the_mask() {
        let before = allowed().unwrap();
        let first = before[0];
        {
            let b = bind(&[first]).unwrap();
            assert!(b.is_some());
            assert_eq!(allowed().unwrap(), vec![first]);
            // A spawned thread inherits the mask.
            let inner = std::thread::spawn(|| allowed().unwrap()).join().unwrap();
            assert_eq!(inner, vec![first]);
        }
        assert_eq!(allowed().unwrap(), before);
        // CPUs outside the mask (or beyond any set) change nothing.
        assert!(bind(&[SET_SIZE + 5]).unwrap().is_none());
        assert_eq!(allowed().unwrap(), before);
    }
}
