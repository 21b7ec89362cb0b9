// DeviceGradientStore: an optimizer state whose FP32 gradient stays on the model's device while
// master, m and v live off it (the Engine's 'cpu' or 'nvme' tier, made without a gradient of
// their own). EngineOptions::gradient_on_device (offload_optimizer.gradient_on_device) makes one.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

#include "comm/staged_communicator.h"
#include "runtime/optimizer_state.h"

namespace zerort {

// Note [gradient on the device]
// Off memory the reduces' target is the largest thing a step moves: with the gradient in host
// memory beside a model on a GPU, every bucket's reduce takes this rank's gradient so far up to a
// device scratch and its sum back down (8 bytes an element each micro-step), and the host holds
// 4 bytes an element more than master, m and v. Here the gradient is a tensor on the device, the
// reduces accumulate into it as in memory (no copy), the unscale and check pass runs there on the
// device's kernel (the GPU-resident run's), and the update copies it down piece by piece (4 bytes
// an element, once a step) through one host buffer of piece_elements floats (pinned for CUDA):
// update(fn) and update_ranges(ranges, fn) hand fn the inner store's parts cut into pieces of at
// most piece_elements, each with its gradient copied to the host just before fn runs on it.
// AdamW is elementwise, so the cut changes no bits. The copies go through the Mover (a memcpy on
// a CPU model, whose device is host memory: that is how the tests run it); each ends with the
// Mover's own host wait (Note [allowed host waits]: kStagedCopy). They do not wait for the compute
// stream (Mover::settled_to_host): the update comes after the step's decision, whose unscale pass
// is the gradient's last writer and which the host waited for (kStepDecision), while the compute
// stream may by then hold the next forward (Note [overlapped step]), which the copies would
// otherwise follow, so the CPU's AdamW would wait for the GPU's forward unit by unit. A copy is
// synchronous: a piece of 1 Mi elements (4 MiB) is about 0.1 ms over PCIe against a few ms of
// AdamW on the CPU. zero_grad() zeroes the device tensor with torch's op on the caller's current
// stream (the Engine's compute stream: the overlapped update runs under it). That is the tier's
// cost: 4 bytes an element of device memory.
class DeviceGradientStore final : public OptimizerStateStore {
 public:
  // inner: master, m and v, made without a gradient (InMemoryStateStore's or NvmeStateOptions'
  // with_gradient false), on the host; grad: FP32 zeros of inner's numel on the model's device;
  // mover: the copies between the two (kept by reference; it must outlive the store).
  DeviceGradientStore(std::unique_ptr<OptimizerStateStore> inner, at::Tensor grad, Mover& mover,
                      std::size_t piece_elements);

  int64_t numel() const override { return inner_->numel(); }
  DType state_dtype() const override { return inner_->state_dtype(); }
  StateTierStats tier_stats() const override;  // the inner tier's, with the host piece in pool_bytes
  const at::Tensor& master() const override { return inner_->master(); }
  const at::Tensor& exp_avg() const override { return inner_->exp_avg(); }
  const at::Tensor& exp_avg_sq() const override { return inner_->exp_avg_sq(); }
  at::Tensor& grad() override { return grad_; }
  const at::Tensor& grad() const override { return grad_; }
  c10::Device device() const override { return inner_->device(); }  // AdamW runs where master, m and v are
  void update(const ChunkFn& fn) override;
  void update_ranges(const std::vector<std::pair<size_t, size_t>>& ranges, const ChunkFn& fn) override;
  void prefetch() override { inner_->prefetch(); }
  void read_range(size_t offset, size_t n, float* master, void* exp_avg, void* exp_avg_sq) override {
    inner_->read_range(offset, n, master, exp_avg, exp_avg_sq);
  }
  void write_range(size_t offset, size_t n, const float* master, const void* exp_avg, const void* exp_avg_sq) override {
    inner_->write_range(offset, n, master, exp_avg, exp_avg_sq);
  }

  OptimizerStateStore& inner() { return *inner_; }
  std::size_t piece_bytes() const { return piece_elements_ * sizeof(float); }

 private:
  // fn on each piece of chunk, its gradient first copied into the host piece.
  void in_pieces(size_t offset, const AdamWBuffers& chunk, const ChunkFn& fn);

  std::unique_ptr<OptimizerStateStore> inner_;
  at::Tensor grad_;
  Mover& mover_;
  std::size_t piece_elements_;
  std::shared_ptr<char> piece_;  // piece_elements_ floats of host staging
};

}  // namespace zerort
