// ShardLayout: parameters packed back to back in one flat buffer, the total padded to a
// multiple of W x alignment, and split into W equal shards. Says which part of every
// parameter each rank owns.
#pragma once

#include <cstddef>
#include <vector>

namespace zerort {

struct Range {
  size_t begin = 0;
  size_t end = 0;
  size_t size() const { return end - begin; }
  bool operator==(const Range& o) const { return begin == o.begin && end == o.end; }
};

// The part of one parameter that lies in one shard.
struct ParamSlice {
  size_t param = 0;         // index into the parameter list
  int rank = 0;             // the shard's owner
  size_t param_offset = 0;  // first element within the parameter
  size_t flat_offset = 0;   // first element within the flat buffer
  size_t shard_offset = 0;  // first element within the owner's shard
  size_t numel = 0;         // never 0
};

class ShardLayout {
 public:
  // numels: element count of each parameter, in flat-buffer order (0 allowed).
  // alignment: elements; each shard's size is a multiple of it (e.g. 16 bytes / 2 for bf16).
  ShardLayout(std::vector<size_t> numels, int world_size, size_t alignment = 1);

  int world_size() const { return world_; }
  size_t alignment() const { return alignment_; }
  size_t num_params() const { return numels_.size(); }
  size_t numel() const { return total_; }  // sum of parameter sizes
  size_t padded_numel() const { return shard_numel_ * static_cast<size_t>(world_); }
  size_t padding() const { return padded_numel() - total_; }
  size_t shard_numel() const { return shard_numel_; }
  size_t param_numel(size_t param) const;
  size_t param_offset(size_t param) const;  // where the parameter starts in the flat buffer

  Range shard_range(int rank) const;                            // [begin, end) in the flat buffer
  std::vector<ParamSlice> slices_in_shard(int rank) const;      // in flat order
  std::vector<ParamSlice> slices_of_param(size_t param) const;  // in rank order

 private:
  void check_rank(int rank) const;
  void check_param(size_t param) const;

  std::vector<size_t> numels_;
  std::vector<size_t> offsets_;
  int world_;
  size_t alignment_;
  size_t total_ = 0;
  size_t shard_numel_ = 0;
};

}  // namespace zerort
