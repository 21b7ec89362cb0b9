#include "optim/adamw_cuda.h"

#include <cstdint>
#include <vector>

#include "core/cuda_check.h"
#include "optim/adamw_math.h"

namespace zerort {

namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 4096;

__device__ __forceinline__ float load_grad(const void* g, bool bf16, size_t i) {
  return bf16 ? bf16_to_f32(static_cast<const uint16_t*>(g)[i]) : static_cast<const float*>(g)[i];
}

__device__ __forceinline__ void store_param(void* p, int mode, size_t i, float x) {
  if (mode == 1)
    static_cast<uint16_t*>(p)[i] = f32_to_bf16(x);
  else if (mode == 2)
    static_cast<uint16_t*>(p)[i] = f32_to_f16(x);
  else if (mode == 3)
    static_cast<float*>(p)[i] = x;
}

// Four elements per thread per step with 16-byte loads of master, m and v when aligned;
// 64-bit indices throughout.
template <typename S>
__global__ void adamw_kernel(AdamWCoeffs c, const void* __restrict__ grad, bool grad_bf16, float* __restrict__ p,
                             S* __restrict__ m, S* __restrict__ v, void* __restrict__ param, int param_mode, size_t n) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t first = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool aligned =
      sizeof(S) == 4 &&
      (reinterpret_cast<uintptr_t>(p) | reinterpret_cast<uintptr_t>(m) | reinterpret_cast<uintptr_t>(v)) % 16 == 0;
  const size_t vec_n = aligned ? n / 4 : 0;
  for (size_t q = first; q < vec_n; q += stride) {
    float4 pv = reinterpret_cast<float4*>(p)[q];
    float4 mv = reinterpret_cast<float4*>(m)[q];
    float4 vv = reinterpret_cast<float4*>(v)[q];
    float* pe = &pv.x;
    float* me = &mv.x;
    float* ve = &vv.x;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      c.lerp_from_grad ? adamw_element<true>(c, load_grad(grad, grad_bf16, 4 * q + k), pe[k], me[k], ve[k])
                       : adamw_element<false>(c, load_grad(grad, grad_bf16, 4 * q + k), pe[k], me[k], ve[k]);
      store_param(param, param_mode, 4 * q + k, pe[k]);
    }
    reinterpret_cast<float4*>(p)[q] = pv;
    reinterpret_cast<float4*>(m)[q] = mv;
    reinterpret_cast<float4*>(v)[q] = vv;
  }
  for (size_t i = vec_n * 4 + first; i < n; i += stride) {
    float pi = p[i], mi = load_as_float(m, i), vi = load_as_float(v, i);
    if (c.lerp_from_grad)
      adamw_element<true>(c, load_grad(grad, grad_bf16, i), pi, mi, vi);
    else
      adamw_element<false>(c, load_grad(grad, grad_bf16, i), pi, mi, vi);
    p[i] = pi;
    store_from_float(m, i, mi);
    store_from_float(v, i, vi);
    store_param(param, param_mode, i, pi);
  }
}

__device__ __forceinline__ void unscale_one(float& g, float inv_scale, double& acc, unsigned long long& nb) {
  const float x = g * inv_scale;
  g = x;
  nb += (__float_as_uint(x) & 0x7f800000u) == 0x7f800000u;
  acc += static_cast<double>(x) * static_cast<double>(x);
}

// 16-byte float4 loads and stores when the gradient is aligned (a scalar tail otherwise);
// the multiply is float, the sum of squares FP64, both as on the CPU.
__global__ void unscale_kernel(float* __restrict__ g, size_t n, float inv_scale, double* __restrict__ block_sums,
                               unsigned long long* __restrict__ block_bad) {
  __shared__ double sums[kThreads];
  __shared__ unsigned long long bad[kThreads];
  double acc = 0;
  unsigned long long nb = 0;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t first = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t vec_n = reinterpret_cast<uintptr_t>(g) % 16 == 0 ? n / 4 : 0;
  for (size_t q = first; q < vec_n; q += stride) {
    float4 v = reinterpret_cast<float4*>(g)[q];
    unscale_one(v.x, inv_scale, acc, nb);
    unscale_one(v.y, inv_scale, acc, nb);
    unscale_one(v.z, inv_scale, acc, nb);
    unscale_one(v.w, inv_scale, acc, nb);
    reinterpret_cast<float4*>(g)[q] = v;
  }
  for (size_t i = vec_n * 4 + first; i < n; i += stride) unscale_one(g[i], inv_scale, acc, nb);
  sums[threadIdx.x] = acc;
  bad[threadIdx.x] = nb;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {  // fixed tree: reproducible
    if (threadIdx.x < s) {
      sums[threadIdx.x] += sums[threadIdx.x + s];
      bad[threadIdx.x] += bad[threadIdx.x + s];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    block_sums[blockIdx.x] = sums[0];
    block_bad[blockIdx.x] = bad[0];
  }
}

unsigned blocks_for(size_t n, size_t per_thread) {
  size_t b = (n / per_thread + kThreads - 1) / kThreads;
  return static_cast<unsigned>(b < 1 ? 1 : b > kMaxBlocks ? kMaxBlocks : b);
}

}  // namespace

