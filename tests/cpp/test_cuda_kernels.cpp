// CUDA kernels against the CPU kernels on random data from a fixed seed (never zeros): casts bitwise
// (specials included), AdamW bitwise (one arithmetic on both sides, optim/adamw_math.h), the
// unscale pass to FP64 summation order. Skips, saying so, when no GPU is visible.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

#include "core/cuda_check.h"
#include "core/half.h"
#include "optim/adamw.h"
#include "optim/adamw_cuda.h"
#include "optim/cast.h"
#include "optim/adamw_bf16_master.h"
#include "optim/cast_cuda.h"
#include "optim/grad_stats.h"

namespace zerort {
namespace {

// A fixed seed, so that a failure reproduces; ZERORT_TEST_SEED=<n> tries another. Printed
// once, and named in every failure (SCOPED_TRACE).
uint32_t test_seed() {
  static const uint32_t seed = [] {
    const char* env = std::getenv("ZERORT_TEST_SEED");
    const uint32_t s = env ? static_cast<uint32_t>(std::strtoul(env, nullptr, 10)) : 20261201u;
    std::printf("test_cuda_kernels: seed %u (set ZERORT_TEST_SEED to change it)\n", s);
    return s;
  }();
  return seed;
}

std::vector<float> random_floats(size_t n) {
  std::mt19937 gen(test_seed() + static_cast<uint32_t>(n));
  std::vector<float> v(n);
  for (auto& x : v) x = f32_from_bits(gen());  // every bit pattern: NaN, Inf, subnormals
  return v;
}

TEST(CastCuda, MatchesCpuBitwise) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device visible; CUDA cast test skipped";
  SCOPED_TRACE(testing::Message() << "seed " << test_seed());
  for (size_t n : {size_t{1}, size_t{7}, size_t{1000}, size_t{(1u << 22) + 5}}) {
    auto host = random_floats(n);
    float* d_in = nullptr;
    uint16_t* d_half = nullptr;
    float* d_back = nullptr;
    ZRT_CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&d_in), n * 4));
    ZRT_CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&d_half), n * 2));
    ZRT_CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&d_back), n * 4));
    ZRT_CHECK_CUDA(cudaMemcpy(d_in, host.data(), n * 4, cudaMemcpyHostToDevice));
    for (DType dt : {DType::kBFloat16, DType::kFloat16}) {
      std::vector<uint16_t> cpu_half(n), gpu_half(n);
      std::vector<float> cpu_back(n), gpu_back(n);
      cast_from_f32(host.data(), cpu_half.data(), dt, n);
      cast_to_f32(cpu_half.data(), dt, cpu_back.data(), n);
      cast_from_f32_cuda(d_in, d_half, dt, n, nullptr);
      cast_to_f32_cuda(d_half, dt, d_back, n, nullptr);
      ZRT_CHECK_CUDA(cudaMemcpy(gpu_half.data(), d_half, n * 2, cudaMemcpyDeviceToHost));
      ZRT_CHECK_CUDA(cudaMemcpy(gpu_back.data(), d_back, n * 4, cudaMemcpyDeviceToHost));
      EXPECT_EQ(0, std::memcmp(cpu_half.data(), gpu_half.data(), n * 2)) << dtype_name(dt) << " n=" << n;
      EXPECT_EQ(0, std::memcmp(cpu_back.data(), gpu_back.data(), n * 4)) << dtype_name(dt) << " n=" << n;
    }
    cudaFree(d_in);
    cudaFree(d_half);
    cudaFree(d_back);
  }
}

