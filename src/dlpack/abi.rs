//! The DLPack C ABI (dmlc/dlpack `dlpack.h`, version 1.3), written from the header: the
//! structs a producer hands out and a consumer takes, with the constants pinstream uses.
//! Layouts are checked by the tests below against the header's sizes and offsets (x86-64 and
//! aarch64 Linux).

use std::os::raw::c_void;

/// The DLPack version pinstream produces (`DLPACK_MAJOR_VERSION`, `DLPACK_MINOR_VERSION`).
pub const VERSION: DLPackVersion = DLPackVersion { major: 1, minor: 3 };

/// `DLPACK_FLAG_BITMASK_READ_ONLY`: the consumer must not write the data.
pub const FLAG_READ_ONLY: u64 = 1 << 0;
/// `DLPACK_FLAG_BITMASK_IS_COPIED`: the data is a copy the consumer owns alone.
pub const FLAG_IS_COPIED: u64 = 1 << 1;

/// `DLDeviceType::kDLCPU`.
pub const KDL_CPU: i32 = 1;
/// `DLDeviceType::kDLCUDA`: device memory.
pub const KDL_CUDA: i32 = 2;
/// `DLDeviceType::kDLCUDAHost`: page-locked host memory (`cudaHostAlloc`).
pub const KDL_CUDA_HOST: i32 = 3;
/// `DLDeviceType::kDLCUDAManaged`: managed memory (`cudaMallocManaged`).
pub const KDL_CUDA_MANAGED: i32 = 13;

/// `DLDataTypeCode::kDLInt`.
pub const KDL_INT: u8 = 0;
/// `DLDataTypeCode::kDLUInt`.
pub const KDL_UINT: u8 = 1;
/// `DLDataTypeCode::kDLFloat`.
pub const KDL_FLOAT: u8 = 2;
/// `DLDataTypeCode::kDLBfloat`.
pub const KDL_BFLOAT: u8 = 4;
/// `DLDataTypeCode::kDLBool`.
pub const KDL_BOOL: u8 = 6;

/// `kDLComplex` (`dlpack.h` 1.3): a compact pair of floats per element.
pub const KDL_COMPLEX: u8 = 5;
/// `kDLFloat8_e4m3fn` (`dlpack.h` 1.3), PyTorch's `float8_e4m3fn`: safetensors' `F8_E4M3`.
pub const KDL_FLOAT8_E4M3FN: u8 = 10;
/// `kDLFloat8_e4m3fnuz` (`dlpack.h` 1.3).
pub const KDL_FLOAT8_E4M3FNUZ: u8 = 11;
/// `kDLFloat8_e5m2` (`dlpack.h` 1.3), PyTorch's `float8_e5m2`: safetensors' `F8_E5M2`.
pub const KDL_FLOAT8_E5M2: u8 = 12;
/// `kDLFloat8_e5m2fnuz` (`dlpack.h` 1.3).
pub const KDL_FLOAT8_E5M2FNUZ: u8 = 13;
/// `kDLFloat8_e8m0fnu` (`dlpack.h` 1.3), PyTorch's `float8_e8m0fnu`: safetensors' `F8_E8M0`.
pub const KDL_FLOAT8_E8M0FNU: u8 = 14;

/// `DLPackVersion`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DLPackVersion {
    /// Major version: a consumer refuses a tensor of another major version.
    pub major: u32,
    /// Minor version.
    pub minor: u32,
}

/// `DLDevice`: where the data lives.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DLDevice {
    /// A `DLDeviceType` (`KDL_CPU`, `KDL_CUDA`, `KDL_CUDA_HOST`, ...).
    pub device_type: i32,
    /// The device ordinal (0 for host memory).
    pub device_id: i32,
}

/// `DLDataType`: the element type.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DLDataType {
    /// A `DLDataTypeCode` (`KDL_INT`, `KDL_UINT`, `KDL_FLOAT`, `KDL_BFLOAT`, ...).
    pub code: u8,
    /// Bits per lane.
    pub bits: u8,
    /// Lanes (1 for scalars).
    pub lanes: u16,
}

/// `DLTensor`: a strided view, not owning anything.
#[repr(C)]
#[derive(Debug)]
pub struct DLTensor {
    /// The allocation's address; the first element is at `data + byte_offset`.
    pub data: *mut c_void,
    /// Where the data lives.
    pub device: DLDevice,
    /// Number of dimensions.
    pub ndim: i32,
    /// Element type.
    pub dtype: DLDataType,
    /// `ndim` sizes.
    pub shape: *mut i64,
    /// `ndim` strides in elements (never null for `ndim > 0` since DLPack 1.2; older
    /// producers may pass null for a compact row-major tensor).
    pub strides: *mut i64,
    /// Bytes from `data` to the first element.
    pub byte_offset: u64,
}

/// `DLManagedTensor`: the legacy (pre-1.0) managed tensor, without version or flags.
#[repr(C)]
#[derive(Debug)]
pub struct DLManagedTensor {
    /// The tensor.
    pub dl_tensor: DLTensor,
    /// The producer's context.
    pub manager_ctx: *mut c_void,
    /// Called by the consumer once, when it no longer uses the tensor; frees `self`.
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

/// `DLManagedTensorVersioned`: the DLPack 1.x managed tensor.
#[repr(C)]
#[derive(Debug)]
pub struct DLManagedTensorVersioned {
    /// The ABI version of this struct.
    pub version: DLPackVersion,
    /// The producer's context.
    pub manager_ctx: *mut c_void,
    /// Called by the consumer once, when it no longer uses the tensor; frees `self`.
    pub deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    /// `FLAG_*` bits.
    pub flags: u64,
    /// The tensor.
    pub dl_tensor: DLTensor,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    #[test]
    fn layouts_match_the_header() {
        assert_eq!(size_of::<DLDevice>(), 8);
        assert_eq!(size_of::<DLDataType>(), 4);
        assert_eq!(offset_of!(DLTensor, device), 8);
        assert_eq!(offset_of!(DLTensor, ndim), 16);
        assert_eq!(offset_of!(DLTensor, dtype), 20);
        assert_eq!(offset_of!(DLTensor, shape), 24);
        assert_eq!(offset_of!(DLTensor, strides), 32);
        assert_eq!(offset_of!(DLTensor, byte_offset), 40);
        assert_eq!(size_of::<DLTensor>(), 48);
        assert_eq!(offset_of!(DLManagedTensor, manager_ctx), 48);
        assert_eq!(offset_of!(DLManagedTensor, deleter), 56);
        assert_eq!(size_of::<DLManagedTensor>(), 64);
        assert_eq!(offset_of!(DLManagedTensorVersioned, manager_ctx), 8);
        assert_eq!(offset_of!(DLManagedTensorVersioned, deleter), 16);
        assert_eq!(offset_of!(DLManagedTensorVersioned, flags), 24);
        assert_eq!(offset_of!(DLManagedTensorVersioned, dl_tensor), 32);
        assert_eq!(size_of::<DLManagedTensorVersioned>(), 80);
    }
}
