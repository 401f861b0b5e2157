// Fused normalize / cast: out = k[c] * (x - mean[c]) + shift (k = scale / std), u8 in, f32 / f16 /
// bf16 / u8 / i8 out, NCHW or NHWC in and out, one launch per batch.
//
// Four kernels, chosen by the launcher:
//  - same_layout: NCHW->NCHW or NHWC->NHWC of a uniform batch. A warp moves 512 input bytes per
//    step: lane l loads words l, l+32, l+64, l+96 (four coalesced 128-byte loads in flight) and
//    stores each as four outputs (float4 / 8-byte / 4-byte), so every store instruction of a warp
//    writes one contiguous span.
//  - nhwc_to_nchw<C>: the fused transpose. A block stages 512 pixels x C bytes of input in shared
//    memory with 16-byte loads, then each thread writes 4 pixels of every channel plane as one
//    vector store per plane.
//  - crop_rows<C>: per-sample tables (crops, mirrors, variable sizes) without channel padding:
//    rows staged in shared memory with 16-byte loads, 4 pixels x C channels per thread out.
//  - general: one thread per output pixel; everything else (channel padding, unaligned outputs,
//    rows wider than 2048), any layout pair, per-sample mean/std.
#include "normalize.h"
#include "pinstream.cuh"
#include "convert.cuh"

#include <cstring>

namespace {

// ---- where the per-sample table is ---------------------------------------------------------
// NoRows: in device memory at a.samples (or none: a uniform batch); ParamRows: in the launch's
// parameters (a __grid_constant__ parameter, read in place from the constant bank).
struct NoRows {};
struct ParamRows {
  pinstream_norm_sample r[PINSTREAM_PARAM_ROWS];
};
__device__ __forceinline__ bool has_rows(const pinstream_norm_args& a, const NoRows&) { return a.samples != nullptr; }
__device__ __forceinline__ bool has_rows(const pinstream_norm_args&, const ParamRows&) { return true; }
__device__ __forceinline__ pinstream_norm_sample row_of(const pinstream_norm_args& a, const NoRows&, uint32_t s) {
  return a.samples[s];
}
__device__ __forceinline__ pinstream_norm_sample row_of(const pinstream_norm_args&, const ParamRows& t, uint32_t s) {
  return t.r[s];
}

// Mean and k of channel c of sample s.
__device__ __forceinline__ void params(const pinstream_norm_args& a, int s, int c, float& mean, float& k) {
  if (a.sample_mean) {
    mean = __ldg(a.sample_mean + (size_t)s * a.c_in + c);
    k = a.scale / __ldg(a.sample_std + (size_t)s * a.c_in + c);
  } else {
    mean = pick(a.mean, c);
    k = pick(a.k, c);
  }
}

__device__ __forceinline__ float norm(uint32_t x, float mean, float k, float shift) {
  return ((float)x - mean) * k + shift;
}

// ---- same layout, uniform batch ------------------------------------------------------------

// Elements 4*w .. 4*w+3 share one channel (NCHW, h*w % 4 == 0) or cycle through channels (NHWC).
// Overflow audit: taken only for total = n*c*h*w < 2^32 elements, so words < 2^30, hw < 2^32 and
// e = 4 * wi < 2^32; the grid has about words / 128 warps, so base + warps * 128 < 2^31 + 2^10.
template <typename Out, bool NHWC>
__global__ void __launch_bounds__(256) same_layout(pinstream_norm_args a, uint32_t words) {
  const uint32_t* in = reinterpret_cast<const uint32_t*>(a.in);
  Out* out = reinterpret_cast<Out*>(a.out);
  const uint32_t hw = (uint32_t)a.h * (uint32_t)a.w;
  const uint32_t C = (uint32_t)a.c_in;
  const uint32_t lane = threadIdx.x & 31;
  const uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const uint32_t warps = (gridDim.x * blockDim.x) >> 5;
  for (uint32_t base = warp * 128; base < words; base += warps * 128) {
    uint32_t v[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t wi = base + lane + 32 * j;
      v[j] = wi < words ? __ldg(in + wi) : 0u;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint32_t wi = base + lane + 32 * j;
      if (wi >= words) break;
      uint32_t e = wi * 4;  // first element
      float r[4];
      if (NHWC) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const uint32_t ei = e + i, pix = ei / C, c = ei - pix * C;
          float mean, k;
          params(a, a.sample_mean ? (int)(pix / hw) : 0, (int)c, mean, k);
          r[i] = norm((v[j] >> (8 * i)) & 0xFF, mean, k, a.shift);
        }
      } else {
        uint32_t plane = e / hw;
        uint32_t c = plane % C;
        float mean, k;
        params(a, (int)(plane / C), (int)c, mean, k);
#pragma unroll
        for (int i = 0; i < 4; ++i) r[i] = norm((v[j] >> (8 * i)) & 0xFF, mean, k, a.shift);
      }
      Vec4<Out>::store(out + e, r[0], r[1], r[2], r[3]);
    }
  }
}

