#include "runtime/shard_optimizer.h"

#include <ATen/ops/cumsum.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/logical_not.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <string>
#include <vector>

#include "core/error.h"
#include "runtime/bf16_state_store.h"
#include "runtime/kernel_dispatch.h"
#include "runtime/step_decision.h"

namespace zerort {

namespace {

LossScalerOptions scaler_options(const OptimizerOptions& o) {
  if (o.precision == DType::kFloat16) return o.loss_scale;
  LossScalerOptions s;  // bf16 and f32: static scale 1, still skip non-finite steps
  s.dynamic = false;
  s.initial_scale = 1.0;
  return s;
}

const OptimizerOptions& validated(const OptimizerOptions& o) {
  ZRT_CHECK_AS(ConfigError,
               o.precision == DType::kBFloat16 || o.precision == DType::kFloat16 || o.precision == DType::kFloat32,
               "precision must be bf16, f16 or f32, got ", dtype_name(o.precision));
  ZRT_CHECK_AS(ConfigError, o.gradient_accumulation_steps >= 1, "gradient_accumulation_steps must be >= 1, got ",
               o.gradient_accumulation_steps);
  ZRT_CHECK_AS(ConfigError, o.gradient_clipping >= 0 && std::isfinite(o.gradient_clipping),
               "gradient_clipping must be >= 0 (0 disables), got ", o.gradient_clipping);
  ZRT_CHECK_AS(ConfigError, o.state_dtype == DType::kFloat32 || o.state_dtype == DType::kBFloat16,
               "optimizer state dtype must be fp32 or bf16, got ", dtype_name(o.state_dtype));
  ZRT_CHECK_AS(
      ConfigError,
      o.master_dtype == DType::kFloat32 || (o.master_dtype == DType::kBFloat16 && o.precision == DType::kBFloat16),
      "optimizer master dtype must be fp32, or bf16 with bf16 precision (bf16.bf16_master_weights_and_grads "
      "needs bf16.enabled); got ",
      dtype_name(o.master_dtype), " with ", dtype_name(o.precision), " precision");
  check_adamw_hyper(o.adamw, "optimizer options (AdamWHyper)");  // at construction, not at the first step
  return o;
}

}  // namespace

ShardOptimizer::ShardOptimizer(at::Tensor master, Communicator& comm, OptimizerOptions options)
    : comm_(comm), options_(validated(options)), scaler_(scaler_options(options)), hypers_{options_.adamw} {
  ZRT_CHECK(master.defined() && master.scalar_type() == at::kFloat && master.dim() == 1 && master.is_contiguous(),
            "ShardOptimizer: master must be a contiguous 1-D float32 tensor");
  check_device_supported(master.device(), "ShardOptimizer's master");
  if (options_.master_dtype == DType::kBFloat16) {  // rounded to nearest even once
    state_ = std::make_unique<Bf16MasterStateStore>(master.to(at::kBFloat16), options_.state_dtype);
  } else {
    state_ = std::make_unique<InMemoryStateStore>(std::move(master), options_.state_dtype);
  }
}

ShardOptimizer::ShardOptimizer(std::unique_ptr<OptimizerStateStore> state, Communicator& comm, OptimizerOptions options)
    : comm_(comm), options_(validated(options)), scaler_(scaler_options(options)),
      state_(std::move(state)), hypers_{options_.adamw} {
  ZRT_CHECK(state_ != nullptr, "ShardOptimizer: no state store");
  ZRT_CHECK(state_->master_dtype() == options_.master_dtype, "ShardOptimizer: the store's master dtype ",
            dtype_name(state_->master_dtype()), " is not the options' ", dtype_name(options_.master_dtype));
  ZRT_CHECK(state_->state_dtype() == options_.state_dtype, "ShardOptimizer: the store's state dtype ",
            dtype_name(state_->state_dtype()), " is not the options' ", dtype_name(options_.state_dtype));
  check_device_supported(state_->device(), "ShardOptimizer's gradient");
}

double ShardOptimizer::grad_denominator() const {
  return scaler_.scale() * comm_.size() * options_.gradient_accumulation_steps;
}

bool ShardOptimizer::step(const std::vector<OutputSegment>& outputs, StepStats& stats, int64_t missed_backward) {
  if (!decide(outputs, stats, missed_backward)) return false;
  auto t0 = std::chrono::steady_clock::now();
  apply(outputs, {});
  stats.optimizer_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return true;
}

bool ShardOptimizer::decide(const std::vector<OutputSegment>& outputs, StepStats& stats, int64_t missed_backward) {
  for (const auto& seg : outputs) {
    ZRT_CHECK(seg.offset + seg.numel <= static_cast<size_t>(state_->numel()) && (seg.out || seg.open || seg.numel == 0),
              "ShardOptimizer.step: output segment [", seg.offset, ", ", seg.offset + seg.numel,
              ") lies outside the master of ", state_->numel(), " elements, or has no buffer");
  }
  auto t0 = std::chrono::steady_clock::now();
  auto elapsed_ms = [&] {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  };
  stats.loss_scale = scaler_.scale();
  const double denominator = grad_denominator();
  GradStats local = state_->unscale_and_check_grad(static_cast<float>(1.0 / denominator));
  Decision global;
  try {  // the one decision, the same on every rank
    global = decide_step(comm_, {static_cast<int64_t>(local.nonfinite), local.sum_squares, missed_backward},
                         options_.owner_ranks, options_.gradient_accumulation_steps);
  } catch (...) {
    state_->zero_grad();  // the window is dropped on every rank alike
    throw;
  }
  stats.nonfinite = global.nonfinite;
  nonfinite_ids_.clear();
  stats.grad_norm = std::sqrt(global.sum_squares);
  if (stats.nonfinite > 0 || !std::isfinite(global.sum_squares)) {
    stats.skipped = true;
    record_nonfinite();
    state_->zero_grad();
    stats.optimizer_ms = elapsed_ms();
    scaler_.update(true);  // may throw at the minimum scale, on every rank alike
    return false;
  }
  if (options_.gradient_clipping > 0) {
    stats.clip_coef = std::min(1.0, options_.gradient_clipping / (stats.grad_norm + 1e-6));
  }
  ++adam_steps_;
  pending_ = AdamWStep{};
  pending_.step = adam_steps_;
  pending_.grad_multiplier = static_cast<float>(stats.clip_coef);
  // The scale's next value: AdamW reads the unscaled gradient and never the scale, so it is
  // updated here, before apply() (Note [overlapped step], runtime/step_overlap.h).
  scaler_.update(false);
  stats.optimizer_ms = elapsed_ms();
  return true;
}

void ShardOptimizer::apply(const std::vector<OutputSegment>& outputs, const std::vector<size_t>& order) {
  const size_t n = static_cast<size_t>(state_->numel());
  const AdamWStep s = pending_;
  // AdamW over every element once, chunk by chunk as the store hands them over: each
  // chunk's part of the output segments, and of the gaps between them (no output).
  std::vector<OutputSegment> segs(outputs);
  std::sort(segs.begin(), segs.end(), [](const auto& a, const auto& b) { return a.offset < b.offset; });
  std::vector<OutputSegment> pieces;             // the gaps and the segments, in order, covering [0, n)
  std::vector<size_t> piece_of(outputs.size());  // outputs[k] is pieces[piece_of[k]]
  std::vector<size_t> sorted_index(outputs.size());
  for (size_t k = 0; k < outputs.size(); ++k) sorted_index[k] = k;
  std::stable_sort(sorted_index.begin(), sorted_index.end(),
                   [&](size_t a, size_t b) { return outputs[a].offset < outputs[b].offset; });
  size_t done = 0;
  for (size_t k = 0; k < segs.size(); ++k) {
    const auto& seg = segs[k];
    ZRT_CHECK(seg.offset >= done, "ShardOptimizer.step: output segments overlap at ", seg.offset);
    pieces.push_back({done, seg.offset - done, nullptr, DType::kFloat32});
    piece_of[sorted_index[k]] = pieces.size();
    pieces.push_back(seg);
    done = seg.offset + seg.numel;
  }
  pieces.push_back({done, n - done, nullptr, DType::kFloat32});
  // The ranges in the order asked: outputs[order[i]] first, then every gap (each store takes
  // them in this order: Note [optimizer state store]).
  std::vector<std::pair<size_t, size_t>> ranges;
  std::vector<bool> taken(pieces.size(), false);
  for (size_t k : order) {
    ZRT_CHECK(k < outputs.size() && !taken[piece_of[k]], "ShardOptimizer.apply: order names output ", k,
              " twice, or one of only ", outputs.size());
    taken[piece_of[k]] = true;
    ranges.emplace_back(pieces[piece_of[k]].offset, pieces[piece_of[k]].numel);
  }
  for (size_t j = 0; j < pieces.size(); ++j) {
    if (!taken[j] && pieces[j].numel > 0) ranges.emplace_back(pieces[j].offset, pieces[j].numel);
  }
  std::vector<void*> lent(pieces.size(), nullptr);  // the buffers open() lent, while open
  std::vector<size_t> left(pieces.size());          // elements still to update: close() at 0
  for (size_t j = 0; j < pieces.size(); ++j) left[j] = pieces[j].numel;
  state_->update_ranges(ranges, [&](size_t offset, const AdamWBuffers& chunk) {
    const size_t end = offset + chunk.n;
    auto first = std::upper_bound(pieces.begin(), pieces.end(), offset,
                                  [](size_t at, const OutputSegment& p) { return at < p.offset + p.numel; });
    for (size_t j = static_cast<size_t>(first - pieces.begin()); j < pieces.size() && pieces[j].offset < end; ++j) {
      const OutputSegment& p = pieces[j];
      const size_t lo = std::max(p.offset, offset), hi = std::min(p.offset + p.numel, end);
      if (lo >= hi) continue;
      if (p.open && left[j] == p.numel) lent[j] = p.open();  // its first part, wherever it lies
      void* base = p.open ? lent[j] : p.out;
      void* out = base ? static_cast<char*>(base) + (lo - p.offset) * dtype_size(p.dtype) : nullptr;
      adamw_range(chunk, offset, lo, hi - lo, out, p.dtype, s);
      left[j] -= hi - lo;
      if (p.close && left[j] == 0) p.close();
    }
  });
  state_->zero_grad();
}

}  // namespace zerort