void adamw_step_cuda(const AdamWBuffers& b, const AdamWStep& s, cudaStream_t stream) {
  ZRT_CHECK(b.grad_dtype == DType::kFloat32 || b.grad_dtype == DType::kBFloat16,
            "adamw_step_cuda: gradient dtype must be f32 or bf16, got ", dtype_name(b.grad_dtype));
  ZRT_CHECK(s.step >= 1, "adamw_step_cuda: step count must be >= 1, got ", s.step);
  if (b.n == 0) return;
  ZRT_CHECK(b.grad && b.master && b.exp_avg && b.exp_avg_sq,
            "adamw_step_cuda: null gradient, master, exp_avg or exp_avg_sq buffer");
  int mode = !b.param                            ? 0
             : b.param_dtype == DType::kBFloat16 ? 1
             : b.param_dtype == DType::kFloat16  ? 2
             : b.param_dtype == DType::kFloat32  ? 3
                                                 : -1;
  ZRT_CHECK(mode >= 0, "adamw_step_cuda: parameter dtype must be bf16, f16 or f32, got ", dtype_name(b.param_dtype));
  ZRT_CHECK(b.state_dtype == DType::kFloat32 || b.state_dtype == DType::kBFloat16,
            "adamw_step_cuda: optimizer state dtype must be f32 or bf16, got ", dtype_name(b.state_dtype));
  const bool grad_bf16 = b.grad_dtype == DType::kBFloat16;
  if (b.state_dtype == DType::kFloat32) {
    adamw_kernel<float><<<blocks_for(b.n, 4), kThreads, 0, stream>>>(
        AdamWCoeffs::from(s), b.grad, grad_bf16, b.master, static_cast<float*>(b.exp_avg),
        static_cast<float*>(b.exp_avg_sq), b.param, mode, b.n);
  } else {
    adamw_kernel<uint16_t><<<blocks_for(b.n, 1), kThreads, 0, stream>>>(
        AdamWCoeffs::from(s), b.grad, grad_bf16, b.master, static_cast<uint16_t*>(b.exp_avg),
        static_cast<uint16_t*>(b.exp_avg_sq), b.param, mode, b.n);
  }
  ZRT_CHECK_CUDA(cudaGetLastError());
}

GradStats unscale_and_check_cuda(float* grad, size_t n, float inv_scale, cudaStream_t stream) {
  GradStats out;
  if (n == 0) return out;
  ZRT_CHECK(grad, "unscale_and_check_cuda: null gradient buffer for ", n, " elements");
  const unsigned blocks = blocks_for(n, 4);
  double* sums = nullptr;
  unsigned long long* bad = nullptr;
  ZRT_CHECK_CUDA(cudaMallocAsync(reinterpret_cast<void**>(&sums), blocks * sizeof(double), stream));
  ZRT_CHECK_CUDA(cudaMallocAsync(reinterpret_cast<void**>(&bad), blocks * sizeof(unsigned long long), stream));
  unscale_kernel<<<blocks, kThreads, 0, stream>>>(grad, n, inv_scale, sums, bad);
  ZRT_CHECK_CUDA(cudaGetLastError());
  std::vector<double> host_sums(blocks);
  std::vector<unsigned long long> host_bad(blocks);
  ZRT_CHECK_CUDA(cudaMemcpyAsync(host_sums.data(), sums, blocks * sizeof(double), cudaMemcpyDeviceToHost, stream));
  ZRT_CHECK_CUDA(
      cudaMemcpyAsync(host_bad.data(), bad, blocks * sizeof(unsigned long long), cudaMemcpyDeviceToHost, stream));
  ZRT_CHECK_CUDA(cudaFreeAsync(sums, stream));
  ZRT_CHECK_CUDA(cudaFreeAsync(bad, stream));
  ZRT_CHECK_CUDA(cudaStreamSynchronize(stream));
  for (unsigned i = 0; i < blocks; ++i) {  // block order: reproducible
    out.sum_squares += host_sums[i];
    out.nonfinite += static_cast<int64_t>(host_bad[i]);
  }
  return out;
}

}  // namespace zerort
