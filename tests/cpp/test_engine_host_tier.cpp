// The Engine's kHost state tier (offload_optimizer.device "cpu" for a model on a device; See
// Note [state tiers]) on a CPU model: the master, Adam's moments and the FP32 gradient in host
// memory, the model's memory reached only through the Mover's explicit copies (the reduce's
// device scratch, the step's host output, stage 3's shard copies on the "device" or, with
// param_host, in host memory), as a GPU model's would be; with gradient_on_device the gradient
// stays with the model instead (kHost and kNvme). Every bit must equal the states kept beside
// the model.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <tuple>
#include <utility>

#include "engine_cases.h"
#include "io_test_util.h"
#include "run_ranks.h"

namespace zerort::testing {
namespace {

class EngineHostTier : public ::testing::TestWithParam<std::tuple<int, int, DType, int64_t>> {};

// Every rank's masters, weights, scales, Adam steps and step statistics, bit for bit.
template <typename Runs>
void expect_equal(const Runs& a, const Runs& b, int world) {
  for (int r = 0; r < world; ++r) {
    ASSERT_EQ(a[r].master.size(), b[r].master.size());
    EXPECT_EQ(0, std::memcmp(a[r].master.data(), b[r].master.data(), a[r].master.size() * 4)) << "rank " << r;
    EXPECT_EQ(a[r].params, b[r].params) << "rank " << r;
    EXPECT_EQ(a[r].scales, b[r].scales) << "rank " << r;
    EXPECT_EQ(a[r].adam_steps, b[r].adam_steps) << "rank " << r;
    for (size_t s = 0; s < a[r].stats.size(); ++s) {
      EXPECT_EQ(a[r].stats[s].grad_norm, b[r].stats[s].grad_norm) << "rank " << r << " step " << s;
      EXPECT_EQ(a[r].stats[s].skipped, b[r].stats[s].skipped) << "rank " << r << " step " << s;
    }
  }
}

TEST_P(EngineHostTier, EqualsTheStatesBesideTheModelBitwise) {
  const int world = std::get<0>(GetParam());
  const int64_t gas = std::get<3>(GetParam());
  RunConfig beside = grid_config(GetParam(), 6);
  // gas 1: two backward passes per micro-step, and one rank's gradient overflows at step 3
  // (the skip, and the fp16 scale, must follow alike); gas 2: buckets reduced during backward
  // on the comm thread, as the Python engine's hooks report them.
  const bool reported = gas > 1;
  beside.report_grads = reported;
  beside.passes = reported ? 1 : 2;
  if (!reported) {
    beside.after_backward = [](std::vector<at::Tensor>& params, int step, int rank) {
      if (step == 3 && rank == 1) params[0].grad().view({-1})[5].fill_(INFINITY);
    };
  }
  RunConfig host = beside;
  host.options.state_tier = StateTier::kHost;
  RunConfig host_params = host;  // stage 3: the shard copies in host memory too (offload_param "cpu")
  host_params.options.param_host = true;
  // The gradient on the "device" (Note [gradient on the device]): kHost's master, m and v, and
  // kNvme's split between RAM and a file, stepped from host pieces of 5 elements.
  io::testing::TempDir dir;
  RunConfig host_grad = host;
  host_grad.options.gradient_on_device = true;
  host_grad.options.nvme.chunk_elements = 5;
  RunConfig nvme_grad = host_grad;
  nvme_grad.options.state_tier = StateTier::kNvme;
  nvme_grad.options.nvme.directory = dir.path();
  nvme_grad.options.nvme.ram_fraction = 0.5;
  nvme_grad.options.nvme.buffer_count = 2;
  const auto a = run_all(world, beside);
  for (const RunConfig* config : {&host, &host_params, &host_grad, &nvme_grad}) {
    if (config->options.param_host && config->options.stage != 3) continue;
    expect_equal(a, run_all(world, *config), world);
  }
  EXPECT_EQ(a[0].adam_steps, reported ? 6 : 5);  // the overflow was skipped
}

std::string case_name(const ::testing::TestParamInfo<EngineHostTier::ParamType>& info) {
  return grid_case_name(info.param);
}

INSTANTIATE_TEST_SUITE_P(Stages, EngineHostTier,
                         ::testing::Combine(::testing::Values(2, 4), ::testing::Values(1, 2, 3),
                                            ::testing::Values(DType::kBFloat16, DType::kFloat16),
                                            ::testing::Values(int64_t{1}, int64_t{2})),
                         case_name);

TEST(EngineHostTierOptions, StageZeroIsRefusedByName) {
  RunConfig config;
  config.options = default_options(0, DType::kBFloat16);
  config.options.state_tier = StateTier::kHost;
  config.steps = 1;
  auto errors = run_ranks(2, [&](Communicator& comm) { run_engine(comm, config); });
  for (const auto& e : errors) EXPECT_NE(e.find("works at stages 1-3; got stage 0"), std::string::npos) << e;
}

TEST(EngineHostTierOptions, GradientOnDeviceNeedsTheStateOffMemory) {
  RunConfig config;
  config.options = default_options(2, DType::kBFloat16);
  config.options.gradient_on_device = true;
  config.steps = 1;
  auto errors = run_ranks(2, [&](Communicator& comm) { run_engine(comm, config); });
  for (const auto& e : errors) EXPECT_NE(e.find("gradient_on_device"), std::string::npos) << e;
}

// The grid above would pass with gradient_on_device ignored: here the Engine says where the
// gradient is, and holds no reduce scratch for it (Note [gradient on the device]).
TEST(EngineHostTierOptions, TheGradientOnTheDeviceIsTheReducesTargetAndNeedsNoScratch) {
  io::testing::TempDir dir;
  for (StateTier tier : {StateTier::kHost, StateTier::kNvme}) {
    for (bool on_device : {false, true}) {
      EngineOptions options = default_options(2, DType::kBFloat16);
      options.state_tier = tier;
      options.gradient_on_device = on_device;
      options.nvme.directory = dir.path();
      auto errors = run_ranks(2, [&](Communicator& comm) {
        Engine engine(init_params(), comm, options);
        size_t numel = 0;
        for (size_t g = 0; g < engine.num_groups(); ++g) numel += static_cast<size_t>(engine.grad(g).numel());
        EXPECT_EQ(engine.state_tier_stats().gradient_on_device, on_device);
        // kHost's gradient in host memory adds the reduces' scratch on the device; kNvme's on a CPU
        // model, and any gradient on the device, none.
        const bool scratch = tier == StateTier::kHost && !on_device;
        EXPECT_EQ(engine.grad_shard_bytes() == numel * sizeof(float), !scratch) << engine.grad_shard_bytes();
      });
      for (const auto& e : errors) EXPECT_EQ(e, "");
    }
  }
}

TEST(EngineHostTierOptions, ABf16MasterIsRefusedOffMemoryByName) {
  io::testing::TempDir dir;
  for (StateTier tier : {StateTier::kHost, StateTier::kNvme}) {
    RunConfig config;
    config.options = default_options(2, DType::kBFloat16);
    config.options.optimizer.master_dtype = DType::kBFloat16;
    config.options.state_tier = tier;
    config.options.nvme.directory = dir.path();
    config.steps = 1;
    auto errors = run_ranks(2, [&](Communicator& comm) { run_engine(comm, config); });
    for (const auto& e : errors) EXPECT_NE(e.find("a bf16 master"), std::string::npos) << e;
  }
}

TEST(EngineHostTierOptions, ParametersInHostMemoryNeedStage3WithTheStatesThere) {
  for (const auto& [stage, tier] : {std::pair{2, StateTier::kHost}, std::pair{3, StateTier::kMemory}}) {
    RunConfig config;
    config.options = default_options(stage, DType::kBFloat16);
    config.options.state_tier = tier;
    config.options.param_host = true;
    config.steps = 1;
    auto errors = run_ranks(2, [&](Communicator& comm) { run_engine(comm, config); });
    for (const auto& e : errors) EXPECT_NE(e.find("param_host"), std::string::npos) << e;
  }
}

}  // namespace
}  // namespace zerort::testing
