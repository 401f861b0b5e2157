//! `Error` and `Result`: what failed, with the CUDA runtime's own name and message.

use std::ffi::CStr;
use std::fmt;

use crate::driver::{driver_status, DriverStatus, DriverVerdict};
use crate::sys;

/// A CUDA runtime error code together with the runtime's name and description of it
/// (`cudaGetErrorName`, `cudaGetErrorString`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CudaError {
    code: i32,
    name: &'static str,
    message: &'static str,
}

impl CudaError {
    pub(crate) fn from_raw(err: sys::cudaError_t) -> Self {
        // SAFETY: both functions accept any error value and return pointers to static,
        // NUL-terminated strings owned by the runtime (or null, handled below).
        let (name, message) = unsafe { (sys::cudaGetErrorName(err), sys::cudaGetErrorString(err)) };
        CudaError {
            code: err as i32,
            name: static_str(name).unwrap_or("cudaErrorUnknownCode"),
            message: static_str(message).unwrap_or("unrecognized error code"),
        }
    }

    /// An error of the CUDA driver API (a `CUresult`, as cudarc reports it), with the driver's
    /// name and description.
    #[cfg(feature = "cudarc-any")]
    pub(crate) fn from_driver(code: i32, name: &'static str, message: &'static str) -> Self {
        CudaError {
            code,
            name,
            message,
        }
    }

    /// The numeric `cudaError_t` value.
    pub fn code(&self) -> i32 {
        self.code
    }

    /// The enumerator's name, e.g. `cudaErrorMemoryAllocation`.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The runtime's description, e.g. `out of memory`.
    pub fn message(&self) -> &'static str {
        self.message
    }
}

fn static_str(p: *const std::os::raw::c_char) -> Option<&'static str> {
    if p.is_null() {
        return None;
    }
    // SAFETY: non-null pointers from cudaGetErrorName/String point at static NUL-terminated
    // strings that live as long as the program.
    unsafe { CStr::from_ptr(p) }.to_str().ok()
}

impl fmt::Display for CudaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}): {}", self.name, self.code, self.message)
    }
}

/// Everything that can go wrong. Argument checks happen before anything is queued, so an error
/// from them leaves all buffers as they were.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum Error {
    /// There is no CUDA driver, it is too old, or there is no device: the machine cannot run
    /// CUDA at all. The message says which, and what to do (see [`DriverStatus::advice`]).
    NoDevice {
        /// The runtime function that found out.
        call: &'static str,
        /// What the runtime said (`cudaErrorInsufficientDriver`, `cudaErrorNoDevice` ...).
        cuda: CudaError,
        /// The installed driver against what this build needs, taken when the error happened.
        driver: Box<DriverStatus>,
    },
    /// An allocation (device or pinned host memory) failed for lack of memory.
    OutOfMemory {
        /// The allocating runtime function.
        call: &'static str,
        /// The size asked for.
        bytes: usize,
        /// The runtime's error (`cudaErrorMemoryAllocation`).
        cuda: CudaError,
    },
    /// Source and destination of a copy (or a kernel's operands) have different lengths.
    LengthMismatch {
        /// The operation, e.g. `Stream::copy_h2d`.
        op: &'static str,
        /// Elements on the source (or expected) side.
        src: usize,
        /// Elements on the destination (or actual) side.
        dst: usize,
    },
    /// A buffer or event belongs to another device than the stream it is used with.
    WrongDevice {
        /// The operation, e.g. `Stream::record`.
        op: &'static str,
        /// The device of the stream.
        expected: i32,
        /// The device of the buffer or event.
        found: i32,
    },
    /// A copy between two devices that cannot reach each other's memory directly (no NVLink or
    /// PCIe peer path between them, or the driver refused to enable it). Nothing was queued.
    /// `Device::can_access_peer` says in advance; to move the data anyway, stage it through
    /// pinned host memory (`copy_d2h`, then `copy_h2d`).
    NoPeerAccess {
        /// The operation, e.g. `Stream::copy_peer`.
        op: &'static str,
        /// The device whose copy engines would access the other's memory (the stream's).
        device: i32,
        /// The device whose memory it cannot access.
        peer: i32,
        /// `cudaDeviceEnablePeerAccess`'s error, where it refused; `None` where
        /// `cudaDeviceCanAccessPeer` said no.
        cuda: Option<CudaError>,
    },
    /// An argument was rejected before any CUDA call was made.
    InvalidArgument {
        /// The operation that rejected it.
        op: &'static str,
        /// What is wrong with it, in words.
        reason: String,
    },
    /// Reading or writing a file failed, or it ended before the range asked for.
    Io {
        /// The operation, e.g. `Stager::upload_file`.
        op: &'static str,
        /// The file's path as the caller gave it.
        path: String,
        /// Where in the file the failed read or write started.
        offset: u64,
        /// How many bytes it asked for.
        len: usize,
        /// What went wrong (the system's message, or "the file ends after N bytes").
        message: String,
    },
    /// A file's contents break the rules of its format (a safetensors header that is not valid
    /// JSON, has a duplicate key, an unknown dtype, offsets that overlap or leave a hole ...).
    /// Nothing was allocated or queued for it.
    Format {
        /// The format, e.g. `safetensors`.
        format: &'static str,
        /// The file's path as the caller gave it (`(in memory)` for bytes parsed directly).
        path: String,
        /// The entry (tensor name) at fault, where one is.
        tensor: Option<String>,
        /// What is wrong, in words.
        detail: String,
    },
    /// A worker thread panicked while working for this call; the call's work was stopped and
    /// waited for.
    Panicked {
        /// The call the worker was working for.
        op: &'static str,
        /// The panic's message, where it was a string.
        message: String,
    },
    /// A prefetcher's source failed (returned an error, panicked, or gave a batch whose pixels
    /// do not match its spec, are page-locked for another device, or name a file range that
    /// cannot be read) at this batch; the batches before it came out whole.
    Loader {
        /// The global batch index the source was called with.
        batch: u64,
        /// The source's error, or the panic's message.
        message: String,
    },
    /// Any other error the CUDA runtime reported.
    Cuda {
        /// The runtime function that failed.
        call: &'static str,
        /// The arguments that matter (sizes, devices, kinds), for the message.
        detail: String,
        /// The runtime's error.
        cuda: CudaError,
    },
}

