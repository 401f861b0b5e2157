//! How much of a file range is in the page cache (`mmap` + `mincore`), and what `Direct::Auto`
//! makes of it.

use std::fs::File;
use std::os::unix::io::AsRawFd;
use std::path::Path;

use super::Direct;

/// Ranges up to this many pages are looked at whole; larger ones through evenly spread windows.
pub(crate) const FULL_PAGES: usize = 1 << 18;
/// Windows sampled in a larger range (pages per window: the budget over this, `FULL_PAGES /
/// WINDOWS` for one file).
const WINDOWS: usize = 1024;
/// The pages looked at over all the shards of a checkpoint of several (each gets its share, at
/// least [`SHARD_PAGES`]): `mincore` costs about 40 ns a page of page cache (a whole 1 GB
/// shard, 10 ms; six of them cost 60 ms of a 180 ms load on an H200 host), and a decision at
/// half resident needs no more.
pub(crate) const CHECKPOINT_PAGES: usize = 1 << 16;
/// The fewest pages looked at in one shard of a checkpoint.
pub(crate) const SHARD_PAGES: usize = 1 << 8;

/// [`Direct::Auto`] reads with `O_DIRECT` only where the data region is at least this large: below
/// it, a cold read costs little either way and the page cache keeps it for the next load.
pub const AUTO_DIRECT_MIN_BYTES: u64 = 64 << 20;
/// ... and less than this fraction of it is in the page cache.
pub(crate) const AUTO_DIRECT_MAX_RESIDENT: f64 = 0.5;

/// Whether a load reads the data region with `O_DIRECT`: `Never` and `Always` say so; `Auto`
/// does where the region is at least [`AUTO_DIRECT_MIN_BYTES`] and less than half of it is
/// resident (`resident`: the fraction in the page cache, `None` where it could not be found out,
/// which keeps the page cache).
pub(crate) fn wants_direct(mode: Direct, resident: Option<f64>, data_len: u64) -> bool {
    match mode {
        Direct::Never => false,
        Direct::Always => true,
        Direct::Auto => {
            data_len >= AUTO_DIRECT_MIN_BYTES
                && resident.is_some_and(|r| r < AUTO_DIRECT_MAX_RESIDENT)
        }
    }
}

/// The fraction of `[offset, offset + len)` of the file at `path` that is in the page cache
/// (what [`Direct::Auto`] decides by; `mmap` + `mincore`, nothing is read): every page of a
/// range up to 1 GiB (4 KiB pages), 1024 evenly spread windows of 1 MiB of a larger one. `None`
/// where the path is not a regular file (a FIFO, a device, a directory: it is opened without
/// blocking and looked at with `fstat`, never waited on), cannot be mapped, or the range is
/// empty.
pub fn resident_fraction(path: &Path, offset: u64, len: u64) -> Option<f64> {
    if len == 0 {
        return None;
    }
    let (file, _, _) = super::open::open_regular("safetensors::resident_fraction", path).ok()?;
    resident_fraction_of(&file, offset, len)
}

/// [`resident_fraction`] of a file already opened (and checked to be a regular file).
pub(crate) fn resident_fraction_of(file: &File, offset: u64, len: u64) -> Option<f64> {
    resident_fraction_within(file, offset, len, FULL_PAGES)
}

