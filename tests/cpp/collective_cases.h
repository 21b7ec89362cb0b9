// Backend-independent conformance checks: every collective, dtype and op on one
// Communicator, against a reference computed on each rank from the other ranks' seeds.
// Used by the in-process gtest (threads) and the MPI test (processes).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "comm/communicator.h"

namespace zerort::testing {

// Runs all_reduce (sum/max/min), reduce_scatter (sum/max/min), all_gather, all_to_all,
// broadcast and reduce_scatter_accumulate (bf16/f16, overwrite and accumulate) for every
// dtype at `count` elements (per rank chunk where the collective has chunks), plus barrier.
// Inputs are small integers, so every dtype and summation order gives an exact reference.
// Returns one line per failure; empty means all passed.
std::vector<std::string> check_all_collectives(Communicator& comm, size_t count);

struct AccuracyResult {
  bool rsa_bitwise_equal = false;  // reduce_scatter_accumulate == fp64 sum rounded once to fp32
  double rsa_max_abs_err = 0;      // vs the fp64 sum
  double bf16_max_abs_err = 0;     // a plain bf16 reduce_scatter of the same data
  double rsa_mean_abs_err = 0;
  double bf16_mean_abs_err = 0;
  std::string to_string() const;
};

// Random N(0,1) bf16 gradients (seeded per rank) of size()*count elements on every rank.
AccuracyResult check_rsa_accuracy(Communicator& comm, size_t count, uint64_t seed);

}  // namespace zerort::testing
