// Note [W = 1 is local] (runtime/engine_local.cpp): a one-rank engine calls no collective for
// its reduces and gathers, at every stage, and still trains as the single-process reference
// says (stages 1-3 bit for bit alike, as at W > 1).
#include <gtest/gtest.h>

#include <ATen/ops/zeros.h>

#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "engine_cases.h"
#include "run_ranks.h"

namespace zerort::testing {
namespace {

bool is_reduce_or_gather(const CallFields& f) {
  const auto kind = static_cast<Collective>(f[0]);
  return kind == Collective::kReduceScatterAccumulate || kind == Collective::kReduceScatter ||
         kind == Collective::kAllGather || kind == Collective::kAllToAll || kind == Collective::kAllReduce;
}

class EngineLocal : public ::testing::TestWithParam<std::tuple<int, int64_t>> {};

TEST_P(EngineLocal, CallsNoCollectiveAndMatchesTheReference) {
  const auto [stage, gas] = GetParam();
  RunConfig config = grid_config({1, stage, DType::kBFloat16, gas}, 6);
  config.report_grads = true;  // the hooks' path: reduces (and stage 3's gathers) during backward
  Communicator* comm = nullptr;
  std::vector<std::string> problems;
  int checked = 0;
  config.after_backward = [&](std::vector<at::Tensor>&, int step, int) {
    ++checked;
    // The log holds every call since the last decision (the first one also the constructor's
    // broadcasts of rank 0's values, which W = 1 makes as no-ops).
    for (const CallFields& f : comm->calls().kept()) {
      if (is_reduce_or_gather(f)) problems.push_back(describe_call(f, 0, 1) + " at step " + std::to_string(step));
    }
    if (step > 0 && comm->calls().summary().calls != 0) {
      problems.push_back(std::to_string(comm->calls().summary().calls) + " calls at step " + std::to_string(step));
    }
  };
  auto runs = run_all(1, config, [&](Communicator& c) { comm = &c; });
  EXPECT_GT(checked, 0);
  EXPECT_EQ(problems, std::vector<std::string>{});
  EXPECT_EQ(comm->backend_calls(), 0);
  auto ref = run_reference(1, config, runs[0].scales);
  EXPECT_LT(max_rel_diff(runs[0].master, ref.master), 5e-4);  // EngineParity's bound (test_engine.cpp)
}

INSTANTIATE_TEST_SUITE_P(Stages, EngineLocal,
                         ::testing::Combine(::testing::Values(0, 1, 2, 3), ::testing::Values(int64_t{1}, int64_t{2})),
                         [](const auto& info) {
                           return "stage" + std::to_string(std::get<0>(info.param)) + "_gas" +
                                  std::to_string(std::get<1>(info.param));
                         });

// Stages 1, 2 and 3 compute the same sums in the same order at W = 1 as at W > 1: the same bits,
// whether the reduces run from the hooks or at the step. (Stage 1 sums a window's micro-steps in
// autograd's low precision, so over one micro-step only.)
TEST(EngineLocal, StagesAgreeBitwiseFromHooksOrStep) {
  for (int64_t gas : {1, 2}) {
    std::vector<EngineRun> runs;
    for (int stage : {1, 2, 3}) {
      for (bool hooks : {false, true}) {
        if (stage == 1 && gas > 1) continue;
        RunConfig config = grid_config({1, stage, DType::kBFloat16, gas}, 4);
        config.options.optimizer.gradient_clipping = 0;
        config.report_grads = hooks;
        runs.push_back(run_all(1, config)[0]);
      }
    }
    for (size_t i = 1; i < runs.size(); ++i) {
      ASSERT_EQ(runs[i].master.size(), runs[0].master.size());
      EXPECT_EQ(0, std::memcmp(runs[i].master.data(), runs[0].master.data(), runs[0].master.size() * 4))
          << "gas " << gas << " run " << i;
      EXPECT_EQ(runs[i].params, runs[0].params) << "gas " << gas << " run " << i;
    }
  }
}

// The reduce runs in grad_ready itself, not on the comm thread: the FP32 gradient holds the
// bucket's sum when the last report returns. (Were a reduce handed to the communicator, its
// call would sleep first: delay_calls slows every reduce call of this rank.)
TEST(EngineLocal, TheReduceIsDoneWhenTheHookReturns) {
  auto errors = run_ranks(1, [](Communicator& comm) {
    comm.delay_calls(DelayedCalls::kReduces, std::chrono::milliseconds(300));
    std::vector<at::Tensor> params = init_params();
    Engine engine(params, comm, default_options(2, DType::kBFloat16));
    engine.begin_backward();
    at::Tensor loss = at::zeros({});
    int64_t numel = 0;
    for (const at::Tensor& p : params) {
      loss = loss.add(p.to(at::kFloat).sum());  // every gradient element is 1
      numel += p.numel();
    }
    loss.mul(engine.loss_scale()).backward();
    for (size_t i = params.size(); i-- > 0;) engine.grad_ready(0, i);
    const at::Tensor grad = engine.grad(0);  // no step, no drain: only what the hooks did
    EXPECT_EQ(grad.sum().item<double>(), static_cast<double>(numel) * engine.loss_scale());
    engine.step();
  });
  EXPECT_EQ(errors, std::vector<std::string>{""});
}

}  // namespace
}  // namespace zerort::testing
