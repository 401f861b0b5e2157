// Fused resized crop: for every sample of a batch, a box of its source image (u8, any size,
// packed anywhere in one input arena) resampled to one output size with a bilinear (triangle)
// filter, widened by the scale when downscaling with antialias (torchvision's antialiased
// bilinear, PIL's convention), optionally mirrored, then out = k[c] * (v - mean[c]) + shift,
// converted to f32 / f16 / bf16 / u8 / i8, NCHW or NHWC in and out. One launch per batch.
//
// A block makes a 32 x 16 tile of one sample's output:
//  - separable (the usual case): the filter of each of the tile's 32 columns and 16 rows is
//    computed once into shared memory; the source rows under the tile are filtered
//    horizontally into shared memory (one thread per source row x output column), then
//    vertically into the output (one thread per output pixel).
//  - direct: where a filter has more than MAXT taps or the tile needs more than RMAX source
//    rows (downscales by more than about 3), each thread filters its output pixel in 2-D with
//    weights computed on the fly. Slower, no limits.
// Reads stay inside each sample's window (which the host checked lies inside its image, which
// lies inside the input); every output element of the batch is written exactly once.
#include "normalize.h"
#include "resize.h"
#include "pinstream.cuh"
#include "convert.cuh"

#include <cstring>

namespace {

constexpr int TW = 32;       // output columns per tile
constexpr int TH = 16;       // output rows per tile
constexpr int THREADS = 256;
constexpr int MAXT = 32;     // taps per filter in the separable path
constexpr int RMAX = 64;     // source rows per tile in the separable path
#ifndef RRC_MIN_BLOCKS
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 750
#define RRC_MIN_BLOCKS 4     // Turing: 1024 threads per SM
#else
#define RRC_MIN_BLOCKS 6     // blocks per SM the registers must allow (40 registers)
#endif
#endif

struct NoRows {};
struct ParamRows {
  pinstream_rrc_sample r[PINSTREAM_RRC_PARAM_ROWS];
};
__device__ __forceinline__ pinstream_rrc_sample row_of(const pinstream_rrc_args& a, const NoRows&, uint32_t s) {
  return a.samples[s];
}
__device__ __forceinline__ pinstream_rrc_sample row_of(const pinstream_rrc_args&, const ParamRows& t, uint32_t s) {
  return t.r[s];
}

__device__ __forceinline__ float tri(float x) {
  x = fabsf(x);
  return x < 1.f ? 1.f - x : 0.f;
}

// The filter of one output coordinate along one axis: taps first .. first + count - 1 (inside
// the window, at least one), weight of tap j = tri((first + j - center + 0.5) * inv).
struct Axis {
  int first, count;
  float center, inv;
};

__device__ __forceinline__ Axis axis_of(float start, float scale, int o, int win0, int winn, bool aa) {
  const float center = start + scale * ((float)o + 0.5f);
  const float support = (aa && scale > 1.f) ? scale : 1.f;
  int lo = max((int)floorf(center - support + 0.5f), win0);
  int hi = min((int)floorf(center + support + 0.5f), win0 + winn);
  if (hi <= lo) {  // only for boxes at the window's very edge: the nearest pixel
    lo = min(max((int)floorf(center), win0), win0 + winn - 1);
    hi = lo + 1;
  }
  return Axis{lo, hi - lo, center, 1.f / support};
}

__device__ __forceinline__ float weight(const Axis& ax, int j) {
  return tri(((float)(ax.first + j) - ax.center + 0.5f) * ax.inv);
}

// 1 / (sum of the weights), or 0 where they sum to 0 (then every tap weighs 1 / count).
__device__ __forceinline__ float inv_total(const Axis& ax) {
  float t = 0.f;
  for (int j = 0; j < ax.count; ++j) t += weight(ax, j);
  return t > 0.f ? 1.f / t : 0.f;
}
__device__ __forceinline__ float norm_weight(const Axis& ax, int j, float inv_t) {
  return inv_t > 0.f ? weight(ax, j) * inv_t : 1.f / (float)ax.count;
}

// Input element (row r, column x, channel c) of a sample.
__device__ __forceinline__ float pixel(const uint8_t* img, bool hwc, int C, int h, int w, int r, int x, int c) {
  const size_t i = hwc ? ((size_t)r * w + x) * C + c : ((size_t)c * h + r) * w + x;
  return (float)__ldg(img + i);
}

template <typename Out, int C>
__device__ __forceinline__ void store(const pinstream_rrc_args& a, uint32_t s, int y, int x, const float (&v)[C]) {
  Out* out = static_cast<Out*>(a.out);
  const size_t plane = (size_t)a.out_h * a.out_w;
  const bool nhwc = a.out_layout == PINSTREAM_NHWC;
  // Element 0 of this pixel, and the distance between its channels.
  Out* p = out + (size_t)s * a.c_out * plane +
           (nhwc ? ((size_t)y * a.out_w + x) * a.c_out : (size_t)y * a.out_w + x);
  const size_t step = nhwc ? 1 : plane;
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    if (c >= a.c_out) break;
    const float val = c < C ? (v[c < C ? c : 0] - a.mean[c]) * a.k[c] + a.shift : a.fill;
    p[c * step] = Conv<Out>::from(val);
  }
}

