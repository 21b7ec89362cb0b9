#include "runtime/secondary_shards.h"

#include <ATen/ops/empty.h>

#include "core/error.h"

namespace zerort {

SecondaryShards::SecondaryShards(Communicator* part, size_t units)
    : part_(part), pieces_(units), current_(units, false) {}

bool SecondaryShards::holds(size_t unit) const {
  std::lock_guard<std::mutex> lock(mu_);
  return part_ != nullptr && current_.at(unit);
}

void SecondaryShards::keep(size_t unit, const at::Tensor& full) {
  const int64_t g = part_->size(), piece = full.numel() / g;
  ZRT_CHECK(piece * g == full.numel(), "SecondaryShards: unit ", unit, " of ", full.numel(),
            " elements does not split into ", g, " pieces");
  std::lock_guard<std::mutex> lock(mu_);
  at::Tensor& mine = pieces_.at(unit);
  if (!mine.defined()) mine = at::empty({piece}, full.options());
  mine.copy_(full.narrow(0, part_->rank() * piece, piece));
  current_[unit] = true;
}

void SecondaryShards::gather(size_t unit, const at::Tensor& full, DType dtype, int64_t tag) {
  at::Tensor mine;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ZRT_CHECK(current_.at(unit), "SecondaryShards: unit ", unit, " has no current piece");
    mine = pieces_[unit];
  }
  // The unit's forward reads it on the compute stream: a device backend's wait is that stream's.
  wait_in_stream_order(
      part_->all_gather(mine.data_ptr(), full.data_ptr(), static_cast<size_t>(mine.numel()), dtype, tag));
}

void SecondaryShards::forget() {
  std::lock_guard<std::mutex> lock(mu_);
  current_.assign(current_.size(), false);
}

size_t SecondaryShards::bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  size_t n = 0;
  for (const at::Tensor& p : pieces_) n += p.defined() ? static_cast<size_t>(p.nbytes()) : 0;
  return n;
}

}  // namespace zerort
