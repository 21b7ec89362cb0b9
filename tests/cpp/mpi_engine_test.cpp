// The Engine in real processes under mpirun (-np 2 and 4): stage 1 and 2, bf16 and f16,
// against the single-process reference, and stage 1 == stage 2 bitwise.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <iostream>

#include "comm/mpi_communicator.h"
#include "mpi_test_main.h"
#include "engine_cases.h"

namespace zerort::testing {
namespace {

Communicator& comm() { return mpi_comm(); }

TEST(MpiEngine, ParityAndDeterminism) {
  for (DType precision : {DType::kBFloat16, DType::kFloat16}) {
    std::vector<float> stage_master[2];
    for (int stage : {1, 2}) {
      RunConfig config;
      config.options = default_options(stage, precision);
      auto run = run_engine(comm(), config);
      auto ref = run_reference(comm().size(), config, run.scales);
      double diff = 0, scale = 0;
      for (size_t i = 0; i < ref.master.size(); ++i) {
        diff = std::max(diff, std::fabs(static_cast<double>(run.master[i]) - ref.master[i]));
        scale = std::max(scale, std::fabs(static_cast<double>(ref.master[i])));
      }
      if (comm().rank() == 0) {
        std::cout << "[parity mpi W=" << comm().size() << " stage " << stage << " " << dtype_name(precision)
                  << "] max |master - reference| / max |reference| = " << diff / scale << std::endl;
      }
      EXPECT_LT(diff / scale, 5e-4);  // tolerance justified in test_engine.cpp
      stage_master[stage - 1] = run.master;
    }
    EXPECT_EQ(0, std::memcmp(stage_master[0].data(), stage_master[1].data(), stage_master[0].size() * 4));
  }
}

}  // namespace
}  // namespace zerort::testing