template <typename Out, int C, typename Rows>
__global__ void __launch_bounds__(THREADS, RRC_MIN_BLOCKS) resized_crop(pinstream_rrc_args a, const __grid_constant__ Rows rows) {
  __shared__ float wx[MAXT][TW];  // [tap][column]: a warp reads 32 banks
  __shared__ float wy[MAXT][TH];
  __shared__ int x0[TW], nx[TW], y0[TH], ny[TH];
  __shared__ float hbuf[C][RMAX][TW];
  __shared__ int span[2];  // source rows under the tile: first, end
  const int tid = threadIdx.x;
  const int tx0 = blockIdx.x * TW, ty0 = blockIdx.y * TH;
  const bool aa = a.antialias != 0;
  const bool hwc = a.in_layout == PINSTREAM_NHWC;
  for (uint32_t s = blockIdx.z; s < (uint32_t)a.n; s += gridDim.z) {
    const pinstream_rrc_sample r = row_of(a, rows, s);
    const uint8_t* img = a.in + r.in_offset;
    __syncthreads();  // the previous sample's tile is done with shared memory
    if (tid == 0) {
      span[0] = 0x7fffffff;
      span[1] = -1;
    }
    __syncthreads();
    bool fits = true;  // this thread's filter (if it computes one) has at most MAXT taps
    if (tid < TW) {
      const int x = tx0 + tid;
      int n = 0, first = 0;
      if (x < a.out_w) {
        const int xs = r.mirror ? a.out_w - 1 - x : x;
        const Axis ax = axis_of(r.left, r.scale_x, xs, r.win_x, r.win_w, aa);
        first = ax.first;
        n = ax.count;
        fits = n <= MAXT;
        if (fits) {
          const float it = inv_total(ax);
          for (int j = 0; j < n; ++j) wx[j][tid] = norm_weight(ax, j, it);
        }
      }
      x0[tid] = first;
      nx[tid] = n;
    } else if (tid >= 32 && tid < 32 + TH) {
      const int k = tid - 32, y = ty0 + k;
      int n = 0, first = 0;
      if (y < a.out_h) {
        const Axis ay = axis_of(r.top, r.scale_y, y, r.win_y, r.win_h, aa);
        first = ay.first;
        n = ay.count;
        fits = n <= MAXT;
        if (fits) {
          const float it = inv_total(ay);
          for (int j = 0; j < n; ++j) wy[j][k] = norm_weight(ay, j, it);
        }
        atomicMin(&span[0], first);
        atomicMax(&span[1], first + n);
      }
      y0[k] = first;
      ny[k] = n;
    }
    // The same decision in every thread of the block.
    const bool all_fit = __syncthreads_and(fits);
    const int ry0 = span[0], R = span[1] - span[0];
    if (R <= 0) continue;  // the tile is below the output (not for valid grids)
    if (all_fit && R <= RMAX) {
      // Horizontal: source rows ry0 .. ry1 - 1 under each of the 32 columns. Taps go four at
      // a time, their loads issued together (a tap past the filter's end reads its first tap
      // again, with weight 0), so that their latencies overlap.
      const size_t plane = (size_t)r.src_h * r.src_w;
      const int xstep = hwc ? C : 1;
      for (int it = tid; it < R * TW; it += THREADS) {
        const int rr = it / TW, col = it % TW;
        float acc[C];
#pragma unroll
        for (int c = 0; c < C; ++c) acc[c] = 0.f;
        const int n = nx[col], xf = x0[col];
        const uint8_t* row = img + (size_t)(ry0 + rr) * r.src_w * xstep + (size_t)xf * xstep;
        for (int j0 = 0; j0 < n; j0 += 4) {
          float w[4], p[4][C];
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            const bool in = j0 + u < n;
            const int j = in ? j0 + u : j0;
            w[u] = in ? wx[j][col] : 0.f;
#pragma unroll
            for (int c = 0; c < C; ++c)
              p[u][c] = (float)(__ldg(row + (size_t)j * xstep + (hwc ? (size_t)c : (size_t)c * plane)));
          }
#pragma unroll
          for (int u = 0; u < 4; ++u)
#pragma unroll
            for (int c = 0; c < C; ++c) acc[c] += w[u] * p[u][c];
        }
#pragma unroll
        for (int c = 0; c < C; ++c) hbuf[c][rr][col] = acc[c];
      }
      __syncthreads();
      // Vertical, one output pixel per thread and row group.
      const int col = tid % TW;
      const int x = tx0 + col;
      for (int k = tid / TW; k < TH; k += THREADS / TW) {
        const int y = ty0 + k;
        if (x >= a.out_w || y >= a.out_h) continue;
        float v[C];
#pragma unroll
        for (int c = 0; c < C; ++c) v[c] = 0.f;
        const int n = ny[k], yf = y0[k] - ry0;
        for (int i = 0; i < n; ++i) {
          const float w = wy[i][k];
#pragma unroll
          for (int c = 0; c < C; ++c) v[c] += w * hbuf[c][yf + i][col];
        }
        store<Out, C>(a, s, y, x, v);
      }
    } else {
      // Direct: 2-D filter per output pixel, weights on the fly.
      for (int it = tid; it < TW * TH; it += THREADS) {
        const int x = tx0 + it % TW, y = ty0 + it / TW;
        if (x >= a.out_w || y >= a.out_h) continue;
        const int xs = r.mirror ? a.out_w - 1 - x : x;
        const Axis ax = axis_of(r.left, r.scale_x, xs, r.win_x, r.win_w, aa);
        const Axis ay = axis_of(r.top, r.scale_y, y, r.win_y, r.win_h, aa);
        const float itx = inv_total(ax), ity = inv_total(ay);
        float v[C];
#pragma unroll
        for (int c = 0; c < C; ++c) v[c] = 0.f;
        for (int i = 0; i < ay.count; ++i) {
          const float wyi = norm_weight(ay, i, ity);
          float acc[C];
#pragma unroll
          for (int c = 0; c < C; ++c) acc[c] = 0.f;
          for (int j = 0; j < ax.count; ++j) {
            const float w = norm_weight(ax, j, itx);
#pragma unroll
            for (int c = 0; c < C; ++c)
              acc[c] += w * pixel(img, hwc, C, r.src_h, r.src_w, ay.first + i, ax.first + j, c);
          }
#pragma unroll
          for (int c = 0; c < C; ++c) v[c] += wyi * acc[c];
        }
        store<Out, C>(a, s, y, x, v);
      }
    }
  }
}

