// Small utility kernels: fill with a 1/2/4/8-byte pattern, iota, and a spin that holds a stream
// for a given time. The tests use them to prove the nvcc path end to end.
#include "pinstream.cuh"

namespace {

template <typename T>
__global__ void fill_kernel(T* __restrict__ dst, size_t n, T value) {
  size_t stride = (size_t)gridDim.x * blockDim.x;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) dst[i] = value;
}

__global__ void iota_u32_kernel(uint32_t* __restrict__ dst, size_t n, uint32_t start, uint32_t step) {
  size_t stride = (size_t)gridDim.x * blockDim.x;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
    dst[i] = start + (uint32_t)i * step;
}

__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void spin_kernel(uint64_t ns) {
  uint64_t start = global_ns();
  while (global_ns() - start < ns) {
    __nanosleep(1000);
  }
}

template <typename T>
cudaError_t launch_fill(void* dst, size_t n, uint64_t pattern, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  T value;
  memcpy(&value, &pattern, sizeof(T));
  const unsigned threads = 256;
  pinstream::before_launch();
  fill_kernel<T><<<pinstream::grid_for(n, threads), threads, 0, stream>>>((T*)dst, n, value);
  return pinstream::launched();
}

}  // namespace

// Fills `n` elements of `width` bytes (1, 2, 4 or 8) at `dst` with the low bytes of `pattern`.
PINSTREAM_API cudaError_t pinstream_fill(void* dst, size_t n, int width, uint64_t pattern,
                                         cudaStream_t stream) {
  switch (width) {
    case 1: return launch_fill<uint8_t>(dst, n, pattern, stream);
    case 2: return launch_fill<uint16_t>(dst, n, pattern, stream);
    case 4: return launch_fill<uint32_t>(dst, n, pattern, stream);
    case 8: return launch_fill<uint64_t>(dst, n, pattern, stream);
    default: return cudaErrorInvalidValue;
  }
}

// dst[i] = start + i * step (wrapping), for i < n.
PINSTREAM_API cudaError_t pinstream_iota_u32(uint32_t* dst, size_t n, uint32_t start, uint32_t step,
                                             cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const unsigned threads = 256;
  pinstream::before_launch();
  iota_u32_kernel<<<pinstream::grid_for(n, threads), threads, 0, stream>>>(dst, n, start, step);
  return pinstream::launched();
}

namespace {
// Grid-stride copy in 16-byte words (both ends aligned, the caller checks) or bytes.
__global__ void copy_words_kernel(uint4* __restrict__ dst, const uint4* __restrict__ src, size_t n) {
  size_t stride = (size_t)gridDim.x * blockDim.x;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) dst[i] = src[i];
}
__global__ void copy_bytes_kernel(uint8_t* __restrict__ dst, const uint8_t* __restrict__ src, size_t n) {
  size_t stride = (size_t)gridDim.x * blockDim.x;
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) dst[i] = src[i];
}
}  // namespace

// Copies `bytes` from `src` to `dst`, both device addresses (`src` may be mapped pinned host
// memory, which the threads read across the bus): the kernels' per-launch tables, uploaded in
// stream order without handing the stream to a copy engine and back.
PINSTREAM_API cudaError_t pinstream_copy_bytes(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  if (bytes == 0) return cudaSuccess;
  if (!dst || !src) return cudaErrorInvalidValue;
  const unsigned threads = 256;
  pinstream::before_launch();
  if ((uintptr_t)dst % 16 == 0 && (uintptr_t)src % 16 == 0 && bytes % 16 == 0) {
    const size_t words = bytes / 16;
    copy_words_kernel<<<pinstream::grid_for(words, threads), threads, 0, stream>>>((uint4*)dst, (const uint4*)src,
                                                                                  words);
  } else {
    copy_bytes_kernel<<<pinstream::grid_for(bytes, threads), threads, 0, stream>>>((uint8_t*)dst,
                                                                                  (const uint8_t*)src, bytes);
  }
  return pinstream::launched();
}

// One thread that keeps the stream busy for `ns` nanoseconds of GPU time.
PINSTREAM_API cudaError_t pinstream_spin(uint64_t ns, cudaStream_t stream) {
  pinstream::before_launch();
  spin_kernel<<<1, 1, 0, stream>>>(ns);
  return pinstream::launched();
}

namespace {
__global__ void gate_kernel(const volatile uint32_t* flag, uint32_t* timed_out, uint64_t timeout_ns) {
  uint64_t start = global_ns();
  while (*flag == 0) {
    if (global_ns() - start > timeout_ns) {
      *timed_out = 1;
      return;
    }
    __nanosleep(200);
  }
}
}  // namespace

// Holds the stream until the host writes a non-zero value to flag[0] (mapped pinned memory), or
// until `timeout_ns` has passed, in which case it sets flag[1] = 1 so the host can tell.
PINSTREAM_API cudaError_t pinstream_gate(uint32_t* flag, uint64_t timeout_ns, cudaStream_t stream) {
  pinstream::before_launch();
  gate_kernel<<<1, 1, 0, stream>>>(flag, flag + 1, timeout_ns);
  return pinstream::launched();
}