impl Error {
    /// The CUDA error behind this one, if the runtime reported it.
    pub fn cuda(&self) -> Option<CudaError> {
        match self {
            Error::NoDevice { cuda, .. }
            | Error::OutOfMemory { cuda, .. }
            | Error::Cuda { cuda, .. } => Some(*cuda),
            Error::NoPeerAccess { cuda, .. } => *cuda,
            _ => None,
        }
    }

    /// True when the machine has no usable CUDA device or driver.
    pub fn is_no_device(&self) -> bool {
        matches!(self, Error::NoDevice { .. })
    }

    /// For `Error::NoDevice`: the installed driver against what this build needs.
    pub fn driver_status(&self) -> Option<&DriverStatus> {
        match self {
            Error::NoDevice { driver, .. } => Some(driver),
            _ => None,
        }
    }

    /// `Error::InvalidArgument` for `op`, with `reason` in words: for crates built on this one
    /// (pinstream-vision) to reject arguments the same way.
    pub fn invalid(op: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidArgument {
            op,
            reason: reason.into(),
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::NoDevice { call, cuda, driver } => {
                write!(f, "no usable CUDA device or driver: {call} failed: {cuda}")?;
                match driver.advice() {
                    Some(advice) => write!(f, "\n{advice}"),
                    None => {
                        write!(
                            f,
                            "\ndriver: {}; this build: {}",
                            driver.driver_line(),
                            driver.needs_line()
                        )?;
                        if driver.verdict() == DriverVerdict::Sufficient
                            && cuda.code() == sys::cudaError::cudaErrorNoDevice as i32
                        {
                            write!(
                                f,
                                "\nthe driver is new enough, but no GPU is visible to this \
                                 process: check `nvidia-smi`, CUDA_VISIBLE_DEVICES and, in a \
                                 container, that it was given the GPUs"
                            )?;
                        }
                        Ok(())
                    }
                }
            }
            Error::OutOfMemory { call, bytes, cuda } => {
                write!(f, "out of memory: {call} of {bytes} bytes failed: {cuda}")
            }
            Error::LengthMismatch { op, src, dst } => write!(
                f,
                "{op}: length mismatch: source has {src} elements, destination has {dst}"
            ),
            Error::WrongDevice {
                op,
                expected,
                found,
            } => write!(
                f,
                "{op}: wrong device: the stream is on device {expected}, the operand on device {found}"
            ),
            Error::NoPeerAccess {
                op,
                device,
                peer,
                cuda,
            } => {
                write!(
                    f,
                    "{op}: device {device} cannot access device {peer}'s memory directly"
                )?;
                match cuda {
                    Some(c) => write!(f, " (cudaDeviceEnablePeerAccess failed: {c})")?,
                    None => write!(f, " (cudaDeviceCanAccessPeer says no)")?,
                }
                write!(
                    f,
                    "; stage the data through pinned host memory (copy_d2h, then copy_h2d)"
                )
            }
            Error::InvalidArgument { op, reason } => write!(f, "{op}: invalid argument: {reason}"),
            Error::Io {
                op,
                path,
                offset,
                len,
                message,
            } => write!(
                f,
                "{op}: {path}: {len} bytes at offset {offset}: {message}"
            ),
            Error::Format {
                format,
                path,
                tensor,
                detail,
            } => {
                write!(f, "{path}: not a valid {format} file: ")?;
                if let Some(t) = tensor {
                    write!(f, "tensor {t:?}: ")?;
                }
                write!(f, "{detail}")
            }
            Error::Panicked { op, message } => write!(f, "{op}: a worker panicked: {message}"),
            Error::Loader { batch, message } => {
                write!(f, "prefetch: the source failed at batch {batch}: {message}")
            }
            Error::Cuda { call, detail, cuda } if detail.is_empty() => {
                write!(f, "{call} failed: {cuda}")
            }
            Error::Cuda { call, detail, cuda } => write!(f, "{call} ({detail}) failed: {cuda}"),
        }
    }
}

