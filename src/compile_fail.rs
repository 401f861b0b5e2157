//! The safety guarantees the compiler checks: each case below must fail to compile (rustdoc's
//! `compile_fail` doctests, run by `cargo test`; `cargo test --doc compile_fail` alone). SAFETY.md
//! names them `ui/<case>`.
//!
//! Each case has a twin, `no_run`, that differs only where the guarantee bites (the write after
//! the wait, the drop after the copy) and must compile: so the case fails for the guarantee, not
//! for a slip in its code. (Stable rustdoc does not check a `compile_fail` block's error code;
//! the code rustc gives is noted above each case.)
//!
//! They replaced trybuild cases, which built the crate a second time (build script and kernels
//! included) in a project of their own; rustdoc checks them against the library `cargo test`
//! already built.
// Compiled only by rustdoc (lib.rs: `cfg(doctest)`), with the default layers whose types the
// cases use.

/// A view into a reused packed arena borrows it: the next upload into the arena (which overwrites
/// it) cannot be made while the view lives.
///
/// Fails with E0499.
///
/// ```compile_fail
/// use pinstream::{Device, PackedArena, Packer, Stager, StagerConfig};
///
/// fn main() -> pinstream::Result<()> {
///     let dev = Device::get(0)?;
///     let stream = dev.stream()?;
///     let stager = Stager::new(&dev, StagerConfig::default())?;
///     let mut arena = PackedArena::new();
///     let data = vec![1.0f32; 16];
///     let mut packer = Packer::new();
///     let h = packer.push(&data)?;
///     let first = stager.upload_packed_into(&stream, &packer, &mut arena)?;
///     let view = first.get(h)?;
///     let second = stager.upload_packed_into(&stream, &packer, &mut arena)?;
///     println!("{} {}", view.len(), second.bytes());
///     Ok(())
/// }
/// ```
///
/// The same with the use in its place compiles (the failure above is the guarantee, not a slip):
///
/// ```no_run
/// use pinstream::{Device, PackedArena, Packer, Stager, StagerConfig};
///
/// fn main() -> pinstream::Result<()> {
///     let dev = Device::get(0)?;
///     let stream = dev.stream()?;
///     let stager = Stager::new(&dev, StagerConfig::default())?;
///     let mut arena = PackedArena::new();
///     let data = vec![1.0f32; 16];
///     let mut packer = Packer::new();
///     let h = packer.push(&data)?;
///     let first = stager.upload_packed_into(&stream, &packer, &mut arena)?;
///     let view = first.get(h)?;
///     println!("{}", view.len());
///     let second = stager.upload_packed_into(&stream, &packer, &mut arena)?;
///     println!("{}", second.bytes());
///     Ok(())
/// }
/// ```
#[allow(dead_code)]
fn arena_view_outlives_next_call() {}

/// DenormInput is sealed: a user type cannot become a denormalize input element (the kernel would
/// read elements of the size its type code stands for).
///
/// Fails with E0277.
///
/// ```compile_fail
/// use bytemuck::{Pod, Zeroable};
/// use pinstream::kernels::DenormInput;
///
/// #[derive(Clone, Copy, Pod, Zeroable)]
/// #[repr(transparent)]
/// struct Byte(u8);
///
/// impl DenormInput for Byte {
///     fn to_f64(self) -> f64 {
///         f64::from(self.0)
///     }
/// }
///
/// fn main() {}
/// ```
///
/// The same with the use in its place compiles (the failure above is the guarantee, not a slip):
///
/// ```no_run
/// use bytemuck::{Pod, Zeroable};
/// use pinstream::kernels::DenormInput;
///
/// #[derive(Clone, Copy, Pod, Zeroable)]
/// #[repr(transparent)]
/// struct Byte(u8);
///
/// fn _use<T: DenormInput>() {}
///
/// fn main() {}
/// ```
#[allow(dead_code)]
fn denorm_input_is_sealed() {}

