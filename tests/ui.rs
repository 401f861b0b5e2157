//! Compile-fail tests (trybuild): the safety guarantees that are checked by the compiler.
//! They need cargo, so they run here and in CI, not on the GPU machine.

#[test]
fn compile_fail() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
}
