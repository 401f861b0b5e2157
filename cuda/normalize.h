/* Parameters of the normalize / denormalize kernels, shared by cuda/normalize.cu and Rust
 * (bindgen generates the Rust side from this header, so the layouts always match). Plain C. */
#ifndef PINSTREAM_NORMALIZE_H
#define PINSTREAM_NORMALIZE_H
#include <stdint.h>
#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Element types. */
enum { PINSTREAM_U8 = 0, PINSTREAM_I8 = 1, PINSTREAM_F32 = 2, PINSTREAM_F16 = 3, PINSTREAM_BF16 = 4 };
/* Layouts. */
enum { PINSTREAM_NCHW = 0, PINSTREAM_NHWC = 1 };

/* One sample of a variable-size (or cropped / mirrored) batch. */
typedef struct {
  uint64_t in_offset;  /* first input element of the sample */
  uint64_t out_offset; /* first output element of the sample */
  int32_t src_h, src_w;
  int32_t crop_x, crop_y; /* top-left of the window read from the source */
  int32_t out_h, out_w;   /* window size = output size */
  int32_t mirror;         /* non-zero: flip horizontally */
  int32_t reserved;
} pinstream_norm_sample;

typedef struct {
  const void* in;
  void* out;
  /* Per-sample table on the device (n entries), or NULL for a uniform batch without crops. */
  const pinstream_norm_sample* samples;
  /* Per-sample mean and std on the device (n * c_in each), or NULL for per-channel. */
  const float* sample_mean;
  const float* sample_std;
  float mean[4];  /* per channel */
  float k[4];     /* scale / std, per channel */
  float scale;    /* used with per-sample std */
  float shift;
  float fill;     /* value of padded channels */
  int32_t n, c_in, c_out;
  int32_t h, w;   /* uniform batch: source = output size; variable: the largest output */
  int32_t in_layout, out_layout;
  int32_t reserved;
} pinstream_norm_args;

/* A per-sample table of at most this many samples travels in the launch's own parameters (the
 * launch copies them when it is queued): no upload, and no host memory that must outlive the
 * call. Larger tables are uploaded to the device and named by `samples`. */
#define PINSTREAM_PARAM_ROWS 256

/* out = k[c] * (x - mean[c]) + shift, converted to out_dtype (round to nearest even, saturating
 * for integers). One launch. `rows`: NULL, or the host table of args->n <= PINSTREAM_PARAM_ROWS
 * samples (then args->samples must be NULL), read before the call returns. Returns the launch
 * error. */
cudaError_t pinstream_normalize(const pinstream_norm_args* args, const pinstream_norm_sample* rows,
                                int32_t out_dtype, cudaStream_t stream);

/* out(u8) = round(x * std[c] / scale ... ) : x = (y - shift) / k[c] + mean[c], same layout in and
 * out; in_dtype is F32, F16 or BF16. n_elems = n * c * h * w. */
cudaError_t pinstream_denormalize(const pinstream_norm_args* args, int32_t in_dtype, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif
