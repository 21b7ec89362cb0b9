// Engine: ZeRO stages 0, 1 and 2 over a list of LibTorch parameters, without Python.
//
//   Engine engine(params, comm, options);       // params become views of one flat bf16/f16 buffer
//   for each micro-batch:
//     (loss * engine.loss_scale()).backward();  // grads land in the flat low-precision grad buffer
//     StepStats s = engine.step();              // reduce; at the accumulation boundary, update
//
// Gradients are averaged over ranks and micro-steps: do not divide the loss by either.
//
// Stage 0 keeps the whole FP32 state on every rank (DDP); stage 1 shards it and reduces
// once per accumulation boundary; stage 2 also reduces every micro-step into the FP32
// gradient shard. Optional fp32_params (FP32 modules such as LayerNorm) form a second flat
// group kept and computed in FP32; both groups share one optimizer and one decision.
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
  int stage = 2;                       // 0, 1 or 2
  DType precision = DType::kBFloat16;  // compute precision of `params`: bf16, f16 or f32
  AdamWHyper adamw;
  std::function<double(int64_t)> lr_schedule;  // optional: lr for Adam step n (1-based)
  LossScalerOptions loss_scale;        // f16 only; bf16 and f32 use a static scale of 1
  double gradient_clipping = 0.0;      // max global L2 norm; 0 disables
  int64_t gradient_accumulation_steps = 1;
  size_t reduce_bucket_numel = size_t{1} << 24;  // gradient elements (all ranks) per bucket
  size_t alignment = 16;               // elements; each shard is a multiple of it
};

class Engine {
 public:
  // params, fp32_params: defined CPU float32 leaf tensors that require grad; the same lists,
  // shapes and order on every rank. Rank 0's values are broadcast. Errors name the index.
  Engine(std::vector<at::Tensor> params, Communicator& comm, EngineOptions options,
         std::vector<at::Tensor> fp32_params = {});
  ~Engine();

  double loss_scale() const { return optimizer_->loss_scale(); }
  StepStats step();
  void set_lr(double lr) { optimizer_->set_lr(lr); }

  int64_t global_step() const { return global_step_; }      // boundaries passed
  int64_t skipped_steps() const { return skipped_steps_; }
  int64_t adam_steps() const { return optimizer_->adam_steps(); }
  const LossScaler& scaler() const { return optimizer_->scaler(); }
  const EngineOptions& options() const { return options_; }

  // Group 0 holds `params` (compute precision), group 1 `fp32_params` when there are any.
  struct Group;
  size_t num_groups() const { return groups_.size(); }
  const ShardLayout& layout(size_t group = 0) const;
  const at::Tensor& flat_params(size_t group = 0) const;  // padded_numel, the group's dtype
  const at::Tensor& flat_grads(size_t group = 0) const;
  // This rank's FP32 state for the group: its shard (stages 1, 2) or all of it (stage 0).
  at::Tensor master(size_t group = 0) const;
  at::Tensor exp_avg(size_t group = 0) const;
  at::Tensor exp_avg_sq(size_t group = 0) const;

 private:
  void reduce_gradients(Group& g);  // flat grads -> the FP32 gradient (accumulating); zeroes them
  void update(StepStats& stats);
  at::Tensor optimizer_slice(const at::Tensor& t, size_t group) const;

  Communicator& comm_;
  EngineOptions options_;
  std::vector<std::unique_ptr<Group>> groups_;
  std::unique_ptr<ShardOptimizer> optimizer_;  // this rank's FP32 master, m, v, gradient
  at::Tensor stage0_scratch_;                  // stage 0: one group's reduced shard, FP32
  int64_t micro_steps_ = 0, global_step_ = 0, skipped_steps_ = 0;
};

}  // namespace zerort
