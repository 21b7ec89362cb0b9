// GradPacker: the buffers a bucket's low-precision gradients are packed into before its
// reduce (stages 2 and 3; See Note [reduce policy]): a pool of two shared slots (stage 2),
// one-off buffers when no slot is free (or at stage 3, always), and which of each bucket's
// parameters are packed in this round.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <vector>

namespace zerort {

// Note [grad packer]: a bucket holds at most one buffer at a time, a pool slot or a
// one-off buffer, from acquire()/ensure() until release(). A slot belongs to one bucket
// at a time. A buffer is zero when it is handed out, so padding and the gradients of
// parameters that got none add nothing to the reduce. Each parameter is packed at most
// once per round (until new_round()): its gradient is copied into its place in the buffer
// and the parameter's .grad is dropped, freeing autograd's copy. Not thread-safe: the
// Engine calls it with its mutex held.
class GradPacker {
 public:
  struct BucketShape {
    size_t params = 0;                    // parameters in the bucket
    size_t bytes = 0;                     // its packed size: padded numel * element size
    at::ScalarType type = at::kBFloat16;  // its gradients' dtype
  };

  // pooled: two pool slots, each as large as the largest bucket (stage 2); otherwise every
  // buffer is a one-off (stage 3). bytes_options: uint8 on the buffers' device.
  GradPacker(std::vector<BucketShape> buckets, bool pooled, at::TensorOptions bytes_options);

  // Takes a free pool slot for bucket b if it has none; true when b holds a slot now.
  bool acquire(size_t b);
  // b holds a buffer after this: its own, a free slot, else a new one-off buffer.
  void ensure(size_t b);
  // param (parameter j of bucket b, at element offset in it) into b's buffer, which b must
  // hold; once per round, later calls do nothing.
  void pack(size_t b, size_t j, int64_t offset, at::Tensor& param);
  void* data(size_t b);    // b's buffer
  void release(size_t b);  // b's buffer goes back to the pool, or is freed
  void new_round();        // no parameter is packed

  // The pool's bytes plus the largest one-off buffer so far (the memory report).
  size_t buffer_bytes() const;
  bool holds(size_t b) const { return slot_[b] >= 0 || overflow_[b].defined(); }
  bool slot_free() const { return pool_[0].defined() && (owner_[0] < 0 || owner_[1] < 0); }  // acquire() would succeed
  bool packed(size_t b, size_t j) const { return packed_[b][j]; }

 private:
  const at::Tensor& buffer(size_t b) const;

  std::vector<BucketShape> shapes_;
  at::TensorOptions bytes_options_;
  at::Tensor pool_[2];
  int owner_[2] = {-1, -1};           // the bucket holding each slot
  std::vector<int> slot_;             // per bucket: its pool slot, or -1
  std::vector<at::Tensor> overflow_;  // per bucket: its one-off buffer, or undefined
  std::vector<std::vector<bool>> packed_;
  size_t overflow_peak_ = 0;
};

}  // namespace zerort
