// Bad input never hangs: count mismatches, null buffers, unknown dtypes and timeouts all
// raise errors that name the collective, the rank and the sizes.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "comm/peer_exits.h"
#include "core/error.h"
#include "run_ranks.h"

namespace zerort::testing {
namespace {

using namespace std::chrono_literals;

CommOptions fast_timeout(bool debug = true) {
  CommOptions o;
  o.timeout = 300ms;
  o.debug = debug;
  return o;
}

// comm.debug: every collective is checked across ranks as it is called.
CommOptions debug_checks() {
  CommOptions o;
  o.debug = true;
  return o;
}

TEST(CommBadInput, CountMismatchAcrossRanksRaisesOnEveryRank) {
  std::vector<float> buf(16, 1.0f);
  auto errors = run_ranks(
      3,
      [&](Communicator& comm) {
        std::vector<float> mine(buf);
        comm.all_reduce(mine.data(), comm.rank() == 1 ? 8 : 7, DType::kFloat32)->wait();
      },
      debug_checks());
  for (int r = 0; r < 3; ++r) {
    EXPECT_NE(errors[r].find("count differs across ranks"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("all_reduce"), std::string::npos) << errors[r];
    // Every rank's error lists what each rank called.
    EXPECT_NE(errors[r].find("rank 0: all_reduce(count=7"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("rank 1: all_reduce(count=8"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("rank 2: all_reduce(count=7"), std::string::npos) << errors[r];
  }
}

TEST(CommBadInput, MismatchCaughtByBackendWithoutConsistencyCheck) {
  auto errors = run_ranks(
      2,
      [&](Communicator& comm) {
        std::vector<float> in(32), out(16);
        comm.reduce_scatter(in.data(), out.data(), comm.rank() == 0 ? 4 : 5, DType::kFloat32)->wait();
      },
      fast_timeout(false));
  for (const auto& e : errors) EXPECT_NE(e.find("collective mismatch"), std::string::npos) << e;
}

TEST(CommBadInput, DifferentCollectivesRaise) {
  auto errors = run_ranks(
      2,
      [&](Communicator& comm) {
        float x = 1;
        if (comm.rank() == 0)
          comm.all_reduce(&x, 1, DType::kFloat32)->wait();
        else
          comm.broadcast(&x, 1, DType::kFloat32, 0)->wait();
      },
      debug_checks());
  for (const auto& e : errors) EXPECT_NE(e.find("different collectives"), std::string::npos) << e;
}

// Same collective, count and dtype, but for different buckets or units (ranks that took
// different paths through a model): the tag differs, and every rank's error lists each call.
TEST(CommBadInput, TagMismatchAcrossRanksRaisesOnEveryRank) {
  auto errors = run_ranks(
      2,
      [&](Communicator& comm) {
        std::vector<float> in(4, 1.0f), out(8);
        comm.all_gather(in.data(), out.data(), 4, DType::kFloat32, comm.rank() == 0 ? 3 : 4)->wait();
      },
      debug_checks());
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("tag differs across ranks"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("rank 0: all_gather(count=4, dtype=f32, tag=3)"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("rank 1: all_gather(count=4, dtype=f32, tag=4)"), std::string::npos) << errors[r];
  }
}

// Note [checked calls]: a communicator made without comm.debug checks every call once each
// rank has switched at the same point (a stage-3 engine does), and only from then on.
TEST(CommBadInput, CheckEachCallSwitchesTheChecksOn) {
  auto errors = run_ranks(
      2,
      [&](Communicator& comm) {
        EXPECT_FALSE(comm.checks_each_call());
        std::vector<float> in(4, 1.0f), out(8);
        comm.all_gather(in.data(), out.data(), 4, DType::kFloat32)->wait();
        const int64_t unchecked = comm.backend_calls();
        comm.check_each_call();
        EXPECT_TRUE(comm.checks_each_call());
        comm.all_gather(in.data(), out.data(), 4, DType::kFloat32)->wait();
        EXPECT_EQ(comm.backend_calls() - unchecked, 2);  // the check, then the call
        comm.all_gather(in.data(), out.data(), comm.rank() == 0 ? 4 : 3, DType::kFloat32)->wait();
      },
      fast_timeout(false));
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("count differs across ranks"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("rank 1: all_gather(count=3, dtype=f32)"), std::string::npos) << errors[r];
  }
}

// comm/peer_exits.h: a peer known to have exited ends a wait at once (after the notice has
// settled), naming it, instead of at the timeout.
TEST(CommBadInput, AnExitedPeerEndsTheWaitNamingIt) {
  clear_peer_exits();
  note_peer_exit(1, "exited");
  CommOptions o;
  o.timeout = std::chrono::seconds(60);
  const auto t0 = std::chrono::steady_clock::now();
  auto errors = run_ranks(
      2,
      [&](Communicator& comm) {
        float x = 1;
        if (comm.rank() == 0) comm.all_reduce(&x, 1, DType::kFloat32)->wait();  // rank 1 never joins
      },
      o);
  clear_peer_exits();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(20));
  EXPECT_NE(errors[0].find("all_reduce(count=1, dtype=f32, op=sum) on rank 0 of 2 [inprocess] cannot finish: rank 1 "
                           "exited while this rank waited for it"),
            std::string::npos)
      << errors[0];
  EXPECT_TRUE(errors[1].empty()) << errors[1];
}

TEST(CommBadInput, NullBufferNamesTheCall) {
  auto errors = run_ranks(2, [&](Communicator& comm) { comm.all_reduce(nullptr, 5, DType::kFloat32)->wait(); });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("buffer argument 0 is null"), std::string::npos) << e;
    EXPECT_NE(e.find("all_reduce(count=5"), std::string::npos) << e;
  }
  // Zero elements need no buffer.
  errors = run_ranks(2, [&](Communicator& comm) { comm.all_gather(nullptr, nullptr, 0, DType::kInt32)->wait(); });
  for (const auto& e : errors) EXPECT_EQ(e, "");
}

TEST(CommBadInput, UnknownDtypeAndOp) {
  auto errors = run_ranks(1, [&](Communicator& comm) {
    float x = 0;
    comm.all_reduce(&x, 1, static_cast<DType>(42))->wait();
  });
  EXPECT_NE(errors[0].find("unknown dtype value 42"), std::string::npos) << errors[0];
  errors = run_ranks(1, [&](Communicator& comm) {
    float x = 0;
    comm.all_reduce(&x, 1, DType::kFloat32, static_cast<ReduceOp>(9))->wait();
  });
  EXPECT_NE(errors[0].find("unknown reduce op value 9"), std::string::npos) << errors[0];
  errors = run_ranks(1, [&](Communicator& comm) {
    int32_t x = 0;
    float y = 0;
    comm.reduce_scatter_accumulate(&x, DType::kInt32, &y, 1)->wait();
  });
  EXPECT_NE(errors[0].find("must be bf16, f16 or f32"), std::string::npos) << errors[0];
  errors = run_ranks(2, [&](Communicator& comm) {
    float x = 0;
    comm.broadcast(&x, 1, DType::kFloat32, 2)->wait();
  });
  for (const auto& e : errors) EXPECT_NE(e.find("root 2 is outside"), std::string::npos) << e;
}

// Rank 1 never calls: rank 0 times out naming the collective; then rank 1's late call
// fails fast because the group was aborted, instead of hanging.
void expect_timeout(bool debug) {
  auto start = std::chrono::steady_clock::now();
  auto errors = run_ranks(
      2,
      [&](Communicator& comm) {
        float x = 1;
        if (comm.rank() == 0) {
          try {
            comm.all_reduce(&x, 1, DType::kFloat32)->wait();
          } catch (const CommTimeoutError& e) {
            throw std::runtime_error(std::string("TIMEOUT: ") + e.what());
          }
        } else {
          std::this_thread::sleep_for(600ms);
          comm.barrier()->wait();
        }
      },
      fast_timeout(debug));
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
  EXPECT_EQ(errors[0].rfind("TIMEOUT: ", 0), 0u) << errors[0];
  EXPECT_NE(errors[0].find("all_reduce(count=1, dtype=f32, op=sum) on rank 0 of 2"), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find("300 ms"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("aborted"), std::string::npos) << errors[1];
}

TEST(CommBadInput, TimeoutFiresInConsistencyCheck) { expect_timeout(true); }
TEST(CommBadInput, TimeoutFiresInCollective) { expect_timeout(false); }

TEST(CommBadInput, WaitAfterTimeoutThrowsAgainInsteadOfReturningGarbage) {
  auto errors = run_ranks(
      2,
      [&](Communicator& comm) {
        std::vector<float> x(4, 1.0f);
        if (comm.rank() == 0) {
          auto w = comm.all_reduce(x.data(), 4, DType::kFloat32);
          EXPECT_THROW(w->wait(), CommTimeoutError);
          EXPECT_THROW(w->wait(std::chrono::seconds(5)), CommTimeoutError);  // no silent success
        }
      },
      fast_timeout(false));
  EXPECT_EQ(errors[0], "");
}

TEST(CommBadInput, WaitTwiceAndCountZeroWork) {
  auto errors = run_ranks(2, [&](Communicator& comm) {
    double x = comm.rank();
    auto w = comm.all_reduce(&x, 1, DType::kFloat64, ReduceOp::kMax);
    w->wait();
    w->wait();  // no-op
    if (x != 1.0) throw std::runtime_error("max wrong");
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
}

}  // namespace
}  // namespace zerort::testing
