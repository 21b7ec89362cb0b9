// CUDA casts against the CPU casts, bitwise, on fresh random data (never zeros) including
// specials. Skips, saying so, when no GPU is visible.
#include <gtest/gtest.h>

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstring>
#include <random>

#include "comm/half.h"
#include "optim/cast.h"
#include "optim/cast_cuda.h"
#include "optim/cuda_check.h"

namespace zerort {
namespace {

std::vector<float> random_floats(size_t n) {
  std::mt19937 gen(static_cast<uint32_t>(std::chrono::steady_clock::now().time_since_epoch().count()));
  std::vector<float> v(n);
  for (auto& x : v) x = f32_from_bits(gen());  // every bit pattern: NaN, Inf, subnormals
  return v;
}

TEST(CastCuda, MatchesCpuBitwise) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device visible; CUDA cast test skipped";
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

}  // namespace
}  // namespace zerort
