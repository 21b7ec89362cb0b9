#include "optim/grad_stats.h"

#include <vector>

#include "core/error.h"
#include "core/half.h"
#include "optim/parallel_for.h"

namespace zerort {

namespace {

constexpr size_t kBlock = kGradStatsBlock;
constexpr size_t kLanes = 8;

__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default"))) void unscale_block(float* g, size_t n,
                                                                                                 float inv_scale,
                                                                                                 double* lanes,
                                                                                                 int64_t* nonfinite) {
  double acc[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t bad[kLanes] = {0, 0, 0, 0, 0, 0, 0, 0};
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (size_t j = 0; j < kLanes; ++j) {
      float x = g[i + j] * inv_scale;
      g[i + j] = x;
      bad[j] += (f32_bits(x) & 0x7f800000u) == 0x7f800000u;
      acc[j] += static_cast<double>(x) * static_cast<double>(x);
    }
  }
  for (size_t j = 0; i < n; ++i, ++j) {
    float x = g[i] * inv_scale;
    g[i] = x;
    bad[j] += (f32_bits(x) & 0x7f800000u) == 0x7f800000u;
    acc[j] += static_cast<double>(x) * static_cast<double>(x);
  }
  for (size_t j = 0; j < kLanes; ++j) {
    lanes[j] = acc[j];
    *nonfinite += bad[j];
  }
}

}  // namespace

void unscale_and_check_more(float* grad, size_t n, float inv_scale, GradStats& running) {
  ZRT_CHECK(n == 0 || grad, "unscale_and_check: null gradient buffer for ", n, " elements");
  const size_t blocks = (n + kBlock - 1) / kBlock;
  std::vector<double> lanes(blocks * kLanes, 0.0);
  std::vector<int64_t> bad(blocks, 0);
  parallel_for(n, kBlock, [&](size_t b, size_t lo, size_t hi) {
    unscale_block(grad + lo, hi - lo, inv_scale, &lanes[b * kLanes], &bad[b]);
  });
  for (size_t b = 0; b < blocks; ++b) {
    running.nonfinite += bad[b];
    for (size_t j = 0; j < kLanes; ++j) running.sum_squares += lanes[b * kLanes + j];
  }
}

GradStats unscale_and_check(float* grad, size_t n, float inv_scale) {
  GradStats s;
  unscale_and_check_more(grad, n, inv_scale, s);
  return s;
}

}  // namespace zerort