impl std::error::Error for Error {}

/// `Result<T, pinstream::Error>`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

fn is_no_device(err: sys::cudaError_t) -> bool {
    use sys::cudaError as E;
    matches!(
        err,
        E::cudaErrorNoDevice
            | E::cudaErrorInsufficientDriver
            | E::cudaErrorSystemDriverMismatch
            | E::cudaErrorStubLibrary
            | E::cudaErrorCompatNotSupportedOnDevice
    )
}

/// Turns a runtime return code into a `Result`; `detail` is only built on failure.
pub(crate) fn check_with(
    err: sys::cudaError_t,
    call: &'static str,
    detail: impl FnOnce() -> String,
) -> Result<()> {
    if err == sys::cudaError::cudaSuccess {
        return Ok(());
    }
    clear_last_error();
    let cuda = CudaError::from_raw(err);
    if is_no_device(err) {
        return Err(Error::NoDevice {
            call,
            cuda,
            driver: Box::new(driver_status()),
        });
    }
    Err(Error::Cuda {
        call,
        detail: detail(),
        cuda,
    })
}

/// A failed call also leaves its error as the thread's "last error", where the next kernel
/// launch check would find it again: it has been reported, so clear it. (Sticky errors stay.)
pub(crate) fn clear_last_error() {
    // SAFETY: plain call without arguments.
    unsafe {
        let _ = sys::cudaGetLastError();
    }
}

/// `check_with` without details.
pub(crate) fn check(err: sys::cudaError_t, call: &'static str) -> Result<()> {
    check_with(err, call, String::new)
}

/// For allocations: out of memory becomes `Error::OutOfMemory` with the size asked for.
pub(crate) fn check_alloc(err: sys::cudaError_t, call: &'static str, bytes: usize) -> Result<()> {
    if err == sys::cudaError::cudaErrorMemoryAllocation {
        clear_last_error();
        return Err(Error::OutOfMemory {
            call,
            bytes,
            cuda: CudaError::from_raw(err),
        });
    }
    check_with(err, call, || format!("{bytes} bytes"))
}

/// The byte size of `len` elements of `T`, or an error if it overflows.
/// An empty `Vec` with room for `len` elements, or `Error::InvalidArgument` (not a panic or an
/// abort) where the host cannot give that much.
pub(crate) fn try_vec<T>(op: &'static str, len: usize) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|e| {
        Error::invalid(
            op,
            format!(
                "cannot allocate {len} elements of {} bytes of host memory: {e}",
                std::mem::size_of::<T>()
            ),
        )
    })?;
    Ok(v)
}

pub(crate) fn byte_len<T>(op: &'static str, len: usize) -> Result<usize> {
    len.checked_mul(std::mem::size_of::<T>()).ok_or_else(|| {
        Error::invalid(
            op,
            format!(
                "{len} elements of {} bytes overflow usize",
                std::mem::size_of::<T>()
            ),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_device(err: sys::cudaError, driver: DriverStatus) -> String {
        Error::NoDevice {
            call: "cudaGetDeviceCount",
            cuda: CudaError::from_raw(err),
            driver: Box::new(driver),
        }
        .to_string()
    }

    /// The message of `Error::NoDevice` says what to do: with an old driver, without one, and
    /// with a driver that is fine but no GPU in sight.
    #[test]
    fn no_device_message_says_what_to_do() {
        let old = DriverStatus::from_parts(12040, Some("550.54.15".into()), 13000);
        let m = no_device(sys::cudaError::cudaErrorInsufficientDriver, old);
        for needle in [
            "cudaGetDeviceCount failed: cudaErrorInsufficientDriver",
            "550.54.15",
            "12.4",
            "CUDA 13.0 runtime",
            "r580",
            "update the NVIDIA driver",
            "CUDA_HOME",
        ] {
            assert!(m.contains(needle), "missing {needle:?} in:\n{m}");
        }
        let none = DriverStatus::from_parts(0, None, 13000);
        let m = no_device(sys::cudaError::cudaErrorInsufficientDriver, none);
        for needle in ["no NVIDIA driver is installed", "r580", "CUDA_HOME"] {
            assert!(m.contains(needle), "missing {needle:?} in:\n{m}");
        }
        let fine = DriverStatus::from_parts(13000, Some("580.95.05".into()), 13000);
        let m = no_device(sys::cudaError::cudaErrorNoDevice, fine);
        for needle in ["580.95.05", "no GPU is visible", "CUDA_VISIBLE_DEVICES"] {
            assert!(m.contains(needle), "missing {needle:?} in:\n{m}");
        }
        assert!(!m.contains("Ways out"), "{m}");
    }
}
