//! JPEG decoding on the GPU through nvJPEG (feature `nvjpeg`, on by default): the GPU's
//! hardware JPEG engines where it has them (A100, H100, H200, ...), nvJPEG's CUDA backend for the
//! other sequential JPEGs, the CPU decoder for the rest, routed per file within one batch, into
//! one device arena that the fused resized-crop kernel reads. nvJPEG's own device and pinned
//! memory comes from pinstream's pools (its stream-ordered v2 allocators).
//!
//! nvJPEG is loaded at run time (`libnvjpeg.so.13`, see [`unavailable`] for where it is looked
//! for); without it, [`Nvjpeg::new`] fails with the reason and the image feed decodes on the CPU.
//!
//! ```no_run
//! use pinstream::memory::DeviceBuffer;
//! use pinstream_vision::nvjpeg::{Item, Nvjpeg};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dev = pinstream::Device::get(0)?;
//! let nv = Nvjpeg::new(&dev)?;                       // Err: no libnvjpeg.so.13 (the reason)
//! let mut decoder = nv.decoder()?;                   // one per thread
//! let files: Vec<Vec<u8>> = vec![std::fs::read("a.jpg")?, std::fs::read("b.jpg")?];
//! // Where each image goes: its plan says how many bytes it writes.
//! let mut items = Vec::new();
//! let mut at = 0;
//! for f in &files {
//!     let plan = decoder.plan(f, None)?;                 // or a region: ROI decoding
//!     items.push(Item { data: f, plan, offset: at });
//!     at += plan.region.rgb_len();
//! }
//! let mut arena = DeviceBuffer::<u8>::new(&dev, at)?;
//! for r in decoder.decode(&items, &mut arena)? {
//!     let plan = r?;                                 // a bad file's error, or how it went
//!     println!("{:?}: {}x{}", plan.route, plan.height, plan.width);
//! }
//! # Ok(()) }
//! ```

mod alloc;
mod decoder;
mod library;
mod sys;

pub use decoder::{GpuDecoder, Item, Nvjpeg, Plan, Region, Route};
pub use library::{unavailable, LIBRARY};
