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
#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "optim/adamw.h"
#include "partition/shard_layout.h"
#include "runtime/loss_scaler.h"
#include "runtime/shard_optimizer.h"

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

class Engine {
 public:
  // params: defined CPU float32 leaf tensors that require grad; the same list, shapes and
  // order on every rank. Rank 0's values are broadcast. Errors name the parameter index.
  Engine(std::vector<at::Tensor> params, Communicator& comm, EngineOptions options);

  double loss_scale() const { return optimizer_->loss_scale(); }
  StepStats step();
  void set_lr(double lr) { optimizer_->set_lr(lr); }

  int64_t global_step() const { return global_step_; }      // boundaries passed
  int64_t skipped_steps() const { return skipped_steps_; }
  int64_t adam_steps() const { return optimizer_->adam_steps(); }
  const ShardLayout& layout() const { return layout_; }
  const LossScaler& scaler() const { return optimizer_->scaler(); }
  const EngineOptions& options() const { return options_; }

  // This rank's FP32 state (shard_numel elements each) and the flat low-precision buffers.
  const at::Tensor& master() const { return optimizer_->master(); }
  const at::Tensor& exp_avg() const { return optimizer_->exp_avg(); }
  const at::Tensor& exp_avg_sq() const { return optimizer_->exp_avg_sq(); }
  const at::Tensor& flat_params() const { return flat_params_; }
  const at::Tensor& flat_grads() const { return flat_grads_; }

 private:
  void reduce_gradients();  // flat low-precision grads -> FP32 shard (accumulating); zeroes them
  void update(StepStats& stats);

  Communicator& comm_;
  EngineOptions options_;
  ShardLayout layout_;
  std::vector<at::Tensor> params_;
  at::Tensor flat_params_, flat_grads_;  // padded_numel, low precision
  std::unique_ptr<ShardOptimizer> optimizer_;  // this rank's FP32 master, m, v, grad shard
  at::Tensor staging_[2];                // packed buckets for the reduce
  int64_t micro_steps_ = 0, global_step_ = 0, skipped_steps_ = 0;
};

}  // namespace zerort
