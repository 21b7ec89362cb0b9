// The training-loop rule every stage enforces at the accumulation boundary: every rank ran
// at least one backward pass in every micro-step of the window.
#pragma once

#include <cstdint>

#include "comm/communicator.h"

namespace zerort {

// The tag of the check's all-gather (bucket and unit tags are >= 0), so a rank that reaches
// it while another is still reducing a bucket is named by the cross-rank check.
constexpr int64_t kBackwardCheckTag = -2;

// missed: this rank's micro-steps in the window that had no backward pass. One all-gather
// of the counts (none at W = 1); when any is non-zero, throws UsageError on every rank,
// naming the ranks and saying what to do.
void check_backward_calls(Communicator& comm, int64_t missed, int64_t window);

}  // namespace zerort
