// The 8-bit wires on the device: See int8_blocks_cuda.h and Note [one 8-bit arithmetic].
#include "comm/int8_blocks_cuda.h"

#include <cstdint>

#include "comm/eight_bit_math.h"
#include "core/cuda_check.h"
#include "core/error.h"

namespace zerort {

namespace {

constexpr unsigned kThreads = 256;  // a power of two: the tree reduction halves it
constexpr size_t kMaxBlocks = 65535;
constexpr unsigned long long kNoNan = ~0ull;

unsigned grid_for(size_t work) {
  const size_t blocks = work < 1 ? 1 : work > kMaxBlocks ? kMaxBlocks : work;
  return static_cast<unsigned>(blocks);
}

// One CUDA block per block of codes (grid-stride over them). Each thread folds its elements'
// magnitudes, NaNs aside; the tree keeps the largest and the first NaN's index; the block's a is
// that NaN's magnitude where there is one (the CPU's fold ends at the first NaN), else the
// largest. Then every thread codes its elements with the shared scale.
template <typename Code>
__global__ void encode_kernel(const float* __restrict__ x, size_t n, size_t block, size_t blocks,
                              uint8_t* __restrict__ codes, float* __restrict__ scales) {
  __shared__ float largest[kThreads];
  __shared__ unsigned long long first_nan[kThreads];
  __shared__ float block_a, block_scale;
  const unsigned t = threadIdx.x;
  for (size_t b = blockIdx.x; b < blocks; b += gridDim.x) {
    const size_t lo = b * block, hi = lo + block < n ? lo + block : n;
    float a = 0;
    unsigned long long nan_at = kNoNan;
    for (size_t i = lo + t; i < hi; i += blockDim.x) {  // increasing i: a thread's first NaN is its lowest
      const float v = x[i];
      if (eight_bit::is_nan(v)) {
        if (nan_at == kNoNan) nan_at = i;
      } else {
        a = eight_bit::fold_abs_max(a, v);
      }
    }
    largest[t] = a;
    first_nan[t] = nan_at;
    __syncthreads();
    for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
      if (t < s) {
        largest[t] = eight_bit::fold_abs_max(largest[t], largest[t + s]);
        if (first_nan[t + s] < first_nan[t]) first_nan[t] = first_nan[t + s];
      }
      __syncthreads();
    }
    if (t == 0) {
      block_a = first_nan[0] != kNoNan ? eight_bit::abs_of(x[first_nan[0]]) : largest[0];
      block_scale = eight_bit::block_scale(block_a, Code::kMax);
      scales[b] = block_scale;
    }
    __syncthreads();
    const float ba = block_a, bs = block_scale;
    for (size_t i = lo + t; i < hi; i += blockDim.x) codes[i] = eight_bit::encode_value<Code>(x[i], ba, bs);
    __syncthreads();  // the shared values are rewritten for the next block
  }
}

template <typename Code>
__global__ void decode_kernel(const uint8_t* __restrict__ codes, const float* __restrict__ scales, size_t n,
                              size_t block, float* __restrict__ x) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    x[i] = eight_bit::decode_value<Code>(codes[i], scales[i / block]);
  }
}

// Each output starts from out (accumulating) and adds wire r = 0..W-1's decoded value in FP64:
// sum_chunks_to_f32's additions, in its order, on the values the CPU decode gives.
template <typename Code>
__global__ void sum_kernel(const uint8_t* __restrict__ wires, size_t wire_bytes, size_t scales_at, size_t world,
                           size_t n, size_t block, float* __restrict__ out, bool accumulate) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    double acc = accumulate ? static_cast<double>(out[i]) : 0.0;
    for (size_t r = 0; r < world; ++r) {
      const uint8_t* wire = wires + r * wire_bytes;
      const float scale = reinterpret_cast<const float*>(wire + scales_at)[i / block];
      acc += static_cast<double>(eight_bit::decode_value<Code>(wire[i], scale));
    }
    out[i] = static_cast<float>(acc);
  }
}

