// SecondaryShards: stage 3's node-local secondary shards (hpZ: stage3.secondary_shard_size,
// DeepSpeed's zero_hpz_partition_size).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <vector>

#include "comm/communicator.h"

namespace zerort {

// Note [secondary shards]
// `part` holds G consecutive ranks of the shard group (a node's, by default), this rank at
// index l. When a unit has been gathered from the primary shards (over the shard group), each
// rank keeps piece l of it in the compute dtype: elements [l P, (l + 1) P) of the padded unit,
// P = padded / G (a whole number: the group's size is a multiple of G and every shard a multiple
// of the alignment). Until the weights change (the next update, or a load), every gather of
// that unit is an all-gather of the pieces within `part`: the backward's re-gather and the
// forwards of the window's later micro-steps never leave the node. The pieces are the gathered
// bits, so the unit is the same either way. Memory: the pieces of every unit that is gathered
// and released, 2 Psi / G bytes in bf16 per rank, allocated at a unit's first gather and kept.
// Ranks agree on each gather's path without a message: all of them gather the same units in
// the same order (Note [checked calls]), and forget() runs at the same step on every rank.
class SecondaryShards {
 public:
  SecondaryShards() = default;
  SecondaryShards(Communicator* part, size_t units);
  bool on() const { return part_ != nullptr; }
  bool holds(size_t unit) const;  // a piece of the current weights
  // full: the unit as gathered (every rank's piece of it is kept).
  void keep(size_t unit, const at::Tensor& full);
  // full (padded, of dtype) whole again from the part's pieces; waited for.
  void gather(size_t unit, const at::Tensor& full, DType dtype, int64_t tag);
  void forget();         // the weights change: no piece is current
  size_t bytes() const;  // the pieces allocated

 private:
  Communicator* part_ = nullptr;
  mutable std::mutex mu_;
  std::vector<at::Tensor> pieces_;
  std::vector<bool> current_;
};

}  // namespace zerort
