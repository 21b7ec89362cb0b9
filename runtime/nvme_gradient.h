// NvmeGradient: the nvme tier's FP32 gradient kept in the state's file too
// (NvmeStateOptions::gradient_in_file), beside master, m and v. Torch-free; NvmeStateStore owns one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <vector>

#include "io/aligned_buffer_pool.h"
#include "io/direct_file.h"
#include "io/io_queue.h"
#include "optim/grad_stats.h"

namespace zerort {

// Note [gradient in the file]
// The gradient is one region of the file: element i at byte base + 4 i. What the reduces
// accumulate goes there, so a rank's RAM holds none of it but two staging buffers (and the
// Engine's reduce scratch of one bucket's shard); the step reads it with master, m and v.
//   - Zero without I/O. After zero() the region's bytes are stale; the gradient remembers which
//     element ranges were written since (the written set) and hands out zeros for every other
//     element. A window's first reduce of a bucket so reads nothing, and a step zeroes it all
//     for free.
//   - Writes are whole alignment units (Note [Direct I/O alignment]). A range whose ends fall
//     inside a unit first reads the unit when the unit holds written elements outside the
//     range (a neighbouring bucket's), so those are kept; unwritten ones may take any bytes,
//     as they are never handed out.
//   - What it hands out is what the in-memory tier's gradient holds at that moment: after
//     check(inv_scale), the values times inv_scale, the same float products the in-memory
//     tier's unscale_and_check leaves in place; zero() ends that.
//   - check() reads the region piece by piece (pieces of a multiple of kGradStatsBlock
//     elements, two in flight) and folds unscale_and_check_more over them, so its counts and
//     sum of squares have the in-memory pass's bits. It reads the gradient once more than the
//     in-memory tier does, the price of deciding the step before any state is touched.
//   - One caller at a time: the Engine's comm thread (the reduces) and its main thread (the
//     step, the accessors) take turns, ordered by the Engine's own locks. A failed request is
//     thrown once none of this call's requests is still in the kernel; the written set then
//     keeps only what was written before the call, so a caller that drops the window (zero())
//     is consistent again.
class NvmeGradient {
 public:
  // numel elements at byte `base` of `file` (the file holds region_bytes(numel, alignment) from
  // there), moved by `queue`, in units of `alignment` bytes (a multiple of the file's; base one
  // too); staged through two buffers of piece_elements (rounded up to a multiple of
  // kGradStatsBlock) floats. file and queue must outlive it.
  NvmeGradient(const io::DirectFile& file, io::IoQueue& queue, std::uint64_t base, std::size_t numel,
               std::size_t alignment, std::size_t piece_elements);

  // The region's bytes for numel elements (whole alignment units).
  static std::uint64_t region_bytes(std::size_t numel, std::size_t alignment);
  std::size_t staging_bytes() const { return staging_.bytes(); }

  void zero();
  // Elements [offset, offset + n) into out (host memory) / from in.
  void read(std::size_t offset, std::size_t n, float* out);
  void write(std::size_t offset, std::size_t n, const float* in);
  // unscale_and_check over the whole gradient (which stays in the file), then hands out the
  // unscaled values (See Note [gradient in the file]).
  GradStats check(float inv_scale);

  // For a pipeline that reads [offset, offset + n) into slot (aligned, offset a multiple of the
  // alignment in elements): start() issues the reads of the written parts (none, when nothing
  // there was written), finish() waits for them, zeroes the rest and unscales.
  std::vector<io::IoQueue::Request> start(std::size_t offset, std::size_t n, float* slot);
  void finish(std::size_t offset, std::size_t n, float* slot, std::vector<io::IoQueue::Request>& reads);
  // Waits for every one of `reads` (each forgotten once done); after a failure, the rest as forget() does.
  void await(std::vector<io::IoQueue::Request>& reads);
  // Waits out requests after a failure (errors ignored), so their buffers can be reused.
  void forget(std::vector<io::IoQueue::Request>& reads) noexcept;

 private:
  std::uint64_t at(std::size_t element) const { return base_ + element * sizeof(float); }
  bool written_in(std::size_t lo, std::size_t hi) const;  // any written element in [lo, hi)
  void mark_written(std::size_t lo, std::size_t hi);
  void zero_unwritten(std::size_t lo, std::size_t hi, float* slot) const;  // slot holds [lo, hi)
  float* buffer(int k) const { return reinterpret_cast<float*>(staging_.base() + k * staging_.buffer_size()); }
  std::size_t window_end(std::size_t lo, std::size_t end) const;  // a staging buffer's worth from lo

  const io::DirectFile& file_;
  io::IoQueue& queue_;
  std::uint64_t base_;
  std::size_t numel_;
  std::size_t unit_;                            // the alignment, in elements
  std::size_t piece_;                           // a staging buffer, in elements
  io::AlignedBufferPool staging_;               // two buffers, held for good (the pool only aligns and counts them)
  std::map<std::size_t, std::size_t> written_;  // disjoint, non-adjacent [first, end) ranges
  float inv_scale_ = 1.0f;
};

}  // namespace zerort
