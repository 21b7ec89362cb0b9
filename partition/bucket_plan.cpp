#include "partition/bucket_plan.h"

#include "core/error.h"

namespace zerort {

std::vector<BucketPlan> plan_buckets(const std::vector<size_t>& numels, int world_size, size_t bucket_numel,
                                     size_t alignment) {
  ZRT_CHECK(bucket_numel >= 1, "plan_buckets: bucket_numel must be >= 1, got ", bucket_numel);
  std::vector<BucketPlan> plan;
  for (size_t end = numels.size(); end > 0;) {
    std::vector<size_t> params, sizes;
    size_t elems = 0;
    while (end > 0 && (params.empty() || elems < bucket_numel)) {
      --end;
      params.push_back(end);
      sizes.push_back(numels[end]);
      elems += numels[end];
    }
    plan.push_back(BucketPlan{std::move(params), ShardLayout(sizes, world_size, alignment)});
  }
  return plan;
}

}  // namespace zerort
