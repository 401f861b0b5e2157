// Shared helpers for pinstream's kernels and their C launchers.
#pragma once
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define PINSTREAM_API extern "C"

namespace pinstream {

// Blocks for a grid-stride loop over n items: enough to fill any current GPU, never more than
// the items need.
inline unsigned grid_for(size_t n, unsigned threads) {
  size_t blocks = (n + threads - 1) / threads;
  const size_t cap = 65536;
  return (unsigned)(blocks < 1 ? 1 : (blocks > cap ? cap : blocks));
}

// Launchers call this right before a launch, so that the check after it sees only the launch's
// own error, not one left behind by an earlier, unrelated call.
inline void before_launch() { (void)cudaGetLastError(); }

// Every launcher returns this: the launch's own error, if any.
inline cudaError_t launched() { return cudaGetLastError(); }

}  // namespace pinstream
