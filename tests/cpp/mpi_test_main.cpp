#include "mpi_test_main.h"

#include <gtest/gtest.h>

#include <chrono>
#include <memory>

#include "comm/mpi_communicator.h"

namespace zerort::testing {

Communicator& mpi_comm() {
  static std::unique_ptr<Communicator> c = [] {
    CommOptions o;
    o.timeout = std::chrono::seconds(60);
    return make_mpi_communicator(o);
  }();
  return *c;
}

}  // namespace zerort::testing

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (zerort::testing::mpi_comm().rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  int rc = RUN_ALL_TESTS();
  zerort::testing::mpi_comm().barrier()->wait();
  return rc;
}
