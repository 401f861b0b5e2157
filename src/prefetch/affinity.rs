//! CPU affinity for the prefetcher's threads: binding the calling
//! thread to them for a while, so that threads it spawns (which inherit the mask) and the
//! page-locked memory they first touch stay on the GPU's NUMA node.

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