// ---- NHWC -> NCHW, uniform batch -----------------------------------------------------------

constexpr int TP = 512;  // pixels per block
constexpr int TT = 128;  // threads per block: 4 pixels each

// Overflow audit: taken only for total < 2^32 and tiles * n < 2^31 blocks, so hw < 2^32,
// p0 < hw and p0 + p < hw + TP; byte and element offsets are formed in size_t.
template <typename Out, int C>
__global__ void __launch_bounds__(TT) nhwc_to_nchw(pinstream_norm_args a, uint32_t tiles_per_sample) {
  __shared__ __align__(16) uint8_t tile[TP * C];
  const uint32_t hw = (uint32_t)a.h * (uint32_t)a.w;
  const uint32_t s = blockIdx.x / tiles_per_sample;
  const uint32_t p0 = (blockIdx.x - s * tiles_per_sample) * TP;
  const uint32_t npix = min((uint32_t)TP, hw - p0);
  const uint8_t* src = reinterpret_cast<const uint8_t*>(a.in) + ((size_t)s * hw + p0) * C;
  // Stage: 16-byte loads where the whole tile is there, bytes for the last one.
  if (npix == TP) {
    const uint4* s16 = reinterpret_cast<const uint4*>(src);
    uint4* t16 = reinterpret_cast<uint4*>(tile);
    // A trip count known at compile time (for C = 2 the runtime-bounded loop made ptxas spill).
#pragma unroll
    for (int j = 0; j < (TP * C / 16 + TT - 1) / TT; ++j) {
      const int i = threadIdx.x + j * TT;
      if (TP * C / 16 % TT == 0 || i < TP * C / 16) t16[i] = __ldg(s16 + i);
    }
  } else {
    for (uint32_t i = threadIdx.x; i < npix * C; i += TT) tile[i] = __ldg(src + i);
  }
  __syncthreads();
  const uint32_t p = threadIdx.x * 4;
  if (p >= npix) return;
  Out* dst = reinterpret_cast<Out*>(a.out) + (size_t)s * C * hw + p0 + p;
#pragma unroll
  for (int c = 0; c < C; ++c) {
    float mean, k;
    params(a, (int)s, c, mean, k);
    float r[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) r[i] = norm(tile[(p + i) * C + c], mean, k, a.shift);
    if (p + 4 <= npix) {
      Vec4<Out>::store(dst + (size_t)c * hw, r[0], r[1], r[2], r[3]);
    } else {
      // Constant indices only: a dynamic r[i] would put r in local memory.
#pragma unroll
      for (int i = 0; i < 3; ++i)
        if ((uint32_t)i < npix - p) dst[(size_t)c * hw + i] = Conv<Out>::from(r[i]);
    }
  }
}

// ---- general ---------------------------------------------------------------------------------

