// sum_over_wire and gather_over_wire (comm/wire_sum.h) on CUDA buffers, over a communicator that
// moves device memory (nccl, its parts): the wire's encode, decode and FP64 sums as kernels on
// `stream`, the same bits as the host functions (Note [one 8-bit arithmetic]).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "comm/communicator.h"
#include "comm/wire_sum.h"

namespace zerort {

// As sum_over_wire: parts (comm.size() x n) and out (n) on the device. The collective orders
// after the caller's compute stream (as every device communicator's), so the encode is waited
// for first; the sum is queued on `stream` when this returns.
void sum_over_wire_cuda(Communicator& comm, const float* parts, size_t n, InterNodeWire wire, float* out,
                        bool accumulate, cudaStream_t stream);
// As gather_over_wire: mine (n) and out (comm.size() x n) on the device; the decode is queued
// on `stream` when this returns.
void gather_over_wire_cuda(Communicator& comm, const float* mine, size_t n, InterNodeWire wire, float* out, int64_t tag,
                           cudaStream_t stream);

}  // namespace zerort
