// The CUDA runtime's streams and events for StreamOrder (comm/stream_order.h), and the one
// StreamOrder of each device that the engine, its kernels and the NCCL backend share.
#pragma once

#include <cuda_runtime_api.h>

#include "comm/stream_order.h"

namespace zerort {

struct CudaStreams {
  using Stream = cudaStream_t;
  using Event = cudaEvent_t;
  int device = 0;

  Event make_event();  // timing disabled: events that only order
  void record(Event e, Stream s);
  void wait(Stream s, Event e);  // cudaStreamWaitEvent: the device waits, the host does not
  void synchronize(Event e);     // cudaEventSynchronize: the host blocks
};

using CudaStreamOrder = StreamOrder<CudaStreams>;

// The process's StreamOrder for `device`, made on first use with the legacy default stream as
// its compute stream. Lives for the process (events of a device outlive every engine on it).
CudaStreamOrder& cuda_stream_order(int device);

// A non-blocking stream of its own on `device` (a copy's or a hop worker's), whose work orders
// after the device's compute stream by after_compute(); the destructor lets its queued work
// finish, then destroys it.
class SideStream {
 public:
  explicit SideStream(int device);
  ~SideStream();
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;

  cudaStream_t get() const { return stream_; }
  void after_compute() const { cuda_stream_order(device_).side_after_compute(stream_); }

 private:
  int device_;
  cudaStream_t stream_ = nullptr;
};

}  // namespace zerort