/// The host destination of a pending download cannot be dropped while the Pending lives.
///
/// Fails with E0505.
///
/// ```compile_fail
/// use pinstream::{Device, DeviceBuffer, HostAlloc, PinnedBuffer};
///
/// fn main() -> pinstream::Result<()> {
///     let dev = Device::get(0)?;
///     let stream = dev.stream()?;
///     let d = DeviceBuffer::<u8>::new(&dev, 16)?;
///     let mut host = PinnedBuffer::<u8>::new(&dev, 16, HostAlloc::DEFAULT)?;
///     let pending = stream.copy_d2h(&d, &mut host)?;
///     drop(host);
///     pending.wait()?;
///     Ok(())
/// }
/// ```
///
/// The same with the use in its place compiles (the failure above is the guarantee, not a slip):
///
/// ```no_run
/// use pinstream::{Device, DeviceBuffer, HostAlloc, PinnedBuffer};
///
/// fn main() -> pinstream::Result<()> {
///     let dev = Device::get(0)?;
///     let stream = dev.stream()?;
///     let d = DeviceBuffer::<u8>::new(&dev, 16)?;
///     let mut host = PinnedBuffer::<u8>::new(&dev, 16, HostAlloc::DEFAULT)?;
///     let pending = stream.copy_d2h(&d, &mut host)?;
///     pending.wait()?;
///     drop(host);
///     Ok(())
/// }
/// ```
#[allow(dead_code)]
fn drop_host_dst_while_pending() {}

/// A pinned source borrowed by an in-flight upload cannot be dropped.
///
/// Fails with E0505.
///
/// ```compile_fail
/// use pinstream::{Device, DeviceBuffer, HostAlloc, PinnedBuffer};
///
/// fn main() -> pinstream::Result<()> {
///     let dev = Device::get(0)?;
///     let stream = dev.stream()?;
///     let mut d = DeviceBuffer::<u8>::new(&dev, 16)?;
///     let host = PinnedBuffer::<u8>::new(&dev, 16, HostAlloc::DEFAULT)?;
///     let upload = stream.copy_h2d(&host, &mut d)?;
///     drop(host);
///     upload.wait()?;
///     Ok(())
/// }
/// ```
///
/// The same with the use in its place compiles (the failure above is the guarantee, not a slip):
///
/// ```no_run
/// use pinstream::{Device, DeviceBuffer, HostAlloc, PinnedBuffer};
///
/// fn main() -> pinstream::Result<()> {
///     let dev = Device::get(0)?;
///     let stream = dev.stream()?;
///     let mut d = DeviceBuffer::<u8>::new(&dev, 16)?;
///     let host = PinnedBuffer::<u8>::new(&dev, 16, HostAlloc::DEFAULT)?;
///     let upload = stream.copy_h2d(&host, &mut d)?;
///     upload.wait()?;
///     drop(host);
///     Ok(())
/// }
/// ```
#[allow(dead_code)]
fn drop_pinned_source_in_flight() {}

/// The trait that carries the kernels' element type code cannot be named (or implemented) outside
/// pinstream.
///
/// Fails with E0603.
///
/// ```compile_fail
/// use bytemuck::{Pod, Zeroable};
///
/// #[derive(Clone, Copy, Pod, Zeroable)]
/// #[repr(transparent)]
/// struct Byte(u8);
///
/// impl pinstream::kernels::element::sealed::Element for Byte {
///     const CODE: i32 = 2;
/// }
///
/// fn main() {}
/// ```
///
/// The same with the use in its place compiles (the failure above is the guarantee, not a slip):
///
/// ```no_run
/// use bytemuck::{Pod, Zeroable};
///
/// #[derive(Clone, Copy, Pod, Zeroable)]
/// #[repr(transparent)]
/// struct Byte(u8);
///
///
/// fn main() {}
/// ```
#[allow(dead_code)]
fn element_code_is_private() {}

/// A pinned source borrowed by an in-flight upload cannot be written.
///
/// Fails with E0502.
///
/// ```compile_fail
/// use pinstream::{Device, DeviceBuffer, HostAlloc, PinnedBuffer};
///
/// fn main() -> pinstream::Result<()> {
///     let dev = Device::get(0)?;
///     let stream = dev.stream()?;
///     let mut d = DeviceBuffer::<u8>::new(&dev, 16)?;
///     let mut host = PinnedBuffer::<u8>::new(&dev, 16, HostAlloc::DEFAULT)?;
///     let upload = stream.copy_h2d(&host, &mut d)?;
///     host.as_mut_slice()?.fill(1);
///     upload.wait()?;
///     Ok(())
/// }
/// ```
///
/// The same with the use in its place compiles (the failure above is the guarantee, not a slip):
///
/// ```no_run
/// use pinstream::{Device, DeviceBuffer, HostAlloc, PinnedBuffer};
///
/// fn main() -> pinstream::Result<()> {
///     let dev = Device::get(0)?;
///     let stream = dev.stream()?;
///     let mut d = DeviceBuffer::<u8>::new(&dev, 16)?;
///     let mut host = PinnedBuffer::<u8>::new(&dev, 16, HostAlloc::DEFAULT)?;
///     let upload = stream.copy_h2d(&host, &mut d)?;
///     upload.wait()?;
///     host.as_mut_slice()?.fill(1);
///     Ok(())
/// }
/// ```
#[allow(dead_code)]
fn mutate_pinned_source_in_flight() {}

