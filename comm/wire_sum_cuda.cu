// See wire_sum_cuda.h.
#include "comm/wire_sum_cuda.h"

#include <memory>

#include "comm/int8_blocks_cuda.h"
#include "comm/local_reduce_cuda.h"
#include "core/cuda_check.h"
#include "core/half.h"

namespace zerort {

namespace {

// The bf16 wire: each FP32 value rounded to nearest even (core/half.h, as the host's encode).
__global__ void to_bf16_kernel(const float* __restrict__ x, size_t n, uint16_t* __restrict__ h) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    h[i] = f32_to_bf16(x[i]);
  }
}
__global__ void from_bf16_kernel(const uint16_t* __restrict__ h, size_t n, float* __restrict__ x) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    x[i] = bf16_to_f32(h[i]);
  }
}

unsigned grid_for(size_t n) { return static_cast<unsigned>(n / 256 + 1 < 65535 ? n / 256 + 1 : 65535); }

EightBitCode code_of(InterNodeWire wire) {
  return wire == InterNodeWire::kInt8 ? EightBitCode::kInt8 : EightBitCode::kFp8E4m3;
}

// Device scratch from the stream-ordered allocator, freed behind the work queued on `stream`.
std::shared_ptr<char> device_scratch(size_t bytes, cudaStream_t stream) {
  void* p = nullptr;
  ZRT_CHECK_CUDA(cudaMallocAsync(&p, bytes > 0 ? bytes : 1, stream));
  int device = 0;
  ZRT_CHECK_CUDA(cudaGetDevice(&device));
  return std::shared_ptr<char>(static_cast<char*>(p), [device, stream](char* q) {
    if (cudaSetDevice(device) == cudaSuccess) cudaFreeAsync(q, stream);
  });
}

void encode(InterNodeWire wire, const float* x, size_t n, char* to, cudaStream_t stream) {
  if (is_eight_bit(wire)) {
    encode_8bit_blocks_cuda(code_of(wire), x, n, to, kInt8Block, stream);
  } else if (wire == InterNodeWire::kBf16) {
    if (n > 0) to_bf16_kernel<<<grid_for(n), 256, 0, stream>>>(x, n, reinterpret_cast<uint16_t*>(to));
    ZRT_CHECK_CUDA(cudaGetLastError());
  } else if (n > 0) {
    ZRT_CHECK_CUDA(cudaMemcpyAsync(to, x, n * sizeof(float), cudaMemcpyDeviceToDevice, stream));
  }
}

void decode(InterNodeWire wire, const char* from, size_t n, float* x, cudaStream_t stream) {
  if (is_eight_bit(wire)) {
    decode_8bit_blocks_cuda(code_of(wire), from, n, x, kInt8Block, stream);
  } else if (wire == InterNodeWire::kBf16) {
    if (n > 0) from_bf16_kernel<<<grid_for(n), 256, 0, stream>>>(reinterpret_cast<const uint16_t*>(from), n, x);
    ZRT_CHECK_CUDA(cudaGetLastError());
  } else if (n > 0) {
    ZRT_CHECK_CUDA(cudaMemcpyAsync(x, from, n * sizeof(float), cudaMemcpyDeviceToDevice, stream));
  }
}

}  // namespace

void sum_over_wire_cuda(Communicator& comm, const float* parts, size_t n, InterNodeWire wire, float* out,
                        bool accumulate, cudaStream_t stream) {
  const size_t ranks = static_cast<size_t>(comm.size()), bytes = inter_node_wire_bytes(wire, n);
  std::shared_ptr<char> to = device_scratch(ranks * bytes, stream), from = device_scratch(ranks * bytes, stream);
  for (size_t k = 0; k < ranks; ++k) encode(wire, parts + k * n, n, to.get() + k * bytes, stream);
  ZRT_CHECK_CUDA(cudaStreamSynchronize(stream));  // the all-to-all orders after the compute stream, not this one
  comm.all_to_all(to.get(), from.get(), inter_node_wire_count(wire, n), inter_node_wire_type(wire))->wait();
  if (is_eight_bit(wire)) {
    sum_8bit_wires_to_f32_cuda(code_of(wire), from.get(), ranks, n, kInt8Block, out, accumulate, stream);
  } else {
    const DType type = wire == InterNodeWire::kBf16 ? DType::kBFloat16 : DType::kFloat32;
    sum_chunks_to_f32_cuda(from.get(), type, ranks, n, out, accumulate, stream);
  }
}

void gather_over_wire_cuda(Communicator& comm, const float* mine, size_t n, InterNodeWire wire, float* out, int64_t tag,
                           cudaStream_t stream) {
  const size_t ranks = static_cast<size_t>(comm.size()), bytes = inter_node_wire_bytes(wire, n);
  std::shared_ptr<char> to = device_scratch(bytes, stream), from = device_scratch(ranks * bytes, stream);
  encode(wire, mine, n, to.get(), stream);
  ZRT_CHECK_CUDA(cudaStreamSynchronize(stream));
  comm.all_gather(to.get(), from.get(), inter_node_wire_count(wire, n), inter_node_wire_type(wire), tag)->wait();
  for (size_t k = 0; k < ranks; ++k) decode(wire, from.get() + k * bytes, n, out + k * n, stream);
}

}  // namespace zerort
