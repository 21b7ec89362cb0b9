// The step's decision exchange (runtime/step_decision.h): the sums every rank decides on,
// and the cross-rank checks folded into it, on threads of one InProcessGroup.
#include <gtest/gtest.h>

#include <vector>

#include "core/error.h"
#include "run_ranks.h"
#include "runtime/step_decision.h"

namespace zerort::testing {
namespace {

// Rank r reports r + 1 non-finite values and a sum of squares of 0.1 * (r + 1).
RankReport report(const Communicator& comm) {
  RankReport r;
  r.nonfinite = comm.rank() + 1;
  r.sum_squares = 0.1 * (comm.rank() + 1);
  return r;
}

TEST(StepDecision, SumsInRankOrderAndClearsTheLog) {
  for (int world : {1, 2, 3, 4}) {
    std::vector<Decision> got(static_cast<size_t>(world));
    auto errors = run_ranks(world, [&](Communicator& comm) {
      std::vector<float> x(5, 1.0f);
      comm.all_reduce(x.data(), 5, DType::kFloat32)->wait();
      got[comm.rank()] = decide_step(comm, report(comm), 0, 1);
      EXPECT_EQ(comm.calls().summary().calls, 0);                                 // the next window starts empty
      got[comm.rank()].nonfinite += 100 * decide_step(comm, {}, 0, 1).nonfinite;  // a second step
    });
    double want = 0;
    for (int r = 0; r < world; ++r) want += 0.1 * (r + 1);  // the same order, so the same bits
    for (int r = 0; r < world; ++r) {
      EXPECT_EQ(errors[r], "") << "W=" << world;
      EXPECT_EQ(got[r].nonfinite, world * (world + 1) / 2) << "W=" << world;
      EXPECT_EQ(got[r].sum_squares, want) << "W=" << world;
    }
  }
}

TEST(StepDecision, ReplicatedTakesRankZerosFigures) {
  auto errors = run_ranks(3, [&](Communicator& comm) {
    RankReport same;
    same.nonfinite = 2;
    same.sum_squares = 4.5;
    Decision d = decide_step(comm, same, 1, 1);
    EXPECT_EQ(d.nonfinite, 2);
    EXPECT_EQ(d.sum_squares, 4.5);
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
}

// The same collective and sizes for different buckets: the transport cannot tell, the
// step does, on every rank, naming the first call that differs and each rank's version.
TEST(StepDecision, DifferentTagIsNamedAtTheStepOnEveryRank) {
  auto errors = run_ranks(3, [&](Communicator& comm) {
    std::vector<float> in(4, 1.0f), out(12);
    comm.all_gather(in.data(), out.data(), 4, DType::kFloat32, 7)->wait();
    comm.all_gather(in.data(), out.data(), 4, DType::kFloat32, comm.rank() == 1 ? 4 : 3)->wait();
    comm.all_gather(in.data(), out.data(), 4, DType::kFloat32, 9)->wait();
    decide_step(comm, {}, 0, 1);
  });
  for (int r = 0; r < 3; ++r) {
    const std::string& e = errors[r];
    EXPECT_NE(e.find("ranks called different collectives since the previous step"), std::string::npos) << e;
    EXPECT_NE(e.find("call 2 since the previous step is the first that differs"), std::string::npos) << e;
    EXPECT_NE(e.find("rank 0: all_gather(count=4, dtype=f32, tag=3) on rank 0 of 3"), std::string::npos) << e;
    EXPECT_NE(e.find("rank 1: all_gather(count=4, dtype=f32, tag=4) on rank 1 of 3"), std::string::npos) << e;
    EXPECT_NE(e.find("rank 2: all_gather(count=4, dtype=f32, tag=3) on rank 2 of 3"), std::string::npos) << e;
    EXPECT_NE(e.find("comm.debug: true"), std::string::npos) << e;
  }
}

// A rank with one more call. The in-process backend pairs every call, so the extra one is
// recorded directly, as a call that completes alone is (gloo returns count-0 calls at once).
TEST(StepDecision, ExtraCallIsNamedAtTheStep) {
  auto errors = run_ranks(2, [&](Communicator& comm) {
    float x = 1;
    comm.all_reduce(&x, 1, DType::kFloat32)->wait();
    decide_step(comm, {}, 0, 1);  // a good step first: the log restarts after it
    CollectiveDesc extra;
    extra.kind = Collective::kAllGather;
    extra.dtype = DType::kInt32;
    extra.tag = 5;
    if (comm.rank() == 0) comm.calls().record(extra);
    decide_step(comm, {}, 0, 1);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("call 1 since the previous step is the first that differs"), std::string::npos)
        << errors[r];
    EXPECT_NE(errors[r].find("rank 0: all_gather(count=0, dtype=i32, tag=5)"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("rank 1: (0 calls in all)"), std::string::npos) << errors[r];
  }
}

TEST(StepDecision, MissedBackwardNamesTheRanks) {
  auto errors = run_ranks(3, [&](Communicator& comm) {
    RankReport r;
    r.missed_backward = comm.rank() == 2 ? 1 : 0;
    try {
      decide_step(comm, r, 0, 4);
    } catch (const UsageError& e) {
      throw std::runtime_error(std::string("USAGE: ") + e.what());
    }
  });
  for (const auto& e : errors) {
    EXPECT_EQ(e.rfind("USAGE: ", 0), 0u) << e;
    EXPECT_NE(e.find("rank 2 (1 of 4) micro-steps of this accumulation window had none"), std::string::npos) << e;
  }
}

// W = 1: no collective reaches the backend, neither the data's nor the decision's.
TEST(StepDecision, NoBackendCallAtWorldOne) {
  auto errors = run_ranks(1, [&](Communicator& comm) {
    std::vector<uint16_t> grads(6, 0x3f80);  // bf16 1.0
    std::vector<float> shard(6, 0.5f), whole(6, 2.0f), own(6, 3.0f);
    comm.reduce_scatter_accumulate(grads.data(), DType::kBFloat16, shard.data(), 6, true)->wait();
    comm.all_gather(own.data(), whole.data(), 6, DType::kFloat32)->wait();
    comm.all_gather(whole.data(), whole.data(), 6, DType::kFloat32)->wait();  // in place
    comm.broadcast(whole.data(), 6, DType::kFloat32, 0)->wait();
    comm.barrier()->wait();
    Decision d = decide_step(comm, report(comm), 0, 1);
    EXPECT_EQ(d.nonfinite, 1);
    for (float v : shard) EXPECT_EQ(v, 1.5f);
    for (float v : whole) EXPECT_EQ(v, 3.0f);
    EXPECT_EQ(comm.backend_calls(), 0);
  });
  EXPECT_EQ(errors[0], "");
}

}  // namespace
}  // namespace zerort::testing
