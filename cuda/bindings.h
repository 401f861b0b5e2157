// What bindgen turns into src/sys (see build.rs for the allowlist): the CUDA runtime API and the
// parameter structs of pinstream's own kernels.
#include <cuda_runtime_api.h>
#include "normalize.h"
#include "resize.h"
