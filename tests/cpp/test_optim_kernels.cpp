// The CPU optim kernels (casts, the unscale/non-finite/norm pass, fused AdamW) against
// references written out here in double, at element counts that hit every tail: 0, 1, 7,
// 1000 and more than two 64Ki blocks. Torch-free, so the sanitizer build (make test-asan)
// runs them: ASan sees any read or write past the n elements the kernels were given.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "optim/adamw.h"
#include "optim/adamw_math.h"
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

// The CUDA kernel's arithmetic (optim/adamw_math.h on the device: __fmul_rn, __fadd_rn, ...,
// and two __fmaf_rn), written out here one rounded operation per line in its order. This file
// is built with -ffp-contract=off (tests/CMakeLists.txt), so nothing here is fused either.
void ref_adamw_cuda_order(const AdamWCoeffs& c, float g_in, float& p, float& m, float& v) {
  const float g = g_in * c.grad_multiplier;
  const float decayed = p * c.decay;
  const float diff = g - m;
  m = std::fma(c.lerp_coeff, diff, c.lerp_from_grad ? g : m);
  const float g_scaled = c.one_minus_b2 * g;
  const float v_scaled = v * c.beta2;
  v = std::fma(g_scaled, g, v_scaled);
  const float root = std::sqrt(v);
  const float corrected = root / c.bc2_sqrt;
  const float denom = corrected + c.eps;
  const float numer = c.neg_step_size * m;
  const float update = numer / denom;
  p = decayed + update;
}

uint16_t ref_f16(float x) { return f32_to_f16(x); }

float widen_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Gradients over many magnitudes (1e-7 .. 1e2) with exact zeros, so that near-zero moments,
// where Adam's update is most sensitive to a last-bit difference, are covered. Made once per
// (size, step) and shared by every case.
const std::vector<float>& wide_grads(size_t n, int step) {
  static std::map<std::pair<size_t, int>, std::vector<float>> made;
  std::vector<float>& g = made[{n, step}];
  if (g.size() == n) return g;
  static const float kScale[] = {1e-7f, 1e-6f, 1e-5f, 1e-4f, 1e-3f, 1e-2f, 1e-1f, 1.0f, 1e1f, 1e2f};
  std::mt19937 gen(100 + static_cast<uint32_t>(step));
  std::normal_distribution<float> dist(0.0f, 1.0f);
  g.resize(n);
  for (auto& x : g) {
    const uint32_t r = gen();
    x = r % 16 == 0 ? 0.0f : dist(gen) * kScale[(r >> 4) % 10];
  }
  return g;
}

struct BitCase {
  DType grad, state, param;
  bool write_param;
};

