// OptimizerStateStore: where this rank's FP32 optimizer state lives: the master weights,
// Adam's m and v, and the FP32 gradient the reduces accumulate (or, for the Engine's kHost
// tier, copy) into. The ShardOptimizer
// and the Engine reach the state only through this interface. InMemoryStateStore keeps all
// four as tensors on the master's device; NvmeStateStore (runtime/nvme_state_store.h) keeps
// master, m and v in a file, and the gradient in memory or (gradient_in_file) there too. Either
// may be made without a gradient, for a DeviceGradientStore (runtime/device_gradient_store.h) that
// keeps it on the model's device.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "optim/adamw.h"
#include "optim/grad_stats.h"

namespace zerort {

// Where master, m and v live: with the gradient on the model's device (kMemory), with the gradient
// in host memory beside a model on a device (kHost: the Engine's; the store is in memory), or in
// a file (kNvme: runtime/nvme_state_store.h).
enum class StateTier { kMemory, kHost, kNvme };
const char* tier_name(StateTier tier);  // "memory", "cpu", "nvme"

// One of the three arrays of the state, for read/write by array (checkpoints, accessors).
enum class StateArray { kMaster, kExpAvg, kExpAvgSq };

// What a tier holds and moves, for the memory report and the monitor. In memory: nothing
// but the tier. In a file: its path and size (gradient_bytes of it the gradient's region, when
// it is there), the pool's RAM, the records kept in RAM when split, the bytes moved since the store was made, and the seconds spent
// blocked waiting for them (IoQueue::wait_seconds).
struct StateTierStats {
  StateTier tier = StateTier::kMemory;
  std::string path;
  std::uint64_t file_bytes = 0, gradient_bytes = 0, pool_bytes = 0, bytes_read = 0, bytes_written = 0;
  std::uint64_t ram_bytes = 0;      // a split file tier's records kept in RAM (Note [NVMe state store])
  bool gradient_on_device = false;  // the FP32 gradient on the model's device (Note [gradient on the device])
  double io_wait_seconds = 0;
  // A file's IoQueue backend ("io_uring" or "threads"; "" in memory) and why it was chosen
  // when not simply asked for (IoQueue::backend_why).
  std::string io_backend, io_backend_why;
};

// Note [optimizer state store]: the state is numel() elements, laid out alike in all four
// arrays (one offset names the same element in each); the same numel on every rank. The
// gradient is where the reduces accumulate: a tensor on the store's device (grad()) when
// gradient_in_memory(), else reached only by ranges (read_grad/write_grad; Note [gradient in
// the file]). Either way the step goes unscale_and_check_grad(), then update() (which hands
// fn the unscaled gradient), then zero_grad(). The update reaches master, m and v only through
// update(fn) or update_ranges(ranges, fn): fn sees pieces that cover [0, numel) once (update():
// consecutive chunks in order; update_ranges(): the ranges' order, see there), each with
// pointers valid only during that call, so a tier that keeps the state elsewhere streams
// each piece in before fn and back out after it (InMemoryStateStore passes the whole state
// as one chunk). read_range()/write_range() copy a range of master, m and v to or from host
// memory, for checkpoints and gathers of the master, in any tier. master(), exp_avg() and
// exp_avg_sq() are the whole tensors, for the in-memory users that still need them; a tier
// that does not hold them in memory throws UsageError from them.
class OptimizerStateStore {
 public:
  // offset: the chunk's (or part's) first element; chunk: its grad, master, m and v (n elements;
  // param unset).
  using ChunkFn = std::function<void(size_t offset, const AdamWBuffers& chunk)>;

  virtual ~OptimizerStateStore() = default;