namespace zerort {

void ShardOptimizer::adamw_range(const AdamWBuffers& chunk, size_t chunk_offset, size_t lo, size_t n, void* out,
                                 DType dtype, const AdamWStep& step) {
  const size_t end = lo + n;
  AdamWStep s = step;
  for (size_t pos = lo; pos < end;) {
    // The region holding pos, or the gap before the next one (group 0).
    auto next = std::upper_bound(hyper_regions_.begin(), hyper_regions_.end(), static_cast<int64_t>(pos),
                                 [](int64_t p, const auto& r) { return p < r[0]; });
    size_t stop = next == hyper_regions_.end() ? end : std::min(end, static_cast<size_t>((*next)[0]));
    size_t group = 0;
    if (next != hyper_regions_.begin()) {
      const auto& r = *std::prev(next);
      if (pos < static_cast<size_t>(r[0] + r[1])) {
        group = static_cast<size_t>(r[2]);
        stop = std::min(stop, static_cast<size_t>(r[0] + r[1]));
      }
    }
    s.hyper = hypers_[group];
    AdamWBuffers b = elements_of(chunk, pos - chunk_offset, stop - pos);
    b.param = out ? static_cast<char*>(out) + (pos - lo) * dtype_size(dtype) : nullptr;
    b.param_dtype = dtype;
    adamw_step_on(state_->device(), b, s);
    pos = stop;
  }
}

void ShardOptimizer::set_hyper_groups(std::vector<AdamWHyper> hypers, std::vector<std::array<int64_t, 3>> regions) {
  ZRT_CHECK(!hypers.empty(), "ShardOptimizer: set_hyper_groups needs at least one param group");
  for (size_t k = 0; k < hypers.size(); ++k) {
    const std::string who = detail::concat("param group ", k);
    check_adamw_hyper(hypers[k], who.c_str());
  }
  std::sort(regions.begin(), regions.end());
  int64_t end = 0;
  for (const auto& r : regions) {
    ZRT_CHECK(r[0] >= end && r[1] >= 0 && r[0] + r[1] <= state_->numel() && r[2] >= 0 &&
                  r[2] < static_cast<int64_t>(hypers.size()),
              "ShardOptimizer: hyper region [", r[0], ", ", r[0] + r[1], ") of group ", r[2],
              " overlaps another, lies outside the shard of ", state_->numel(), " elements, or names no group");
    end = r[0] + r[1];
  }
  hypers_ = std::move(hypers);
  hyper_regions_ = std::move(regions);
}

void ShardOptimizer::set_watch_regions(std::vector<std::array<int64_t, 3>> regions) {
  for (const auto& r : regions) {
    ZRT_CHECK(r[0] >= 0 && r[1] >= 0 && r[0] + r[1] <= state_->numel(), "ShardOptimizer: watch region [", r[0], ", ",
              r[0] + r[1], ") (id ", r[2], ") lies outside the shard of ", state_->numel(), " elements");
  }
  watch_regions_ = std::move(regions);
}

void ShardOptimizer::record_nonfinite() {
  if (watch_regions_.empty()) return;
  // A window at a time where the gradient is not a device tensor (in host memory, or in a file).
  if (!state_->gradient_in_memory() || state_->grad().device().is_cpu()) {
    constexpr int64_t kWindow = int64_t{1} << 20;
    std::vector<float> window;
    for (const auto& r : watch_regions_) {
      bool bad = false;
      for (int64_t at = 0; at < r[1] && !bad; at += kWindow) {
        window.resize(static_cast<size_t>(std::min(kWindow, r[1] - at)));
        state_->read_grad(static_cast<size_t>(r[0] + at), window.size(), window.data());
        bad = std::any_of(window.begin(), window.end(), [](float x) { return !std::isfinite(x); });
      }
      if (bad) nonfinite_ids_.push_back(r[2]);
    }
    return;
  }
  const at::Tensor& grad = state_->grad();
  // On the device: a prefix count of non-finite values, read at each region's two ends, so
  // only 2 numbers per region come to the host, not the shard.
  const at::Tensor prefix = at::cumsum(at::logical_not(at::isfinite(grad)), 0, at::kLong);
  const int64_t k = static_cast<int64_t>(watch_regions_.size());
  at::Tensor ends = at::empty({2 * k}, at::TensorOptions().dtype(at::kLong));
  int64_t* e = ends.data_ptr<int64_t>();
  for (int64_t i = 0; i < k; ++i) {  // inclusive prefix: count in [a, a+n) = P[a+n-1] - P[a-1]
    const auto& r = watch_regions_[static_cast<size_t>(i)];
    e[2 * i] = r[1] > 0 ? r[0] + r[1] - 1 : 0;
    e[2 * i + 1] = r[0] > 0 ? r[0] - 1 : 0;
  }
  const at::Tensor at_ends = at::index_select(prefix, 0, ends.to(prefix.device())).cpu();
  const int64_t* p = at_ends.data_ptr<int64_t>();
  for (int64_t i = 0; i < k; ++i) {
    const auto& r = watch_regions_[static_cast<size_t>(i)];
    const int64_t hi = r[1] > 0 ? p[2 * i] : 0, lo = r[0] > 0 && r[1] > 0 ? p[2 * i + 1] : 0;
    if (hi - lo > 0) nonfinite_ids_.push_back(r[2]);
  }
}

void ShardOptimizer::load_state(const LossScaler::State& scaler, int64_t adam_steps) {
  ZRT_CHECK(adam_steps >= 0, "checkpoint: Adam step count must be >= 0, got ", adam_steps);
  scaler_.load_state(scaler);
  adam_steps_ = adam_steps;
}

}  // namespace zerort
