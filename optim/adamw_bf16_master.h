// Fused AdamW over a bf16 master (DeepSpeed's bf16.bf16_master_weights_and_grads): reads the
// bf16 master (AdamWBuffers::master_bf16), the gradient (f32 or bf16) and m, v (f32 or bf16),
// computes in FP32 with adamw_element's arithmetic (optim/adamw_math.h), and stores master,
// m and v rounded to nearest even once. The CPU kernel here and the CUDA one
// (adamw_step_bf16_master_cuda, optim/adamw_cuda.h) give the same bits.
#pragma once

#include "optim/adamw.h"

namespace zerort {

// The buffers of a step over a bf16 master: n elements of grad (grad_dtype), master, and m and v
// (state_dtype); no parameter output (set param and param_dtype for one), grad_unscale 1.
AdamWBuffers bf16_master_buffers(const void* grad, DType grad_dtype, uint16_t* master, void* exp_avg, void* exp_avg_sq,
                                 DType state_dtype, size_t n);

// Checks the arguments (errors name the bad one), then runs the pass on all CPU threads.
// The parameter output (param, nullable) takes the new master: bf16 bits as they are, or f32
// (exact widening) for FP32 modules.
void adamw_step_bf16_master(const AdamWBuffers& buffers, const AdamWStep& step);

// The checks adamw_step_bf16_master makes, for the CUDA entry too; `who` prefixes the error.
void check_bf16_master_buffers(const AdamWBuffers& buffers, const AdamWStep& step, const char* who);

}  // namespace zerort
