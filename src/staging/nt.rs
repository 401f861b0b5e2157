//! Host copies that write with non-temporal (streaming) stores.
//!
//! A normal store first reads the destination's cache line from memory (read for ownership),
//! so copying `n` bytes costs `3n` bytes of memory traffic; a streaming store writes the line
//! without reading it, `2n`. The staging engine's host side is bound by memory traffic (a pinned
//! slot is written by a worker and read by the DMA at the same time), and its destinations are
//! not read again by the CPU soon, so it fills slots (and, on the way back, the caller's
//! buffer) this way. x86-64 only (SSE2, always present there); elsewhere a plain copy.

/// Below this a plain copy: the fence and the alignment head cost more than they save.
const MIN_STREAM: usize = 4096;

/// Copies `src` into `dst` with streaming stores and a fence (x86-64, from 4 KiB; below that,
/// and on other targets, a plain copy, whose stores are ordered anyway): for a destination the
/// CPU does not read again soon, such as page-locked memory a DMA reads next, it costs two
/// bytes of memory traffic per byte instead of three. Very large copies can be slower (the
/// staging engine streams only up to `StagerConfig::streaming_max_bytes`, 256 MiB by default,
/// after 1 GiB measured 9 % slower). `Err` (nothing copied) where the lengths differ.
pub fn copy_streaming(dst: &mut [u8], src: &[u8]) -> crate::Result<()> {
    if dst.len() != src.len() {
        return Err(crate::Error::invalid(
            "staging::copy_streaming",
            format!(
                "the destination has {} bytes, the source {}",
                dst.len(),
                src.len()
            ),
        ));
    }
    // SAFETY: two live slices of `src.len()` bytes; `dst` is borrowed mutably, so the two do
    // not overlap.
    unsafe { copy(dst.as_mut_ptr(), src.as_ptr(), src.len()) };
    Ok(())
}

/// Copies `len` bytes from `src` to `dst` with streaming stores where the target allows, and
/// fences, so the bytes are visible to a DMA queued after the return.
///
/// # Safety
/// As `std::ptr::copy_nonoverlapping`: `src` readable and `dst` writable for `len` bytes, the
/// ranges disjoint.
pub(crate) unsafe fn copy(dst: *mut u8, src: *const u8, len: usize) {
    #[cfg(target_arch = "x86_64")]
    if len >= MIN_STREAM {
        // SAFETY: the caller's contract is this function's.
        unsafe { copy_x86(dst, src, len) };
        return;
    }
    // SAFETY: the caller's contract is `copy_nonoverlapping`'s.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) };
}

#[cfg(target_arch = "x86_64")]
unsafe fn copy_x86(dst: *mut u8, src: *const u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    // Plain copy up to the first 16-byte boundary of the destination.
    let head = dst.align_offset(16).min(len);
    // SAFETY: `head <= len`, inside both ranges (caller's contract).
    unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
    let mut off = head;
    // 64 bytes (one cache line) per step.
    while len - off >= 64 {
        // SAFETY: `off + 64 <= len`, so the loads read inside `src` and the stores write inside
        // `dst`; `dst + off` is 16-byte aligned (`head` aligned it and steps are multiples of
        // 16), as `_mm_stream_si128` requires; unaligned loads have no alignment requirement.
        unsafe {
            let s = src.add(off).cast::<__m128i>();
            let d = dst.add(off).cast::<__m128i>();
            let a = _mm_loadu_si128(s);
            let b = _mm_loadu_si128(s.add(1));
            let c = _mm_loadu_si128(s.add(2));
            let e = _mm_loadu_si128(s.add(3));
            _mm_stream_si128(d, a);
            _mm_stream_si128(d.add(1), b);
            _mm_stream_si128(d.add(2), c);
            _mm_stream_si128(d.add(3), e);
        }
        off += 64;
    }
    // SAFETY: the remaining `len - off` bytes lie inside both ranges.
    unsafe { std::ptr::copy_nonoverlapping(src.add(off), dst.add(off), len - off) };
    // Streaming stores are weakly ordered: make them visible before anything that follows
    // (the runtime call that queues the DMA, or the caller reading its buffer).
    // SAFETY: a fence has no memory-safety preconditions (SSE2 is part of x86-64).
    unsafe { _mm_sfence() };
}

#[cfg(test)]
mod tests {
    /// The safe form copies exactly and refuses different lengths with nothing written.
    #[test]
    fn copy_streaming_checks_lengths() {
        let src: Vec<u8> = (0..100_000u32).map(|i| (i * 13 + 5) as u8).collect();
        let mut dst = vec![0x55u8; 100_000];
        super::copy_streaming(&mut dst[..], &src[..]).unwrap();
        assert_eq!(dst, src);
        let mut short = vec![0x55u8; 99_999];
        assert!(super::copy_streaming(&mut short, &src).is_err());
        assert!(short.iter().all(|&b| b == 0x55));
    }

    /// Every alignment of both sides and lengths around the thresholds; the bytes around the
    /// destination stay untouched.
    #[test]
    fn copies_exactly() {
        let src: Vec<u8> = (0..20_000u32).map(|i| (i * 7 + 3) as u8).collect();
        for len in [0, 1, 15, 63, 64, 4095, 4096, 4097, 4160, 9999, 16_384] {
            for so in 0..17 {
                for dof in 0..17 {
                    let mut dst = vec![0xAAu8; len + 64];
                    // SAFETY: both ranges lie inside their vectors and are disjoint.
                    unsafe { super::copy(dst.as_mut_ptr().add(dof), src.as_ptr().add(so), len) };
                    assert!(dst[..dof].iter().all(|&b| b == 0xAA));
                    assert_eq!(&dst[dof..dof + len], &src[so..so + len], "len {len}");
                    assert!(dst[dof + len..].iter().all(|&b| b == 0xAA));
                }
            }
        }
    }
}