template <typename T>
T* to_device(const std::vector<T>& host) {
  T* d = nullptr;
  ZRT_CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&d), host.size() * sizeof(T) + 16));
  ZRT_CHECK_CUDA(cudaMemcpy(d, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

template <typename T>
std::vector<T> to_host(const T* d, size_t n) {
  std::vector<T> h(n);
  ZRT_CHECK_CUDA(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
  return h;
}

TEST(AdamWCuda, EqualsCpuBitForBitOver10Steps) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device visible; CUDA AdamW test skipped";
  SCOPED_TRACE(testing::Message() << "seed " << test_seed());
  std::mt19937 gen(test_seed());
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (size_t n : {size_t{1}, size_t{1001}, size_t{(1u << 22) + 3}}) {
    std::vector<float> p(n), m(n, 0.0f), v(n, 0.0f), g(n);
    for (auto& x : p) x = normal(gen);
    float *dp = to_device(p), *dm = to_device(m), *dv = to_device(v), *dg = to_device(g);
    uint16_t* dlp = to_device(std::vector<uint16_t>(n));
    std::vector<uint16_t> lp(n);
    for (int64_t step = 1; step <= 10; ++step) {
      for (auto& x : g) x = normal(gen) * (step % 3 == 0 ? 1e-6f : 1.0f);  // near-zero moments too
      ZRT_CHECK_CUDA(cudaMemcpy(dg, g.data(), n * 4, cudaMemcpyHostToDevice));
      AdamWStep s;
      s.step = step;
      s.hyper.lr = 1e-2;
      s.hyper.weight_decay = 0.1;
      s.hyper.bias_correction = step < 6;  // both forms
      s.grad_multiplier = step % 2 ? 1.0f : 0.37f;
      adamw_step({g.data(), DType::kFloat32, p.data(), m.data(), v.data(), lp.data(), DType::kBFloat16, n}, s);
      adamw_step_cuda({dg, DType::kFloat32, dp, dm, dv, dlp, DType::kBFloat16, n}, s, nullptr);
    }
    auto gp = to_host(dp, n), gm = to_host(dm, n), gv = to_host(dv, n);
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(std::memcmp(&gp[i], &p[i], 4), 0) << "master: n=" << n << " i=" << i << " " << gp[i] << " vs " << p[i];
      ASSERT_EQ(std::memcmp(&gm[i], &m[i], 4), 0) << "exp_avg: n=" << n << " i=" << i << " " << gm[i] << " vs " << m[i];
      ASSERT_EQ(std::memcmp(&gv[i], &v[i], 4), 0)
          << "exp_avg_sq: n=" << n << " i=" << i << " " << gv[i] << " vs " << v[i];
    }
    auto glp = to_host(dlp, n);
    std::vector<uint16_t> expect(n);
    cast_from_f32(gp.data(), expect.data(), DType::kBFloat16, n);
    EXPECT_EQ(0, std::memcmp(glp.data(), expect.data(), n * 2)) << "bf16 write != RNE(master)";

    auto cpu_stats = unscale_and_check(g.data(), n, 0.25f);
    auto gpu_stats = unscale_and_check_cuda(dg, n, 0.25f, nullptr);
    EXPECT_EQ(gpu_stats.nonfinite, cpu_stats.nonfinite);
    EXPECT_NEAR(gpu_stats.sum_squares, cpu_stats.sum_squares, 1e-9 * cpu_stats.sum_squares);
    for (void* d : {static_cast<void*>(dp), static_cast<void*>(dm), static_cast<void*>(dv), static_cast<void*>(dg),
                    static_cast<void*>(dlp)}) {
      cudaFree(d);
    }
  }
}

TEST(AdamWCuda, Bf16MasterEqualsCpuBitForBitOver5Steps) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device visible; CUDA bf16-master AdamW test skipped";
  SCOPED_TRACE(testing::Message() << "seed " << test_seed());
  std::mt19937 gen(test_seed());
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (size_t n : {size_t{1}, size_t{1001}, size_t{(1u << 20) + 3}}) {
    std::vector<uint16_t> p(n), m(n, 0), v(n, 0), g(n), lp(n);
    for (auto& x : p) x = f32_to_bf16(normal(gen));
    uint16_t *dp = to_device(p), *dm = to_device(m), *dv = to_device(v), *dg = to_device(g), *dlp = to_device(lp);
    for (int64_t step = 1; step <= 5; ++step) {
      for (auto& x : g) x = f32_to_bf16(normal(gen) * (step % 3 == 0 ? 1e-6f : 1.0f));
      ZRT_CHECK_CUDA(cudaMemcpy(dg, g.data(), n * 2, cudaMemcpyHostToDevice));
      AdamWStep s;
      s.step = step;
      s.hyper.lr = 1e-2;
      s.hyper.weight_decay = 0.1;
      s.grad_multiplier = step % 2 ? 1.0f : 0.37f;
      AdamWBuffers b =
          bf16_master_buffers(g.data(), DType::kBFloat16, p.data(), m.data(), v.data(), DType::kBFloat16, n);
      b.param = lp.data();
      b.grad_unscale = 0.5f;
      adamw_step_bf16_master(b, s);
      b.grad = dg;
      b.master_bf16 = dp;
      b.exp_avg = dm;
      b.exp_avg_sq = dv;
      b.param = dlp;
      adamw_step_bf16_master_cuda(b, s, nullptr);
    }
    EXPECT_EQ(to_host(dp, n), p) << "master, n=" << n;
    EXPECT_EQ(to_host(dm, n), m) << "exp_avg, n=" << n;
    EXPECT_EQ(to_host(dv, n), v) << "exp_avg_sq, n=" << n;
    EXPECT_EQ(to_host(dlp, n), p) << "the parameter output is the master's bits, n=" << n;
    for (uint16_t* d : {dp, dm, dv, dg, dlp}) cudaFree(d);
  }
}

}  // namespace
}  // namespace zerort
