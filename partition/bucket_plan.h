// Reduce buckets for ZeRO stages 0-2: runs of consecutive parameters taken in reverse order
// (the order backward completes their gradients), each holding at least bucket_numel
// elements except the last, each split W ways by a ShardLayout of its own. The engine lays
// out its flat buffers from this plan, and the memory estimator sizes them from it.
#pragma once

#include <cstddef>
#include <vector>

#include "partition/shard_layout.h"

namespace zerort {

struct BucketPlan {
  std::vector<size_t> params;  // parameter indices, in bucket order
  ShardLayout layout;          // over those parameters' sizes, in that order
};

std::vector<BucketPlan> plan_buckets(const std::vector<size_t>& numels, int world_size, size_t bucket_numel,
                                     size_t alignment);

}  // namespace zerort
