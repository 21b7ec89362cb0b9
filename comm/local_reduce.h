// Element-wise host reductions used by every CPU backend: one place for the arithmetic.
#pragma once

#include <cstddef>

#include "core/dtype.h"

namespace zerort {

// acc[i] = op(acc[i], src[i]) for n elements. bf16/f16 compute in float and round once
// per call (round to nearest even). Max/min propagate NaN.
void reduce_into(void* acc, const void* src, size_t n, DType dtype, ReduceOp op);

// The local half of reduce_scatter_accumulate. chunks holds `world` chunks of n elements
// each (bf16, f16 or f32), chunk r from rank r. out[i] (+)= sum over r = 0..world-1 in that
// order, accumulated in FP64 and rounded once to FP32, so the result is the correctly
// rounded sum and is bitwise reproducible. With accumulate=false out is overwritten.
void sum_chunks_to_f32(const void* chunks, DType dtype, size_t world, size_t n, float* out, bool accumulate);

}  // namespace zerort
