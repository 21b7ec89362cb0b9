#include "engine_cases.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mse_loss.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/tanh.h>
#include <ATen/ops/zeros.h>
#include <ATen/core/Generator.h>
#include <ATen/CPUGeneratorImpl.h>

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "run_ranks.h"

namespace zerort::testing {

namespace {

// MLP 13 -> 31 -> 7 with an empty parameter in the middle: 658 elements, odd, not
// divisible by 2 or 4, so shards carry padding.
const std::vector<std::vector<int64_t>> kShapes = {{31, 13}, {31}, {0}, {7, 31}, {7}};
constexpr int64_t kBatch = 8;

at::Generator gen(uint64_t seed) { return at::detail::createCPUGenerator(seed); }

// The micro-batch of (step, rank, micro): the same on every process.
std::pair<at::Tensor, at::Tensor> batch(int step, int rank, int64_t micro) {
  auto g =
      gen(static_cast<uint64_t>(step) * 1000003 + static_cast<uint64_t>(rank) * 101 + static_cast<uint64_t>(micro));
  return {at::randn({kBatch, 13}, g), at::randn({kBatch, 7}, g)};
}

// Forward in the parameters' dtype, loss in FP32 (as AMP does).
at::Tensor forward(const std::vector<at::Tensor>& p, const at::Tensor& x, const at::Tensor& y) {
  auto h = at::tanh(at::addmm(p[1], x.to(p[0].scalar_type()), p[0].t()));
  auto out = at::addmm(p[4], h, p[3].t());
  return at::mse_loss(out.to(at::kFloat), y);
}

void forward_backward(const std::vector<at::Tensor>& p, const at::Tensor& x, const at::Tensor& y, double scale) {
  (forward(p, x, y) * scale).backward();
}

at::ScalarType lp_type(DType d) { return d == DType::kBFloat16 ? at::kBFloat16 : at::kHalf; }

// One backward pass (and its forward) as the Python engine runs it. Stage 3, as its module
// hooks do: each unit gathered before its forward (the next one prefetched), every unit
// released after forward (the views autograd saved hold no bytes then), then
// begin_backward() and each unit gathered again, in reverse, before backward. Stages 1-2: each
// bucket's gather waited for in forward order (reversed buckets), as the module hooks of
// overlap_param_gather do (no-ops when step() waited).
void pass(Engine& engine, const std::vector<at::Tensor>& p, const at::Tensor& x, const at::Tensor& y) {
  if (engine.options().stage != 3) {
    for (size_t b = engine.num_buckets(); b-- > 0;) engine.wait_param_gather(b);
    engine.begin_backward();
    forward_backward(p, x, y, engine.loss_scale());
    return;
  }
  const size_t units = engine.num_buckets();
  for (size_t u = 0; u < units; ++u) {
    if (u + 1 < units) engine.prefetch(u + 1);
    engine.gather(u);
  }
  at::Tensor loss = forward(p, x, y);
  for (size_t u = 0; u < units; ++u) engine.release(u);
  engine.begin_backward();
  for (size_t u = units; u-- > 0;) engine.gather(u);
  (loss * engine.loss_scale()).backward();
}

}  // namespace

std::vector<at::Tensor> init_params() {
  auto g = gen(1234);
  std::vector<at::Tensor> ps;
  for (const auto& s : kShapes) ps.push_back((at::randn(s, g) * 0.3).requires_grad_(true));
  return ps;
}

std::vector<UnitSpec> default_units() { return {{{0, 1}, false}, {{2}, false}, {{3}, false}, {{4}, true}}; }

RunConfig grid_config(const std::tuple<int, int, DType, int64_t>& grid_case, int steps) {
  auto [world, stage, precision, gas] = grid_case;
  RunConfig config;
  config.options = default_options(stage, precision);
  config.options.optimizer.gradient_accumulation_steps = gas;
  config.steps = steps;
  return config;
}

RunConfig two_pass_config(int stage, int64_t gas) {
  RunConfig config;
  config.options = default_options(stage, DType::kBFloat16);
  config.options.optimizer.gradient_accumulation_steps = gas;
  config.steps = 5;
  config.passes = 2;
  config.report_grads = true;  // the hooks' path: each pass is reduced on its own
  return config;
}

std::string grid_case_name(const std::tuple<int, int, DType, int64_t>& grid_case) {
  auto [world, stage, precision, gas] = grid_case;
  return "W" + std::to_string(world) + "_stage" + std::to_string(stage) + "_" + dtype_name(precision) + "_gas" +
         std::to_string(gas);
}

EngineOptions default_options(int stage, DType precision) {
  EngineOptions o;
  o.stage = stage;
  o.optimizer.precision = precision;
  o.optimizer.adamw = AdamWHyper{3e-3, 0.9, 0.999, 1e-8, 0.01};
  o.optimizer.loss_scale.initial_scale = 1024;  // f16: dynamic, from 2^10
  o.optimizer.loss_scale.window = 5;
  o.reduce_bucket_numel = 200;  // several buckets over 658 elements
  o.alignment = 4;
  return o;
}

EngineRun run_engine(Communicator& comm, const RunConfig& config) {
  auto params = init_params();
  const bool stage3 = config.options.stage == 3;
  // As the Python engine does at stage 3: See Note [checked calls] (comm/communicator.h).
  if (stage3) comm.check_each_call();
  Engine engine(params, comm, config.options, {},
                stage3 ? (config.units.empty() ? default_units() : config.units) : std::vector<UnitSpec>{},
                config.groups ? config.groups(comm.rank()) : ShardGroups{});
  EngineRun run;
  const int64_t gas = config.options.optimizer.gradient_accumulation_steps;
  for (int step = 0; step < config.steps; ++step) {
    for (int64_t micro = 0; micro < gas; ++micro) {
      const bool skip = config.skip_backward && config.skip_backward(step, comm.rank(), micro);
      for (int k = 0; k < config.passes && !skip; ++k) {
        auto [x, y] = batch(step, comm.rank(), micro * config.passes + k);
        pass(engine, params, x, y);
        for (size_t i = params.size(); config.report_grads && i-- > 0;) engine.grad_ready(0, i);
      }
      if (config.after_backward) config.after_backward(params, step, comm.rank());
      run.stats.push_back(engine.step());
    }
    run.scales.push_back(engine.loss_scale());
  }
  // Back to parameter order (the engine lays parameters out in reversed buckets). The
  // parameters view the working copy: the flat buffer, or (stage 3) every unit, held whole.
  at::Tensor full = engine.gather_master();
  engine.wait_param_gathers();
  if (stage3) engine.hold_gathered(true);
  for (size_t i = 0; i < params.size(); ++i) {
    const size_t off = engine.param_offset(0, i), n = static_cast<size_t>(params[i].numel());
    run.master.insert(run.master.end(), full.data_ptr<float>() + off, full.data_ptr<float>() + off + n);
    const at::Tensor p = params[i].detach().contiguous();
    const auto* bits = static_cast<const uint16_t*>(p.data_ptr());
    run.params.insert(run.params.end(), bits, bits + n);
  }
  if (stage3) engine.hold_gathered(false);
  run.adam_steps = engine.adam_steps();
  return run;
}

std::vector<EngineRun> run_all(int world, const RunConfig& config, const std::function<void(Communicator&)>& setup) {
  std::vector<EngineRun> runs(static_cast<size_t>(world));
  auto errors = run_ranks(world, [&](Communicator& comm) {
    if (setup) setup(comm);
    runs[static_cast<size_t>(comm.rank())] = run_engine(comm, config);
  });
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  return runs;
}

double max_rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff = std::max(diff, std::fabs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(b[i])));
  }
  return diff / scale;
}

