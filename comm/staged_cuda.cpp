// The CUDA Mover of StagedCommunicator: pinned host staging and synchronous copies on the
// legacy default stream, so a copy out of a device buffer orders after the work that wrote it.
#include <cuda_runtime_api.h>

#include "comm/staged_communicator.h"
#include "core/cuda_check.h"

namespace zerort {

namespace {

class CudaMover final : public Mover {
 public:
  explicit CudaMover(int device) : device_(device) {}
  std::shared_ptr<char> host_buffer(size_t bytes) override {
    void* p = nullptr;
    CudaDeviceGuard guard(device_);  // the comm thread's current device is 0
    ZRT_CHECK_CUDA(cudaMallocHost(&p, bytes == 0 ? 1 : bytes));
    return std::shared_ptr<char>(static_cast<char*>(p), [](char* q) { cudaFreeHost(q); });
  }
  void to_host(void* host, const void* buf, size_t bytes) override { copy(host, buf, bytes); }
  void from_host(void* buf, const void* host, size_t bytes) override { copy(buf, host, bytes); }
  bool device_memory() const override { return true; }
  const char* name() const override { return "cuda"; }

 private:
  void copy(void* dst, const void* src, size_t bytes) {
    if (bytes == 0 || dst == src) return;
    CudaDeviceGuard guard(device_);
    ZRT_CHECK_CUDA(cudaMemcpy(dst, src, bytes, cudaMemcpyDefault));  // host or device, either way
  }
  int device_;
};

}  // namespace

std::unique_ptr<Mover> make_cuda_mover(int device) { return std::make_unique<CudaMover>(device); }

}  // namespace zerort
