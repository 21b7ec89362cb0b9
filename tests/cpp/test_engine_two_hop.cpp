// The Engine over the two-hop communicator (Note [two hops]) on in-process groups playing 2
// nodes of 2 ranks, its reduces left in flight (Note [reduces in flight]) and its hops pipelined
// (Note [pipelined hops]): stages 2 and 3, gradients reported as the hooks report them, with
// and without accumulation, give the flat engine's bits, also with the inter-node hops slowed
// on some ranks.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "engine_cases.h"
#include "two_hop_nodes.h"

namespace zerort::testing {
namespace {

// run_engine on every rank of 2 nodes x 2 over the two-hop communicator; slowed: ranks 1 and 2
// sleep before each inter-node all-to-all (the reduces' hop 2) and all-gather (stage 3's hop 1).
std::vector<EngineRun> run_two_hop(const RunConfig& config, bool slowed) {
  Nodes shape;
  if (slowed) {
    shape.inter_part = [](std::shared_ptr<Communicator> inter, int r) -> std::shared_ptr<Communicator> {
      if (r != 1 && r != 2) return inter;
      inter->delay_calls(DelayedCalls::kGathers, std::chrono::microseconds(700));
      return std::make_shared<SlowAllToAll>(std::move(inter), std::chrono::microseconds(900));
    };
  }
  std::vector<EngineRun> runs(4);
  auto errors = run_nodes(
      shape, [&](Communicator& two, Communicator&, int r) { runs[static_cast<size_t>(r)] = run_engine(two, config); });
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
  return runs;
}

void expect_bits(const std::vector<EngineRun>& runs, const EngineRun& base, const std::string& what) {
  for (size_t r = 0; r < runs.size(); ++r) {
    ASSERT_EQ(runs[r].master.size(), base.master.size()) << what;
    EXPECT_EQ(0, std::memcmp(runs[r].master.data(), base.master.data(), base.master.size() * sizeof(float)))
        << what << ", rank " << r;
    EXPECT_EQ(runs[r].params, base.params) << what << ", rank " << r;
  }
}

// fp32 between the hops: each node's sum of two bf16 gradients is exact in FP32 (their
// exponents are close), so both patterns round the same exact sum once.
TEST(EngineTwoHop, StagesTwoAndThreeGiveTheFlatBitsWithSlowedHopsToo) {
  for (int stage : {2, 3}) {
    for (int64_t gas : {1, 2}) {
      RunConfig config = grid_config({4, stage, DType::kBFloat16, gas}, 5);
      config.report_grads = true;  // buckets reduce during backward, one after another
      const std::string what = detail::concat("stage ", stage, " gas ", gas);
      const auto flat = run_all(4, config);
      expect_bits(run_two_hop(config, false), flat[0], what + ", two-hop");
      expect_bits(run_two_hop(config, true), flat[0], what + ", two-hop with slowed inter-node hops");
      const double diff = max_rel_diff(flat[0].master, run_reference(4, config, flat[0].scales).master);
      EXPECT_LT(diff, 5e-4) << what;  // EngineParity's bound
    }
  }
}

}  // namespace
}  // namespace zerort::testing
