// The optim/ kernels on the device a tensor lives on: the CPU kernels for CPU memory, the
// CUDA kernels for CUDA memory, on the compute stream (the stream the user's work is on: Note
// [stream order], comm/stream_order.h). One place decides, so
// the Engine and ShardOptimizer code is the same for both.
#pragma once

#include <c10/core/Device.h>

#include <cstddef>

#include "comm/local_reduce.h"
#include "core/dtype.h"
#include "optim/adamw.h"
#include "optim/grad_stats.h"

namespace zerort {

void cast_from_f32_on(const c10::Device& device, const float* in, void* out, DType out_dtype, size_t n);
void cast_to_f32_on(const c10::Device& device, const void* in, DType in_dtype, float* out, size_t n);
void sum_chunks_to_f32_on(const c10::Device& device, const void* chunks, DType dtype, size_t world, size_t n,
                          float* out, bool accumulate);
void adamw_step_on(const c10::Device& device, const AdamWBuffers& buffers, const AdamWStep& step);
GradStats unscale_and_check_on(const c10::Device& device, float* grad, size_t n, float inv_scale);

// Throws unless `device` is CPU, or CUDA in a build with CUDA; names `what`.
void check_device_supported(const c10::Device& device, const char* what);

}  // namespace zerort
