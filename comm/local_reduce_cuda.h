// The device half of reduce_scatter_accumulate (see local_reduce.h), on a stream.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "core/dtype.h"

namespace zerort {

// chunks: `world` chunks of n elements (bf16, f16 or f32) on the device, chunk r from rank r.
// out[i] (+)= the sum over r = 0..world-1 in that order, accumulated in FP64 and rounded once
// to FP32: bitwise the CPU sum_chunks_to_f32. 16-byte loads, 64-bit indices. Checked launch.
void sum_chunks_to_f32_cuda(const void* chunks, DType dtype, size_t world, size_t n, float* out, bool accumulate,
                            cudaStream_t stream);

}  // namespace zerort
