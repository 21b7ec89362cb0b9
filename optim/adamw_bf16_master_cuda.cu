// The CUDA AdamW over a bf16 master: adamw_bf16_master_element (optim/adamw_math.h), the
// CPU kernel's arithmetic (optim/adamw_bf16_master.cpp), one thread per element.
#include <cstdint>

#include "core/cuda_check.h"
#include "optim/adamw_cuda.h"
#include "optim/adamw_math.h"

namespace zerort {

namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 4096;

// out_mode: 0 none, 1 bf16 bits, 2 f32.
template <typename G, typename S>
__global__ void adamw_bf16_master_kernel(AdamWCoeffs c, float unscale, const G* __restrict__ g,
                                         uint16_t* __restrict__ p, S* __restrict__ m, S* __restrict__ v,
                                         void* __restrict__ out, int out_mode, size_t n) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    uint16_t pi = p[i];
    float mi = load_as_float(m, i), vi = load_as_float(v, i);
    if (c.lerp_from_grad)
      adamw_bf16_master_element<true>(c, unscale, load_as_float(g, i), pi, mi, vi);
    else
      adamw_bf16_master_element<false>(c, unscale, load_as_float(g, i), pi, mi, vi);
    p[i] = pi;
    store_from_float(m, i, mi);
    store_from_float(v, i, vi);
    if (out_mode == 1) static_cast<uint16_t*>(out)[i] = pi;
    if (out_mode == 2) static_cast<float*>(out)[i] = bf16_to_f32(pi);
  }
}

template <typename G, typename S>
void launch(const AdamWBuffers& b, const AdamWStep& s, int out_mode, cudaStream_t stream) {
  size_t blocks = (b.n + kThreads - 1) / kThreads;
  blocks = blocks < 1 ? 1 : blocks > kMaxBlocks ? kMaxBlocks : blocks;
  adamw_bf16_master_kernel<G, S><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      AdamWCoeffs::from(s), b.grad_unscale, static_cast<const G*>(b.grad), b.master_bf16, static_cast<S*>(b.exp_avg),
      static_cast<S*>(b.exp_avg_sq), b.param, out_mode, b.n);
}

}  // namespace

void adamw_step_bf16_master_cuda(const AdamWBuffers& b, const AdamWStep& s, cudaStream_t stream) {
  ZRT_CHECK(s.step >= 1, "adamw_step_bf16_master_cuda: step count must be >= 1, got ", s.step);
  ZRT_CHECK(b.master == nullptr && (b.state_dtype == DType::kFloat32 || b.state_dtype == DType::kBFloat16) &&
                (b.grad_dtype == DType::kFloat32 || b.grad_dtype == DType::kBFloat16) &&
                (!b.param || b.param_dtype == DType::kBFloat16 || b.param_dtype == DType::kFloat32),
            "adamw_step_bf16_master_cuda: needs master_bf16 alone, f32 or bf16 gradient and moments, and a bf16 or "
            "f32 parameter output");
  if (b.n == 0) return;
  ZRT_CHECK(b.grad && b.master_bf16 && b.exp_avg && b.exp_avg_sq,
            "adamw_step_bf16_master_cuda: null gradient, master_bf16, exp_avg or exp_avg_sq buffer");
  const int out_mode = !b.param ? 0 : b.param_dtype == DType::kBFloat16 ? 1 : 2;
  const bool g16 = b.grad_dtype == DType::kBFloat16, s16 = b.state_dtype == DType::kBFloat16;
  if (g16 && s16)
    launch<uint16_t, uint16_t>(b, s, out_mode, stream);
  else if (g16)
    launch<uint16_t, float>(b, s, out_mode, stream);
  else if (s16)
    launch<float, uint16_t>(b, s, out_mode, stream);
  else
    launch<float, float>(b, s, out_mode, stream);
  ZRT_CHECK_CUDA(cudaGetLastError());
}

}  // namespace zerort
