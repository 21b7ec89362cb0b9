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

namespace {

at::ScalarType scalar_type(DType d) { return d == DType::kBFloat16 ? at::kBFloat16 : at::kHalf; }

std::vector<size_t> checked_numels(const std::vector<at::Tensor>& params) {
  std::vector<size_t> numels;
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    ZRT_CHECK(p.defined(), "Engine: parameter ", i, " is undefined");
    ZRT_CHECK(p.device().is_cpu(), "Engine: parameter ", i, " is on ", p.device().str(),
              "; this engine runs on CPU tensors");
    ZRT_CHECK(p.scalar_type() == at::kFloat, "Engine: parameter ", i, " has dtype ",
              c10::toString(p.scalar_type()), "; build the model in float32 (the engine keeps the FP32 "
              "master and casts the working copy itself)");
    ZRT_CHECK(p.requires_grad() && p.is_leaf(), "Engine: parameter ", i,
              " must be a leaf tensor that requires grad");
    numels.push_back(static_cast<size_t>(p.numel()));
  }
  return numels;
}

const EngineOptions& validated(const EngineOptions& o) {
  ZRT_CHECK(o.stage == 1 || o.stage == 2, "stage must be 1 or 2 in this engine, got ", o.stage,
            " (stage 0 and 3 are not built yet)");
  ZRT_CHECK(o.reduce_bucket_numel >= 1, "reduce_bucket_numel must be >= 1, got ", o.reduce_bucket_numel);
  return o;
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

Engine::Engine(std::vector<at::Tensor> params, Communicator& comm, EngineOptions options)
    : comm_(comm),
      options_(validated(options)),
      layout_(checked_numels(params), comm.size(), options.alignment),
      params_(std::move(params)) {
  const int64_t padded = static_cast<int64_t>(layout_.padded_numel());
  const int64_t shard = static_cast<int64_t>(layout_.shard_numel());
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  const auto lp = at::TensorOptions().dtype(scalar_type(options_.precision));

  // Every rank starts from rank 0's FP32 values.
  at::Tensor flat32 = at::zeros({padded}, f32);
  for (size_t i = 0; i < params_.size(); ++i) {
    flat32.narrow(0, static_cast<int64_t>(layout_.param_offset(i)), params_[i].numel())
        .copy_(params_[i].detach().reshape({-1}));
  }
  constexpr int64_t kPiece = int64_t{1} << 30;  // MPI counts are int: broadcast in pieces
  for (int64_t off = 0; off < padded; off += kPiece) {
    comm_.broadcast(flat32.data_ptr<float>() + off, static_cast<size_t>(std::min(kPiece, padded - off)),
                    DType::kFloat32, 0)->wait();
  }

  flat_params_ = at::empty({padded}, lp);
  cast_from_f32(flat32.data_ptr<float>(), flat_params_.data_ptr(), options_.precision,
                static_cast<size_t>(padded));
  flat_grads_ = at::zeros({padded}, lp);
  OptimizerOptions oo;
  oo.precision = options_.precision;
  oo.adamw = options_.adamw;
  oo.lr_schedule = options_.lr_schedule;
  oo.loss_scale = options_.loss_scale;
  oo.gradient_clipping = options_.gradient_clipping;
  oo.gradient_accumulation_steps = options_.gradient_accumulation_steps;
  optimizer_ = std::make_unique<ShardOptimizer>(flat32.narrow(0, comm_.rank() * shard, shard).clone(),
                                                comm_, oo);

  // Parameters and their grads become views of the flat buffers. Autograd then
  // accumulates each micro-step's gradient in place into flat_grads_.
  c10::AutoGradMode no_grad(false);
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor& p = params_[i];
    const int64_t off = static_cast<int64_t>(layout_.param_offset(i));
    p.set_data(flat_params_.narrow(0, off, p.numel()).view(p.sizes()));
    p.mutable_grad() = flat_grads_.narrow(0, off, p.numel()).view(p.sizes());
  }
  const size_t world = static_cast<size_t>(comm_.size());
  const size_t slice = std::min(layout_.shard_numel(),
                                std::max<size_t>(1, (options_.reduce_bucket_numel + world - 1) / world));
  for (auto& s : staging_) s = at::empty({static_cast<int64_t>(slice * world)}, lp);
}

void Engine::reduce_gradients() {
  const size_t shard = layout_.shard_numel(), world = static_cast<size_t>(comm_.size());
  const size_t slice = static_cast<size_t>(staging_[0].numel()) / world;
  const size_t esize = dtype_size(options_.precision);
  const char* grads = static_cast<const char*>(flat_grads_.data_ptr());
  at::Tensor& grad_shard = optimizer_->grad_shard();
  float* out = grad_shard.data_ptr<float>();
  // Bucket k covers shard offsets [k*slice, ...) on every rank: pack those W pieces into
  // one buffer and reduce-scatter it; two staging buffers let packing overlap the reduce.
  WorkPtr pending[2];
  try {
    size_t k = 0;
    for (size_t off = 0; off < shard; off += slice, ++k) {
      const size_t len = std::min(slice, shard - off);
      WorkPtr& slot = pending[k % 2];
      if (slot) slot->wait();
      char* stage = static_cast<char*>(staging_[k % 2].data_ptr());
      for (size_t r = 0; r < world; ++r) {
        std::memcpy(stage + r * len * esize, grads + (r * shard + off) * esize, len * esize);
      }
      slot = comm_.reduce_scatter_accumulate(stage, options_.precision, out + off, len, true);
    }
    for (auto& w : pending) {
      if (w) w->wait();
    }
  } catch (...) {
    // A failed reduce leaves a half-accumulated shard: drop this window's gradients so a
    // caller that catches and continues does not train on them. The staging buffers stay
    // owned by the engine, so a transfer still in flight writes into live memory.
    flat_grads_.zero_();
    grad_shard.zero_();
    throw;
  }
  flat_grads_.zero_();
}

StepStats Engine::step() {
  StepStats stats;
  stats.loss_scale = optimizer_->loss_scale();
  ++micro_steps_;
  stats.boundary = micro_steps_ % options_.gradient_accumulation_steps == 0;
  auto t0 = std::chrono::steady_clock::now();
  if (options_.stage == 2 || stats.boundary) reduce_gradients();
  stats.reduce_ms = ms_since(t0);
  if (stats.boundary) update(stats);
  return stats;
}

void Engine::update(StepStats& stats) {
  ++global_step_;
  const size_t shard = layout_.shard_numel();
  char* my_params = static_cast<char*>(flat_params_.data_ptr()) +
                    static_cast<size_t>(comm_.rank()) * shard * dtype_size(options_.precision);
  if (!optimizer_->step(my_params, stats)) {
    ++skipped_steps_;
    return;
  }
  auto t1 = std::chrono::steady_clock::now();
  comm_.all_gather(my_params, flat_params_.data_ptr(), shard, options_.precision)->wait();
  stats.gather_ms = ms_since(t1);
}

}  // namespace zerort
