// CUDA versions of optim/cast.h: same rounding (shared core/half.h code), on a stream.
// Built only when nvcc is found (config.h ZERORT_WITH_CUDA).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "core/dtype.h"

namespace zerort {

// Device pointers. Errors name the CUDA call and its error string.
void cast_from_f32_cuda(const float* in, void* out, DType out_dtype, size_t n, cudaStream_t stream);
void cast_to_f32_cuda(const void* in, DType in_dtype, float* out, size_t n, cudaStream_t stream);

// Visible devices; 0 when there is no driver or no GPU (never throws).
int cuda_device_count();

}  // namespace zerort
