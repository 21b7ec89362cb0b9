// Engine, its state as callers read and load it: per-group views of the FP32 optimizer state
// and gradient, the whole master gathered, the checkpoint counters, and the working weights
// rebuilt from the master (the rest of the Engine is engine.cpp, engine_reduce.cpp and
// engine_units.cpp).
#include <ATen/ops/empty.h>

#include "core/error.h"
#include "runtime/engine_parts.h"
#include "runtime/kernel_dispatch.h"

namespace zerort {

const Engine::Group& Engine::group(size_t g) const {
  ZRT_CHECK(g < groups_.size(), "Engine: group ", g, " does not exist (", groups_.size(), " groups)");
  return *groups_[g];
}
size_t Engine::numel(size_t g) const { return group(g).numel; }
size_t Engine::param_offset(size_t g, size_t i) const {
  ZRT_CHECK(i < group(g).params.size(), "Engine: parameter ", i, " of group ", g, " does not exist");
  return group(g).param_offset[i];
}
const at::Tensor& Engine::flat_params(size_t g) const { return group(g).flat_params; }
const at::Tensor& Engine::flat_grads(size_t g) const { return group(g).flat_grads; }
at::Tensor Engine::optimizer_slice(const at::Tensor& t, size_t g) const {
  return t.narrow(0, static_cast<int64_t>(group(g).opt_offset), static_cast<int64_t>(group(g).opt_numel));
}
at::Tensor Engine::master(size_t g) const { return optimizer_slice(optimizer_->state().master(), g); }
at::Tensor Engine::exp_avg(size_t g) const { return optimizer_slice(optimizer_->state().exp_avg(), g); }
at::Tensor Engine::exp_avg_sq(size_t g) const { return optimizer_slice(optimizer_->state().exp_avg_sq(), g); }
at::Tensor Engine::grad(size_t g) const { return optimizer_slice(optimizer_->state().grad(), g); }

at::Tensor Engine::gather_master(size_t g) const {
  const Group& grp = group(g);
  const int64_t padded =
      grp.buckets.empty()
          ? 0
          : static_cast<int64_t>(grp.buckets.back().flat_offset + grp.buckets.back().layout.padded_numel());
  at::Tensor out = at::empty({padded}, at::TensorOptions().dtype(at::kFloat).device(device_));
  const at::Tensor& all = optimizer_->state().master();
  const float* master = all.data_ptr<float>();
  for (const Bucket& b : grp.buckets) {
    if (policy_.replicated) {  // every rank holds it all
      out.narrow(0, static_cast<int64_t>(b.flat_offset), static_cast<int64_t>(b.opt_numel))
          .copy_(all.narrow(0, static_cast<int64_t>(b.opt_offset), static_cast<int64_t>(b.opt_numel)));
    } else {
      comm_
          .all_gather(master + b.opt_offset, out.data_ptr<float>() + b.flat_offset, b.opt_numel, DType::kFloat32,
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
  optimizer_->load_state(c.scaler, c.adam_steps);
  global_step_ = c.global_step;
  skipped_steps_ = c.skipped_steps;
  micro_steps_ = c.micro_steps;
}

void Engine::refresh_params() {
  const float* master = optimizer_->state().master().data_ptr<float>();
  for (Bucket* b : whole_buckets()) {  // released units are cast from the master when gathered
    const DType dtype = groups_[b->group]->dtype;
    cast_from_f32_on(device_, master + b->opt_offset, own_chunk(*b), dtype, b->opt_numel);
    if (!policy_.replicated) {
      comm_
          .all_gather(own_chunk(*b), units_.full(b->index).data_ptr(), b->layout.shard_numel(), dtype,
                      static_cast<int64_t>(b->index))
          ->wait();
    }
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
