// ZRT_CHECK_CUDA: every CUDA runtime call and kernel launch goes through it.
#pragma once

#include <cuda_runtime_api.h>

#include "core/error.h"

#define ZRT_CHECK_CUDA(call)                                                                 \
  do {                                                                                       \
    cudaError_t zrt_err_ = (call);                                                           \
    ZRT_CHECK(zrt_err_ == cudaSuccess, #call, " failed: ", cudaGetErrorName(zrt_err_), " (", \
              cudaGetErrorString(zrt_err_), ")");                                            \
  } while (0)

namespace zerort {

// Makes `device` current for a scope and restores the caller's device after it (PyTorch
// keeps its own notion of the current device on each thread).
class CudaDeviceGuard {
 public:
  explicit CudaDeviceGuard(int device) {
    ZRT_CHECK_CUDA(cudaGetDevice(&previous_));
    if (previous_ != device) ZRT_CHECK_CUDA(cudaSetDevice(device));
  }
  ~CudaDeviceGuard() { cudaSetDevice(previous_); }
  CudaDeviceGuard(const CudaDeviceGuard&) = delete;
  CudaDeviceGuard& operator=(const CudaDeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace zerort
