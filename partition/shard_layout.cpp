#include "partition/shard_layout.h"

#include <algorithm>

#include "core/error.h"

namespace zerort {

ShardLayout::ShardLayout(std::vector<size_t> numels, int world_size, size_t alignment)
    : numels_(std::move(numels)), world_(world_size), alignment_(alignment) {
  ZRT_CHECK(world_size >= 1, "ShardLayout: world_size must be >= 1, got ", world_size);
  ZRT_CHECK(alignment >= 1, "ShardLayout: alignment must be >= 1 element, got ", alignment);
  offsets_.reserve(numels_.size());
  for (size_t n : numels_) {
    offsets_.push_back(total_);
    total_ += n;
  }
  const size_t unit = alignment_ * static_cast<size_t>(world_);
  const size_t padded = (total_ + unit - 1) / unit * unit;
  shard_numel_ = padded / static_cast<size_t>(world_);
}

void ShardLayout::check_rank(int rank) const {
  ZRT_CHECK(rank >= 0 && rank < world_, "ShardLayout: rank ", rank, " is outside world size ", world_);
}

void ShardLayout::check_param(size_t param) const {
  ZRT_CHECK(param < numels_.size(), "ShardLayout: parameter index ", param, " out of range (", numels_.size(),
            " parameters)");
}

size_t ShardLayout::param_numel(size_t param) const {
  check_param(param);
  return numels_[param];
}

size_t ShardLayout::param_offset(size_t param) const {
  check_param(param);
  return offsets_[param];
}

Range ShardLayout::shard_range(int rank) const {
  check_rank(rank);
  size_t begin = static_cast<size_t>(rank) * shard_numel_;
  return Range{begin, begin + shard_numel_};
}

std::vector<ParamSlice> ShardLayout::slices_in_shard(int rank) const {
  const Range shard = shard_range(rank);
  std::vector<ParamSlice> out;
  // First parameter ending after shard.begin: offsets are sorted, so binary search.
  auto it = std::upper_bound(offsets_.begin(), offsets_.end(), shard.begin);
  size_t p = it == offsets_.begin() ? 0 : static_cast<size_t>(it - offsets_.begin()) - 1;
  for (; p < numels_.size() && offsets_[p] < shard.end; ++p) {
    size_t lo = std::max(offsets_[p], shard.begin);
    size_t hi = std::min(offsets_[p] + numels_[p], shard.end);
    if (lo >= hi) continue;  // empty parameter, or one ending before the shard
    out.push_back(ParamSlice{p, rank, lo - offsets_[p], lo, lo - shard.begin, hi - lo});
  }
  return out;
}

std::vector<ParamSlice> ShardLayout::slices_of_param(size_t param) const {
  check_param(param);
  std::vector<ParamSlice> out;
  size_t lo = offsets_[param], end = lo + numels_[param];
  while (lo < end) {
    int rank = static_cast<int>(lo / shard_numel_);
    size_t shard_begin = static_cast<size_t>(rank) * shard_numel_;
    size_t hi = std::min(end, shard_begin + shard_numel_);
    out.push_back(ParamSlice{param, rank, lo - offsets_[param], lo, lo - shard_begin, hi - lo});
    lo = hi;
  }
  return out;
}

}  // namespace zerort
