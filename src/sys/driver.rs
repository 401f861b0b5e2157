//! The two driver-API calls pinstream needs that the runtime API lacks, looked up in the driver
//! library the runtime already loaded (`libcuda.so.1`, opened with `RTLD_NOLOAD`): nothing is
//! loaded, initialised or created by asking.

use std::ffi::{c_int, c_uint, c_void};
use std::sync::OnceLock;

type DeviceGet = unsafe extern "C" fn(*mut c_int, c_int) -> c_int;
type PrimaryCtxGetState = unsafe extern "C" fn(c_int, *mut c_uint, *mut c_int) -> c_int;

struct Driver {
    device_get: DeviceGet,
    state: PrimaryCtxGetState,
}

/// The driver's entry points, once the runtime has loaded the driver library; `None` before
/// that (nothing in the process can have a context then) or where a symbol is missing.
fn driver() -> Option<&'static Driver> {
    static DRIVER: OnceLock<Driver> = OnceLock::new();
    if let Some(d) = DRIVER.get() {
        return Some(d);
    }
    // SAFETY: `dlopen` with RTLD_NOLOAD only returns a handle to a library already loaded (the
    // runtime's own `libcuda.so.1`), and takes a NUL-terminated name; the handle is kept for
    // the life of the process (never closed), so the symbols stay valid. The two symbols are
    // the driver API's `cuDeviceGet(CUdevice*, int)` and
    // `cuDevicePrimaryCtxGetState(CUdevice, unsigned*, int*)`, whose C signatures the
    // function-pointer types above spell out (`CUdevice` and `CUresult` are `int`).
    let found = unsafe {
        let lib = libc::dlopen(
            c"libcuda.so.1".as_ptr(),
            libc::RTLD_LAZY | libc::RTLD_NOLOAD,
        );
        if lib.is_null() {
            return None;
        }
        let get = libc::dlsym(lib, c"cuDeviceGet".as_ptr());
        let state = libc::dlsym(lib, c"cuDevicePrimaryCtxGetState".as_ptr());
        if get.is_null() || state.is_null() {
            return None;
        }
        Driver {
            device_get: std::mem::transmute::<*mut c_void, DeviceGet>(get),
            state: std::mem::transmute::<*mut c_void, PrimaryCtxGetState>(state),
        }
    };
    Some(DRIVER.get_or_init(|| found))
}

/// Whether the primary context of device `ordinal` is active in this process: whether anyone
/// (pinstream, PyTorch, CuPy, JAX) has work or memory on that device. `Some(false)` where the
/// driver was never loaded or initialised (no context can exist), `None` where the driver
/// cannot say (the caller then assumes it is).
pub fn primary_context_active(ordinal: i32) -> Option<bool> {
    let Some(d) = driver() else {
        return Some(false);
    };
    let mut dev: c_int = 0;
    // SAFETY: `dev` is a valid out-pointer; the function pointer is the driver's `cuDeviceGet`.
    let r = unsafe { (d.device_get)(&mut dev, ordinal) };
    // CUDA_ERROR_NOT_INITIALIZED (3): `cuInit` never ran, so no context exists.
    if r == 3 {
        return Some(false);
    }
    if r != 0 {
        return None;
    }
    let (mut flags, mut active): (c_uint, c_int) = (0, 0);
    // SAFETY: valid out-pointers; `dev` came from `cuDeviceGet`.
    let r = unsafe { (d.state)(dev, &mut flags, &mut active) };
    match r {
        0 => Some(active != 0),
        3 => Some(false),
        _ => None,
    }
}
