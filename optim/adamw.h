// Fused AdamW over one shard, one pass: reads the FP32 (or bf16) gradient, FP32 master, m
// and v; writes master, m, v and the bf16/f16 parameter shard. 30 bytes per element with
// an FP32 gradient and a 2-byte parameter. The math is torch.optim.AdamW's (decoupled
// weight decay, bias corrections, eps added after dividing sqrt(v) by sqrt(bc2)), in float.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"

namespace zerort {

// Double, as torch's param_groups hold them: the per-step scalars (1 - beta2, lr / bc1, ...)
// are derived in double and only then rounded to float, exactly as torch rounds them.
struct AdamWHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  bool bias_correction = true;  // false: m and v used as they are (DeepSpeed's bias_correction=False)
};

// Per-step scalars, computed once on the host in double exactly as torch does.
struct AdamWStep {
  AdamWHyper hyper;
  int64_t step = 1;              // Adam's step count, 1 for the first update
  float grad_multiplier = 1.0f;  // folded into the gradient read: unscale and/or clip
};

struct AdamWBuffers {
  const void* grad = nullptr;  // n elements of grad_dtype (f32 or bf16)
  DType grad_dtype = DType::kFloat32;
  float* master = nullptr;
  void* exp_avg = nullptr;  // n elements of state_dtype each
  void* exp_avg_sq = nullptr;
  void* param = nullptr;  // n elements of param_dtype (bf16, f16, or f32 for FP32 modules; nullptr to skip)
  DType param_dtype = DType::kBFloat16;
  size_t n = 0;
  // Adam's moments: f32, or bf16 (read to float, updated in float, rounded to nearest even
  // on store: half the memory of the moments).
  DType state_dtype = DType::kFloat32;
  // A bf16 master in place of `master` (which is then nullptr): n bf16 values, stepped by
  // adamw_step_bf16_master (optim/adamw_bf16_master.h), never by adamw_step.
  uint16_t* master_bf16 = nullptr;
  // bf16 master only: the gradient is multiplied by this in float before grad_multiplier, the
  // unscale a bf16 gradient shard does not write back (it would round the gradient twice).
  float grad_unscale = 1.0f;
};

// Elements [skip, skip + n) of b: every array (grad, master or master_bf16, m, v, param) advanced
// by skip elements of its own dtype, a null one left null; the rest of b as it is.
AdamWBuffers elements_of(const AdamWBuffers& b, size_t skip, size_t n);

// Throws zerort::Error, prefixed by `who`, unless betas are in [0, 1), lr and weight_decay
// are >= 0, and eps is a finite number > 0: eps = 0 makes the update 0 / 0 = NaN wherever a
// gradient and its moments are 0, turning the master weight into NaN.
void check_adamw_hyper(const AdamWHyper& hyper, const char* who);

// Checks the arguments (errors name the bad one), then runs the pass on all CPU threads.
void adamw_step(const AdamWBuffers& buffers, const AdamWStep& step);

// The instruction-set levels the CPU AdamW is built for, one picked at run time from CPUID:
// x86-64 baseline, x86-64-v3 (AVX2 + FMA), x86-64-v4 (AVX-512). All give the same bits.
enum class CpuIsa { kBaseline = 0, kAvx2 = 1, kAvx512 = 2 };

// The level adamw_step runs on this CPU (the highest it supports).
CpuIsa adamw_cpu_isa();
const char* cpu_isa_name(CpuIsa isa);

// adamw_step on the kernel built for `isa` (tests compare the levels); throws unless this CPU runs it.
void adamw_step_isa(const AdamWBuffers& buffers, const AdamWStep& step, CpuIsa isa);

}  // namespace zerort
