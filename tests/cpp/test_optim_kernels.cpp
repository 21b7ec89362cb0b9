// The CPU optim kernels (casts, the unscale/non-finite/norm pass, fused AdamW) against
// references written out here in double, at element counts that hit every tail: 0, 1, 7,
// 1000 and more than two 64Ki blocks. Torch-free, so the sanitizer build (make test-asan)
// runs them: ASan sees any read or write past the n elements the kernels were given.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "optim/adamw.h"
#include "optim/cast.h"
#include "optim/grad_stats.h"

namespace zerort {
namespace {

class OptimKernels : public ::testing::TestWithParam<size_t> {};

std::vector<float> random_floats(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

// Heap buffers of exactly n elements (no slack), so ASan catches a kernel that touches n.
template <typename T>
std::unique_ptr<T[]> exact(const std::vector<T>& v) {
  std::unique_ptr<T[]> p(new T[v.size()]);
  if (!v.empty()) std::memcpy(p.get(), v.data(), v.size() * sizeof(T));
  return p;
}

// bf16 round to nearest even, from the bit pattern (finite inputs).
uint16_t ref_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

TEST_P(OptimKernels, Bf16CastMatchesBitReferenceAndWidensExactly) {
  const size_t n = GetParam();
  auto in = exact(random_floats(n, 1, 3.0f));
  std::unique_ptr<uint16_t[]> out(new uint16_t[n]);
  std::unique_ptr<float[]> back(new float[n]);
  cast_from_f32(in.get(), out.get(), DType::kBFloat16, n);
  cast_to_f32(out.get(), DType::kBFloat16, back.get(), n);
  for (size_t i = 0; i < n; ++i) {
    ASSERT_EQ(out[i], ref_bf16(in[i])) << "element " << i << " of " << n;
    uint32_t widened = static_cast<uint32_t>(out[i]) << 16;
    float w;
    std::memcpy(&w, &widened, 4);
    ASSERT_EQ(back[i], w) << "element " << i;
  }
}

TEST_P(OptimKernels, F16RoundTripOfRepresentableValuesIsExact) {
  const size_t n = GetParam();
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<float>(static_cast<int>(i % 4096) - 2048) / 64.0f;
  auto in = exact(v);
  std::unique_ptr<uint16_t[]> half(new uint16_t[n]);
  std::unique_ptr<float[]> back(new float[n]);
  cast_from_f32(in.get(), half.get(), DType::kFloat16, n);
  cast_to_f32(half.get(), DType::kFloat16, back.get(), n);
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(back[i], v[i]) << "element " << i;
}

TEST_P(OptimKernels, UnscalePassCountsNonFiniteAndSumsSquares) {
  const size_t n = GetParam();
  std::vector<float> v = random_floats(n, 2, 100.0f);
  int64_t expect_bad = 0;
  for (size_t i = 0; i < n; i += 97) {  // sprinkle NaN and +-Inf
    v[i] = (i % 3 == 0) ? std::numeric_limits<float>::quiet_NaN()
                        : (i % 3 == 1 ? 1 : -1) * std::numeric_limits<float>::infinity();
    ++expect_bad;
  }
  const float inv = 1.0f / 64.0f;
  double expect_sum = 0;
  std::vector<float> expect(n);
  for (size_t i = 0; i < n; ++i) {
    expect[i] = v[i] * inv;
    if (std::isfinite(expect[i])) expect_sum += static_cast<double>(expect[i]) * expect[i];
  }
  auto g = exact(v);
  GradStats s = unscale_and_check(g.get(), n, inv);
  EXPECT_EQ(s.nonfinite, expect_bad);
  for (size_t i = 0; i < n; ++i) {
    if (std::isfinite(expect[i])) {
      ASSERT_EQ(g[i], expect[i]) << "element " << i;
    }
  }
  // The kernel's sum includes the non-finite values (NaN/Inf); check the finite case too.
  if (expect_bad == 0) {
    EXPECT_NEAR(s.sum_squares, expect_sum, 1e-12 * expect_sum);
  } else {
    EXPECT_FALSE(std::isfinite(s.sum_squares));
  }
  std::vector<float> clean = random_floats(n, 3);
  double clean_sum = 0;
  for (float x : clean) clean_sum += static_cast<double>(x) * x;
  auto c = exact(clean);
  GradStats cs = unscale_and_check(c.get(), n, 1.0f);
  EXPECT_EQ(cs.nonfinite, 0);
  EXPECT_NEAR(cs.sum_squares, clean_sum, 1e-12 * clean_sum);
}

// torch.optim.AdamW's update in double.
void ref_adamw(const AdamWHyper& h, int64_t step, double g, double& p, double& m, double& v) {
  p *= 1 - h.lr * h.weight_decay;
  m = h.beta1 * m + (1 - h.beta1) * g;
  v = h.beta2 * v + (1 - h.beta2) * g * g;
  const double bc1 = 1 - std::pow(h.beta1, step), bc2 = 1 - std::pow(h.beta2, step);
  p -= h.lr / bc1 * m / (std::sqrt(v) / std::sqrt(bc2) + h.eps);
}

TEST_P(OptimKernels, AdamWMatchesDoubleReferenceAndWritesBf16Params) {
  const size_t n = GetParam();
  AdamWHyper h{1e-2, 0.9, 0.999, 1e-8, 0.01};
  std::vector<float> p0 = random_floats(n, 4);
  auto master = exact(p0);
  auto m = exact(std::vector<float>(n, 0.0f));
  auto v = exact(std::vector<float>(n, 0.0f));
  std::unique_ptr<uint16_t[]> param(new uint16_t[n]);
  std::vector<double> rp(p0.begin(), p0.end()), rm(n, 0.0), rv(n, 0.0);
  for (int64_t step = 1; step <= 5; ++step) {
    auto g = exact(random_floats(n, 10 + static_cast<uint32_t>(step)));
    AdamWStep s;
    s.hyper = h;
    s.step = step;
    adamw_step({g.get(), DType::kFloat32, master.get(), m.get(), v.get(), param.get(), DType::kBFloat16, n}, s);
    for (size_t i = 0; i < n; ++i) ref_adamw(h, step, g[i], rp[i], rm[i], rv[i]);
  }
  for (size_t i = 0; i < n; ++i) {
    ASSERT_NEAR(master[i], rp[i], 1e-5 * (1 + std::fabs(rp[i]))) << "element " << i;
    ASSERT_EQ(param[i], ref_bf16(master[i])) << "element " << i;
  }
}

// eps = 0 made the update 0 / 0 = NaN where a gradient and its moments are 0; eps must be a
// normal FP32 number (> 0), as must every other hyperparameter be in range, before anything moves.
TEST(AdamWHyperCheck, EpsMustBeFiniteAndPositive) {
  // 1e-46 is 0 in FP32 and 1e-40 subnormal: both positive doubles the FP32 kernels cannot use.
  for (double eps :
       {0.0, -1e-8, 1e-46, 1e-40, std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
    AdamWHyper h{1e-3, 0.9, 0.999, eps, 0.0};
    try {
      check_adamw_hyper(h, "test");
      ADD_FAILURE() << "eps " << eps << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(
                    "test: eps must be a finite number >= 1.17549e-38 (FP32's smallest normal number; e.g. 1e-8)"),
                std::string::npos)
          << e.what();
    }
    const size_t n = 3;
    auto g = exact(std::vector<float>(n, 0.0f));
    auto master = exact(std::vector<float>{1.0f, 2.0f, 3.0f});
    auto m = exact(std::vector<float>(n, 0.0f));
    auto v = exact(std::vector<float>(n, 0.0f));
    AdamWStep s;
    s.hyper = h;
    EXPECT_THROW(
        adamw_step({g.get(), DType::kFloat32, master.get(), m.get(), v.get(), nullptr, DType::kBFloat16, n}, s), Error);
    EXPECT_EQ(master[0], 1.0f);  // nothing moved
  }
  check_adamw_hyper(AdamWHyper{1e-3, 0.9, 0.999, 1e-30, 0.0}, "test");  // any positive eps is taken
  AdamWHyper bad_betas{1e-3, 1.0, 0.999, 1e-8, 0.0};
  EXPECT_THROW(check_adamw_hyper(bad_betas, "test"), Error);
}

INSTANTIATE_TEST_SUITE_P(Counts, OptimKernels,
                         ::testing::Values(size_t{0}, size_t{1}, size_t{7}, size_t{1000}, size_t{2} * 65536 + 3));

}  // namespace
}  // namespace zerort
