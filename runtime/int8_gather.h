// Stage 3's weight gathers on the int8 wire (stage3.gather_dtype int8, DeepSpeed's
// zero_quantized_weights; Note [int8 blocks], comm/int8_blocks.h), on the host or on a CUDA
// model's device.
#pragma once

#include <c10/core/Device.h>

#include <cstddef>
#include <cstdint>

#include "comm/communicator.h"
#include "core/dtype.h"

namespace zerort {

// full (comm.size() x n values of dtype, on `device`) gets every rank's `own` chunk (n values of
// dtype), each cast to FP32, encoded as int8 blocks, all-gathered as opaque 32-bit words and
// decoded on every rank, this rank's own too, so all ranks hold the same bits. The decode runs
// when the returned Work is waited for (then()).
// - CPU: the host codes (comm/int8_blocks.h).
// - CUDA: the same codes as kernels (comm/int8_blocks_cuda.h, bit for bit the host's) on the
//   compute stream (Note [stream order]): the cast and encode before the all-gather, the decode
//   and cast into full after it. `comm` moves device memory (nccl, or staged).
WorkPtr gather_int8_blocks(Communicator& comm, const void* own, DType dtype, size_t n, void* full, int64_t tag,
                           const c10::Device& device);

}  // namespace zerort
