// Every collective and dtype on the in-process backend, W in {1,2,3,4,8} x counts
// {0, 1, 7, 1000, 2^16+3} (and 2^20+3 at W = 2), against the exact reference in collective_cases.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <iostream>
#include <mutex>
#include <thread>

#include "collective_cases.h"
#include "comm/staged_communicator.h"
#include "core/half.h"
#include "run_ranks.h"

namespace zerort::testing {
namespace {

class InProcessCollectives : public ::testing::TestWithParam<std::tuple<int, size_t>> {};

TEST_P(InProcessCollectives, MatchReference) {
  auto [world, count] = GetParam();
  std::mutex mu;
  std::vector<std::string> failures;
  auto errors = run_ranks(world, [&](Communicator& comm) {
    auto f = check_all_collectives(comm, count);
    std::lock_guard<std::mutex> lock(mu);
    failures.insert(failures.end(), f.begin(), f.end());
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
  for (const auto& f : failures) ADD_FAILURE() << f;
}

std::string world_and_count(const ::testing::TestParamInfo<std::tuple<int, size_t>>& info) {
  return "W" + std::to_string(std::get<0>(info.param)) + "_n" + std::to_string(std::get<1>(info.param));
}

// The in-process backend has no size thresholds, so a count past one cache's worth is checked
// at W = 2 only: the reference costs W^2 x count per case (at W = 8, 2^20 + 3 took 114 s).
INSTANTIATE_TEST_SUITE_P(WorldsAndCounts, InProcessCollectives,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4, 8),
                                            ::testing::Values(size_t{0}, size_t{1}, size_t{7}, size_t{1000},
                                                              size_t{(1u << 16) + 3})),
                         world_and_count);
INSTANTIATE_TEST_SUITE_P(LargeCount, InProcessCollectives,
                         ::testing::Combine(::testing::Values(2), ::testing::Values(size_t{(1u << 20) + 3})),
                         world_and_count);

// The host-staged path (a CUDA model's collectives over mpi or gloo) with CPU buffers:
// every collective through staging buffers and back gives the reference results too.
class StagedCollectives : public ::testing::TestWithParam<std::tuple<int, size_t>> {};

TEST_P(StagedCollectives, MatchReference) {
  auto [world, count] = GetParam();
  auto group = InProcessGroup::create(world, {});
  std::mutex mu;
  std::vector<std::string> failures;
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      std::vector<std::string> f;
      try {
        auto staged = make_staged_communicator(std::shared_ptr<Communicator>(group->communicator(r)), make_host_mover(),
                                               CommOptions{});
        EXPECT_STREQ(staged->backend_name(), "inprocess+staged-host");
        f = check_all_collectives(*staged, count);
      } catch (const std::exception& e) {
        f.push_back(e.what());
      }
      std::lock_guard<std::mutex> lock(mu);
      failures.insert(failures.end(), f.begin(), f.end());
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& f : failures) ADD_FAILURE() << f;
}

INSTANTIATE_TEST_SUITE_P(WorldsAndCounts, StagedCollectives,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4),
                                            ::testing::Values(size_t{0}, size_t{1}, size_t{7}, size_t{1000})),
                         world_and_count);

// Note [staged accumulate]: two accumulating reduce-scatters into one shard, the second issued
// before the first is waited for, give the direct path's bits. Element 0 of every shard sums
// 1 + 2^-24 + 2^-50: rounded once it is 1 + 2^-23, where rounding the sum before adding it to the
// shard (2^-24, a tie with 1) would leave 1; after the second call 1 + 2^-22.
TEST(StagedAccumulate, ChainedIntoOneShardGivesTheDirectBits) {
  constexpr int kWorld = 2;
  constexpr size_t kCount = 5;
  auto direct_group = InProcessGroup::create(kWorld, {});
  auto staged_group = InProcessGroup::create(kWorld, {});
  std::vector<std::vector<float>> direct(kWorld), staged(kWorld);
  std::vector<std::thread> threads;
  std::vector<std::string> errors(kWorld);
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      try {
        std::vector<uint16_t> in(kWorld * kCount);
        for (size_t i = 0; i < in.size(); ++i) in[i] = f32_to_bf16(0.001f * static_cast<float>(i * 7 + r * 3 + 1));
        for (int j = 0; j < kWorld; ++j)
          in[j * kCount] = f32_to_bf16(r == 0 ? std::ldexp(1.0f, -24) : std::ldexp(1.0f, -50));
        auto run = [&](Communicator& comm, std::vector<float>& out) {
          out.assign(kCount, 1.0f);
          for (size_t i = 1; i < kCount; ++i) out[i] = 0.3f * static_cast<float>(i);
          WorkPtr first = comm.reduce_scatter_accumulate(in.data(), DType::kBFloat16, out.data(), kCount, true, 0);
          WorkPtr second = comm.reduce_scatter_accumulate(in.data(), DType::kBFloat16, out.data(), kCount, true, 0);
          first->wait();
          second->wait();
        };
        run(*direct_group->communicator(r), direct[r]);
        auto stage = make_staged_communicator(std::shared_ptr<Communicator>(staged_group->communicator(r)),
                                              make_host_mover(), CommOptions{});
        run(*stage, staged[r]);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_EQ(errors[r], "") << "rank " << r;
    EXPECT_EQ(direct[r][0], 1.0f + std::ldexp(1.0f, -22)) << "rank " << r;
    for (size_t i = 0; i < kCount; ++i) {
      EXPECT_EQ(std::memcmp(&staged[r][i], &direct[r][i], sizeof(float)), 0)
          << "rank " << r << " element " << i << ": staged " << staged[r][i] << ", direct " << direct[r][i];
    }
  }
}

// At W = 8 the FP32-accumulating reduce-scatter equals the fp64 sum rounded once, and a
// plain bf16 reduce-scatter of the same data is measurably worse.
TEST(InProcessAccuracy, ReduceScatterAccumulateBeatsBf16AtW8) {
  std::vector<AccuracyResult> results(8);  // one slot per rank: no lock needed
  auto errors = run_ranks(
      8, [&](Communicator& comm) { results[static_cast<size_t>(comm.rank())] = check_rsa_accuracy(comm, 4099, 42); });
  for (const auto& e : errors) ASSERT_EQ(e, "");
  for (const auto& r : results) {
    EXPECT_TRUE(r.rsa_bitwise_equal) << r.to_string();
    EXPECT_GT(r.bf16_max_abs_err, 10 * r.rsa_max_abs_err) << r.to_string();
  }
  std::cout << "[accuracy W=8 inprocess, rank 0] " << results[0].to_string() << std::endl;
}

}  // namespace
}  // namespace zerort::testing
