/* Parameters of the fused resized-crop kernel (cuda/resize.cu), shared with Rust through bindgen.
 * Plain C. */
#ifndef PINSTREAM_RESIZE_H
#define PINSTREAM_RESIZE_H
#include <stdint.h>
#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/* One output sample: where its source image is, which pixels the filter may read, and how
 * output pixels map into the source. Output pixel (y, x) of the sample (x mirrored first when
 * `mirror`) is centred at source row top + scale_y * (y + 0.5) and column
 * left + scale_x * (x + 0.5); the filter reads only rows win_y .. win_y + win_h - 1 and columns
 * win_x .. win_x + win_w - 1, which lie inside the src_h x src_w image. 56 bytes. */
typedef struct {
  uint64_t in_offset; /* first input byte of the source image */
  int32_t src_h, src_w;
  int32_t win_y, win_x, win_h, win_w;
  float top, left;
  float scale_y, scale_x; /* source pixels per output pixel, > 0 */
  int32_t mirror;         /* non-zero: flip the output left-right */
  int32_t reserved;
} pinstream_rrc_sample;

typedef struct {
  const uint8_t* in;
  void* out; /* n samples of c_out x out_h x out_w, packed */
  /* Per-sample table on the device (n entries), or NULL when the launcher is given host rows. */
  const pinstream_rrc_sample* samples;
  float mean[4]; /* per channel */
  float k[4];    /* scale / std, per channel */
  float shift;
  float fill; /* value of padded channels */
  int32_t n, c_in, c_out;
  int32_t out_h, out_w;
  int32_t in_layout, out_layout; /* PINSTREAM_NCHW / PINSTREAM_NHWC (normalize.h) */
  int32_t antialias; /* non-zero: widen the filter by the scale when downscaling */
} pinstream_rrc_args;

/* Rows in the launch's parameters: at most this many (56 bytes each). */
#define PINSTREAM_RRC_PARAM_ROWS 256

/* out = k[c] * (resample(in) - mean[c]) + shift, converted to out_dtype. Bilinear (triangle)
 * filter; with antialias, widened by the scale where it is > 1 (torchvision's antialiased
 * bilinear). One launch. `rows`: NULL, or the host table of args->n <= PINSTREAM_RRC_PARAM_ROWS
 * samples (args->samples NULL), copied before the call returns. Returns the launch error. */
cudaError_t pinstream_resized_crop(const pinstream_rrc_args* args, const pinstream_rrc_sample* rows,
                                   int32_t out_dtype, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif
