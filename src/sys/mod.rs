//! Raw FFI: the CUDA runtime bindings that bindgen generates from the toolkit's own
//! `cuda_runtime_api.h` at build time, and the C launchers of the kernels in `cuda/`.
//!
//! Nothing here is safe to call without reading the CUDA documentation; the rest of the crate
//! wraps every function it uses.

#![allow(
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals,
    dead_code,
    unnecessary_transmutes,
    clippy::all,
    clippy::pedantic,
    missing_docs
)]

#[cfg(not(pinstream_docs))]
include!(concat!(env!("OUT_DIR"), "/cuda_runtime.rs"));

// docs.rs builds without a toolkit: a snapshot of the same bindgen output (CUDA 13.0), used for
// documentation only.
#[cfg(pinstream_docs)]
include!("docs_bindings.rs");

extern "C" {
    /// `cuda/fill.cu`: fills `n` elements of `width` bytes with the low bytes of `pattern`.
    pub fn pinstream_fill(
        dst: *mut ::std::os::raw::c_void,
        n: usize,
        width: ::std::os::raw::c_int,
        pattern: u64,
        stream: cudaStream_t,
    ) -> cudaError_t;
    /// `cuda/fill.cu`: `dst[i] = start + i * step`.
    pub fn pinstream_iota_u32(
        dst: *mut u32,
        n: usize,
        start: u32,
        step: u32,
        stream: cudaStream_t,
    ) -> cudaError_t;
    /// `cuda/fill.cu`: copies `bytes` from `src` to `dst`, both device addresses (`src` may be
    /// mapped pinned host memory), with a kernel.
    pub fn pinstream_copy_bytes(
        dst: *mut ::std::os::raw::c_void,
        src: *const ::std::os::raw::c_void,
        bytes: usize,
        stream: cudaStream_t,
    ) -> cudaError_t;
    /// `cuda/fill.cu`: one thread that holds the stream for `ns` nanoseconds.
    pub fn pinstream_spin(ns: u64, stream: cudaStream_t) -> cudaError_t;
    /// `cuda/fill.cu`: holds the stream until `flag[0] != 0` (mapped host memory) or the
    /// timeout, which sets `flag[1] = 1`.
    pub fn pinstream_gate(flag: *mut u32, timeout_ns: u64, stream: cudaStream_t) -> cudaError_t;
}

pub mod driver;
