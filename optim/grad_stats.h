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

// The elements per block of that order. A gradient passed in parts, each starting at a multiple
// of kGradStatsBlock elements of the whole, in order, gives the whole pass's bits when each
// part's result is folded into the one before it: unscale_and_check_more(part, n, inv,
// running) adds the part's counts and squares to running in the whole pass's order (the NVMe
// tier's gradient, read from its file a piece at a time, is checked so).
constexpr size_t kGradStatsBlock = size_t{1} << 16;
void unscale_and_check_more(float* grad, size_t n, float inv_scale, GradStats& running);

}  // namespace zerort
