#include "optim/cast_cuda.h"

#include <cstdint>

#include "core/cuda_check.h"
#include "core/half.h"

namespace zerort {

namespace {

struct ToBf16 {
  __device__ uint16_t operator()(float f) const { return f32_to_bf16(f); }
};
struct ToF16 {
  __device__ uint16_t operator()(float f) const { return f32_to_f16(f); }
};
struct FromBf16 {
  __device__ float operator()(uint16_t h) const { return bf16_to_f32(h); }
};
struct FromF16 {
  __device__ float operator()(uint16_t h) const { return f16_to_f32(h); }
};

constexpr int kThreads = 256;

// A grid-stride loop over n elements in groups of 8 (16-byte accesses on both sides);
// vec_n is 0 when either pointer is not 16-byte aligned, leaving all to the scalar tail.
struct GridLoop {
  __device__ GridLoop(const void* in, const void* out, size_t n)
      : first(static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x),
        stride(static_cast<size_t>(gridDim.x) * blockDim.x),
        vec_n((reinterpret_cast<uintptr_t>(in) % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0) ? n / 8 : 0) {}
  size_t first, stride, vec_n;
};

// Each thread handles 8 elements per step: 2 x 16-byte float4 loads and one 16-byte
// store of 8 halves. Unaligned pointers and the tail take the scalar path. 64-bit index.
template <typename Narrow>
__global__ void narrow_kernel(const float* __restrict__ in, uint16_t* __restrict__ out, size_t n) {
  Narrow narrow;
  const GridLoop g(in, out, n);
  for (size_t v = g.first; v < g.vec_n; v += g.stride) {
    float4 a = reinterpret_cast<const float4*>(in)[2 * v];
    float4 b = reinterpret_cast<const float4*>(in)[2 * v + 1];
    uint4 packed;
    packed.x = narrow(a.x) | (static_cast<uint32_t>(narrow(a.y)) << 16);
    packed.y = narrow(a.z) | (static_cast<uint32_t>(narrow(a.w)) << 16);
    packed.z = narrow(b.x) | (static_cast<uint32_t>(narrow(b.y)) << 16);
    packed.w = narrow(b.z) | (static_cast<uint32_t>(narrow(b.w)) << 16);
    reinterpret_cast<uint4*>(out)[v] = packed;
  }
  for (size_t i = g.vec_n * 8 + g.first; i < n; i += g.stride) out[i] = narrow(in[i]);
}

template <typename Widen>
__global__ void widen_kernel(const uint16_t* __restrict__ in, float* __restrict__ out, size_t n) {
  Widen widen;
  const GridLoop g(in, out, n);
  for (size_t v = g.first; v < g.vec_n; v += g.stride) {
    uint4 packed = reinterpret_cast<const uint4*>(in)[v];
    const uint32_t words[4] = {packed.x, packed.y, packed.z, packed.w};
    float r[8];
    for (int k = 0; k < 4; ++k) {
      r[2 * k] = widen(static_cast<uint16_t>(words[k] & 0xffffu));
      r[2 * k + 1] = widen(static_cast<uint16_t>(words[k] >> 16));
    }
    reinterpret_cast<float4*>(out)[2 * v] = make_float4(r[0], r[1], r[2], r[3]);
    reinterpret_cast<float4*>(out)[2 * v + 1] = make_float4(r[4], r[5], r[6], r[7]);
  }
  for (size_t i = g.vec_n * 8 + g.first; i < n; i += g.stride) out[i] = widen(in[i]);
}

unsigned blocks_for(size_t n) {
  size_t blocks = (n / 8 + kThreads - 1) / kThreads;
  if (blocks < 1) blocks = 1;
  if (blocks > 65535) blocks = 65535;  // grid-stride loops cover the rest
  return static_cast<unsigned>(blocks);
}

}  // namespace

void cast_from_f32_cuda(const float* in, void* out, DType out_dtype, size_t n, cudaStream_t stream) {
  if (n == 0) return;
  auto* o = static_cast<uint16_t*>(out);
  if (out_dtype == DType::kBFloat16) {
    narrow_kernel<ToBf16><<<blocks_for(n), kThreads, 0, stream>>>(in, o, n);
  } else if (out_dtype == DType::kFloat16) {
    narrow_kernel<ToF16><<<blocks_for(n), kThreads, 0, stream>>>(in, o, n);
  } else {
    ZRT_THROW("cast_from_f32_cuda: target dtype must be bf16 or f16, got ", dtype_name(out_dtype));
  }
  ZRT_CHECK_CUDA(cudaGetLastError());
}

void cast_to_f32_cuda(const void* in, DType in_dtype, float* out, size_t n, cudaStream_t stream) {
  if (n == 0) return;
  const auto* h = static_cast<const uint16_t*>(in);
  if (in_dtype == DType::kBFloat16) {
    widen_kernel<FromBf16><<<blocks_for(n), kThreads, 0, stream>>>(h, out, n);
  } else if (in_dtype == DType::kFloat16) {
    widen_kernel<FromF16><<<blocks_for(n), kThreads, 0, stream>>>(h, out, n);
  } else {
    ZRT_THROW("cast_to_f32_cuda: source dtype must be bf16 or f16, got ", dtype_name(in_dtype));
  }
  ZRT_CHECK_CUDA(cudaGetLastError());
}

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return count;
}

}  // namespace zerort