/// OutputElement is sealed: a user type cannot become a normalize output element. (A 1-byte type
/// that claimed the f32 type code made `kernels::normalize` write 4 bytes per element, out of
/// bounds.) Every item of the public trait is given, so the only error is the seal.
///
/// Fails with E0277.
///
/// ```compile_fail
/// use bytemuck::{Pod, Zeroable};
/// use pinstream::kernels::OutputElement;
///
/// #[derive(Clone, Copy, Pod, Zeroable)]
/// #[repr(transparent)]
/// struct Byte(u8);
///
/// impl OutputElement for Byte {
///     const NAME: &'static str = "byte";
///     fn from_f64(v: f64) -> Self {
///         Byte(v as u8)
///     }
///     fn to_f64(self) -> f64 {
///         f64::from(self.0)
///     }
///     fn unit_at(_: f64) -> f64 {
///         1.0
///     }
///     fn poison() -> Self {
///         Byte(0xAB)
///     }
///     fn reference(exact: f64) -> f64 {
///         exact
///     }
///     fn rounding_error(self, _exact: f64, _shift: f32) -> f64 {
///         0.0
///     }
/// }
///
/// fn main() {}
/// ```
///
/// The same with the use in its place compiles (the failure above is the guarantee, not a slip):
///
/// ```no_run
/// use bytemuck::{Pod, Zeroable};
/// use pinstream::kernels::OutputElement;
///
/// #[derive(Clone, Copy, Pod, Zeroable)]
/// #[repr(transparent)]
/// struct Byte(u8);
///
/// impl Byte {
///     fn from_f64(v: f64) -> Self {
///         Byte(v as u8)
///     }
///     fn to_f64(self) -> f64 {
///         f64::from(self.0)
///     }
///     fn unit_at(_: f64) -> f64 {
///         1.0
///     }
///     fn poison() -> Self {
///         Byte(0xAB)
///     }
///     fn reference(exact: f64) -> f64 {
///         exact
///     }
///     fn rounding_error(self, _exact: f64, _shift: f32) -> f64 {
///         0.0
///     }
/// }
///
/// fn main() {}
/// ```
#[allow(dead_code)]
fn output_element_is_sealed() {}

/// A view of a pinned buffer is a copy source only, never a device-to-host destination.
///
/// Fails with E0277.
///
/// ```compile_fail
/// use pinstream::{Device, DeviceBuffer, HostAlloc, PinnedBuffer};
///
/// fn main() -> pinstream::Result<()> {
///     let dev = Device::get(0)?;
///     let stream = dev.stream()?;
///     let d = DeviceBuffer::<u8>::new(&dev, 16)?;
///     let host = PinnedBuffer::<u8>::new(&dev, 32, HostAlloc::DEFAULT)?;
///     let mut view = host.slice(8..24)?;
///     stream.copy_d2h(&d, &mut view)?.wait()?;
///     Ok(())
/// }
/// ```
///
/// The same with the use in its place compiles (the failure above is the guarantee, not a slip):
///
/// ```no_run
/// use pinstream::{Device, DeviceBuffer, HostAlloc, PinnedBuffer};
///
/// fn main() -> pinstream::Result<()> {
///     let dev = Device::get(0)?;
///     let stream = dev.stream()?;
///     let d = DeviceBuffer::<u8>::new(&dev, 16)?;
///     let host = PinnedBuffer::<u8>::new(&dev, 32, HostAlloc::DEFAULT)?;
///     let mut host = host;
///     stream.copy_d2h(&d, &mut host)?.wait()?;
///     Ok(())
/// }
/// ```
#[allow(dead_code)]
fn pinned_view_not_a_destination() {}

