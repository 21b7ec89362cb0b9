// zerort._C's view of the engine's stream order (Note [stream order], comm/stream_order.h):
// the compute stream before an Engine exists, and the host waits counted by reason.
#include <pybind11/pybind11.h>

#include <cstdint>

#include "zerort/config.h"
#if ZERORT_WITH_CUDA
#include "comm/cuda_streams.h"
#endif

namespace py = pybind11;

void bind_streams(py::module_& m) {
  // Note [allowed host waits]: the host waits of the engine's device work on CUDA device
  // `device` so far, per reason (tests/gpu/test_gpu_streams.py counts a step's).
  m.def("host_waits", [](int device) {
    py::dict d;
#if ZERORT_WITH_CUDA
    const zerort::CudaStreamOrder& order = zerort::cuda_stream_order(device);
    d["step_decision"] = order.host_waits(zerort::HostWait::kStepDecision);
    d["user_call"] = order.host_waits(zerort::HostWait::kUserCall);
    d["staged_copy"] = order.host_waits(zerort::HostWait::kStagedCopy);
#else
    (void)device;
#endif
    return d;
  });
  // The compute stream before an Engine exists (its constructor's kernels).
  m.def("set_compute_stream", [](int device, uintptr_t cuda_stream) {
#if ZERORT_WITH_CUDA
    zerort::cuda_stream_order(device).set_compute(reinterpret_cast<cudaStream_t>(cuda_stream));
#else
    (void)device;
    (void)cuda_stream;
#endif
  });
}
