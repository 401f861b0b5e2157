//! Unit tests of the pool: size classes, backing allocations, accounting.

use super::backing::{map_anonymous, page_size, prefault, unmap, HUGE_PAGE};
use super::*;

#[test]
fn handles_cross_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<PinnedPool>();
    send_sync::<PoolBlock<u8>>();
    send_sync::<PoolBlock<crate::f16>>();
}

#[test]
fn class_examples() {
    assert_eq!(class_of(0), Some(0));
    assert_eq!(class_of(1), Some(4096));
    assert_eq!(class_of(4096), Some(4096));
    assert_eq!(class_of(4097), Some(8192));
    assert_eq!(class_of(32 << 10), Some(32 << 10));
    assert_eq!(class_of((32 << 10) + 1), Some(36 << 10));
    assert_eq!(class_of(1 << 20), Some(1 << 20));
    assert_eq!(class_of((1 << 20) + 1), Some((1 << 20) + (128 << 10)));
    assert_eq!(class_of((2 << 20) - 1), Some(2 << 20));
    assert_eq!(class_of(usize::MAX), None);
    assert_eq!(class_of(usize::MAX - 4095), None);
}

/// xorshift, so the property runs over sizes of every magnitude without a dependency.
fn sizes() -> impl Iterator<Item = usize> {
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let random = std::iter::from_fn(move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        // A random magnitude, then a random value below it.
        let bits = (x % 63) as u32 + 1;
        Some((x >> 1) as usize & ((1usize << bits.min(usize::BITS - 1)) - 1))
    });
    let edges = (0..usize::BITS - 1).flat_map(|k| {
        let p = 1usize << k;
        [p - 1, p, p + 1, p + p / 8, p + p / 8 + 1]
    });
    (1..=70_000).chain(edges).chain(random.take(200_000))
}

#[test]
fn class_waste_is_bounded() {
    for bytes in sizes().filter(|&b| b > 0) {
        let Some(class) = class_of(bytes) else {
            // Only at the very top of the range.
            assert!(bytes > usize::MAX - (usize::MAX >> 3), "{bytes}");
            continue;
        };
        assert!(class >= bytes, "{bytes} -> {class}");
        assert_eq!(class % MIN_STEP, 0, "{bytes} -> {class}");
        if bytes >= 32 << 10 {
            assert!(class - bytes <= bytes / 8, "{bytes} -> {class}");
        } else {
            assert!(class - bytes < MIN_STEP, "{bytes} -> {class}");
        }
        // Classes are fixed points: a request of exactly a class size wastes nothing.
        assert_eq!(class_of(class), Some(class), "{bytes} -> {class}");
        // Monotonic.
        assert!(class_of(bytes - 1).is_none_or(|c| c <= class), "{bytes}");
    }
}

#[test]
fn fit_window() {
    let c = 1 << 20;
    assert!(fits(c, c));
    assert!(fits(c, c + c / 8));
    assert!(!fits(c, c + c / 8 + 1));
    assert!(!fits(c, c - 1));
    // Below 32 KiB only the class itself fits (the 4 KiB step is more than an eighth)...
    assert!(!fits(8192, 12288));
    // ...above, the next class up fits too: a block of class `c + step` can serve `c`.
    for bytes in [40_000usize, 1 << 20, (3 << 20) + 5, 1 << 40] {
        let c = class_of(bytes).unwrap();
        let next = class_of(c + 1).unwrap();
        assert!(fits(c, next), "{c} {next}");
        assert!(fits(c, c.saturating_add(c / 8)));
    }
    assert!(fits(usize::MAX, usize::MAX));
}

#[repr(C, align(8192))]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Over([[u8; 4096]; 2]);

#[repr(C, align(4096))]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Page([u8; 4096]);

#[test]
fn layout_refuses_without_panicking() {
    assert!(matches!(
        layout::<Over>(1),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        layout::<Over>(0),
        Err(Error::InvalidArgument { .. })
    ));
    assert_eq!(layout::<Page>(3).unwrap(), (3 * 4096, 3 * 4096));
    assert_eq!(layout::<u8>(0).unwrap(), (0, 0));
    assert_eq!(layout::<()>(usize::MAX).unwrap(), (0, 0));
    for len in [
        usize::MAX,
        usize::MAX / 2,
        usize::MAX / 8 + 1,
        usize::MAX - 1,
    ] {
        assert!(matches!(
            layout::<u64>(len),
            Err(Error::InvalidArgument { .. })
        ));
    }
    assert!(matches!(
        layout::<u8>(usize::MAX),
        Err(Error::InvalidArgument { .. })
    ));
    // Large but representable: a class that is then refused by `fresh` as more than the
    // machine's memory.
    let (bytes, class) = layout::<u8>(1 << 50).unwrap();
    assert_eq!((bytes, class), (1 << 50, 1 << 50));
    assert!(physical_memory().is_none_or(|m| class > m));
}

#[test]
fn config_is_validated() {
    let register = |threads| PoolConfig {
        backing: PoolBacking::Register {
            threads,
            huge_pages: false,
            flags: HostRegister::DEFAULT,
        },
        ..Default::default()
    };
    assert!(matches!(
        validate(&register(0)),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(validate(&register(1)).is_ok());
    assert!(validate(&register(usize::MAX)).is_ok());
    let d = PoolConfig::default();
    assert!(validate(&d).is_ok());
    assert_eq!(d.max_cached_bytes, 4 << 30);
    assert_eq!(d.backing, PoolBacking::HostAlloc(HostAlloc::DEFAULT));
}

/// Whether every page of `ptr..ptr + len` is resident (`mincore`).
fn resident(ptr: *mut u8, len: usize) -> bool {
    let page = page_size();
    let mut vec = vec![0u8; len.div_ceil(page)];
    // SAFETY: `ptr..ptr + len` is a live mapping; `vec` has one byte per page.
    let rc = unsafe { libc::mincore(ptr.cast(), len, vec.as_mut_ptr()) };
    assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
    vec.iter().all(|&v| v & 1 == 1)
}

#[test]
fn prefault_touches_every_page() {
    for (threads, huge) in [(1, false), (3, false), (64, true)] {
        let len = (5 << 20) + 4096 * 3;
        let ptr = map_anonymous(len, huge).unwrap();
        if huge {
            assert_eq!(ptr as usize % HUGE_PAGE, 0);
        }
        assert!(!resident(ptr, len), "a fresh mapping is not faulted in yet");
        prefault(ptr, len, threads);
        assert!(resident(ptr, len), "{threads} threads, huge pages {huge}");
        // SAFETY: the mapping is live, zero-filled and used by nobody else.
        let bytes = unsafe { std::slice::from_raw_parts(ptr, len) };
        assert!(bytes.iter().all(|&b| b == 0));
        // SAFETY: mapped above; the slice is not used after this.
        unsafe { unmap(ptr, len) };
    }
}
