// The step's one collective. It carries what every rank must agree on before an update:
// the gradient's non-finite count and sum of squares, the micro-steps that had no backward
// pass, and a summary (count and fingerprint) of the collectives this rank called since the
// previous decision. So the default cross-rank check costs no round-trip of its own: a rank
// that skipped backward, or called a different collective that the transport let through
// (the same bytes for another bucket, unit, dtype, count, or under MPI another collective),
// is named at the step, on every rank, before anything is updated. Calls the transport
// cannot pair fail at the call first (a timeout naming it; gloo ends the process on a byte
// size mismatch) unless every call is checked as it is made (Note [checked calls]).
#pragma once

#include <cstdint>

#include "comm/communicator.h"

namespace zerort {

// The tag of the decision's collective (bucket and unit tags are >= 0), so under
// comm.debug a rank that reaches the step while another is still in a collective of
// backward is named at that collective.
constexpr int64_t kStepDecisionTag = -2;

struct RankReport {
  int64_t nonfinite = 0;        // non-finite gradient values in this rank's shard
  double sum_squares = 0;       // of this rank's (unscaled) gradient shard
  int64_t missed_backward = 0;  // micro-steps of this window without a backward pass
};

struct Decision {
  int64_t nonfinite = 0;
  double sum_squares = 0;  // summed in rank order 0..W-1: bitwise the same on every rank
};

// One all-reduce of W rows of 5 int64 (each rank fills its own row, so it is an all-gather
// that every backend runs on host memory); none at W = 1. owner_ranks > 0: only ranks
// 0..owner_ranks-1's figures are summed, since they hold every element once (stage 0: rank 0's
// are already global; hybrid sharding: group 0's); 0 sums every rank's. Clears the
// communicator's call log (a new window starts). Throws UsageError on every rank alike when
// a rank had a micro-step without backward (naming the ranks), or when the ranks' calls
// differ (one more collective, only then, names the first call that differs on each rank).
// window: the accumulation window's length, for the message.
Decision decide_step(Communicator& comm, const RankReport& mine, int owner_ranks, int64_t window);

}  // namespace zerort
