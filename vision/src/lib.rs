//! # pinstream-vision
//!
//! Image pipelines over [`pinstream`]: files in, normalized batches on the GPU out.
//!
//! - [`decode`]: JPEG (zune-jpeg) and PNG decoding into caller memory, with size checks before
//!   any allocation;
//! - [`dataset`]: image folders (`train/<class>/<image>.jpg`) and `(path, label)` lists;
//! - [`sampler`]: seeded per-epoch orders, sharded by rank, `drop_last`;
//! - [`augment`]: torchvision's `RandomResizedCrop` + flip and `Resize` + `CenterCrop` as
//!   crop boxes for the core's fused resized-crop kernel
//!   ([`pinstream::kernels::resized_crop`]);
//! - `nvjpeg` (feature `nvjpeg`, default): batched JPEG decoding on the GPU's JPEG engines,
//!   nvJPEG's CUDA backend or the CPU, per file, into one device arena;
//! - [`ImageFeed`] / [`ImageSource`]: the training feed — decoded on the GPU ([`Decoding`]) or
//!   on loader threads into page-locked memory, cropped, resized, normalized and cast on the GPU
//!   in one launch per batch.
//!
//! ```no_run
//! use pinstream_vision::dataset::ImageList;
//! use pinstream_vision::{ImageFeed, ImageFeedConfig};
//! # fn main() -> pinstream::Result<()> {
//! let stream = pinstream::Device::get(0)?.stream()?;
//! let train = ImageList::folder("/data/imagenet/train")?;
//! let mut feed = ImageFeed::<pinstream::bf16>::new(&stream, train, ImageFeedConfig::default())?;
//! while let Some(batch) = feed.next() {
//!     let batch = batch?;
//!     let (x, y) = (batch.pixels()?, batch.labels()?); // 256 x 3 x 224 x 224, labels
//! #   let _ = (x, y);
//! }
//! # Ok(()) }
//! ```

#![deny(unsafe_op_in_unsafe_fn)]
#![deny(clippy::undocumented_unsafe_blocks)]
#![warn(missing_docs)]
#![warn(missing_debug_implementations)]
// The GPU path's helpers in `feed` are dead code without it.
#![cfg_attr(not(feature = "nvjpeg"), allow(dead_code))]

pub mod augment;
pub mod dataset;
pub mod decode;
mod feed;
mod gpu_cache;
#[cfg(feature = "nvjpeg")]
mod gpu_feed;
pub mod sampler;
mod source;
mod util;

pub use feed::{FeedBatch, ImageFeed};
#[doc(hidden)]
pub use gpu_cache::fail_keeps as __fail_cache_keeps;
pub use gpu_cache::GpuCacheStats;
#[cfg(feature = "nvjpeg")]
pub use gpu_feed::GpuBatch;
pub use source::{
    Augment, BadFiles, Decoding, ImageFeedConfig, ImageSource, RouteCounts, Skipped,
    AUTO_CPU_LOADER_THREADS, AUTO_DECODES_AT_ONCE, AUTO_GPU_LOADER_THREADS,
};
#[cfg(feature = "nvjpeg")]
pub mod nvjpeg;
