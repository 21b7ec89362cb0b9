// The shared-memory backend in real processes: run under mpirun -np 2 and 4 (see
// tests/CMakeLists), with MPI as the bootstrap that carries the segment's name. The
// conformance checks compare every collective against references computed from the other
// ranks' seeds; the rest checks the segment's name, timeouts and aborts.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <iostream>
#include <thread>
#include <vector>

#include "collective_cases.h"
#include "comm/shm/shm_communicator.h"
#include "core/error.h"
#include "mpi_test_main.h"

namespace zerort::testing {
namespace {

using namespace std::chrono_literals;

Communicator& shm() {
  static std::unique_ptr<Communicator> c = [] {
    CommOptions o;
    o.timeout = 60s;
    return make_shm_communicator(mpi_comm(), o);
  }();
  return *c;
}

TEST(Shm, AllCollectivesAllCounts) {
  // The last count puts more than one window (4 MiB) into every chunk, for every dtype.
  for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{1000}, size_t{65539}, kShmWindowBytes / 4 + 5}) {
    for (const auto& f : check_all_collectives(shm(), count)) ADD_FAILURE() << "count " << count << ": " << f;
  }
}

// A small window: every call at these counts runs many rounds, and all_to_all's pieces are
// smaller than an element row of the window.
TEST(Shm, ManyRoundsWithASmallWindow) {
  CommOptions o;
  o.timeout = 60s;
  auto small = make_shm_communicator(mpi_comm(), o, 4096);
  for (size_t count : {size_t{1000}, size_t{65539}}) {
    for (const auto& f : check_all_collectives(*small, count)) ADD_FAILURE() << "count " << count << ": " << f;
  }
}

// The default window shrinks as the group grows: the segment stays within its budget (half
// of Docker's default /dev/shm) at any ranks per host, and no window is under a page.
TEST(Shm, DefaultWindowKeepsTheSegmentWithinItsBudget) {
  EXPECT_EQ(shm_window_bytes(2), kShmWindowBytes);
  EXPECT_EQ(shm_window_bytes(4), kShmWindowBytes);
  EXPECT_EQ(shm_window_bytes(8), size_t{2} << 20);
  EXPECT_EQ(shm_window_bytes(64), size_t{256} << 10);
  for (int w = 1; w <= 4096; ++w) {
    EXPECT_LE(2 * static_cast<size_t>(w) * shm_window_bytes(w), std::max(kShmSegmentBudget, size_t{8192} * w)) << w;
    EXPECT_EQ(shm_window_bytes(w) % 4096, 0u) << w;
  }
}

TEST(Shm, ReduceScatterAccumulateAccuracy) {
  auto r = check_rsa_accuracy(shm(), 4099, 11);
  EXPECT_TRUE(r.rsa_bitwise_equal) << r.to_string();
  EXPECT_GT(r.bf16_max_abs_err, r.rsa_max_abs_err) << r.to_string();
  if (shm().rank() == 0) std::cout << "[accuracy W=" << shm().size() << " shm] " << r.to_string() << std::endl;
}

// The name is gone from /dev/shm as soon as every rank has mapped the segment.
TEST(Shm, NothingLeftInDevShm) {
  int64_t pid = getpid();
  mpi_comm().broadcast(&pid, 1, DType::kInt64, 0)->wait();
  auto fresh = make_shm_communicator(mpi_comm(), {});
  const std::string prefix = "zerort-shm-" + std::to_string(pid) + "-";
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
    EXPECT_NE(entry.path().filename().string().rfind(prefix, 0), 0U) << entry.path() << " was left behind";
  }
  fresh->barrier()->wait();
  EXPECT_STREQ(fresh->backend_name(), "shm");
}

// Rank 0 calls an all_reduce that nobody joins: its CommTimeoutError names the call and the
// ranks that did not arrive. Its timeout aborts the segment, so a peer's later call fails at
// once, naming rank 0, instead of at its own timeout.
TEST(Shm, TimeoutNamesTheCallAndTheMissingRanks) {
  CommOptions o;
  o.timeout = 300ms;
  auto late = make_shm_communicator(mpi_comm(), o);
  float x = 1;
  if (late->rank() == 0) {
    const auto start = std::chrono::steady_clock::now();
    try {
      late->all_reduce(&x, 1, DType::kFloat32)->wait();
      ADD_FAILURE() << "no timeout";
    } catch (const CommTimeoutError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("all_reduce(count=1, dtype=f32, op=sum) on rank 0"), std::string::npos) << what;
      EXPECT_NE(what.find("[shm] did not finish within 300 ms: rank 1 (pid "), std::string::npos) << what;
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, 2s);
  }
  mpi_comm().barrier()->wait();
  if (late->rank() == 1) {
    const auto start = std::chrono::steady_clock::now();
    try {
      late->barrier()->wait(10s);
      ADD_FAILURE() << "no error after rank 0 gave up";
    } catch (const CommError& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("barrier(count=0, dtype=f32) on rank 1"), std::string::npos) << what;
      EXPECT_NE(what.find("rank 0 (pid "), std::string::npos) << what;
      EXPECT_NE(what.find("gave up"), std::string::npos) << what;
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, 2s);
  }
  mpi_comm().barrier()->wait();
}

// Calls from two threads run in the order they were issued, and a zero-count call is done at once.
TEST(Shm, CallsRunInIssueOrder) {
  std::vector<int64_t> a(1000, shm().rank() + 1), b(1000, 10 * (shm().rank() + 1));
  WorkPtr first, second;
  std::thread t([&] { first = shm().all_reduce(a.data(), a.size(), DType::kInt64); });
  t.join();
  second = shm().all_reduce(b.data(), b.size(), DType::kInt64);
  EXPECT_NO_THROW(shm().all_reduce(a.data(), 0, DType::kInt64)->wait(1ms));
  second->wait();
  first->wait();
  const int64_t w = shm().size();
  EXPECT_EQ(a[999], w * (w + 1) / 2);
  EXPECT_EQ(b[0], 10 * w * (w + 1) / 2);
}

}  // namespace
}  // namespace zerort::testing