// Every CPU ISA level this machine runs (AVX-512, AVX2+FMA, baseline) against the scalar
// reference in the CUDA kernel's order, bit for bit: master, m, v and the written parameter,
// after every step, for every gradient/state/parameter dtype, with weight decay, bias
// correction on and off, both lerp forms (beta1 = 0.9 and 0.3), a gradient multiplier, at odd
// sizes (one spanning several 64Ki-element blocks of the thread pool).
TEST(AdamWBitEquality, EveryIsaLevelEqualsTheCudaOrderReferenceBitForBit) {
  std::vector<CpuIsa> levels;
  for (int l = 0; l <= static_cast<int>(adamw_cpu_isa()); ++l) levels.push_back(static_cast<CpuIsa>(l));
  std::vector<BitCase> cases;
  for (DType g : {DType::kFloat32, DType::kBFloat16})
    for (DType st : {DType::kFloat32, DType::kBFloat16}) {
      for (DType pa : {DType::kBFloat16, DType::kFloat16, DType::kFloat32}) cases.push_back({g, st, pa, true});
      cases.push_back({g, st, DType::kBFloat16, false});
    }
  struct Hyp {
    AdamWHyper h;
    float multiplier;
  };
  const Hyp hypers[] = {{{3e-3, 0.9, 0.999, 1e-8, 0.01, true}, 1.0f},
                        {{1e-2, 0.3, 0.99, 1e-6, 0.1, false}, 0.37f},
                        {{1e-3, 0.9, 0.95, 1e-8, 0.0, true}, 0.125f}};
  // (size, steps): many steps on small odd sizes, fewer on the one that spans blocks.
  const std::pair<size_t, int> shapes[] = {{1, 100}, {7, 100}, {1001, 60}, {3 * 65536 + 5, 6}};
  int checked = 0;
  for (CpuIsa isa : levels) {
    for (const Hyp& hy : hypers) {
      for (const BitCase& bc : cases) {
        for (auto [n, steps] : shapes) {
          const bool sbf = bc.state == DType::kBFloat16, gbf = bc.grad == DType::kBFloat16;
          std::vector<float> p = random_floats(n, 5), rp = p;
          std::vector<float> m32(n, 0.0f), v32(n, 0.0f), rm(n, 0.0f), rv(n, 0.0f);
          std::vector<uint16_t> m16(n, 0), v16(n, 0), g16(n), out16(n);
          std::vector<float> out32(n);
          for (int step = 1; step <= steps; ++step) {
            std::vector<float> g = wide_grads(n, step);
            if (gbf)
              for (size_t i = 0; i < n; ++i) {
                g16[i] = ref_bf16(g[i]);
                g[i] = widen_bf16(g16[i]);
              }
            AdamWStep s;
            s.hyper = hy.h;
            s.step = step;
            s.grad_multiplier = hy.multiplier;
            void* out = !bc.write_param               ? nullptr
                        : bc.param == DType::kFloat32 ? static_cast<void*>(out32.data())
                                                      : static_cast<void*>(out16.data());
            AdamWBuffers b{gbf ? static_cast<const void*>(g16.data()) : static_cast<const void*>(g.data()),
                           bc.grad,
                           p.data(),
                           sbf ? static_cast<void*>(m16.data()) : static_cast<void*>(m32.data()),
                           sbf ? static_cast<void*>(v16.data()) : static_cast<void*>(v32.data()),
                           out,
                           bc.param,
                           n,
                           bc.state};
            adamw_step_isa(b, s, isa);
            const AdamWCoeffs c = AdamWCoeffs::from(s);
            for (size_t i = 0; i < n; ++i) {
              ref_adamw_cuda_order(c, g[i], rp[i], rm[i], rv[i]);
              if (sbf) {  // the states are stored rounded to bf16 and read back widened
                rm[i] = widen_bf16(ref_bf16(rm[i]));
                rv[i] = widen_bf16(ref_bf16(rv[i]));
              }
            }
            for (size_t i = 0; i < n; ++i) {
              const float km = sbf ? widen_bf16(m16[i]) : m32[i], kv = sbf ? widen_bf16(v16[i]) : v32[i];
              const bool same = bits(p[i]) == bits(rp[i]) && bits(km) == bits(rm[i]) && bits(kv) == bits(rv[i]) &&
                                (!bc.write_param || (bc.param == DType::kFloat32   ? bits(out32[i]) == bits(rp[i])
                                                     : bc.param == DType::kFloat16 ? out16[i] == ref_f16(rp[i])
                                                                                   : out16[i] == ref_bf16(rp[i])));
              ASSERT_TRUE(same) << cpu_isa_name(isa) << ", grad " << dtype_name(bc.grad) << ", states "
                                << dtype_name(bc.state) << ", param "
                                << (bc.write_param ? dtype_name(bc.param) : "none") << ", beta1 " << hy.h.beta1
                                << ", bias correction " << hy.h.bias_correction << ", n " << n << ", step " << step
                                << ", element " << i << ": kernel p/m/v " << p[i] << " " << km << " " << kv
                                << ", reference " << rp[i] << " " << rm[i] << " " << rv[i];
            }
          }
          ++checked;
        }
      }
    }
  }
  std::printf("[adamw bit equality] %d runs equal bit for bit on %zu ISA level(s), up to %s\n", checked, levels.size(),
              cpu_isa_name(adamw_cpu_isa()));
}

TEST(AdamWBitEquality, AnIsaLevelThisCpuDoesNotRunIsRefused) {
  float x = 0;
  AdamWBuffers b{&x, DType::kFloat32, &x, &x, &x, nullptr, DType::kBFloat16, 1};
  try {
    adamw_step_isa(b, AdamWStep{}, static_cast<CpuIsa>(3));  // past the highest level
    ADD_FAILURE() << "an unknown level was run";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("adamw_step_isa: this CPU does not run the"), std::string::npos) << e.what();
  }
  if (adamw_cpu_isa() != CpuIsa::kAvx512) {
    EXPECT_THROW(adamw_step_isa(b, AdamWStep{}, CpuIsa::kAvx512), Error);
  }
  EXPECT_EQ(x, 0.0f);  // nothing ran
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

// elements_of: each array moves by its own dtype's width; a null one stays null.
TEST(AdamWBuffersTest, ElementsOfAdvancesEachArrayByItsDtype) {
  float grad[8], master[8], m[8], v[8];
  uint16_t param[8];
  AdamWBuffers b;
  b.grad = grad;
  b.master = master;
  b.exp_avg = m;
  b.exp_avg_sq = v;
  b.param = param;
  b.state_dtype = DType::kBFloat16;  // 2 bytes an element of m and v
  b.n = 8;
  const AdamWBuffers part = elements_of(b, 3, 4);
  EXPECT_EQ(part.grad, static_cast<const void*>(grad + 3));
  EXPECT_EQ(part.master, master + 3);
  EXPECT_EQ(part.exp_avg, static_cast<void*>(reinterpret_cast<char*>(m) + 6));
  EXPECT_EQ(part.exp_avg_sq, static_cast<void*>(reinterpret_cast<char*>(v) + 6));
  EXPECT_EQ(part.param, static_cast<void*>(param + 3));
  EXPECT_EQ(part.master_bf16, nullptr);
  EXPECT_EQ(part.n, 4u);
  b.grad = nullptr;
  b.param = nullptr;
  EXPECT_EQ(elements_of(b, 3, 4).grad, nullptr);
  EXPECT_EQ(elements_of(b, 3, 4).param, nullptr);
}

}  // namespace
}  // namespace zerort
