// CUDA versions of optim/adamw.h and optim/grad_stats.h, on a stream. AdamW: the same element
// math as the CPU kernels (optim/adamw_math.h), each operation rounded on its own and the same
// two FMAs on both sides, so the two give the same bits.
#pragma once

#include <cuda_runtime_api.h>

#include "optim/adamw.h"
#include "optim/grad_stats.h"

namespace zerort {

// Device buffers. Checks arguments as the CPU version does; launches are checked.
void adamw_step_cuda(const AdamWBuffers& buffers, const AdamWStep& step, cudaStream_t stream);

// AdamW over a bf16 master (AdamWBuffers::master_bf16; optim/adamw_bf16_master.h): the CPU
// kernel's bits. Device buffers; launches are checked.
void adamw_step_bf16_master_cuda(const AdamWBuffers& buffers, const AdamWStep& step, cudaStream_t stream);

// Device gradient; returns the stats after synchronising the stream. Per-block partial
// sums are combined in block order, so the result is reproducible run to run.
GradStats unscale_and_check_cuda(float* grad, size_t n, float inv_scale, cudaStream_t stream);

}  // namespace zerort
