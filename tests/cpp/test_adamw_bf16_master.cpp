// The AdamW over a bf16 master (optim/adamw_bf16_master.h) against two references written
// here: (1) a double-precision AdamW rounded once to bf16, which the FP32 kernel may miss by one
// bf16 step only where the double value sits within FP32 error of a rounding boundary; (2) the
// FP32 kernel's arithmetic spelled out per element with master, m and v rounded to bf16 after
// each step, which it must equal bit for bit. Sizes 0, 1, 7 and past two 64Ki blocks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "core/error.h"
#include "core/half.h"
#include "optim/adamw.h"
#include "optim/adamw_bf16_master.h"

namespace zerort {
namespace {

class AdamWBf16Master : public ::testing::TestWithParam<size_t> {};

std::vector<uint16_t> random_bf16(size_t n, uint32_t seed, float scale) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = f32_to_bf16(dist(gen));
  return v;
}

AdamWStep step_of(int64_t k) {
  AdamWStep s;
  s.step = k;
  s.hyper.lr = 1e-2;
  s.hyper.weight_decay = 0.1;
  s.grad_multiplier = k % 2 ? 1.0f : 0.5f;
  return s;
}

// torch.optim.AdamW's update of one element in double, from the bf16 values widened.
void double_adamw(const AdamWStep& s, float unscale, double g, double& p, double& m, double& v) {
  const AdamWHyper& h = s.hyper;
  g = g * unscale * s.grad_multiplier;
  p *= 1.0 - h.lr * h.weight_decay;
  m = h.beta1 * m + (1.0 - h.beta1) * g;
  v = h.beta2 * v + (1.0 - h.beta2) * g * g;
  const double bc1 = 1.0 - std::pow(h.beta1, s.step), bc2 = 1.0 - std::pow(h.beta2, s.step);
  p -= h.lr / bc1 * m / (std::sqrt(v) / std::sqrt(bc2) + h.eps);
}

TEST_P(AdamWBf16Master, OneStepIsTheDoubleUpdateRoundedOnceWithinOneBf16Step) {
  const size_t n = GetParam();
  std::vector<uint16_t> p = random_bf16(n, 1, 1.0f), g = random_bf16(n, 2, 1.0f);
  std::vector<uint16_t> m = random_bf16(n, 3, 0.1f), v(n);
  for (size_t i = 0; i < n; ++i) v[i] = f32_to_bf16(std::fabs(bf16_to_f32(random_bf16(1, 4 + i, 1.0f)[0])));
  const std::vector<uint16_t> p0 = p, m0 = m, v0 = v;
  std::vector<uint16_t> out(n, 0);
  AdamWBuffers b = bf16_master_buffers(g.data(), DType::kBFloat16, p.data(), m.data(), v.data(), DType::kBFloat16, n);
  b.param = out.data();
  b.grad_unscale = 0.25f;
  const AdamWStep s = step_of(3);
  adamw_step_bf16_master(b, s);
  size_t off_by_one = 0;
  for (size_t i = 0; i < n; ++i) {
    double dp = bf16_to_f32(p0[i]), dm = bf16_to_f32(m0[i]), dv = bf16_to_f32(v0[i]);
    double_adamw(s, 0.25f, bf16_to_f32(g[i]), dp, dm, dv);
    const uint16_t want = f32_to_bf16(static_cast<float>(dp));
    ASSERT_LE(std::abs(int{p[i]} - int{want}), 1) << "i=" << i << ": " << bf16_to_f32(p[i]) << " vs " << dp;
    off_by_one += p[i] != want;
    ASSERT_EQ(out[i], p[i]) << "the parameter output is the master's bits, i=" << i;
  }
  EXPECT_LE(off_by_one, n / 100) << "more than 1% of the elements one bf16 step from the double update";
}

TEST_P(AdamWBf16Master, EqualsTheFp32KernelWithEveryStoreRoundedBitForBit) {
  const size_t n = GetParam();
  for (DType states : {DType::kFloat32, DType::kBFloat16}) {
    std::vector<uint16_t> p = random_bf16(n, 5, 1.0f);
    std::vector<float> m32(n, 0.0f), v32(n, 0.0f);
    std::vector<uint16_t> m16(n, 0), v16(n, 0);
    std::vector<float> rp(n), rm(n, 0.0f), rv(n, 0.0f);  // the reference: FP32 kernel, rounded stores
    for (size_t i = 0; i < n; ++i) rp[i] = bf16_to_f32(p[i]);
    for (int64_t k = 1; k <= 5; ++k) {
      const std::vector<uint16_t> g = random_bf16(n, 10 + static_cast<uint32_t>(k), k == 4 ? 1e-6f : 1.0f);
      const AdamWStep s = step_of(k);
      const bool s16 = states == DType::kBFloat16;
      AdamWBuffers b =
          bf16_master_buffers(g.data(), DType::kBFloat16, p.data(), s16 ? static_cast<void*>(m16.data()) : m32.data(),
                              s16 ? static_cast<void*>(v16.data()) : v32.data(), states, n);
      b.grad_unscale = 0.5f;
      adamw_step_bf16_master(b, s);
      std::vector<float> g32(n);
      for (size_t i = 0; i < n; ++i) g32[i] = bf16_to_f32(g[i]) * 0.5f;  // the unscale, in float
      adamw_step(
          {g32.data(), DType::kFloat32, rp.data(), rm.data(), rv.data(), nullptr, DType::kBFloat16, n, DType::kFloat32},
          s);
      for (size_t i = 0; i < n; ++i) {
        rp[i] = bf16_to_f32(f32_to_bf16(rp[i]));
        if (states == DType::kBFloat16) rm[i] = bf16_to_f32(f32_to_bf16(rm[i]));
        if (states == DType::kBFloat16) rv[i] = bf16_to_f32(f32_to_bf16(rv[i]));
      }
    }
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(p[i], f32_to_bf16(rp[i])) << "master, i=" << i << " states " << dtype_name(states);
      const float gm = states == DType::kBFloat16 ? bf16_to_f32(m16[i]) : m32[i];
      const float gv = states == DType::kBFloat16 ? bf16_to_f32(v16[i]) : v32[i];
      ASSERT_EQ(std::memcmp(&gm, &rm[i], 4), 0) << "exp_avg, i=" << i;
      ASSERT_EQ(std::memcmp(&gv, &rv[i], 4), 0) << "exp_avg_sq, i=" << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, AdamWBf16Master, ::testing::Values(0, 1, 7, 1000, (size_t{1} << 17) + 3));

TEST(AdamWBf16MasterArgs, AnFp32MasterBesideTheBf16OneIsRefused) {
  uint16_t p = 0, g = 0, m = 0, v = 0;
  float fp = 0;
  AdamWBuffers b = bf16_master_buffers(&g, DType::kBFloat16, &p, &m, &v, DType::kBFloat16, 1);
  b.master = &fp;
  EXPECT_THROW(adamw_step_bf16_master(b, step_of(1)), Error);
  b.master = nullptr;
  b.param = &fp;
  b.param_dtype = DType::kFloat16;
  EXPECT_THROW(adamw_step_bf16_master(b, step_of(1)), Error);
}

}  // namespace
}  // namespace zerort