/// The PyTorch hazard: `cuda_tensor.to("cpu", non_blocking=True)` read before a sync. Reading the
/// destination while the copy's `Pending` lives must not compile.
///
/// Fails with E0502.
///
/// ```compile_fail
/// use pinstream::{Device, DeviceBuffer, HostAlloc, PinnedBuffer};
///
/// fn main() -> pinstream::Result<()> {
///     let dev = Device::get(0)?;
///     let stream = dev.stream()?;
///     let d = DeviceBuffer::<f32>::new(&dev, 16)?;
///     let mut host = PinnedBuffer::<f32>::new(&dev, 16, HostAlloc::DEFAULT)?;
///     let pending = stream.copy_d2h(&d, &mut host)?;
///     let mean: f32 = host.as_slice()?.iter().sum::<f32>() / 16.0;
///     let _ = pending.wait()?;
///     println!("{mean}");
///     Ok(())
/// }
/// ```
///
/// The same with the use in its place compiles (the failure above is the guarantee, not a slip):
///
/// ```no_run
/// use pinstream::{Device, DeviceBuffer, HostAlloc, PinnedBuffer};
///
/// fn main() -> pinstream::Result<()> {
///     let dev = Device::get(0)?;
///     let stream = dev.stream()?;
///     let d = DeviceBuffer::<f32>::new(&dev, 16)?;
///     let mut host = PinnedBuffer::<f32>::new(&dev, 16, HostAlloc::DEFAULT)?;
///     let pending = stream.copy_d2h(&d, &mut host)?;
///     let _ = pending.wait()?;
///     let mean: f32 = host.as_slice()?.iter().sum::<f32>() / 16.0;
///     println!("{mean}");
///     Ok(())
/// }
/// ```
#[allow(dead_code)]
fn read_dst_while_pending() {}

/// Same hazard with a plain Vec as the destination.
///
/// Fails with E0502.
///
/// ```compile_fail
/// use pinstream::{Device, DeviceBuffer};
///
/// fn main() -> pinstream::Result<()> {
///     let dev = Device::get(0)?;
///     let stream = dev.stream()?;
///     let d = DeviceBuffer::<u8>::new(&dev, 16)?;
///     let mut host = vec![0u8; 16];
///     let pending = stream.copy_d2h(&d, &mut host[..])?;
///     let first = host[0];
///     pending.wait()?;
///     println!("{first}");
///     Ok(())
/// }
/// ```
///
/// The same with the use in its place compiles (the failure above is the guarantee, not a slip):
///
/// ```no_run
/// use pinstream::{Device, DeviceBuffer};
///
/// fn main() -> pinstream::Result<()> {
///     let dev = Device::get(0)?;
///     let stream = dev.stream()?;
///     let d = DeviceBuffer::<u8>::new(&dev, 16)?;
///     let mut host = vec![0u8; 16];
///     let pending = stream.copy_d2h(&d, &mut host[..])?;
///     pending.wait()?;
///     let first = host[0];
///     println!("{first}");
///     Ok(())
/// }
/// ```
#[allow(dead_code)]
fn read_vec_while_pending() {}

/// The registered slice is borrowed for the whole scope: it cannot be touched directly inside.
///
/// Fails with E0499.
///
/// ```compile_fail
/// use pinstream::{Device, HostRegister, Registered};
///
/// fn main() -> pinstream::Result<()> {
///     let dev = Device::get(0)?;
///     let mut data = vec![0u8; 16];
///     Registered::scope(&dev, &mut data, HostRegister::DEFAULT, |_r| {
///         data[0] = 1;
///     })?;
///     Ok(())
/// }
/// ```
///
/// The same with the use in its place compiles (the failure above is the guarantee, not a slip):
///
/// ```no_run
/// use pinstream::{Device, HostRegister, Registered};
///
/// fn main() -> pinstream::Result<()> {
///     let dev = Device::get(0)?;
///     let mut data = vec![0u8; 16];
///     Registered::scope(&dev, &mut data, HostRegister::DEFAULT, |_r| {})?;
///     data[0] = 1;
///     Ok(())
/// }
/// ```
#[allow(dead_code)]
fn registered_data_used_in_scope() {}

/// A Registered cannot leave its scope (so it cannot be leaked with mem::forget while a copy into
/// the caller's memory is in flight).
///
/// Fails with E0521.
///
/// ```compile_fail
/// use pinstream::{Device, HostRegister, Registered};
///
/// fn main() -> pinstream::Result<()> {
///     let dev = Device::get(0)?;
///     let mut data = vec![0u8; 16];
///     let mut escaped = None;
///     Registered::scope(&dev, &mut data, HostRegister::DEFAULT, |r| {
///         escaped = Some(r);
///     })?;
///     drop(escaped);
///     Ok(())
/// }
/// ```
///
/// The same with the use in its place compiles (the failure above is the guarantee, not a slip):
///
/// ```no_run
/// use pinstream::{Device, HostRegister, Registered};
///
/// fn main() -> pinstream::Result<()> {
///     let dev = Device::get(0)?;
///     let mut data = vec![0u8; 16];
///     let mut escaped = None;
///     let _ = &mut escaped;
///     Registered::scope(&dev, &mut data, HostRegister::DEFAULT, |r| {
///         let _ = r;
///         escaped = Some(());
///     })?;
///     drop(escaped);
///     Ok(())
/// }
/// ```
#[allow(dead_code)]
fn registered_escapes_scope() {}

