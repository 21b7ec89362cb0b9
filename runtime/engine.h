// Engine: ZeRO stages 1 and 2 over a list of LibTorch parameters, without Python.
//
//   Engine engine(params, comm, options);       // params become views of one flat bf16/f16 buffer
//   for each micro-batch:
//     (loss * engine.loss_scale()).backward();  // grads land in the flat low-precision grad buffer
//     StepStats s = engine.step();              // reduce; at the accumulation boundary, update
//
// Gradients are averaged over ranks and micro-steps: do not divide the loss by either.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "comm/communicator.h"
#include "optim/adamw.h"
#include "partition/shard_layout.h"
#include "runtime/loss_scaler.h"

namespace zerort {

struct EngineOptions {
  int stage = 2;                       // 1: reduce once per boundary; 2: every micro-step into FP32
  DType precision = DType::kBFloat16;  // bf16 or f16
  AdamWHyper adamw;
  std::function<double(int64_t)> lr_schedule;  // optional: lr for Adam step n (1-based)
  LossScalerOptions loss_scale;        // f16 only; bf16 uses a static scale of 1
  double gradient_clipping = 0.0;      // max global L2 norm; 0 disables
  int64_t gradient_accumulation_steps = 1;
  size_t reduce_bucket_numel = size_t{1} << 24;  // gradient elements (all ranks) per bucket
  size_t alignment = 16;               // elements; each shard is a multiple of it
};

struct StepStats {
  bool boundary = false;   // false: a micro-step that only accumulated
  bool skipped = false;    // non-finite gradients: no update, scale backed off
  double loss_scale = 1;   // the scale this step's gradients carried
  double grad_norm = 0;    // global L2 norm of the averaged, unscaled gradient (pre-clip)
  double clip_coef = 1;    // min(1, clip / (norm + 1e-6)) when clipping
  int64_t nonfinite = 0;   // global count of non-finite gradient values
  double reduce_ms = 0, optimizer_ms = 0, gather_ms = 0;
};

class Engine {
 public:
  // params: defined CPU float32 leaf tensors that require grad; the same list, shapes and
  // order on every rank. Rank 0's values are broadcast. Errors name the parameter index.
  Engine(std::vector<at::Tensor> params, Communicator& comm, EngineOptions options);

  double loss_scale() const { return scaler_.scale(); }
  StepStats step();
  void set_lr(double lr) { options_.adamw.lr = lr; }

  int64_t global_step() const { return global_step_; }      // boundaries passed
  int64_t skipped_steps() const { return skipped_steps_; }
  int64_t adam_steps() const { return adam_steps_; }
  const ShardLayout& layout() const { return layout_; }
  const LossScaler& scaler() const { return scaler_; }
  const EngineOptions& options() const { return options_; }

  // This rank's FP32 state (shard_numel elements each) and the flat low-precision buffers.
  const at::Tensor& master() const { return master_; }
  const at::Tensor& exp_avg() const { return exp_avg_; }
  const at::Tensor& exp_avg_sq() const { return exp_avg_sq_; }
  const at::Tensor& grad_shard() const { return grad_shard_; }
  const at::Tensor& flat_params() const { return flat_params_; }
  const at::Tensor& flat_grads() const { return flat_grads_; }

 private:
  void reduce_gradients();  // flat low-precision grads -> FP32 shard (accumulating); zeroes them
  void update(StepStats& stats);

  Communicator& comm_;
  EngineOptions options_;
  ShardLayout layout_;
  LossScaler scaler_;
  std::vector<at::Tensor> params_;
  at::Tensor flat_params_, flat_grads_;              // padded_numel, low precision
  at::Tensor master_, exp_avg_, exp_avg_sq_, grad_shard_;  // shard_numel, FP32
  at::Tensor staging_[2];                            // packed buckets for the reduce
  int64_t micro_steps_ = 0, global_step_ = 0, skipped_steps_ = 0, adam_steps_ = 0;
};

}  // namespace zerort
