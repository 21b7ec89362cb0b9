#include "runtime/shard_groups.h"

#include <algorithm>
#include <vector>

namespace zerort {

void sum_across_replicas(Communicator& replicas, float* grad, size_t n, InterNodeWire wire, int64_t tag) {
  const size_t groups = static_cast<size_t>(replicas.size());
  if (groups == 1 || n == 0) return;
  const size_t piece = (n + groups - 1) / groups;
  std::vector<float> parts(groups * piece, 0.0f), mine(piece);
  std::copy_n(grad, n, parts.begin());
  sum_over_wire(replicas, parts.data(), piece, wire, mine.data(), false);
  gather_over_wire(replicas, mine.data(), piece, wire, parts.data(), tag);
  std::copy_n(parts.begin(), n, grad);
}

}  // namespace zerort