// Index arithmetic (audited for overflow): the host guarantees n <= INT32_MAX, h, w <= INT32_MAX
// and out_h * out_w <= src_h * src_w <= UINT32_MAX per sample; element offsets are 64-bit. The
// sample loop counts in uint32 (s < n <= 2^31 - 1, plus gridDim.y <= 65535: no wrap). The pixel
// loop keeps 32-bit indices (32-bit division is much cheaper) but never steps past npix: with
// npix up to 2^32 - 1 and a stride of up to 2^20, `p += stride` could wrap to a small p and loop
// forever, so a thread stops as soon as the remaining distance is at most one stride.
template <typename Out, typename Rows>
__global__ void __launch_bounds__(256) general(pinstream_norm_args a, const __grid_constant__ Rows rows) {
  const uint8_t* in = reinterpret_cast<const uint8_t*>(a.in);
  Out* out = reinterpret_cast<Out*>(a.out);
  const uint32_t n = (uint32_t)a.n;
  const uint32_t stride = gridDim.x * blockDim.x;  // <= 4096 * 256 (launch below)
  for (uint32_t s = blockIdx.y; s < n; s += gridDim.y) {
    pinstream_norm_sample d;
    if (has_rows(a, rows)) {
      d = row_of(a, rows, s);
    } else {
      const size_t hw = (size_t)a.h * a.w;
      d.in_offset = (uint64_t)s * a.c_in * hw;
      d.out_offset = (uint64_t)s * a.c_out * hw;
      d.src_h = d.out_h = a.h;
      d.src_w = d.out_w = a.w;
      d.crop_x = d.crop_y = 0;
      d.mirror = 0;
    }
    const uint32_t npix = (uint32_t)d.out_h * (uint32_t)d.out_w;
    const size_t src_hw = (size_t)d.src_h * d.src_w;
    float mean[4], k[4];
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      if (c < a.c_in) {
        params(a, (int)s, c, mean[c], k[c]);
      } else {
        mean[c] = 0.f;
        k[c] = 0.f;
      }
    }
    for (uint32_t p = blockIdx.x * blockDim.x + threadIdx.x; p < npix; p = npix - p <= stride ? npix : p + stride) {
      const uint32_t oy = p / (uint32_t)d.out_w, ox = p - oy * (uint32_t)d.out_w;
      const uint32_t sx = d.crop_x + (d.mirror ? d.out_w - 1 - ox : ox);
      const uint32_t sy = d.crop_y + oy;
      const size_t spix = (size_t)sy * d.src_w + sx;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        if (c >= a.c_out) break;
        float v;
        if (c < a.c_in) {
          const size_t ii = a.in_layout == PINSTREAM_NCHW ? d.in_offset + (size_t)c * src_hw + spix
                                                          : d.in_offset + spix * a.c_in + c;
          v = norm(__ldg(in + ii), mean[c], k[c], a.shift);
        } else {
          v = a.fill;
        }
        const size_t oi = a.out_layout == PINSTREAM_NCHW ? d.out_offset + (size_t)c * npix + p
                                                         : d.out_offset + (size_t)p * a.c_out + c;
        out[oi] = Conv<Out>::from(v);
      }
    }
  }
}

// ---- crops and mirrors, rows through shared memory ----------------------------------------------

// A block takes R output rows of one sample (grid: row groups x samples). Their source bytes --
// one contiguous span per row in NHWC, one per row and channel in NCHW ("segments") -- are
// staged in shared memory, shifted so that each span starts on a 4-byte boundary: every staged
// word is a funnel shift of two aligned 32-bit loads. A load that would reach outside the
// sample's source image is assembled from single bytes inside it instead, so nothing outside the
// input is read. Writing NCHW with out_w % 4 == 0 and an aligned sample, a thread takes 4
// consecutive output pixels of one row: C words from shared memory (4 pixels x C channels; the
// mirror reads the mirrored 4 pixels and reverses them), then one vector store per channel plane.
// Other outputs take a per-element path. Used for per-sample tables (crops, mirrors, variable
// sizes) with c_out == c_in and output rows of at most ROW_MAX pixels.
constexpr int ROW_MAX = 2048;
constexpr int ROW_THREADS = 256;
constexpr int ROW_SMEM = 12288;  // bytes of staged source per block (R rows)
constexpr int ROW_R_MAX = 16;

