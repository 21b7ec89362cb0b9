// ZRT_CHECK_CUDA: every CUDA runtime call and kernel launch goes through it.
#pragma once

#include <cuda_runtime_api.h>

#include "comm/error.h"

#define ZRT_CHECK_CUDA(call)                                                               \
  do {                                                                                     \
    cudaError_t zrt_err_ = (call);                                                         \
    ZRT_CHECK(zrt_err_ == cudaSuccess, #call, " failed: ", cudaGetErrorName(zrt_err_), " (", \
              cudaGetErrorString(zrt_err_), ")");                                          \
  } while (0)
