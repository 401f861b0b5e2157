//! Unit tests of the kernels' specs (`kernels::spec`).

use super::*;

#[test]
fn checked_total_refuses_what_would_wrap() {
    // Each of these wraps to a small number (0 or 1) in wrapping arithmetic.
    let half = 1usize << (usize::BITS / 2);
    for sizes in [
        vec![[4, half / 2, half / 2]],
        vec![[1, usize::MAX, 1], [1, 1, 1]],
        vec![[usize::MAX, 2, 1]],
        vec![[3, 1, usize::MAX / 3], [1, 1, 2]],
    ] {
        let r = checked_total("t", sizes.clone());
        assert!(
            matches!(r, Err(Error::InvalidArgument { .. })),
            "{sizes:?}: {r:?}"
        );
    }
    assert_eq!(checked_total("t", [[3, 4, 5], [1, 2, 3]]).ok(), Some(66));
    assert_eq!(
        checked_total("t", [[1, 1, usize::MAX]]).ok(),
        Some(usize::MAX)
    );
    assert_eq!(checked_total("t", []).ok(), Some(0));
}

fn spec(c: usize, h: usize, w: usize) -> Spec {
    let k = c.min(4);
    Spec::uniform(2, c, h, w, Normalize::new(&vec![0.0; k], &vec![1.0; k])).unwrap()
}

#[test]
fn lengths_overflow_is_an_error() {
    // Lengths may be asked of a Spec that was never validated.
    let s = spec(usize::MAX / 2, 3, 3);
    assert!(matches!(s.input_len(), Err(Error::InvalidArgument { .. })));
    assert!(matches!(s.output_len(), Err(Error::InvalidArgument { .. })));
    assert!(matches!(s.offsets(), Err(Error::InvalidArgument { .. })));
    assert!(matches!(
        s.validate("t"),
        Err(Error::InvalidArgument { .. })
    ));
    // A crop that is huge (invalid, but asked before validation).
    let mut s = spec(1, 2, 2);
    s.samples[1].crop = Some(Crop {
        x: 0,
        y: 0,
        w: usize::MAX,
        h: 3,
    });
    assert!(s.input_len().is_ok());
    assert!(matches!(s.output_len(), Err(Error::InvalidArgument { .. })));
    assert!(matches!(s.offsets(), Err(Error::InvalidArgument { .. })));
    // The sum (not one sample) overflows: two samples of more than half of usize.
    let mut s = spec(1, 1, 1);
    s.samples = vec![Sample::new(1, usize::MAX / 2 + 1); 2];
    assert!(matches!(s.input_len(), Err(Error::InvalidArgument { .. })));
    // The last offset is fine, but the end of the batch is not: offsets() fails too.
    assert!(matches!(s.offsets(), Err(Error::InvalidArgument { .. })));
}

#[test]
fn lengths_and_offsets() {
    let mut s = Spec::variable(3, &[(2, 3), (4, 5)], Normalize::new(&[0.0; 3], &[1.0; 3]));
    s.samples[1].crop = Some(Crop {
        x: 1,
        y: 1,
        w: 2,
        h: 3,
    });
    let s = s.pad_to_4(0.0);
    assert_eq!(s.input_len().ok(), Some(18 + 60));
    assert_eq!(s.output_len().ok(), Some(24 + 24));
    assert_eq!(s.offsets().ok(), Some(vec![(0, 0), (18, 24)]));
    assert!(s.validate("t").is_ok());
}

#[test]
fn totals_beyond_any_allocation_are_refused() {
    let big = isize::MAX as usize;
    let too_big = |i: Result<usize>, o: Result<usize>| {
        matches!(check_totals("t", i, o), Err(Error::InvalidArgument { .. }))
    };
    assert!(too_big(Ok(big + 1), Ok(1)));
    assert!(too_big(Ok(1), Ok(big / 4 + 1)));
    // 4 x this wraps to 4: a wrapping multiplication would let it through.
    assert!(too_big(Ok(1), Ok(usize::MAX / 4 + 2)));
    assert!(too_big(Err(Error::invalid("x", "overflow")), Ok(1)));
    assert!(too_big(Ok(1), Err(Error::invalid("x", "overflow"))));
    assert!(check_totals("t", Ok(big), Ok(big / 4)).is_ok());
}

#[test]
fn large_valid_batch() {
    let mut s = spec(4, 65535, 65535);
    s.samples = vec![Sample::new(65535, 65535); 3];
    assert!(s.validate("t").is_ok());
    assert_eq!(s.input_len().ok(), Some(3 * 4 * 65535 * 65535));
}