  virtual int64_t numel() const = 0;
  virtual DType state_dtype() const = 0;  // Adam's m and v: f32 or bf16
  // The master's and the gradient's dtype: f32, or bf16 (Bf16MasterStateStore,
  // runtime/bf16_state_store.h). read_range/write_range and read_grad/write_grad take FP32 either way.
  virtual DType master_dtype() const { return DType::kFloat32; }
  virtual StateTierStats tier_stats() const = 0;
  StateTier tier() const { return tier_stats().tier; }
  virtual const at::Tensor& master() const = 0;
  virtual const at::Tensor& exp_avg() const = 0;
  virtual const at::Tensor& exp_avg_sq() const = 0;
  virtual at::Tensor& grad() = 0;  // FP32, summed over ranks and micro-steps (in memory only)
  virtual const at::Tensor& grad() const = 0;
  virtual bool gradient_in_memory() const { return true; }
  virtual c10::Device device() const { return grad().device(); }  // where the step's kernels run
  // Elements [offset, offset + n) of the gradient to or from host memory, in any tier.
  virtual void read_grad(size_t offset, size_t n, float* out);
  virtual void write_grad(size_t offset, size_t n, const float* in);
  // The gradient times inv_scale, its non-finite count and FP64 sum of squares (the
  // unscale_and_check pass, optim/grad_stats.h); zero_grad() sets it to zeros.
  virtual GradStats unscale_and_check_grad(float inv_scale);
  virtual void zero_grad() { grad().zero_(); }
  // Calls fn on every chunk in order; what fn leaves in a chunk's master, m and v is the state
  // once update() returns. See Note [optimizer state store].
  virtual void update(const ChunkFn& fn) = 0;
  // update(fn) over the ranges {offset, n} (which cover [0, numel) once), in the order given:
  // fn sees every element of one range before any of the next (within a range, a streamed
  // tier may go down: Note [NVMe state store]). The default takes update()'s order.
  virtual void update_ranges(const std::vector<std::pair<size_t, size_t>>& ranges, const ChunkFn& fn) {
    (void)ranges;
    update(fn);
  }
  // A hint that update() comes soon: a tier that streams the state may start reading it now.
  virtual void prefetch() {}
  // Elements [offset, offset + n) of master (float32), m and v (state_dtype) to or from host
  // memory; a nullptr array is skipped.
  virtual void read_range(size_t offset, size_t n, float* master, void* exp_avg, void* exp_avg_sq) = 0;
  virtual void write_range(size_t offset, size_t n, const float* master, const void* exp_avg,
                           const void* exp_avg_sq) = 0;
};

// Throws Error naming `who` unless the ranges {offset, n} cover [0, numel), each element once
// (update_ranges' argument check, for every store).
void check_ranges_tile(const std::vector<std::pair<size_t, size_t>>& ranges, size_t numel, const char* who);

// Every tensor on the master's device, allocated once. See Note [optimizer state store].
class InMemoryStateStore final : public OptimizerStateStore {
 public:
  // master: a contiguous 1-D float32 tensor (kept); m and v are state_dtype zeros, the
  // gradient float32 zeros, all of its numel on its device. Without with_gradient there is no
  // gradient here: a DeviceGradientStore keeps it (grad() then throws UsageError, and update()
  // hands fn a null gradient for the wrapper to fill).
  InMemoryStateStore(at::Tensor master, DType state_dtype, bool with_gradient = true);

  int64_t numel() const override { return master_.numel(); }
  DType state_dtype() const override { return state_dtype_; }
  StateTierStats tier_stats() const override { return {}; }
  const at::Tensor& master() const override { return master_; }
  const at::Tensor& exp_avg() const override { return exp_avg_; }
  const at::Tensor& exp_avg_sq() const override { return exp_avg_sq_; }
  at::Tensor& grad() override;
  const at::Tensor& grad() const override { return const_cast<InMemoryStateStore*>(this)->grad(); }
  c10::Device device() const override { return master_.device(); }
  void update(const ChunkFn& fn) override;  // one chunk: the whole state
  void update_ranges(const std::vector<std::pair<size_t, size_t>>& ranges, const ChunkFn& fn) override;
  void read_range(size_t offset, size_t n, float* master, void* exp_avg, void* exp_avg_sq) override;
  void write_range(size_t offset, size_t n, const float* master, const void* exp_avg, const void* exp_avg_sq) override;

 private:
  DType state_dtype_;
  at::Tensor master_, exp_avg_, exp_avg_sq_, grad_;
};

}  // namespace zerort
