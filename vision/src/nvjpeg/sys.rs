//! nvJPEG's C API, bound by bindgen from `nvjpeg.h` at build time, as a loader struct
//! ([`Nvjpeg`]) whose functions come from `dlopen` of the library. Nothing else is here.
#![allow(
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals,
    dead_code,
    missing_docs,
    missing_debug_implementations,
    unsafe_op_in_unsafe_fn,
    clippy::all,
    clippy::undocumented_unsafe_blocks
)]

#[cfg(not(pinstream_vision_docs))]
include!(concat!(env!("OUT_DIR"), "/nvjpeg.rs"));

// docs.rs has no toolkit: the bindings as the build made them from nvJPEG 13.0's header.
#[cfg(pinstream_vision_docs)]
include!("bindings_13_0.rs");