Reference run_reference(int world, const RunConfig& config, const std::vector<double>& scales) {
  const int stage = config.options.stage;
  const OptimizerOptions& o = config.options.optimizer;
  auto init = init_params();
  std::vector<float> master;
  for (auto& p : init) {
    auto c = p.detach().contiguous();
    master.insert(master.end(), c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
  }
  const size_t n = master.size();
  std::vector<double> m(n, 0.0), v(n, 0.0);
  Reference ref;
  int64_t adam_step = 0;
  const int64_t gas = o.gradient_accumulation_steps;
  for (int step = 0; step < config.steps; ++step) {
    const double scale = step == 0 ? (o.precision == DType::kFloat16 ? o.loss_scale.initial_scale : 1.0)
                                   : scales[static_cast<size_t>(step - 1)];
    // Low-precision working copy of the FP32 master, rounded as the engine rounds it.
    auto flat = at::from_blob(master.data(), {static_cast<int64_t>(n)}, at::kFloat).to(lp_type(o.precision));
    std::vector<double> grad(n, 0.0);
    for (int r = 0; r < world; ++r) {
      std::vector<at::Tensor> p;
      int64_t off = 0;
      for (const auto& s : kShapes) {
        int64_t numel = 1;
        for (auto d : s) numel *= d;
        p.push_back(flat.narrow(0, off, numel).view(s).detach().clone().requires_grad_(true));
        off += numel;
      }
      // Autograd sums micro-steps in low precision until the reducing one (stages 0, 1);
      // stages 2 and 3 reduce every micro-step. Each pass of a reducing micro-step is reduced
      // on its own (the engine's begin_backward()), so it is summed here in FP64.
      for (int64_t micro = 0; micro < gas; ++micro) {
        for (int pass = 0; pass < config.passes; ++pass) {
          auto [x, y] = batch(step, r, micro * config.passes + pass);
          forward_backward(p, x, y, scale);
          if (stage < 2 && micro != gas - 1) continue;
          size_t k = 0;
          for (auto& t : p) {
            if (!t.grad().defined()) {
              k += static_cast<size_t>(t.numel());
              continue;
            }
            auto g = t.grad().to(at::kDouble).contiguous();
            for (int64_t i = 0; i < g.numel(); ++i) grad[k++] += g.data_ptr<double>()[i];
            t.mutable_grad() = at::Tensor();
          }
        }
      }
    }
    double sumsq = 0;
    for (auto& g : grad) {
      g /= scale * world * static_cast<double>(gas);
      sumsq += g * g;
    }
    const double norm = std::sqrt(sumsq);
    ref.grad_norms.push_back(norm);
    if (!std::isfinite(norm)) continue;  // skipped step
    double coef = o.gradient_clipping > 0 ? std::min(1.0, o.gradient_clipping / (norm + 1e-6)) : 1.0;
    ++adam_step;
    const double lr = o.adamw.lr, b1 = o.adamw.beta1, b2 = o.adamw.beta2;
    const double bc1 = 1 - std::pow(b1, adam_step), bc2 = 1 - std::pow(b2, adam_step);
    for (size_t i = 0; i < n; ++i) {  // torch.optim.AdamW's update, in FP64, on the FP32 master
      double g = grad[i] * coef, p = master[i];
      p *= 1 - lr * o.adamw.weight_decay;
      m[i] = b1 * m[i] + (1 - b1) * g;
      v[i] = b2 * v[i] + (1 - b2) * g * g;
      p -= lr / bc1 * m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + o.adamw.eps);
      master[i] = static_cast<float>(p);
    }
  }
  ref.master = master;
  return ref;
}

}  // namespace zerort::testing
