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
#include "optim/grad_stats.h"

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

LossScalerOptions scaler_options(const EngineOptions& o) {
  if (o.precision == DType::kFloat16) return o.loss_scale;
  LossScalerOptions s;  // bf16: static scale 1, still skips non-finite steps
  s.dynamic = false;
  s.initial_scale = 1.0;
  return s;
}

const EngineOptions& validated(const EngineOptions& o) {
  ZRT_CHECK(o.stage == 1 || o.stage == 2, "stage must be 1 or 2 in this engine, got ", o.stage,
            " (stage 0 and 3 are not built yet)");
  ZRT_CHECK(o.precision == DType::kBFloat16 || o.precision == DType::kFloat16,
            "precision must be bf16 or f16, got ", dtype_name(o.precision));
  ZRT_CHECK(o.gradient_accumulation_steps >= 1, "gradient_accumulation_steps must be >= 1, got ",
            o.gradient_accumulation_steps);
  ZRT_CHECK(o.gradient_clipping >= 0 && std::isfinite(o.gradient_clipping),
            "gradient_clipping must be >= 0 (0 disables), got ", o.gradient_clipping);
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
      scaler_(scaler_options(options)),
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
  master_ = flat32.narrow(0, comm_.rank() * shard, shard).clone();
  exp_avg_ = at::zeros({shard}, f32);
  exp_avg_sq_ = at::zeros({shard}, f32);
  grad_shard_ = at::zeros({shard}, f32);

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
  float* out = grad_shard_.data_ptr<float>();
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
    grad_shard_.zero_();
    throw;
  }
  flat_grads_.zero_();
}

StepStats Engine::step() {
  StepStats stats;
  stats.loss_scale = scaler_.scale();
  ++micro_steps_;
  stats.boundary = micro_steps_ % options_.gradient_accumulation_steps == 0;
  auto t0 = std::chrono::steady_clock::now();
  if (options_.stage == 2 || stats.boundary) reduce_gradients();
  stats.reduce_ms = ms_since(t0);
  if (stats.boundary) update(stats);
  return stats;
}

void Engine::update(StepStats& stats) {
  auto t0 = std::chrono::steady_clock::now();
  const size_t shard = layout_.shard_numel();
  const double denominator = scaler_.scale() * comm_.size() * options_.gradient_accumulation_steps;
  GradStats local = unscale_and_check(grad_shard_.data_ptr<float>(), shard,
                                      static_cast<float>(1.0 / denominator));
  double global[2] = {static_cast<double>(local.nonfinite), local.sum_squares};
  comm_.all_reduce(global, 2, DType::kFloat64)->wait();  // the one decision, same on every rank
  stats.nonfinite = static_cast<int64_t>(global[0]);
  stats.grad_norm = std::sqrt(global[1]);
  const bool overflow = stats.nonfinite > 0 || !std::isfinite(global[1]);
  ++global_step_;
  if (overflow) {
    stats.skipped = true;
    ++skipped_steps_;
    grad_shard_.zero_();
    stats.optimizer_ms = ms_since(t0);
    scaler_.update(true);  // may throw at the minimum scale, on every rank alike
    return;
  }
  if (options_.gradient_clipping > 0) {
    stats.clip_coef = std::min(1.0, options_.gradient_clipping / (stats.grad_norm + 1e-6));
  }
  ++adam_steps_;
  AdamWStep s;
  s.hyper = options_.adamw;
  if (options_.lr_schedule) s.hyper.lr = options_.lr_schedule(adam_steps_);
  s.step = adam_steps_;
  s.grad_multiplier = static_cast<float>(stats.clip_coef);
  const size_t esize = dtype_size(options_.precision);
  char* my_params = static_cast<char*>(flat_params_.data_ptr()) + comm_.rank() * shard * esize;
  adamw_step({grad_shard_.data_ptr<float>(), DType::kFloat32, master_.data_ptr<float>(),
              exp_avg_.data_ptr<float>(), exp_avg_sq_.data_ptr<float>(), my_params,
              options_.precision, shard},
             s);
  scaler_.update(false);
  grad_shard_.zero_();
  stats.optimizer_ms = ms_since(t0);

  auto t1 = std::chrono::steady_clock::now();
  comm_.all_gather(my_params, flat_params_.data_ptr(), shard, options_.precision)->wait();
  stats.gather_ms = ms_since(t1);
}

}  // namespace zerort
