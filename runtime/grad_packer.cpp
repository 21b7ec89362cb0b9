#include "runtime/grad_packer.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>

#include "core/error.h"

namespace zerort {

GradPacker::GradPacker(std::vector<BucketShape> buckets, bool pooled, at::TensorOptions bytes_options)
    : shapes_(std::move(buckets)), bytes_options_(bytes_options) {
  const size_t n = shapes_.size();
  slot_.assign(n, -1);
  overflow_.resize(n);
  packed_.resize(n);
  size_t largest = 0;
  for (size_t b = 0; b < n; ++b) {
    packed_[b].assign(shapes_[b].params, false);
    largest = std::max(largest, shapes_[b].bytes);
  }
  if (pooled) {  // two: one filling while the other is reduced
    for (auto& slot : pool_) slot = at::empty({static_cast<int64_t>(largest)}, bytes_options_);
  }
}

bool GradPacker::acquire(size_t b) {
  if (slot_[b] >= 0) return true;
  for (int s = 0; s < 2 && pool_[0].defined(); ++s) {
    if (owner_[s] < 0) {
      owner_[s] = static_cast<int>(b);
      slot_[b] = s;
      pool_[s].narrow(0, 0, static_cast<int64_t>(shapes_[b].bytes)).zero_();  // See Note [grad packer]
      return true;
    }
  }
  return false;
}

void GradPacker::ensure(size_t b) {
  if (holds(b) || acquire(b)) return;
  // Stage 3, or stage 2 with gradients out of bucket order (never wait for a later bucket).
  const size_t bytes = shapes_[b].bytes;
  overflow_[b] = at::zeros({static_cast<int64_t>(bytes)}, bytes_options_);
  overflow_peak_ = std::max(overflow_peak_, bytes);
}

const at::Tensor& GradPacker::buffer(size_t b) const {
  ZRT_CHECK(holds(b), "GradPacker: bucket ", b, " holds no pack buffer");
  return slot_[b] >= 0 ? pool_[slot_[b]] : overflow_[b];
}

void* GradPacker::data(size_t b) { return buffer(b).data_ptr(); }

void GradPacker::pack(size_t b, size_t j, int64_t offset, at::Tensor& param) {
  if (packed_[b][j]) return;
  if (param.grad().defined()) {
    at::Tensor pack = buffer(b).narrow(0, 0, static_cast<int64_t>(shapes_[b].bytes)).view(shapes_[b].type);
    pack.narrow(0, offset, param.numel()).copy_(param.grad().reshape({-1}));
    param.mutable_grad() = at::Tensor();  // autograd's buffer is freed here
  }
  packed_[b][j] = true;
}

void GradPacker::release(size_t b) {
  if (slot_[b] >= 0) owner_[slot_[b]] = -1;
  slot_[b] = -1;
  overflow_[b] = at::Tensor();
}

void GradPacker::new_round() {
  for (auto& p : packed_) p.assign(p.size(), false);
}

size_t GradPacker::buffer_bytes() const {
  const size_t pool = pool_[0].defined() ? static_cast<size_t>(pool_[0].numel() + pool_[1].numel()) : 0;
  return pool + overflow_peak_;
}

}  // namespace zerort