// The 16-byte aligned chunk at `p`: one vector load where [lo, hi) holds all of it, else byte by
// byte (bytes outside [lo, hi) read as 0 and are never used).
__device__ __forceinline__ uint4 load_chunk(const uint8_t* p, const uint8_t* lo, const uint8_t* hi) {
  if (p >= lo && p + 16 <= hi) return __ldg(reinterpret_cast<const uint4*>(p));
  uint32_t w[4] = {0, 0, 0, 0};
#pragma unroll
  for (int i = 0; i < 16; ++i)
    if (p + i >= lo && p + i < hi) w[i / 4] |= (uint32_t)__ldg(p + i) << (8 * (i % 4));
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// `n` words of tile bytes starting at byte offset `o` (any alignment): aligned shared loads and
// funnel shifts.
template <int N>
__device__ __forceinline__ void tile_words(const uint8_t* tile, uint32_t o, uint32_t (&w)[N]) {
  const uint32_t* t = reinterpret_cast<const uint32_t*>(tile) + o / 4;
  const uint32_t sh = (o % 4) * 8;
  uint32_t raw[N + 1];
#pragma unroll
  for (int i = 0; i <= N; ++i) raw[i] = t[i];
#pragma unroll
  for (int i = 0; i < N; ++i) w[i] = __funnelshift_r(raw[i], raw[i + 1], sh);
}

template <int C>
__device__ __forceinline__ uint32_t byte_of(const uint32_t (&w)[C], int i) {
  return (w[i >> 2] >> (8 * (i & 3))) & 0xFFu;
}

// Overflow audit: as `general` (64-bit element and byte offsets); per block at most
// ROW_R_MAX * 4 segments of at most 4 * ROW_MAX + 4 bytes, so smem-local indices are small.
// Blocks per SM the register allocation must allow: 5 for 1- and 2-byte outputs (48 registers;
// f16 crop + mirror, 3 channels: 94 -> 99 % of a copy on the H100), 4 with 4 channels (48 would
// spill), 1 for f32 (more blocks measured no faster).
// (Turing holds at most 1024 threads per SM: 4 there.)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
constexpr int ROW_BLOCKS_NARROW = 4;
#else
constexpr int ROW_BLOCKS_NARROW = 5;
#endif
template <typename Out, int C>
constexpr int crop_rows_min_blocks() {
  return sizeof(Out) <= 2 ? (C == 4 ? 4 : ROW_BLOCKS_NARROW) : 1;
}

template <typename Out, int C, typename Rows>
__global__ void __launch_bounds__(ROW_THREADS, crop_rows_min_blocks<Out, C>())
    crop_rows(pinstream_norm_args a, uint32_t R, uint32_t S, const __grid_constant__ Rows rows) {
  extern __shared__ __align__(16) uint8_t tile[];
  __shared__ uint8_t lead_s[ROW_R_MAX * 4];
  const uint8_t* in = reinterpret_cast<const uint8_t*>(a.in);
  Out* out = reinterpret_cast<Out*>(a.out);
  const bool in_nhwc = a.in_layout == PINSTREAM_NHWC;
  const uint32_t segs_per_row = in_nhwc ? 1u : (uint32_t)C;
  for (uint32_t s = blockIdx.y; s < (uint32_t)a.n; s += gridDim.y) {
    const pinstream_norm_sample d = row_of(a, rows, s);
    const uint32_t out_w = (uint32_t)d.out_w, out_h = (uint32_t)d.out_h;
    const size_t npix = (size_t)out_w * out_h;
    const size_t src_hw = (size_t)d.src_h * d.src_w;
    const uint8_t* img = in + d.in_offset;  // the sample's source image
    const uint8_t* img_end = img + src_hw * C;
    const uint32_t L = in_nhwc ? out_w * C : out_w;  // bytes per segment
    const uint32_t nc = (L + 15) / 16 + 1;           // 16-byte chunks covering any span of L bytes
    float mean[C], k[C];
#pragma unroll
    for (int c = 0; c < C; ++c) params(a, (int)s, c, mean[c], k[c]);
    // NCHW out, 4 pixels per thread: threads per row a power of two >= the groups of a row.
    const uint32_t q = out_w / 4;
    uint32_t tpr = 1;
    while (tpr < q && tpr < ROW_THREADS) tpr *= 2;
    const uint32_t tx = threadIdx.x & (tpr - 1), ty = threadIdx.x / tpr, rp = ROW_THREADS / tpr;
    const bool fast = a.out_layout == PINSTREAM_NCHW && out_w % 4 == 0 && npix % 4 == 0 && d.out_offset % 4 == 0;
    for (uint32_t oy0 = blockIdx.x * R; oy0 < out_h; oy0 += gridDim.x * R) {
      const uint32_t rows = min(R, out_h - oy0);
      const uint32_t G = rows * segs_per_row;
      __syncthreads();  // the previous rows' reads of the tile are done
      // Segment g's span starts at byte lead(g) = b & 15 of its first chunk; chunks go to the tile
      // as they are (16-byte stores), four loads in flight per thread.
      auto span = [&](uint32_t g) -> const uint8_t* {
        const uint32_t r = g / segs_per_row, c = g - r * segs_per_row;
        const size_t pix = (size_t)(d.crop_y + oy0 + r) * d.src_w + d.crop_x;
        return in_nhwc ? img + pix * C : img + (size_t)c * src_hw + pix;
      };
      for (uint32_t base = threadIdx.x; base < G * nc; base += 4 * ROW_THREADS) {
        uint4 v[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint32_t i = base + j * ROW_THREADS;
          if (i < G * nc) {
            const uint32_t g = i / nc, ch = i - g * nc;
            const uint8_t* a16 = reinterpret_cast<const uint8_t*>((uintptr_t)span(g) & ~(uintptr_t)15);
            v[j] = load_chunk(a16 + 16 * ch, img, img_end);
          }
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint32_t i = base + j * ROW_THREADS;
          if (i < G * nc) {
            const uint32_t g = i / nc, ch = i - g * nc;
            reinterpret_cast<uint4*>(tile + g * S)[ch] = v[j];
          }
        }
      }
      if (threadIdx.x < G) lead_s[threadIdx.x] = (uint8_t)((uintptr_t)span(threadIdx.x) & 15);
      __syncthreads();
      if (fast) {
        for (uint32_t r = ty; r < rows; r += rp) {
          for (uint32_t x4 = tx; x4 < q; x4 += tpr) {
            const uint32_t x = 4 * x4;
            const uint32_t sx = d.mirror ? out_w - 4 - x : x;  // first of the 4 source pixels
            float o[C][4];
            if (in_nhwc) {
              uint32_t w[C];
              tile_words<C>(tile + r * S, lead_s[r] + sx * C, w);
#pragma unroll
              for (int p = 0; p < 4; ++p)
#pragma unroll
                for (int c = 0; c < C; ++c) o[c][p] = norm(byte_of<C>(w, p * C + c), mean[c], k[c], a.shift);
            } else {
#pragma unroll
              for (int c = 0; c < C; ++c) {
                uint32_t w1[1];
                tile_words<1>(tile + (r * C + c) * S, lead_s[r * C + c] + sx, w1);
                const uint32_t w = w1[0];
#pragma unroll
                for (int p = 0; p < 4; ++p) o[c][p] = norm((w >> (8 * p)) & 0xFFu, mean[c], k[c], a.shift);
              }
            }
            Out* dst = out + d.out_offset + (size_t)(oy0 + r) * out_w + x;
#pragma unroll
            for (int c = 0; c < C; ++c) {
              if (d.mirror)
                Vec4<Out>::store(dst + (size_t)c * npix, o[c][3], o[c][2], o[c][1], o[c][0]);
              else
                Vec4<Out>::store(dst + (size_t)c * npix, o[c][0], o[c][1], o[c][2], o[c][3]);
            }
          }
        }
      } else {
        // Any output layout and width: one element per step.
        const uint32_t per_row = out_w * C;
        for (uint32_t i = threadIdx.x; i < rows * per_row; i += ROW_THREADS) {
          const uint32_t r = i / per_row, e = i - r * per_row;
          uint32_t x, c;
          size_t oi;
          if (a.out_layout == PINSTREAM_NCHW) {
            c = e / out_w;
            x = e - c * out_w;
            oi = d.out_offset + (size_t)c * npix + (size_t)(oy0 + r) * out_w + x;
          } else {
            x = e / C;
            c = e - x * C;
            oi = d.out_offset + (size_t)(oy0 + r) * per_row + e;
          }
          const uint32_t sx = d.mirror ? out_w - 1 - x : x;
          const uint32_t v = in_nhwc ? tile[r * S + lead_s[r] + sx * C + c]
                                     : tile[(r * C + c) * S + lead_s[r * C + c] + sx];
          out[oi] = Conv<Out>::from(norm(v, pick4(mean, c), pick4(k, c), a.shift));
        }
      }
    }
  }
}

// ---- denormalize -----------------------------------------------------------------------------

template <typename T>
__device__ __forceinline__ float to_f32(T v);
template <>
__device__ __forceinline__ float to_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_f32<half_t>(half_t v) { return f16_bits_to_f32(v.bits); }
template <>
__device__ __forceinline__ float to_f32<bf16_t>(bf16_t v) { return bf16_bits_to_f32(v.bits); }

// Overflow audit: 64-bit element indices; total <= 2^31 * 4 * 2^32 < 2^64 - stride.
template <typename In>
__global__ void __launch_bounds__(256) denormalize(pinstream_norm_args a, size_t total) {
  const In* in = reinterpret_cast<const In*>(a.in);
  uint8_t* out = reinterpret_cast<uint8_t*>(a.out);
  const size_t hw = (size_t)a.h * a.w;
  for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < total; e += (size_t)gridDim.x * blockDim.x) {
    const int c = a.in_layout == PINSTREAM_NCHW ? (int)((e / hw) % a.c_in) : (int)(e % a.c_in);
    // x = (y - shift) / k + mean
    const float y = to_f32(in[e]);
    out[e] = Conv<uint8_t>::from((y - a.shift) / pick(a.k, c) + pick(a.mean, c));
  }
}

