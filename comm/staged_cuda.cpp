// The CUDA Mover of StagedCommunicator (and of the host tier beside a CUDA model): pinned host
// staging, and copies on a stream of its own that first waits for the compute stream, so a copy
// out of a device buffer orders after the work that wrote it on whatever stream the user's work
// is on (Note [stream order], comm/stream_order.h). The host backend then needs the bytes: each
// copy ends with a host wait, HostWait::kStagedCopy of Note [allowed host waits].
#include <cuda_runtime_api.h>

#include "comm/cuda_streams.h"
#include "comm/staged_communicator.h"
#include "core/cuda_check.h"

namespace zerort {

namespace {

class CudaMover final : public Mover {
 public:
  explicit CudaMover(int device) : device_(device), side_(device) {
    CudaDeviceGuard guard(device_);
    ZRT_CHECK_CUDA(cudaEventCreateWithFlags(&copied_, cudaEventDisableTiming));
  }
  ~CudaMover() override {
    if (copied_) cudaEventDestroy(copied_);
  }
  std::shared_ptr<char> host_buffer(size_t bytes) override {
    void* p = nullptr;
    CudaDeviceGuard guard(device_);  // the comm thread's current device is 0
    ZRT_CHECK_CUDA(cudaMallocHost(&p, bytes == 0 ? 1 : bytes));
    return std::shared_ptr<char>(static_cast<char*>(p), [](char* q) { cudaFreeHost(q); });
  }
  void to_host(void* host, const void* buf, size_t bytes) override { copy(host, buf, bytes); }
  void from_host(void* buf, const void* host, size_t bytes) override { copy(buf, host, bytes); }
  void settled_to_host(void* host, const void* buf, size_t bytes) override { copy(host, buf, bytes, false); }
  bool device_memory() const override { return true; }
  const char* name() const override { return "cuda"; }

 private:
  void copy(void* dst, const void* src, size_t bytes, bool after_compute = true) {
    if (bytes == 0 || dst == src) return;
    CudaDeviceGuard guard(device_);
    if (after_compute) side_.after_compute();
    ZRT_CHECK_CUDA(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, side_.get()));  // host or device, either way
    CudaStreamOrder& order = cuda_stream_order(device_);
    order.record(copied_, side_.get());
    order.host_wait(copied_, HostWait::kStagedCopy);
  }
  int device_;
  SideStream side_;
  cudaEvent_t copied_ = nullptr;
};

}  // namespace

std::unique_ptr<Mover> make_cuda_mover(int device) { return std::make_unique<CudaMover>(device); }

}  // namespace zerort
