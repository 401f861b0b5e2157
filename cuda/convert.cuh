// Element conversions shared by pinstream's kernels: f32 to f16 / bf16 / u8 / i8 with round to
// nearest even (integers saturate), 4-wide vector stores, and register-array picks. In an
// anonymous namespace: each .cu file is its own library and gets its own copy.
#pragma once
#include <stdint.h>

namespace {

// ---- conversions ---------------------------------------------------------------------------
// f16 / bf16 as raw bits: no dependency on cuda_fp16.h (which needs CCCL headers that the PyPI
// toolkit packages pinned here do not ship).

struct half_t {
  uint16_t bits;
};
struct bf16_t {
  uint16_t bits;
};

__device__ __forceinline__ uint16_t f32_to_f16_bits(float v) {
  uint16_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
  return h;
}
__device__ __forceinline__ float f16_bits_to_f32(uint16_t h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
// Round to nearest even on the bit pattern (exact on every architecture); NaN stays NaN.
__device__ __forceinline__ uint16_t f32_to_bf16_bits(float v) {
  uint32_t u = __float_as_uint(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
__device__ __forceinline__ float bf16_bits_to_f32(uint16_t b) { return __uint_as_float((uint32_t)b << 16); }

// Two values packed into 32 bits (lo in the low half), one instruction from sm_80 on.
__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
#if __CUDA_ARCH__ >= 800
  uint32_t r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return (uint32_t)f32_to_f16_bits(lo) | ((uint32_t)f32_to_f16_bits(hi) << 16);
#endif
}
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
#if __CUDA_ARCH__ >= 800
  uint32_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return (uint32_t)f32_to_bf16_bits(lo) | ((uint32_t)f32_to_bf16_bits(hi) << 16);
#endif
}

template <typename T>
struct Conv;
template <>
struct Conv<float> {
  static __device__ __forceinline__ float from(float v) { return v; }
};
template <>
struct Conv<half_t> {
  static __device__ __forceinline__ half_t from(float v) { return half_t{f32_to_f16_bits(v)}; }
};
template <>
struct Conv<bf16_t> {
  static __device__ __forceinline__ bf16_t from(float v) { return bf16_t{f32_to_bf16_bits(v)}; }
};
template <>
struct Conv<uint8_t> {
  static __device__ __forceinline__ uint8_t from(float v) {
    int i = __float2int_rn(v);  // round half to even; NaN -> 0
    return (uint8_t)min(max(i, 0), 255);
  }
};
template <>
struct Conv<int8_t> {
  static __device__ __forceinline__ int8_t from(float v) {
    int i = __float2int_rn(v);
    return (int8_t)min(max(i, -128), 127);
  }
};

// Four outputs as one vector store.
template <typename T>
struct Vec4;
template <>
struct Vec4<float> {
  static __device__ __forceinline__ void store(float* p, float a, float b, float c, float d) {
    *reinterpret_cast<float4*>(p) = make_float4(a, b, c, d);
  }
};
template <>
struct Vec4<half_t> {
  static __device__ __forceinline__ void store(half_t* p, float a, float b, float c, float d) {
    *reinterpret_cast<uint2*>(p) = make_uint2(pack_f16x2(a, b), pack_f16x2(c, d));
  }
};
template <>
struct Vec4<bf16_t> {
  static __device__ __forceinline__ void store(bf16_t* p, float a, float b, float c, float d) {
    *reinterpret_cast<uint2*>(p) = make_uint2(pack_bf16x2(a, b), pack_bf16x2(c, d));
  }
};
template <typename I>
__device__ __forceinline__ void store4_int(I* p, float a, float b, float c, float d) {
  uint32_t v = (uint32_t)(uint8_t)Conv<I>::from(a) | ((uint32_t)(uint8_t)Conv<I>::from(b) << 8) |
               ((uint32_t)(uint8_t)Conv<I>::from(c) << 16) | ((uint32_t)(uint8_t)Conv<I>::from(d) << 24);
  *reinterpret_cast<uint32_t*>(p) = v;
}
template <>
struct Vec4<uint8_t> {
  static __device__ __forceinline__ void store(uint8_t* p, float a, float b, float c, float d) {
    store4_int(p, a, b, c, d);
  }
};
template <>
struct Vec4<int8_t> {
  static __device__ __forceinline__ void store(int8_t* p, float a, float b, float c, float d) {
    store4_int(p, a, b, c, d);
  }
};

// Picks element c (0..3) of a 4-array held in registers or kernel parameters without a dynamic
// index (which would put the array in local memory).
__device__ __forceinline__ float pick(const float (&v)[4], int c) {
  return c == 0 ? v[0] : c == 1 ? v[1] : c == 2 ? v[2] : v[3];
}

// Element c of a C-array in registers, without a dynamic index.
template <typename T, int C>
__device__ __forceinline__ T pick4(const T (&v)[C], uint32_t c) {
  T r = v[0];
#pragma unroll
  for (int i = 1; i < C; ++i)
    if (c == (uint32_t)i) r = v[i];
  return r;
}

}  // namespace