inline size_t cap(size_t a, size_t b) { return a < b ? a : b; }

template <typename Out, typename Rows>
cudaError_t launch_with(const pinstream_norm_args& a, const Rows& rows, bool table, cudaStream_t stream) {
  const bool uniform = !table && a.c_out == a.c_in;
  const size_t hw = (size_t)a.h * a.w;
  const size_t total = (size_t)a.n * a.c_in * hw;
  const uintptr_t in_addr = (uintptr_t)a.in, out_addr = (uintptr_t)a.out;
  const bool aligned = in_addr % 16 == 0 && out_addr % (4 * sizeof(Out)) == 0;
  pinstream::before_launch();
  if (uniform && aligned && a.in_layout == a.out_layout && total < (1ull << 32) && total % 4 == 0 &&
      (a.in_layout == PINSTREAM_NHWC || hw % 4 == 0)) {
    const uint32_t words = (uint32_t)(total / 4);
    // One 512-element step per warp, no grid-stride remainder: an uneven number of steps per
    // warp left part of the GPU idle at the end (measured ~8 % on the H100).
    const unsigned blocks = (unsigned)cap((words + 1023) / 1024, 0x7fffffff);
    if (a.in_layout == PINSTREAM_NHWC)
      same_layout<Out, true><<<blocks, 256, 0, stream>>>(a, words);
    else
      same_layout<Out, false><<<blocks, 256, 0, stream>>>(a, words);
    return pinstream::launched();
  }
  if (uniform && aligned && a.in_layout == PINSTREAM_NHWC && a.out_layout == PINSTREAM_NCHW && hw % 4 == 0 &&
      (hw * a.c_in) % 16 == 0 && total < (1ull << 32)) {
    const uint32_t tiles = (uint32_t)((hw + TP - 1) / TP);
    const size_t blocks = (size_t)tiles * a.n;
    if (blocks < (1u << 31)) {
      switch (a.c_in) {
        case 1: nhwc_to_nchw<Out, 1><<<(unsigned)blocks, TT, 0, stream>>>(a, tiles); return pinstream::launched();
        case 2: nhwc_to_nchw<Out, 2><<<(unsigned)blocks, TT, 0, stream>>>(a, tiles); return pinstream::launched();
        case 3: nhwc_to_nchw<Out, 3><<<(unsigned)blocks, TT, 0, stream>>>(a, tiles); return pinstream::launched();
        case 4: nhwc_to_nchw<Out, 4><<<(unsigned)blocks, TT, 0, stream>>>(a, tiles); return pinstream::launched();
        default: break;
      }
    }
  }
  if (table && a.c_out == a.c_in && a.c_in >= 1 && a.c_in <= 4 && a.w <= ROW_MAX && a.h > 0 &&
      out_addr % (4 * sizeof(Out)) == 0) {
    // Rows per block: as many as fit ROW_SMEM of staged source, at most ROW_R_MAX.
    const bool nhwc = a.in_layout == PINSTREAM_NHWC;
    const uint32_t L = nhwc ? (uint32_t)a.w * a.c_in : (uint32_t)a.w;
    // Per segment: the chunks covering a span (lead up to 15 bytes) and one word more for the
    // funnel-shifted reads at its end.
    const uint32_t S = ((L + 15) / 16 + 1) * 16 + 16;
    const uint32_t segs = nhwc ? 1u : (uint32_t)a.c_in;
    // 16 rows of 224 x 3 at most: more rows per block or more blocks per SM (fewer registers)
    // measured slower on the H100 (BENCHMARKS.md).
    uint32_t R = ROW_SMEM / (segs * S);
    R = R < 1 ? 1 : (R > (uint32_t)ROW_R_MAX ? (uint32_t)ROW_R_MAX : R);
    const size_t smem = (size_t)R * segs * S;
    dim3 grid((unsigned)cap(((size_t)a.h + R - 1) / R, 65535), (unsigned)cap((size_t)a.n, 65535));
    switch (a.c_in) {
      case 1: crop_rows<Out, 1, Rows><<<grid, ROW_THREADS, smem, stream>>>(a, R, S, rows); return pinstream::launched();
      case 2: crop_rows<Out, 2, Rows><<<grid, ROW_THREADS, smem, stream>>>(a, R, S, rows); return pinstream::launched();
      case 3: crop_rows<Out, 3, Rows><<<grid, ROW_THREADS, smem, stream>>>(a, R, S, rows); return pinstream::launched();
      case 4: crop_rows<Out, 4, Rows><<<grid, ROW_THREADS, smem, stream>>>(a, R, S, rows); return pinstream::launched();
      default: break;
    }
  }
  // general: at most 4096 x 256 threads per sample (the kernel's stride bound), h and w being the
  // largest output height and width (their product may exceed any sample's; only the grid uses it).
  const size_t max_pix = (size_t)a.h * a.w;
  dim3 grid((unsigned)cap((max_pix + 255) / 256, 4096), (unsigned)cap((size_t)a.n, 65535));
  general<Out, Rows><<<grid, 256, 0, stream>>>(a, rows);
  return pinstream::launched();
}

