// OptimizerStateStore: where this rank's FP32 optimizer state lives: the master weights,
// Adam's m and v, and the FP32 gradient the reduces accumulate into. The ShardOptimizer
// and the Engine reach the state only through this interface. InMemoryStateStore, the one
// tier today, keeps all four as tensors on the master's device.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"
#include "optim/adamw.h"

namespace zerort {

// Note [optimizer state store]: the state is numel() elements, laid out alike in all four
// tensors (one offset names the same element in each); the same numel on every rank. The
// gradient tensor is where the reduces accumulate, so it is always addressable on the
// compute device; the update reaches master, m and v for a range only through span(),
// whose pointers are valid until the next span() or the end of the step, so a tier that
// keeps them elsewhere can stage that range in and out around it. master(), exp_avg() and
// exp_avg_sq() are the whole tensors, for checkpoints and the gathers of the master.
class OptimizerStateStore {
 public:
  virtual ~OptimizerStateStore() = default;

  virtual int64_t numel() const = 0;
  virtual DType state_dtype() const = 0;  // Adam's m and v: f32 or bf16
  virtual const at::Tensor& master() const = 0;
  virtual const at::Tensor& exp_avg() const = 0;
  virtual const at::Tensor& exp_avg_sq() const = 0;
  virtual at::Tensor& grad() = 0;  // FP32, summed over ranks and micro-steps
  virtual const at::Tensor& grad() const = 0;
  // AdamW's buffers for elements [offset, offset + n): grad, master, m and v set (the
  // caller sets the low-precision output).
  virtual AdamWBuffers span(size_t offset, size_t n) = 0;
};

// Every tensor on the master's device, allocated once. See Note [optimizer state store].
class InMemoryStateStore final : public OptimizerStateStore {
 public:
  // master: a contiguous 1-D float32 tensor (kept); m and v are state_dtype zeros, the
  // gradient float32 zeros, all of its numel on its device.
  InMemoryStateStore(at::Tensor master, DType state_dtype);

  int64_t numel() const override { return master_.numel(); }
  DType state_dtype() const override { return state_dtype_; }
  const at::Tensor& master() const override { return master_; }
  const at::Tensor& exp_avg() const override { return exp_avg_; }
  const at::Tensor& exp_avg_sq() const override { return exp_avg_sq_; }
  at::Tensor& grad() override { return grad_; }
  const at::Tensor& grad() const override { return grad_; }
  AdamWBuffers span(size_t offset, size_t n) override;

 private:
  DType state_dtype_;
  at::Tensor master_, exp_avg_, exp_avg_sq_, grad_;
};

}  // namespace zerort
