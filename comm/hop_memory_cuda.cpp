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
  explicit CudaHopMemory(int device) : device_(device), side_(device) {}

  void after_caller() override { side_.after_compute(); }

  std::shared_ptr<char> scratch(size_t bytes) override {
    CudaDeviceGuard guard(device_);
    void* p = nullptr;
    ZRT_CHECK_CUDA(cudaMallocAsync(&p, bytes > 0 ? bytes : 1, side_.get()));
    const int device = device_;
    cudaStream_t stream = side_.get();
    return std::shared_ptr<char>(static_cast<char*>(p), [device, stream](char* q) {
      if (cudaSetDevice(device) == cudaSuccess) cudaFreeAsync(q, stream);  // after the work queued so far
    });
  }

  void copy(void* to, const void* from, size_t bytes) override {
    if (bytes == 0 || to == from) return;
    CudaDeviceGuard guard(device_);
    ZRT_CHECK_CUDA(cudaMemcpyAsync(to, from, bytes, cudaMemcpyDeviceToDevice, side_.get()));
  }

  void sum_chunks(const void* chunks, DType dtype, size_t world, size_t n, float* out, bool accumulate) override {
    CudaDeviceGuard guard(device_);
    sum_chunks_to_f32_cuda(chunks, dtype, world, n, out, accumulate, side_.get());
  }

  void sum_over_wire(Communicator& comm, const float* parts, size_t n, InterNodeWire wire, float* out,
                     bool accumulate) override {
    CudaDeviceGuard guard(device_);
    sum_over_wire_cuda(comm, parts, n, wire, out, accumulate, side_.get());
  }

  void settle() override {
    CudaDeviceGuard guard(device_);
    ZRT_CHECK_CUDA(cudaStreamSynchronize(side_.get()));
  }

 private:
  int device_;
  SideStream side_;
};

}  // namespace

std::unique_ptr<HopMemory> make_cuda_hop_memory(int device) { return std::make_unique<CudaHopMemory>(device); }

}  // namespace zerort