/// The slice `wait()` hands out borrows the destination: it cannot outlive it.
///
/// Fails with E0597.
///
/// ```compile_fail
/// use pinstream::{Device, DeviceBuffer, HostAlloc, PinnedBuffer};
///
/// fn main() -> pinstream::Result<()> {
///     let dev = Device::get(0)?;
///     let stream = dev.stream()?;
///     let d = DeviceBuffer::<u8>::new(&dev, 16)?;
///     let values: &[u8];
///     {
///         let mut host = PinnedBuffer::<u8>::new(&dev, 16, HostAlloc::DEFAULT)?;
///         values = stream.copy_d2h(&d, &mut host)?.wait()?;
///     }
///     println!("{}", values[0]);
///     Ok(())
/// }
/// ```
///
/// The same with the use in its place compiles (the failure above is the guarantee, not a slip):
///
/// ```no_run
/// use pinstream::{Device, DeviceBuffer, HostAlloc, PinnedBuffer};
///
/// fn main() -> pinstream::Result<()> {
///     let dev = Device::get(0)?;
///     let stream = dev.stream()?;
///     let d = DeviceBuffer::<u8>::new(&dev, 16)?;
///     let values: &[u8];
///     {
///         let mut host = PinnedBuffer::<u8>::new(&dev, 16, HostAlloc::DEFAULT)?;
///         values = stream.copy_d2h(&d, &mut host)?.wait()?;
///         println!("{}", values[0]);
///     }
///     Ok(())
/// }
/// ```
#[allow(dead_code)]
fn result_outlives_destination() {}

/// Only a TimingEvent keeps time: asking a plain Event for elapsed time does not compile.
///
/// Fails with E0599.
///
/// ```compile_fail
/// use pinstream::{Device, Event};
///
/// fn main() -> pinstream::Result<()> {
///     let dev = Device::get(0)?;
///     let a = Event::new(&dev)?;
///     let b = Event::new(&dev)?;
///     let _ = a.elapsed_ms(&b)?;
///     Ok(())
/// }
/// ```
///
/// The same with the use in its place compiles (the failure above is the guarantee, not a slip):
///
/// ```no_run
/// use pinstream::{Device, TimingEvent as Event};
///
/// fn main() -> pinstream::Result<()> {
///     let dev = Device::get(0)?;
///     let a = Event::new(&dev)?;
///     let b = Event::new(&dev)?;
///     let _ = a.elapsed_ms(&b)?;
///     Ok(())
/// }
/// ```
#[allow(dead_code)]
fn timing_on_plain_event() {}

/// The buffer cannot be written while a view of it (a copy source) lives.
///
/// Fails with E0502.
///
/// ```compile_fail
/// use pinstream::{Device, DeviceBuffer, HostAlloc, PinnedBuffer};
///
/// fn main() -> pinstream::Result<()> {
///     let dev = Device::get(0)?;
///     let stream = dev.stream()?;
///     let mut d = DeviceBuffer::<u8>::new(&dev, 16)?;
///     let mut host = PinnedBuffer::<u8>::new(&dev, 32, HostAlloc::DEFAULT)?;
///     let view = host.slice(8..24)?;
///     let upload = stream.copy_h2d(&view, &mut d)?;
///     host.as_mut_slice()?.fill(1);
///     upload.wait()?;
///     Ok(())
/// }
/// ```
///
/// The same with the use in its place compiles (the failure above is the guarantee, not a slip):
///
/// ```no_run
/// use pinstream::{Device, DeviceBuffer, HostAlloc, PinnedBuffer};
///
/// fn main() -> pinstream::Result<()> {
///     let dev = Device::get(0)?;
///     let stream = dev.stream()?;
///     let mut d = DeviceBuffer::<u8>::new(&dev, 16)?;
///     let mut host = PinnedBuffer::<u8>::new(&dev, 32, HostAlloc::DEFAULT)?;
///     let view = host.slice(8..24)?;
///     let upload = stream.copy_h2d(&view, &mut d)?;
///     upload.wait()?;
///     host.as_mut_slice()?.fill(1);
///     Ok(())
/// }
/// ```
#[allow(dead_code)]
fn write_pinned_while_view_lives() {}
