//! Ordinary (pageable, never registered) memory in an anonymous mapping advised
//! `MADV_HUGEPAGE` and pre-faulted on several threads: the alternative source that
//! [`staging::compare`](super::staging::compare) measures staged and plain copies from.

use std::sync::{Mutex, PoisonError};

use memmap2::{Advice, MmapMut};
use pinstream::Result;

use super::invalid;

/// A transparent huge page on x86-64.
const HUGE_PAGE: usize = 2 << 20;
/// The base page, the step at which pages are faulted in.
const PAGE: usize = 4096;

/// `len` bytes of anonymous memory, aligned to a huge page and advised to use them.
pub struct HugePageBuf {
    map: MmapMut,
    off: usize,
    len: usize,
}

impl std::fmt::Debug for HugePageBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HugePageBuf")
            .field("len", &self.len)
            .finish_non_exhaustive()
    }
}

impl HugePageBuf {
    /// `len` bytes (at least 1), zeroed and faulted in on up to `threads` threads. Where
    /// transparent huge pages are off the advice fails quietly and small pages are used.
    pub fn new(len: usize, threads: usize) -> Result<HugePageBuf> {
        const OP: &str = "HugePageBuf::new";
        let len = len.max(1);
        // A huge page more than needed, so that an aligned start fits.
        let padded = len
            .checked_add(HUGE_PAGE)
            .ok_or_else(|| invalid(OP, format!("{len} bytes plus alignment overflow usize")))?;
        let mut map = MmapMut::map_anon(padded)
            .map_err(|e| invalid(OP, format!("mmap of {padded} bytes failed: {e}")))?;
        let off = (map.as_ptr() as usize).wrapping_neg() % HUGE_PAGE;
        // Advice only.
        let _ = map.advise_range(Advice::HugePage, off, len);
        prefault(&mut map[off..off + len], threads);
        Ok(HugePageBuf { map, off, len })
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.map[self.off..self.off + self.len]
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.map[self.off..self.off + self.len]
    }
}

/// Faults in every page of `buf` by writing one byte per page, on up to `threads` threads (the
/// calling one included; one that cannot be started leaves its share to the others).
fn prefault(buf: &mut [u8], threads: usize) {
    let pages = buf.len().div_ceil(PAGE);
    if pages == 0 {
        return;
    }
    let threads = threads.clamp(1, pages);
    let per = pages.div_ceil(threads) * PAGE;
    let work = Mutex::new(buf.chunks_mut(per).collect::<Vec<_>>());
    let next = || work.lock().unwrap_or_else(PoisonError::into_inner).pop();
    let run = || {
        while let Some(chunk) = next() {
            for b in chunk.iter_mut().step_by(PAGE) {
                *b = 0;
            }
            std::hint::black_box(chunk);
        }
    };
    std::thread::scope(|scope| {
        for _ in 1..threads {
            if std::thread::Builder::new()
                .spawn_scoped(scope, run)
                .is_err()
            {
                break;
            }
        }
        run();
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_zeroed_and_writable() {
        for (len, threads) in [(1, 1), ((5 << 20) + 3 * 4096 + 7, 3), (64 << 10, 64)] {
            let mut b = HugePageBuf::new(len, threads).unwrap();
            assert_eq!(b.as_slice().as_ptr() as usize % HUGE_PAGE, 0);
            assert_eq!(b.as_slice().len(), len);
            assert!(b.as_slice().iter().all(|&x| x == 0));
            b.as_mut_slice()[len - 1] = 9;
            assert_eq!(b.as_slice()[len - 1], 9);
        }
    }
}