/// As [`resident_fraction_of`], looking at no more than `budget` pages (at least 2): a range of
/// at most `budget` pages whole, a larger one through 1024 evenly spread windows of `budget /
/// 1024` pages (where `budget` is below 1024, `budget` windows of one page).
pub(crate) fn resident_fraction_within(
    file: &File,
    offset: u64,
    len: u64,
    budget: usize,
) -> Option<f64> {
    let budget = budget.max(2);
    if len == 0 {
        return None;
    }
    // SAFETY: sysconf only reads a configuration value.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    let page = u64::try_from(page).ok().filter(|&p| p > 0)?;
    let start = offset - offset % page;
    let end = offset.checked_add(len)?;
    let map_len = usize::try_from(end - start).ok()?;
    let map_off = libc::off_t::try_from(start).ok()?;
    // SAFETY: a new read-only shared mapping of `map_len` bytes of an open file, at a
    // page-aligned offset; nothing in this process reads or writes through it (only `mincore`
    // looks at it), and `Mapping` unmaps it once, below.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            map_len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            map_off,
        )
    };
    if ptr == libc::MAP_FAILED {
        return None;
    }
    let mapping = Mapping { ptr, len: map_len };
    let page = page as usize;
    let pages = map_len.div_ceil(page);
    let windows: Vec<(usize, usize)> = if pages <= budget {
        vec![(0, pages)]
    } else {
        // At least two windows, each of at least one page, together at most `budget` pages.
        let count = WINDOWS.min(budget);
        let size = budget / count;
        let span = pages - size;
        (0..count).map(|i| (span / (count - 1) * i, size)).collect()
    };
    let mut vec = vec![0u8; pages.min(budget)];
    let (mut resident, mut seen) = (0usize, 0usize);
    for (first, n) in windows {
        let bytes = (n * page).min(map_len - first * page);
        // SAFETY: `first * page .. + bytes` lies inside the mapping (first + n <= pages, and
        // the length is cut at its end); `vec` has room for one byte per page of it (n pages,
        // at most its length).
        let rc = unsafe {
            libc::mincore(
                mapping.ptr.cast::<u8>().add(first * page).cast(),
                bytes,
                vec.as_mut_ptr(),
            )
        };
        if rc != 0 {
            return None;
        }
        let n = bytes.div_ceil(page);
        resident += vec[..n].iter().filter(|&&b| b & 1 != 0).count();
        seen += n;
    }
    Some(resident as f64 / seen.max(1) as f64)
}

struct Mapping {
    ptr: *mut libc::c_void,
    len: usize,
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are a mapping made by `mmap` above and unmapped only here.
        unsafe {
            libc::munmap(self.ptr, self.len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn auto_reads_cold_large_regions_directly() {
        let big = AUTO_DIRECT_MIN_BYTES;
        assert!(!wants_direct(Direct::Never, Some(0.0), big));
        assert!(wants_direct(Direct::Always, Some(1.0), 1));
        assert!(wants_direct(Direct::Auto, Some(0.0), big));
        assert!(wants_direct(Direct::Auto, Some(0.49), big * 10));
        assert!(!wants_direct(Direct::Auto, Some(0.5), big));
        assert!(!wants_direct(Direct::Auto, Some(1.0), big));
        assert!(!wants_direct(Direct::Auto, Some(0.0), big - 1));
        assert!(!wants_direct(Direct::Auto, None, big));
    }

    #[test]
    fn a_file_just_written_is_resident() {
        let path = std::env::temp_dir().join(format!(
            "pinstream-residency-{}-{}",
            std::process::id(),
            rand::random::<u64>()
        ));
        let data = vec![7u8; (3 << 20) + 123];
        std::fs::File::create(&path)
            .unwrap()
            .write_all(&data)
            .unwrap();
        // Pages just written sit in the page cache (tmpfs or a disk filesystem alike).
        let whole = resident_fraction(&path, 0, data.len() as u64).unwrap();
        let part = resident_fraction(&path, 5000, 1 << 20).unwrap();
        // Within a budget of pages: sampled, the same answer.
        let (file, _, _) = super::super::open::open_regular("t", &path).unwrap();
        for budget in [0, 2, 3, 100, 1000, 1024, 5000] {
            let f = resident_fraction_within(&file, 0, data.len() as u64, budget).unwrap();
            assert!(f > 0.9, "budget {budget}: {f}");
        }
        let _ = std::fs::remove_file(&path);
        assert!(whole > 0.9 && part > 0.9, "{whole} {part}");
        assert_eq!(resident_fraction(&path, 0, 0), None);
        assert_eq!(resident_fraction(Path::new("/nonexistent/x"), 0, 10), None);
    }
}