// The checks every entry makes: a block size, a 4-byte aligned wire, values where n > 0.
void check_args(const void* wire, size_t block, const void* values, size_t n, const char* what) {
  ZRT_CHECK(block > 0, what, ": a block holds at least one element");
  ZRT_CHECK(reinterpret_cast<uintptr_t>(wire) % 4 == 0, what,
            ": the wire must start 4-byte aligned (its scales are FP32 words)");
  ZRT_CHECK(n == 0 || values != nullptr, what, ": a null values buffer for ", n, " values");
}

// fn(Code{}) with the code's arithmetic type.
template <typename Fn>
void with_code(EightBitCode code, Fn&& fn) {
  if (code == EightBitCode::kInt8) return fn(eight_bit::Int8Code{});
  fn(eight_bit::Fp8Code{});
}

template <typename Code>
void encode(const float* x, size_t n, void* wire, size_t block, cudaStream_t stream) {
  auto* codes = static_cast<uint8_t*>(wire);
  const size_t pad = eight_bit::codes_bytes(n) - n;
  if (pad > 0) ZRT_CHECK_CUDA(cudaMemsetAsync(codes + n, 0, pad, stream));
  if (n == 0) return;
  const size_t blocks = eight_bit::blocks_of(n, block);
  auto* scales = reinterpret_cast<float*>(codes + eight_bit::codes_bytes(n));
  encode_kernel<Code><<<grid_for(blocks), kThreads, 0, stream>>>(x, n, block, blocks, codes, scales);
  ZRT_CHECK_CUDA(cudaGetLastError());
}

template <typename Code>
void decode(const void* wire, size_t n, float* x, size_t block, cudaStream_t stream) {
  if (n == 0) return;
  const auto* codes = static_cast<const uint8_t*>(wire);
  const auto* scales = reinterpret_cast<const float*>(codes + eight_bit::codes_bytes(n));
  decode_kernel<Code><<<grid_for((n + kThreads - 1) / kThreads), kThreads, 0, stream>>>(codes, scales, n, block, x);
  ZRT_CHECK_CUDA(cudaGetLastError());
}

template <typename Code>
void sum(const void* wires, size_t world, size_t n, size_t block, float* out, bool accumulate, cudaStream_t stream) {
  if (n == 0) return;
  sum_kernel<Code><<<grid_for((n + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      static_cast<const uint8_t*>(wires), int8_wire_bytes(n, block), eight_bit::codes_bytes(n), world, n, block, out,
      accumulate);
  ZRT_CHECK_CUDA(cudaGetLastError());
}

}  // namespace

void encode_8bit_blocks_cuda(EightBitCode code, const float* x, size_t n, void* wire, size_t block,
                             cudaStream_t stream) {
  check_args(wire, block, x, n, "encode_8bit_blocks_cuda");
  with_code(code, [&](auto c) { encode<decltype(c)>(x, n, wire, block, stream); });
}

void decode_8bit_blocks_cuda(EightBitCode code, const void* wire, size_t n, float* x, size_t block,
                             cudaStream_t stream) {
  check_args(wire, block, x, n, "decode_8bit_blocks_cuda");
  with_code(code, [&](auto c) { decode<decltype(c)>(wire, n, x, block, stream); });
}

void sum_8bit_wires_to_f32_cuda(EightBitCode code, const void* wires, size_t world, size_t n, size_t block, float* out,
                                bool accumulate, cudaStream_t stream) {
  check_args(wires, block, out, n, "sum_8bit_wires_to_f32_cuda");
  ZRT_CHECK(world >= 1, "sum_8bit_wires_to_f32_cuda: world must be >= 1, got ", world);
  with_code(code, [&](auto c) { sum<decltype(c)>(wires, world, n, block, out, accumulate, stream); });
}

}  // namespace zerort
