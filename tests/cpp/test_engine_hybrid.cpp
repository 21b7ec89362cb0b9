// Hybrid sharding (Note [hybrid sharding], runtime/shard_groups.h) and stage 3's secondary
// shards (Note [secondary shards], runtime/secondary_shards.h) on in-process ranks: the
// Engine against the single-process reference at W = 4 and 6 in groups of 1, 2 and 3 (pieces
// that do not divide the shards), every rank's weights the same on every wire, the secondary
// shards' bits equal to the run without them, several backward passes per micro-step, and the
// refusals.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "comm/inprocess_communicator.h"
#include "engine_cases.h"
#include "run_ranks.h"

namespace zerort::testing {
namespace {

// Every rank's parts of a world of `world`: groups of `shard` consecutive ranks, the replicas
// across them (Note [hybrid sharding]), and secondary groups of `secondary` (0: none).
struct Parts {
  std::vector<std::shared_ptr<InProcessGroup>> groups;
  std::vector<std::unique_ptr<Communicator>> shard, replicas, secondary;

  Parts(int world, int shard_size, int secondary_size) {
    const int count = world / shard_size;
    for (int k = 0; k < count; ++k) groups.push_back(InProcessGroup::create(shard_size));
    for (int i = 0; i < shard_size; ++i) groups.push_back(InProcessGroup::create(count));
    for (int r = 0; r < world; ++r) {
      shard.push_back(groups[static_cast<size_t>(r / shard_size)]->communicator(r % shard_size));
      replicas.push_back(groups[static_cast<size_t>(count + r % shard_size)]->communicator(r / shard_size));
    }
    if (secondary_size == 0) return;
    const size_t first = groups.size();
    for (int k = 0; k < world / secondary_size; ++k) groups.push_back(InProcessGroup::create(secondary_size));
    for (int r = 0; r < world; ++r) {
      secondary.push_back(groups[first + static_cast<size_t>(r / secondary_size)]->communicator(r % secondary_size));
    }
  }
  std::function<ShardGroups(int)> of(InterNodeWire wire = InterNodeWire::kFp32, bool hybrid = true) {
    return [this, wire, hybrid](int r) {
      const auto u = static_cast<size_t>(r);
      return ShardGroups{hybrid ? shard[u].get() : nullptr, hybrid ? replicas[u].get() : nullptr, wire,
                         secondary.empty() ? nullptr : secondary[u].get()};
    };
  }
};

void expect_same_weights_everywhere(const std::vector<EngineRun>& runs, const std::string& what) {
  for (size_t r = 1; r < runs.size(); ++r) {
    EXPECT_EQ(runs[r].master, runs[0].master) << what << " rank " << r;
    EXPECT_EQ(runs[r].params, runs[0].params) << what << " rank " << r;
  }
}

// The bound of EngineParity (test_engine.cpp): the same sums, grouped otherwise.
TEST(EngineHybrid, MatchesTheReferenceInGroups) {
  for (auto [world, shard] : {std::pair{4, 2}, {4, 1}, {6, 3}, {6, 2}}) {
    for (int stage : {1, 2, 3}) {
      for (int64_t gas : {1, 2}) {
        RunConfig config = grid_config({world, stage, DType::kBFloat16, gas}, 8);
        Parts parts(world, shard, 0);
        config.groups = parts.of();
        auto runs = run_all(world, config);
        const std::string what = detail::concat("W", world, " groups of ", shard, " stage ", stage, " gas ", gas);
        expect_same_weights_everywhere(runs, what);
        const double diff = max_rel_diff(runs[0].master, run_reference(world, config, runs[0].scales).master);
        std::cout << "[hybrid " << what << "] max |master - reference| / max |reference| = " << diff << std::endl;
        EXPECT_LT(diff, 5e-4) << what;
      }
    }
  }
}

// Gradients reported as the hooks report them, so each bucket is summed across the groups on
// the comm thread as its reduce ends, and two backward passes per micro-step: the second pass's
// part is summed on its own and added (the sum stays linear). The reference sums every pass;
// the flat engine at W = 4 runs the same windows (stage 1 with accumulation sums its flat bf16
// gradients across micro-steps, 1.2e-5 from the reference either way).
TEST(EngineHybrid, SeveralBackwardPassesAddUpAcrossGroups) {
  for (int stage : {1, 2}) {
    for (int64_t gas : {1, 2}) {
      RunConfig config = two_pass_config(stage, gas);
      auto flat = run_all(4, config);
      Parts parts(4, 2, 0);
      config.groups = parts.of();
      auto runs = run_all(4, config);
      expect_same_weights_everywhere(runs, detail::concat("two passes stage ", stage, " gas ", gas));
      const double diff = max_rel_diff(runs[0].master, run_reference(4, config, runs[0].scales).master);
      const double apart = max_rel_diff(runs[0].master, flat[0].master);
      std::cout << "[hybrid two passes stage " << stage << " gas " << gas << "] max rel diff " << diff
                << ", from the flat engine " << apart << std::endl;
      EXPECT_LT(diff, 5e-4) << "stage " << stage << " gas " << gas;  // EngineParity's bound
      // The same sums grouped otherwise (measured 0: sums of two FP32 values are exact in FP64).
      EXPECT_LT(apart, 1e-6) << "stage " << stage << " gas " << gas;
    }
  }
}

// Both halves of the sum across groups on a low-precision wire, decoded on every rank: all
// ranks keep the same weights (a rank that kept its own undecoded sum would drift apart).
TEST(EngineHybrid, LowPrecisionWiresKeepEveryRankTheSame) {
  for (InterNodeWire wire : {InterNodeWire::kBf16, InterNodeWire::kInt8, InterNodeWire::kFp8}) {
    for (int stage : {2, 3}) {
      RunConfig config = grid_config({4, stage, DType::kBFloat16, 1}, 6);
      Parts parts(4, 2, 0);
      config.groups = parts.of(wire);
      auto runs = run_all(4, config);
      expect_same_weights_everywhere(runs, detail::concat("wire ", static_cast<int>(wire), " stage ", stage));
      EXPECT_LT(max_rel_diff(runs[0].master, run_reference(4, config, runs[0].scales).master), 5e-2);
    }
  }
}

// The re-gathers from the secondary shards carry the bits of the primary gathers.
TEST(EngineSecondaryShards, GiveTheSameBitsAsWithout) {
  for (auto [shard, secondary] : {std::pair{4, 2}, {2, 2}, {2, 1}}) {
    for (int64_t gas : {1, 2}) {
      RunConfig plain = grid_config({4, 3, DType::kBFloat16, gas}, 6);
      RunConfig with = plain;
      Parts parts(4, shard, secondary), none(4, shard, 0);
      with.groups = parts.of(InterNodeWire::kFp32, shard < 4);
      plain.groups = none.of(InterNodeWire::kFp32, shard < 4);
      auto a = run_all(4, plain), b = run_all(4, with);
      for (int r = 0; r < 4; ++r) {
        EXPECT_EQ(a[r].master, b[r].master) << "groups of " << shard << ", secondary " << secondary;
        EXPECT_EQ(a[r].params, b[r].params) << "groups of " << shard << ", secondary " << secondary;
      }
    }
  }
}

TEST(EngineHybrid, RefusalsNameTheKey) {
  auto refused = [](int stage, int shard, int secondary, StateTier tier = StateTier::kMemory) {
    RunConfig config = grid_config({4, stage, DType::kBFloat16, 1}, 1);
    config.options.state_tier = tier;
    Parts parts(4, shard, secondary);
    config.groups = parts.of(InterNodeWire::kFp32, shard < 4);
    std::vector<std::string> errors = run_ranks(4, [&](Communicator& comm) { run_engine(comm, config); });
    for (const auto& e : errors) EXPECT_EQ(e, errors[0]);
    return errors[0];
  };
  EXPECT_NE(refused(0, 2, 0).find("shard_size: stage 0"), std::string::npos);
  EXPECT_NE(refused(2, 2, 0, StateTier::kHost).find("keeps the state in memory"), std::string::npos);
  EXPECT_NE(refused(2, 4, 2).find("at stages 1-2 drop it"), std::string::npos);
  EXPECT_NE(refused(3, 2, 4).find("groups of 4 ranks do not fit within the groups of 2"), std::string::npos);
}

}  // namespace
}  // namespace zerort::testing
