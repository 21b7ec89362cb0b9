#include "comm/cuda_streams.h"

#include <array>
#include <memory>
#include <mutex>

#include "core/cuda_check.h"
#include "core/error.h"

namespace zerort {

CudaStreams::Event CudaStreams::make_event() {
  CudaDeviceGuard guard(device);
  cudaEvent_t e = nullptr;
  ZRT_CHECK_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return e;
}

void CudaStreams::record(Event e, Stream s) {
  CudaDeviceGuard guard(device);
  ZRT_CHECK_CUDA(cudaEventRecord(e, s));
}

void CudaStreams::wait(Stream s, Event e) {
  CudaDeviceGuard guard(device);
  ZRT_CHECK_CUDA(cudaStreamWaitEvent(s, e, 0));
}

void CudaStreams::synchronize(Event e) { ZRT_CHECK_CUDA(cudaEventSynchronize(e)); }

SideStream::SideStream(int device) : device_(device) {
  CudaDeviceGuard guard(device_);
  ZRT_CHECK_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
}

SideStream::~SideStream() {
  if (stream_ != nullptr && cudaSetDevice(device_) == cudaSuccess) {
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
}

CudaStreamOrder& cuda_stream_order(int device) {
  constexpr int kMaxDevices = 64;
  ZRT_CHECK(device >= 0 && device < kMaxDevices, "cuda_stream_order: device ", device, " is outside [0, ", kMaxDevices,
            ")");
  static std::array<std::unique_ptr<CudaStreamOrder>, kMaxDevices> orders;
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  auto& order = orders[static_cast<size_t>(device)];
  if (!order) order = std::make_unique<CudaStreamOrder>(CudaStreams{device}, cudaStreamLegacy);
  return *order;
}

}  // namespace zerort
