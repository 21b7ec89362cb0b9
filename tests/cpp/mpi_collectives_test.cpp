// The MPI backend in real processes: run under mpirun -np 2, 4 and 8 (see tests/CMakeLists).
// Every rank runs every test; only rank 0 prints gtest's report, and any rank's failure
// makes its exit code, and so mpirun's, non-zero.
#include <gtest/gtest.h>

#include <chrono>
#include <iostream>
#include <thread>

#include "collective_cases.h"
#include "comm/mpi_communicator.h"
#include "core/error.h"
#include "mpi_test_main.h"

namespace zerort::testing {
namespace {

using namespace std::chrono_literals;

Communicator& comm() { return mpi_comm(); }

TEST(Mpi, AllCollectivesAllCounts) {
  for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{1000}, size_t{65539}}) {
    for (const auto& f : check_all_collectives(comm(), count)) ADD_FAILURE() << f;
  }
}

TEST(Mpi, ReduceScatterAccumulateAccuracy) {
  auto r = check_rsa_accuracy(comm(), 4099, 11);
  EXPECT_TRUE(r.rsa_bitwise_equal) << r.to_string();
  EXPECT_GT(r.bf16_max_abs_err, r.rsa_max_abs_err) << r.to_string();
  if (comm().rank() == 0) {
    std::cout << "[accuracy W=" << comm().size() << " mpi] " << r.to_string() << std::endl;
  }
}

// comm.debug: the mismatch is named at the call, and the communicator stays usable.
TEST(Mpi, CountMismatchRaisesOnEveryRankUnderDebug) {
  CommOptions o;
  o.debug = true;
  auto checked = make_mpi_communicator(o);
  std::vector<int64_t> buf(8, 1);
  size_t n = checked->rank() == 1 ? 5 : 4;
  try {
    checked->all_reduce(buf.data(), n, DType::kInt64)->wait();
    ADD_FAILURE() << "no error for mismatched counts";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("count differs across ranks"), std::string::npos) << e.what();
  }
  checked->barrier()->wait();
}

TEST(Mpi, NullBufferAndUnknownDtype) {
  EXPECT_THROW(comm().all_gather(nullptr, nullptr, 3, DType::kFloat32), Error);
  float x = 0;
  EXPECT_THROW(comm().broadcast(&x, 1, static_cast<DType>(-1), 0), Error);
  comm().barrier()->wait();
}

// Rank 0 waits 300 ms for an all_reduce that the other ranks join only after 1 s: rank 0
// gets a CommTimeoutError naming the call; the late calls still complete, and all exit cleanly.
TEST(Mpi, TimeoutNamesTheCollective) {
  if (comm().size() < 2) {  // ctest runs this binary at -np 2, 4 and 8 only
    GTEST_SKIP() << "a timeout needs a peer that arrives late: run under mpirun -np 2 or more";
  }
  CommOptions o;
  o.timeout = 300ms;
  o.debug = false;
  auto late = make_mpi_communicator(o);
  float x = 1;
  if (late->rank() == 0) {
    auto start = std::chrono::steady_clock::now();
    try {
      late->all_reduce(&x, 1, DType::kFloat32)->wait();
      ADD_FAILURE() << "no timeout";
    } catch (const CommTimeoutError& e) {
      std::string what = e.what();
      EXPECT_NE(what.find("all_reduce(count=1, dtype=f32, op=sum) on rank 0"), std::string::npos) << what;
      EXPECT_NE(what.find("300 ms"), std::string::npos) << what;
    }
    EXPECT_LT(std::chrono::steady_clock::now() - start, 2s);
  } else {
    std::this_thread::sleep_for(1s);
    late->all_reduce(&x, 1, DType::kFloat32)->wait(10s);
  }
  comm().barrier()->wait();
}

}  // namespace
}  // namespace zerort::testing