unsigned cap(size_t v, size_t hi) { return (unsigned)(v < 1 ? 1 : (v > hi ? hi : v)); }

template <typename Out, typename Rows>
cudaError_t launch_with(const pinstream_rrc_args& a, const Rows& rows, cudaStream_t stream) {
  dim3 grid(cap(((size_t)a.out_w + TW - 1) / TW, 0x7fffffff), cap(((size_t)a.out_h + TH - 1) / TH, 65535),
            cap((size_t)a.n, 65535));
  pinstream::before_launch();
  switch (a.c_in) {
    case 1: resized_crop<Out, 1, Rows><<<grid, THREADS, 0, stream>>>(a, rows); break;
    case 2: resized_crop<Out, 2, Rows><<<grid, THREADS, 0, stream>>>(a, rows); break;
    case 3: resized_crop<Out, 3, Rows><<<grid, THREADS, 0, stream>>>(a, rows); break;
    case 4: resized_crop<Out, 4, Rows><<<grid, THREADS, 0, stream>>>(a, rows); break;
    default: return cudaErrorInvalidValue;
  }
  return pinstream::launched();
}

template <typename Out>
cudaError_t launch(const pinstream_rrc_args& a, const pinstream_rrc_sample* host_rows, cudaStream_t stream) {
  if (host_rows) {
    // Copied into the launch's parameters when it is queued: the caller's memory is free on return.
    ParamRows t{};
    std::memcpy(t.r, host_rows, (size_t)a.n * sizeof(pinstream_rrc_sample));
    return launch_with<Out>(a, t, stream);
  }
  return launch_with<Out>(a, NoRows{}, stream);
}

}  // namespace

PINSTREAM_API cudaError_t pinstream_resized_crop(const pinstream_rrc_args* args, const pinstream_rrc_sample* rows,
                                                 int32_t out_dtype, cudaStream_t stream) {
  if (!args || !args->in || !args->out || args->n <= 0 || args->out_h <= 0 || args->out_w <= 0 ||
      args->c_in < 1 || args->c_in > 4 || args->c_out < args->c_in || args->c_out > 4)
    return cudaErrorInvalidValue;
  if (rows ? (args->samples || args->n > PINSTREAM_RRC_PARAM_ROWS) : !args->samples) return cudaErrorInvalidValue;
  switch (out_dtype) {
    case PINSTREAM_F32: return launch<float>(*args, rows, stream);
    case PINSTREAM_F16: return launch<half_t>(*args, rows, stream);
    case PINSTREAM_BF16: return launch<bf16_t>(*args, rows, stream);
    case PINSTREAM_U8: return launch<uint8_t>(*args, rows, stream);
    case PINSTREAM_I8: return launch<int8_t>(*args, rows, stream);
    default: return cudaErrorInvalidValue;
  }
}
