// ShardOptimizer: the optimizer half of every ZeRO stage. Owns this rank's FP32 master,
// Adam m and v and FP32 gradient shard (in an OptimizerStateStore: See Note [optimizer
// state store]), and the loss scaler. One step: the fused unscale /
// non-finite / sum-of-squares pass, the step's decision exchange so every rank takes the same
// skip-or-clip decision, the fused AdamW that also writes the low-precision shard.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "comm/communicator.h"
#include "optim/adamw.h"
#include "runtime/loss_scaler.h"
#include "runtime/optimizer_state.h"

namespace zerort {

struct OptimizerOptions {
  DType precision = DType::kBFloat16;       // compute precision: f16 gets the dynamic loss scale
  AdamWHyper adamw;                         // every element's, until set_hyper_groups
  LossScalerOptions loss_scale;             // used for f16; bf16 uses a static scale of 1
  double gradient_clipping = 0.0;           // max global L2 norm; 0 disables
  int64_t gradient_accumulation_steps = 1;  // the gradient is averaged over these and W
  DType state_dtype = DType::kFloat32;      // Adam's m and v: f32, or bf16 (half their memory)
  // The master and gradient shard: f32, or bf16 (DeepSpeed's bf16_master_weights_and_grads:
  // runtime/bf16_state_store.h; the update still computes in FP32 and rounds once).
  DType master_dtype = DType::kFloat32;
  // Ranks 0..owner_ranks-1 hold every element of the state once between them, so only their
  // gradient figures are summed at the decision (0: every rank; stage 0, where every rank holds
  // it all: 1; hybrid sharding: the group's size, Note [hybrid sharding]).
  int owner_ranks = 0;
};

// Where step() writes the updated weights: master[offset, offset+numel) cast to dtype
// (bf16, f16, or f32 for FP32 modules) at out. Instead of out, a segment can borrow its buffer:
// open() before the step writes any of its elements, close() once all are written. The step
// finishes one segment before it starts the next (apply()'s order; a store may walk a segment
// down: Note [NVMe state store]), so a lender needs one buffer at a time.
struct OutputSegment {
  size_t offset = 0;
  size_t numel = 0;
  void* out = nullptr;
  DType dtype = DType::kBFloat16;
  std::function<void*()> open = nullptr;
  std::function<void()> close = nullptr;
};

struct StepStats {
  bool boundary = false;  // false: a micro-step that only accumulated
  bool skipped = false;   // non-finite gradients: no update, scale backed off
  double loss_scale = 1;  // the scale this step's gradients carried
  double grad_norm = 0;   // global L2 norm of the averaged, unscaled gradient (pre-clip)
  double clip_coef = 1;   // min(1, clip / (norm + 1e-6)) when clipping
  int64_t nonfinite = 0;  // global count of non-finite gradient values
  double reduce_ms = 0, optimizer_ms = 0, gather_ms = 0;
};

class ShardOptimizer {
 public:
  // master: this rank's FP32 shard (the optimizer keeps this tensor). The same numel on
  // every rank. The state is kept in memory (InMemoryStateStore).
  ShardOptimizer(at::Tensor master, Communicator& comm, OptimizerOptions options);
  // The state in a given store (any tier), whose state_dtype must be options.state_dtype.
  ShardOptimizer(std::unique_ptr<OptimizerStateStore> state, Communicator& comm, OptimizerOptions options);

  // The FP32 state: master, m, v and the gradient. See Note [optimizer state store].
  OptimizerStateStore& state() { return *state_; }
  const OptimizerStateStore& state() const { return *state_; }
  // Accumulate gradients here (sum over ranks and micro-steps, still loss-scaled).
  at::Tensor& grad_shard() { return state_->grad(); }
  const at::Tensor& grad_shard() const { return state_->grad(); }

