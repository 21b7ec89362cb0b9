// Bf16MasterStateStore: the optimizer state with a bf16 master and a bf16 gradient shard
// (DeepSpeed's bf16.bf16_master_weights_and_grads), Adam's m and v in state_dtype, all four
// tensors in memory on the master's device. See Note [bf16 master].
#pragma once

#include "runtime/optimizer_state.h"

namespace zerort {

// Note [bf16 master]: 2 bytes of master and 2 of gradient per element instead of 4 + 4. Every
// sum and update still computes in FP32, and each stored value is rounded to nearest even once:
//   - the reduces reach the gradient by ranges only (gradient_in_memory() is false): the Engine
//     reads its bucket's shard widened to FP32 into a scratch, accumulates the bucket's FP32
//     sums into it, and write_grad rounds the result once per micro-step;
//   - unscale_and_check_grad computes the stats of gradient * inv_scale in FP32, as the FP32
//     store does, but writes nothing back: update() hands the kernel inv_scale as
//     AdamWBuffers::grad_unscale, so the gradient is rounded once, by the reduce, only;
//   - update() hands one chunk, the whole state, with master_bf16 set; the kernel
//     (optim/adamw_bf16_master.h) steps in FP32 and rounds master, m and v once;
//   - read_range/write_range take an FP32 master: reads widen (exact), writes round to
//     nearest even, so a checkpoint of this store reloads bit for bit, and loads into an
//     FP32-master run too.
// read_grad/write_grad's pointers are memory on the store's device (the Engine's scratch).
class Bf16MasterStateStore final : public OptimizerStateStore {
 public:
  // master: a contiguous 1-D bf16 tensor (kept); m and v are state_dtype zeros, the gradient
  // bf16 zeros, all of its numel on its device.
  Bf16MasterStateStore(at::Tensor master, DType state_dtype);

  int64_t numel() const override { return master_.numel(); }
  DType state_dtype() const override { return state_dtype_; }
  DType master_dtype() const override { return DType::kBFloat16; }
  StateTierStats tier_stats() const override { return {}; }
  const at::Tensor& master() const override { return master_; }  // bf16
  const at::Tensor& exp_avg() const override { return exp_avg_; }
  const at::Tensor& exp_avg_sq() const override { return exp_avg_sq_; }
  at::Tensor& grad() override { return grad_; }  // bf16: reduces go through read_grad/write_grad
  const at::Tensor& grad() const override { return grad_; }
  bool gradient_in_memory() const override { return false; }
  c10::Device device() const override { return master_.device(); }
  void read_grad(size_t offset, size_t n, float* out) override;
  void write_grad(size_t offset, size_t n, const float* in) override;
  GradStats unscale_and_check_grad(float inv_scale) override;
  void zero_grad() override;
  void update(const ChunkFn& fn) override;  // one chunk: the whole state
  void read_range(size_t offset, size_t n, float* master, void* exp_avg, void* exp_avg_sq) override;
  void write_range(size_t offset, size_t n, const float* master, const void* exp_avg, const void* exp_avg_sq) override;

 private:
  DType state_dtype_;
  float grad_unscale_ = 1.0f;  // the last unscale_and_check_grad's inv_scale, until zero_grad
  at::Tensor master_, exp_avg_, exp_avg_sq_, grad_;
};

}  // namespace zerort
