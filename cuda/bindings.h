// The CUDA runtime API that bindgen turns into src/sys (see build.rs for the allowlist).
#include <cuda_runtime_api.h>
