#include "comm/local_reduce_cuda.h"

#include <cstdint>

#include "core/cuda_check.h"
#include "core/error.h"
#include "core/half.h"

namespace zerort {

namespace {

constexpr int kThreads = 256;
constexpr unsigned kMaxBlocks = 8192;

template <typename T>
__device__ __forceinline__ double widen(T x);
template <>
__device__ __forceinline__ double widen<float>(float x) {
  return x;
}

struct Bf16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};
template <>
__device__ __forceinline__ double widen<Bf16>(Bf16 x) {
  return bf16_to_f32(x.bits);
}
template <>
__device__ __forceinline__ double widen<F16>(F16 x) {
  return f16_to_f32(x.bits);
}

// kVec elements of T make 16 bytes: one vector load per chunk per step.
template <typename T>
struct Vec {
  static constexpr int kN = 16 / sizeof(T);
  T v[kN];
};

// Each thread owns kN consecutive outputs per step; chunk r is read with one 16-byte load.
// The sum starts from out (when accumulating), adds r = 0..W-1 in order in FP64 and rounds
// once: the CPU kernel's operations in the CPU kernel's order, so the results are bitwise equal.
template <typename T>
__global__ void sum_chunks_kernel(const T* __restrict__ chunks, size_t world, size_t n, size_t vec_n,
                                  float* __restrict__ out, bool accumulate) {
  constexpr int kN = Vec<T>::kN;
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const size_t first = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (size_t q = first; q < vec_n; q += stride) {
    double acc[kN];  // starts from out, as the CPU kernel does: the same order of additions
#pragma unroll
    for (int k = 0; k < kN; ++k) acc[k] = accumulate ? static_cast<double>(out[q * kN + k]) : 0.0;
    for (size_t r = 0; r < world; ++r) {
      const Vec<T> x = reinterpret_cast<const Vec<T>*>(chunks + r * n)[q];
#pragma unroll
      for (int k = 0; k < kN; ++k) acc[k] += widen<T>(x.v[k]);
    }
#pragma unroll
    for (int k = 0; k < kN; ++k) out[q * kN + k] = static_cast<float>(acc[k]);
  }
  for (size_t i = vec_n * kN + first; i < n; i += stride) {
    double acc = accumulate ? static_cast<double>(out[i]) : 0.0;
    for (size_t r = 0; r < world; ++r) acc += widen<T>(chunks[r * n + i]);
    out[i] = static_cast<float>(acc);
  }
}

template <typename T>
void launch(const void* chunks, size_t world, size_t n, float* out, bool accumulate, cudaStream_t stream) {
  constexpr size_t kN = Vec<T>::kN;
  // Vector loads need every chunk start 16-byte aligned: the base, and n a multiple of kN.
  const bool aligned =
      reinterpret_cast<uintptr_t>(chunks) % 16 == 0 && n % kN == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0;
  const size_t vec_n = aligned ? n / kN : 0;
  const size_t work = aligned ? vec_n : n;
  size_t blocks = (work + kThreads - 1) / kThreads;
  blocks = blocks < 1 ? 1 : blocks > kMaxBlocks ? kMaxBlocks : blocks;
  sum_chunks_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(static_cast<const T*>(chunks), world, n,
                                                                               vec_n, out, accumulate);
  ZRT_CHECK_CUDA(cudaGetLastError());
}

}  // namespace

void sum_chunks_to_f32_cuda(const void* chunks, DType dtype, size_t world, size_t n, float* out, bool accumulate,
                            cudaStream_t stream) {
  ZRT_CHECK(world >= 1, "sum_chunks_to_f32_cuda: world must be >= 1, got ", world);
  if (n == 0) return;
  ZRT_CHECK(chunks && out, "sum_chunks_to_f32_cuda: null chunks or output buffer for ", n, " elements");
  switch (dtype) {
    case DType::kBFloat16: return launch<Bf16>(chunks, world, n, out, accumulate, stream);
    case DType::kFloat16: return launch<F16>(chunks, world, n, out, accumulate, stream);
    case DType::kFloat32: return launch<float>(chunks, world, n, out, accumulate, stream);
    default: ZRT_THROW("sum_chunks_to_f32_cuda: input dtype must be bf16, f16 or f32, got ", dtype_name(dtype));
  }
}

}  // namespace zerort