  // One optimizer step from grad_shard(); writes the new weights to the output segments
  // (which must lie inside the master) and zeroes grad_shard(). Returns false when the
  // step was skipped. Fills stats' skip/scale/norm/clip/optimizer_ms. Its one collective is
  // the step's decision (runtime/step_decision.h), which also checks that every rank called
  // the same collectives since the last step and had no micro-step without backward
  // (missed_backward: this rank's count); it throws UsageError on every rank, with the
  // window's gradients dropped, when not.
  bool step(const std::vector<OutputSegment>& outputs, StepStats& stats, int64_t missed_backward = 0);
  // step() in two halves (Note [overlapped step], runtime/step_overlap.h): decide() takes the
  // decision (the collective, the skip, the clip, the loss scale's next value) and, when the
  // step is applied, leaves the update pending; apply() then runs AdamW over every element
  // once, outputs[order[0]], outputs[order[1]], ... first (the nvme store streams them in that
  // order too: Note [NVMe state store]), and zeroes the gradient. The bits do not depend on the
  // order: AdamW is elementwise. apply() may run on another thread than decide().
  bool decide(const std::vector<OutputSegment>& outputs, StepStats& stats, int64_t missed_backward = 0);
  void apply(const std::vector<OutputSegment>& outputs, const std::vector<size_t>& order);

  double loss_scale() const { return scaler_.scale(); }
  // What the summed gradient is divided by before the update: the loss scale, W and the window
  // length (the gradient is averaged over ranks and micro-steps).
  double grad_denominator() const;
  int64_t adam_steps() const { return adam_steps_; }
  // Checkpoints: the scaler's state and Adam's step count (master, m, v are the tensors).
  void load_state(const LossScaler::State& scaler, int64_t adam_steps);
  // Per-group hyperparameters (torch's param groups): hypers[k] for the elements of each
  // region {offset, numel, k} of the master; regions are disjoint, and elements outside
  // every region (padding) take hypers[0]. Checked whole before anything changes.
  void set_hyper_groups(std::vector<AdamWHyper> hypers, std::vector<std::array<int64_t, 3>> regions);
  const std::vector<AdamWHyper>& hyper_groups() const { return hypers_; }
  const OptimizerOptions& options() const { return options_; }
  const at::Tensor& master() const { return state_->master(); }
  const LossScaler::State& scaler_state() const { return scaler_.state(); }
  const at::Tensor& exp_avg() const { return state_->exp_avg(); }
  const at::Tensor& exp_avg_sq() const { return state_->exp_avg_sq(); }

  // Diagnostics for skipped steps. Regions {offset, numel, id} of the gradient shard, for
  // example each parameter's piece with the parameter's index as id. When a step is
  // skipped, the ids of the regions holding a non-finite value are recorded, in the order
  // given, before the shard is zeroed (one extra pass over the regions, on skipped steps
  // only). nonfinite_ids() is empty after a step that was not skipped.
  void set_watch_regions(std::vector<std::array<int64_t, 3>> regions);
  const std::vector<int64_t>& nonfinite_ids() const { return nonfinite_ids_; }

 private:
  void record_nonfinite();
  // AdamW over elements [lo, lo + n) of `chunk` (whose first element is chunk_offset), split
  // where the hyper group changes; out (nullable) is the low-precision copy of that range.
  void adamw_range(const AdamWBuffers& chunk, size_t chunk_offset, size_t lo, size_t n, void* out, DType dtype,
                   const AdamWStep& step);

  Communicator& comm_;
  OptimizerOptions options_;
  LossScaler scaler_;
  std::unique_ptr<OptimizerStateStore> state_;
  int64_t adam_steps_ = 0;
  AdamWStep pending_;                                  // decide()'s, for apply()
  std::vector<AdamWHyper> hypers_;                     // one per param group
  std::vector<std::array<int64_t, 3>> hyper_regions_;  // sorted by offset
  std::vector<std::array<int64_t, 3>> watch_regions_;
  std::vector<int64_t> nonfinite_ids_;
};

}  // namespace zerort
