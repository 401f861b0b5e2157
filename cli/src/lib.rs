//! # pinstream-cli
//!
//! The `pinstream` program (`info`, `bandwidth`, `normalize`, `staging`, `prefetch`, `load`) and
//! the measurement code behind it ([`mod@bench`]), kept out of the `pinstream` library so that a
//! crate depending on the library builds none of the program's dependencies (clap, plotters,
//! image, csv, serde, indicatif). Everything here is built on the library's public API, its timing
//! module ([`pinstream::timing`]) included, and has no `unsafe` code of its own.

#![forbid(unsafe_code)]
#![warn(missing_docs)]
#![warn(missing_debug_implementations)]

pub mod bench;