template <typename Out>
cudaError_t launch(const pinstream_norm_args& a, const pinstream_norm_sample* host_rows, cudaStream_t stream) {
  if (host_rows) {
    // Copied into the launch's parameters when it is queued: the caller's memory is free on return.
    ParamRows t{};
    std::memcpy(t.r, host_rows, (size_t)a.n * sizeof(pinstream_norm_sample));
    return launch_with<Out>(a, t, true, stream);
  }
  return launch_with<Out>(a, NoRows{}, a.samples != nullptr, stream);
}

}  // namespace

PINSTREAM_API cudaError_t pinstream_normalize(const pinstream_norm_args* args, const pinstream_norm_sample* rows,
                                              int32_t out_dtype, cudaStream_t stream) {
  if (!args || !args->in || !args->out || args->n <= 0 || args->h <= 0 || args->w <= 0 || args->c_in < 1 ||
      args->c_in > 4 || args->c_out < args->c_in || args->c_out > 4)
    return cudaErrorInvalidValue;
  if (rows && (args->samples || args->n > PINSTREAM_PARAM_ROWS)) return cudaErrorInvalidValue;
  switch (out_dtype) {
    case PINSTREAM_F32: return launch<float>(*args, rows, stream);
    case PINSTREAM_F16: return launch<half_t>(*args, rows, stream);
    case PINSTREAM_BF16: return launch<bf16_t>(*args, rows, stream);
    case PINSTREAM_U8: return launch<uint8_t>(*args, rows, stream);
    case PINSTREAM_I8: return launch<int8_t>(*args, rows, stream);
    default: return cudaErrorInvalidValue;
  }
}

PINSTREAM_API cudaError_t pinstream_denormalize(const pinstream_norm_args* args, int32_t in_dtype,
                                                cudaStream_t stream) {
  if (!args || !args->in || !args->out || args->n <= 0 || args->h <= 0 || args->w <= 0 || args->c_in < 1 ||
      args->c_in > 4)
    return cudaErrorInvalidValue;
  const size_t total = (size_t)args->n * args->c_in * args->h * args->w;
  if (total == 0) return cudaSuccess;
  const unsigned blocks = (unsigned)cap((total + 255) / 256, 132 * 32);
  pinstream::before_launch();
  switch (in_dtype) {
    case PINSTREAM_F32: denormalize<float><<<blocks, 256, 0, stream>>>(*args, total); break;
    case PINSTREAM_F16: denormalize<half_t><<<blocks, 256, 0, stream>>>(*args, total); break;
    case PINSTREAM_BF16: denormalize<bf16_t><<<blocks, 256, 0, stream>>>(*args, total); break;
    default: return cudaErrorInvalidValue;
  }
  return pinstream::launched();
}
