// The fused pre-step pass over the FP32 gradient shard: one read and one write per element.
#pragma once

#include <cstddef>
#include <cstdint>

namespace zerort {

struct GradStats {
  int64_t nonfinite = 0;   // elements that are NaN or +-Inf after unscaling
  double sum_squares = 0;  // of the unscaled values, accumulated in FP64
};

// grad[i] *= inv_scale; counts non-finite values; sums squares in FP64. The sum's order is
// fixed (8 lanes per 64Ki-element block, blocks in order), so it is bitwise reproducible
// for any thread count.
GradStats unscale_and_check(float* grad, size_t n, float inv_scale);

}  // namespace zerort
