// Engine, its state as callers read and load it: the optimizer state's tier, per-group views
// of the FP32 optimizer state and gradient, ranges of it in any tier, the whole master
// gathered, the checkpoint counters, and the working weights rebuilt from the master (the rest
// of the Engine is engine.cpp, engine_reduce.cpp, engine_units.cpp and engine_tiers.cpp, which makes the state).
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include <algorithm>
#include <vector>

#include "core/error.h"
#include "runtime/engine_parts.h"
#include "runtime/kernel_dispatch.h"

namespace zerort {

void Engine::cast_master(size_t offset, size_t n, void* out, DType dtype, bool out_on_host) const {
  OptimizerStateStore& state = optimizer_->state();
  if (out_on_host && state.tier() == StateTier::kMemory) {  // kHost's shard copies in host memory: beside the master
    cast_from_f32_on(at::kCPU, state.master().data_ptr<float>() + offset, out, dtype, n);
    return;
  }
  if (host_mover_ && state.tier() == StateTier::kMemory) {  // kHost: cast on the host, then one copy
    cast_from_f32_on(at::kCPU, state.master().data_ptr<float>() + offset, host_out_.get(), dtype, n);
    host_mover_->from_host(out, host_out_.get(), n * dtype_size(dtype));
    return;
  }
  if (state.tier() == StateTier::kMemory && state.master_dtype() == DType::kBFloat16) {  // bits, or widened
    const auto to = at::TensorOptions().dtype(scalar_type(dtype)).device(device_);
    at::from_blob(out, {static_cast<int64_t>(n)}, to)
        .copy_(state.master().narrow(0, static_cast<int64_t>(offset), static_cast<int64_t>(n)));
    return;
  }
  if (state.tier() == StateTier::kMemory) {
    cast_from_f32_on(device_, state.master().data_ptr<float>() + offset, out, dtype, n);
    return;
  }
  // kNvme: read through a bounded buffer and cast on the host; to the model's memory through
  // host_out_ and the mover (n: a bucket's at most, so a piece fits host_out_).
  constexpr size_t kPiece = size_t{1} << 20;
  std::vector<float> piece(std::min(n, kPiece));
  for (size_t at = 0; at < n; at += kPiece) {
    const size_t count = std::min(kPiece, n - at);
    state.read_range(offset + at, count, piece.data(), nullptr, nullptr);
    char* dest = static_cast<char*>(out) + at * dtype_size(dtype);
    cast_from_f32_on(at::kCPU, piece.data(), out_on_host ? dest : host_out_.get(), dtype, count);
    if (!out_on_host) host_mover_->from_host(dest, host_out_.get(), count * dtype_size(dtype));
  }
}

void Engine::fill_own_chunk(const Bucket& b) {
  if (shard_copies_.has(b.index)) {
    shard_copies_.read(b.index, own_chunk(b));
  } else {
    cast_master(b.opt_offset, b.opt_numel, own_chunk(b), groups_[b.group]->dtype);
  }
}

namespace {

at::ScalarType array_type(StateArray array, DType state_dtype) {
  return array == StateArray::kMaster ? at::kFloat : scalar_type(state_dtype);
}

}  // namespace

at::Tensor Engine::read_state(StateArray array, size_t offset, size_t n) const {
  settle_update();  // Note [overlapped step]
  OptimizerStateStore& state = optimizer_->state();
  at::Tensor out =
      at::empty({static_cast<int64_t>(n)}, at::TensorOptions().dtype(array_type(array, state.state_dtype())));
  void* p = out.data_ptr();
  state.read_range(offset, n, array == StateArray::kMaster ? static_cast<float*>(p) : nullptr,
                   array == StateArray::kExpAvg ? p : nullptr, array == StateArray::kExpAvgSq ? p : nullptr);
  return out;
}

void Engine::write_state(StateArray array, size_t offset, const at::Tensor& values) {
  settle_update();
  OptimizerStateStore& state = optimizer_->state();
  const at::ScalarType type = array_type(array, state.state_dtype());
  ZRT_CHECK_AS(UsageError, values.defined() && values.dim() == 1 && values.scalar_type() == type,
               "Engine.write_state: values must be a 1-D ", c10::toString(type), " tensor");
  const at::Tensor host = values.to(at::kCPU).contiguous();
  const void* p = host.data_ptr();
  state.write_range(offset, static_cast<size_t>(host.numel()),
                    array == StateArray::kMaster ? static_cast<const float*>(p) : nullptr,
                    array == StateArray::kExpAvg ? p : nullptr, array == StateArray::kExpAvgSq ? p : nullptr);
}

const Engine::Group& Engine::group(size_t g) const {
  ZRT_CHECK(g < groups_.size(), "Engine: group ", g, " does not exist (", groups_.size(), " groups)");
  return *groups_[g];
}
size_t Engine::numel(size_t g) const { return group(g).numel; }
size_t Engine::param_offset(size_t g, size_t i) const {
  ZRT_CHECK(i < group(g).params.size(), "Engine: parameter ", i, " of group ", g, " does not exist");
  return group(g).param_offset[i];
}
size_t Engine::bucket_of(size_t g, size_t i) const {
  param_offset(g, i);  // checks g and i
  return group(g).buckets[group(g).param_bucket[i]].index;
}
const at::Tensor& Engine::flat_params(size_t g) const { return group(g).flat_params; }
const at::Tensor& Engine::flat_grads(size_t g) const { return group(g).flat_grads; }
at::Tensor Engine::optimizer_slice(const at::Tensor& t, size_t g) const {
  return t.narrow(0, static_cast<int64_t>(group(g).opt_offset), static_cast<int64_t>(group(g).opt_numel));
}
at::Tensor Engine::master(size_t g) const {
  settle_update();
  return optimizer_slice(optimizer_->state().master(), g);
}
at::Tensor Engine::exp_avg(size_t g) const {
  settle_update();
  return optimizer_slice(optimizer_->state().exp_avg(), g);
}
at::Tensor Engine::exp_avg_sq(size_t g) const {
  settle_update();
  return optimizer_slice(optimizer_->state().exp_avg_sq(), g);
}
at::Tensor Engine::grad(size_t g) const {
  settle_update();
  OptimizerStateStore& state = optimizer_->state();
  if (state.gradient_in_memory()) return optimizer_slice(state.grad(), g);
  at::Tensor out = at::empty({static_cast<int64_t>(group(g).opt_numel)},
                             at::TensorOptions().dtype(at::kFloat).device(state.device()));
  state.read_grad(group(g).opt_offset, group(g).opt_numel, out.data_ptr<float>());
  return out;
}

size_t Engine::grad_shard_bytes() const {
  const OptimizerStateStore& state = optimizer_->state();
  if (state.master_dtype() == DType::kBFloat16) {  // the bf16 shard and the reduces' FP32 scratch
    return static_cast<size_t>(state.grad().numel()) * 2 + static_cast<size_t>(reduce_scratch_.numel()) * sizeof(float);
  }
  const at::Tensor& held = state.gradient_in_memory() ? state.grad() : reduce_scratch_;
  const bool host_tier = host_mover_ && state.tier() == StateTier::kMemory;  // and its reduce scratch on the device
  const int64_t scratch = host_tier && reduce_scratch_.defined() ? reduce_scratch_.numel() : 0;
  return static_cast<size_t>(held.numel() + scratch) * sizeof(float);
}

StateTierStats Engine::state_tier_stats() const {
  StateTierStats s = optimizer_->state().tier_stats();
  if (host_mover_ && s.tier == StateTier::kMemory)
    s.tier = StateTier::kHost;  // a store in (host) memory beside a device model
  return s;
}

at::Tensor Engine::gather_master(size_t g) const {
  settle_update();
  const Group& grp = group(g);
  const int64_t padded =
      grp.buckets.empty()
          ? 0
          : static_cast<int64_t>(grp.buckets.back().flat_offset + grp.buckets.back().layout.padded_numel());
  at::Tensor out = at::empty({padded}, at::TensorOptions().dtype(at::kFloat).device(device_));
  for (const Bucket& b : grp.buckets) {
    const int64_t n = static_cast<int64_t>(b.opt_numel);
    const at::Tensor mine = (optimizer_->state().tier() == StateTier::kMemory
                                 ? optimizer_->state().master().narrow(0, static_cast<int64_t>(b.opt_offset), n)
                                 : read_state(StateArray::kMaster, b.opt_offset, b.opt_numel))
                                .to(device_, at::kFloat);  // kHost: from host memory; a bf16 master widened
    if (policy_.replicated) {                              // every rank holds it all
      out.narrow(0, static_cast<int64_t>(b.flat_offset), n).copy_(mine);
    } else {
      shard_
          .all_gather(mine.data_ptr<float>(), out.data_ptr<float>() + b.flat_offset, b.opt_numel, DType::kFloat32,
                      static_cast<int64_t>(b.index))
          ->wait();
    }
  }
  return out;
}

// Checkpoints: the counters beside the optimizer tensors.
Engine::Counters Engine::counters() const {
  return Counters{global_step_, skipped_steps_, micro_steps_, optimizer_->adam_steps(), optimizer_->scaler_state()};
}

void Engine::load_counters(const Counters& c) {
  ZRT_CHECK(c.global_step >= 0 && c.skipped_steps >= 0 && c.skipped_steps <= c.global_step && c.micro_steps >= 0,
            "checkpoint: inconsistent step counters (global ", c.global_step, ", skipped ", c.skipped_steps, ", micro ",
            c.micro_steps, ")");
  settle_update();
  optimizer_->load_state(c.scaler, c.adam_steps);
  global_step_ = c.global_step;
  skipped_steps_ = c.skipped_steps;
  micro_steps_ = c.micro_steps;
  restart_window_sums();  // a load starts the window afresh (Note [hybrid sharding])
}

void Engine::refresh_params() {
  settle_update();
  wait_param_gathers();                  // none may write a working copy after this fills it
  if (secondary_) secondary_->forget();  // the loaded weights are new (Note [secondary shards])
  for (Bucket* b : buckets_) {           // shard copies first (See Note [state tiers])
    if (shard_copies_.has(b->index)) {
      cast_master(b->opt_offset, b->opt_numel, shard_copies_.begin_write(b->index), groups_[b->group]->dtype,
                  shard_copies_.host_writes());
      shard_copies_.end_write(b->index);
    }
  }
  for (Bucket* b : whole_buckets()) {  // released units take the master's values when gathered
    fill_own_chunk(*b);
    if (!policy_.replicated) gather_working_copy(*b)->wait();
  }
}

std::vector<std::array<size_t, 4>> Engine::bucket_layout(size_t g) const {
  std::vector<std::array<size_t, 4>> out;
  for (const Bucket& b : group(g).buckets) {
    out.push_back({b.flat_offset, b.layout.padded_numel(), b.layout.shard_numel(), b.opt_offset});
  }
  return out;
}

}  // namespace zerort
