#include "runtime/engine.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>

#include "comm/error.h"
#include "optim/cast.h"

namespace zerort {

struct Engine::Group {
  DType dtype;
  std::vector<at::Tensor> params;
  ShardLayout layout;
  at::Tensor flat_params, flat_grads, staging[2];
  size_t opt_offset = 0;  // where this group starts in the optimizer's master
  size_t opt_numel = 0;   // shard_numel (stages 1, 2) or padded_numel (stage 0)
};

namespace {

at::ScalarType scalar_type(DType d) {
  return d == DType::kBFloat16 ? at::kBFloat16 : d == DType::kFloat16 ? at::kHalf : at::kFloat;
}

std::vector<size_t> checked_numels(const std::vector<at::Tensor>& params, const char* what) {
  std::vector<size_t> numels;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    ZRT_CHECK(p.defined(), "Engine: ", what, " ", i, " is undefined");
    ZRT_CHECK(p.device().is_cpu(), "Engine: ", what, " ", i, " is on ", p.device().str(),
              "; this engine runs on CPU tensors");
    ZRT_CHECK(p.scalar_type() == at::kFloat, "Engine: ", what, " ", i, " has dtype ",
              c10::toString(p.scalar_type()), "; build the model in float32 (the engine keeps the FP32 "
              "master and casts the working copy itself)");
    ZRT_CHECK(p.requires_grad() && p.is_leaf(), "Engine: ", what, " ", i,
              " must be a leaf tensor that requires grad");
    numels.push_back(static_cast<size_t>(p.numel()));
  }
  return numels;
}

const EngineOptions& validated(const EngineOptions& o) {
  ZRT_CHECK(o.stage >= 0 && o.stage <= 2, "stage must be 0, 1 or 2 in this engine, got ", o.stage,
            " (stage 3 lives in the Python package: zerort.initialize)");
  ZRT_CHECK(o.reduce_bucket_numel >= 1, "reduce_bucket_numel must be >= 1, got ", o.reduce_bucket_numel);
  return o;
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

Engine::Engine(std::vector<at::Tensor> params, Communicator& comm, EngineOptions options,
               std::vector<at::Tensor> fp32_params)
    : comm_(comm), options_(validated(options)) {
  const bool replicated = options_.stage == 0;
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  const int64_t rank = comm_.rank();
  std::vector<at::Tensor> master_parts;
  size_t opt_total = 0;
  auto add_group = [&](std::vector<at::Tensor> ps, DType dtype, const char* what) {
    ShardLayout layout(checked_numels(ps, what), comm_.size(), options_.alignment);
    auto g = std::make_unique<Group>(Group{dtype, std::move(ps), std::move(layout)});
    const int64_t padded = static_cast<int64_t>(g->layout.padded_numel());
    const int64_t shard = static_cast<int64_t>(g->layout.shard_numel());
    // Every rank starts from rank 0's FP32 values.
    at::Tensor flat32 = at::zeros({padded}, f32);
    for (size_t i = 0; i < g->params.size(); ++i) {
      flat32.narrow(0, static_cast<int64_t>(g->layout.param_offset(i)), g->params[i].numel())
          .copy_(g->params[i].detach().reshape({-1}));
    }
    constexpr int64_t kPiece = int64_t{1} << 30;  // MPI counts are int: broadcast in pieces
    for (int64_t off = 0; off < padded; off += kPiece) {
      comm_.broadcast(flat32.data_ptr<float>() + off, static_cast<size_t>(std::min(kPiece, padded - off)),
                      DType::kFloat32, 0)->wait();
    }
    const auto opts = at::TensorOptions().dtype(scalar_type(dtype));
    g->flat_params = at::empty({padded}, opts);
    cast_from_f32(flat32.data_ptr<float>(), g->flat_params.data_ptr(), dtype, static_cast<size_t>(padded));
    g->flat_grads = at::zeros({padded}, opts);
    g->opt_offset = opt_total;
    g->opt_numel = static_cast<size_t>(replicated ? padded : shard);
    opt_total += g->opt_numel;
    master_parts.push_back(replicated ? flat32 : flat32.narrow(0, rank * shard, shard));
    const size_t world = static_cast<size_t>(comm_.size());
    const size_t slice = std::min(g->layout.shard_numel(),
                                  std::max<size_t>(1, (options_.reduce_bucket_numel + world - 1) / world));
    for (auto& s : g->staging) s = at::empty({static_cast<int64_t>(slice * world)}, opts);
    // Parameters and their grads become views of the flat buffers. Autograd then
    // accumulates each micro-step's gradient in place into flat_grads.
    c10::AutoGradMode no_grad(false);
    for (size_t i = 0; i < g->params.size(); ++i) {
      at::Tensor& p = g->params[i];
      const int64_t off = static_cast<int64_t>(g->layout.param_offset(i));
      p.set_data(g->flat_params.narrow(0, off, p.numel()).view(p.sizes()));
      p.mutable_grad() = g->flat_grads.narrow(0, off, p.numel()).view(p.sizes());
    }
    groups_.push_back(std::move(g));
  };
  add_group(std::move(params), options_.precision, "parameter");
  if (!fp32_params.empty()) add_group(std::move(fp32_params), DType::kFloat32, "fp32 parameter");

  at::Tensor master = at::empty({static_cast<int64_t>(opt_total)}, f32);
  for (size_t i = 0; i < groups_.size(); ++i) {
    master.narrow(0, static_cast<int64_t>(groups_[i]->opt_offset), static_cast<int64_t>(groups_[i]->opt_numel))
        .copy_(master_parts[i]);
  }
  OptimizerOptions oo;
  oo.precision = options_.precision;
  oo.adamw = options_.adamw;
  oo.lr_schedule = options_.lr_schedule;
  oo.loss_scale = options_.loss_scale;
  oo.gradient_clipping = options_.gradient_clipping;
  oo.gradient_accumulation_steps = options_.gradient_accumulation_steps;
  oo.replicated = replicated;
  optimizer_ = std::make_unique<ShardOptimizer>(master, comm_, oo);
}

Engine::~Engine() = default;

const ShardLayout& Engine::layout(size_t group) const {
  ZRT_CHECK(group < groups_.size(), "Engine: group ", group, " does not exist (", groups_.size(), " groups)");
  return groups_[group]->layout;
}
const at::Tensor& Engine::flat_params(size_t group) const {
  layout(group);
  return groups_[group]->flat_params;
}
const at::Tensor& Engine::flat_grads(size_t group) const {
  layout(group);
  return groups_[group]->flat_grads;
}
at::Tensor Engine::optimizer_slice(const at::Tensor& t, size_t group) const {
  layout(group);
  return t.narrow(0, static_cast<int64_t>(groups_[group]->opt_offset), static_cast<int64_t>(groups_[group]->opt_numel));
}
at::Tensor Engine::master(size_t group) const { return optimizer_slice(optimizer_->master(), group); }
at::Tensor Engine::exp_avg(size_t group) const { return optimizer_slice(optimizer_->exp_avg(), group); }
at::Tensor Engine::exp_avg_sq(size_t group) const { return optimizer_slice(optimizer_->exp_avg_sq(), group); }

void Engine::reduce_gradients(Group& g) {
  const size_t shard = g.layout.shard_numel(), world = static_cast<size_t>(comm_.size());
  const size_t slice = static_cast<size_t>(g.staging[0].numel()) / world;
  const size_t esize = dtype_size(g.dtype);
  const char* grads = static_cast<const char*>(g.flat_grads.data_ptr());
  at::Tensor& grad = optimizer_->grad_shard();
  const bool replicated = options_.stage == 0;
  // Stage 1/2: straight into this rank's FP32 gradient shard. Stage 0: into a scratch
  // shard, then all-gathered so every rank holds the whole summed gradient.
  if (replicated && stage0_scratch_.numel() < static_cast<int64_t>(shard)) {
    stage0_scratch_ = at::empty({static_cast<int64_t>(shard)}, at::TensorOptions().dtype(at::kFloat));
  }
  float* out = replicated ? stage0_scratch_.data_ptr<float>() : grad.data_ptr<float>() + g.opt_offset;
  // Bucket k covers shard offsets [k*slice, ...) on every rank: pack those W pieces into
  // one buffer and reduce-scatter it; two staging buffers let packing overlap the reduce.
  WorkPtr pending[2];
  try {
    size_t k = 0;
    for (size_t off = 0; off < shard; off += slice, ++k) {
      const size_t len = std::min(slice, shard - off);
      WorkPtr& slot = pending[k % 2];
      if (slot) slot->wait();
      char* stage = static_cast<char*>(g.staging[k % 2].data_ptr());
      for (size_t r = 0; r < world; ++r) {
        std::memcpy(stage + r * len * esize, grads + (r * shard + off) * esize, len * esize);
      }
      slot = comm_.reduce_scatter_accumulate(stage, g.dtype, out + off, len, !replicated);
    }
    for (auto& w : pending) {
      if (w) w->wait();
    }
    if (replicated) {
      comm_.all_gather(out, grad.data_ptr<float>() + g.opt_offset, shard, DType::kFloat32)->wait();
    }
  } catch (...) {
    // A failed reduce leaves a half-accumulated gradient: drop this window's gradients so a
    // caller that catches and continues does not train on them. The staging buffers stay
    // owned by the engine, so a transfer still in flight writes into live memory.
    g.flat_grads.zero_();
    grad.zero_();
    throw;
  }
  g.flat_grads.zero_();
}

StepStats Engine::step() {
  StepStats stats;
  stats.loss_scale = optimizer_->loss_scale();
  ++micro_steps_;
  stats.boundary = micro_steps_ % options_.gradient_accumulation_steps == 0;
  auto t0 = std::chrono::steady_clock::now();
  if (options_.stage == 2 || stats.boundary) {
    for (auto& g : groups_) reduce_gradients(*g);
  }
  stats.reduce_ms = ms_since(t0);
  if (stats.boundary) update(stats);
  return stats;
}

void Engine::update(StepStats& stats) {
  ++global_step_;
  const bool replicated = options_.stage == 0;
  std::vector<OutputSegment> outputs;
  for (auto& g : groups_) {
    const size_t shard = g->layout.shard_numel();
    char* base = static_cast<char*>(g->flat_params.data_ptr());
    char* out = replicated ? base : base + static_cast<size_t>(comm_.rank()) * shard * dtype_size(g->dtype);
    outputs.push_back({g->opt_offset, g->opt_numel, out, g->dtype});
  }
  if (!optimizer_->step(outputs, stats)) {
    ++skipped_steps_;
    return;
  }
  if (replicated) return;  // every rank updated all of its weights itself
  auto t1 = std::chrono::steady_clock::now();
  for (size_t i = 0; i < groups_.size(); ++i) {
    Group& g = *groups_[i];
    comm_.all_gather(outputs[i].out, g.flat_params.data_ptr(), g.layout.shard_numel(), g.dtype)->wait();
  }
  stats.gather_ms = ms_since(t1);
}

}  // namespace zerort
