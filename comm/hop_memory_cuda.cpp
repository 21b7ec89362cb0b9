// The CUDA HopMemory (comm/hop_memory.h): scratch from the stream-ordered allocator, copies and
// the sums' kernels on a stream of its own that orders after the caller's compute stream, and
// the inter-node wire on the device (comm/wire_sum_cuda.h): the bits of the host path (Note
// [two hops on the device], comm/two_hop_communicator.h).
#include <cstdint>

#include "comm/cuda_streams.h"
#include "comm/hop_memory.h"
#include "comm/local_reduce_cuda.h"
#include "comm/wire_sum_cuda.h"
#include "core/cuda_check.h"
#include "core/error.h"

namespace zerort {

namespace {

class CudaHopMemory final : public HopMemory {
 public:
  explicit CudaHopMemory(int device) : device_(device) {
    CudaDeviceGuard guard(device_);
    ZRT_CHECK_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  ~CudaHopMemory() override {
    if (cudaSetDevice(device_) == cudaSuccess) {
      cudaStreamSynchronize(stream_);
      cudaStreamDestroy(stream_);
    }
  }

  void after_caller() override { cuda_stream_order(device_).side_after_compute(stream_); }

  std::shared_ptr<char> scratch(size_t bytes) override {
    CudaDeviceGuard guard(device_);
    void* p = nullptr;
    ZRT_CHECK_CUDA(cudaMallocAsync(&p, bytes > 0 ? bytes : 1, stream_));
    const int device = device_;
    cudaStream_t stream = stream_;
    return std::shared_ptr<char>(static_cast<char*>(p), [device, stream](char* q) {
      if (cudaSetDevice(device) == cudaSuccess) cudaFreeAsync(q, stream);  // after the work queued so far
    });
  }

  void copy(void* to, const void* from, size_t bytes) override {
    if (bytes == 0 || to == from) return;
    CudaDeviceGuard guard(device_);
    ZRT_CHECK_CUDA(cudaMemcpyAsync(to, from, bytes, cudaMemcpyDeviceToDevice, stream_));
  }

  void sum_chunks(const void* chunks, DType dtype, size_t world, size_t n, float* out, bool accumulate) override {
    CudaDeviceGuard guard(device_);
    sum_chunks_to_f32_cuda(chunks, dtype, world, n, out, accumulate, stream_);
  }

  void sum_over_wire(Communicator& comm, const float* parts, size_t n, InterNodeWire wire, float* out,
                     bool accumulate) override {
    CudaDeviceGuard guard(device_);
    sum_over_wire_cuda(comm, parts, n, wire, out, accumulate, stream_);
  }

  void settle() override {
    CudaDeviceGuard guard(device_);
    ZRT_CHECK_CUDA(cudaStreamSynchronize(stream_));
  }

 private:
  int device_;
  cudaStream_t stream_ = nullptr;
};

}  // namespace

std::unique_ptr<HopMemory> make_cuda_hop_memory(int device) { return std::make_unique<CudaHopMemory>(device); }

}  // namespace zerort
