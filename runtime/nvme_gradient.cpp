#include "runtime/nvme_gradient.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <iterator>

#include "core/error.h"
#include "io/alignment.h"

namespace zerort {

namespace {

std::size_t round_down(std::size_t x, std::size_t unit) { return x / unit * unit; }

}  // namespace

NvmeGradient::NvmeGradient(const io::DirectFile& file, io::IoQueue& queue, std::uint64_t base, std::size_t numel,
                           std::size_t alignment, std::size_t piece_elements)
    : file_(file), queue_(queue), base_(base), numel_(numel), unit_(alignment / sizeof(float)),
      piece_(io::round_up(std::max<std::size_t>(piece_elements, 1), std::max(kGradStatsBlock, unit_))),
      staging_(2, piece_ * sizeof(float), file.alignment()) {
  ZRT_CHECK(alignment % file.alignment() == 0 && base % alignment == 0 &&
                base + region_bytes(numel, alignment) <= file.size(),
            "NvmeGradient: the region at ", base, " for ", numel, " elements in units of ", alignment,
            " bytes does not fit ", file.path(), " (", file.size(), " bytes, alignment ", file.alignment(), ")");
}

std::uint64_t NvmeGradient::region_bytes(std::size_t numel, std::size_t alignment) {
  return io::round_up(numel * sizeof(float), alignment);
}

void NvmeGradient::zero() {
  written_.clear();
  inv_scale_ = 1.0f;
}

bool NvmeGradient::written_in(std::size_t lo, std::size_t hi) const {
  if (lo >= hi) return false;
  auto it = written_.upper_bound(lo);
  if (it != written_.begin() && std::prev(it)->second > lo) return true;
  return it != written_.end() && it->first < hi;
}

void NvmeGradient::mark_written(std::size_t lo, std::size_t hi) {
  if (lo >= hi) return;
  auto it = written_.upper_bound(lo);
  if (it != written_.begin() && std::prev(it)->second >= lo) --it;
  while (it != written_.end() && it->first <= hi) {
    lo = std::min(lo, it->first);
    hi = std::max(hi, it->second);
    it = written_.erase(it);
  }
  written_.emplace(lo, hi);
}

void NvmeGradient::zero_unwritten(std::size_t lo, std::size_t hi, float* slot) const {
  std::size_t pos = lo;
  auto it = written_.upper_bound(lo);
  if (it != written_.begin()) --it;
  for (; pos < hi && it != written_.end() && it->first < hi; ++it) {
    if (it->second <= pos) continue;
    if (it->first > pos) std::memset(slot + (pos - lo), 0, (it->first - pos) * sizeof(float));
    pos = std::max(pos, it->second);
  }
  if (pos < hi) std::memset(slot + (pos - lo), 0, (hi - pos) * sizeof(float));
}

std::size_t NvmeGradient::window_end(std::size_t lo, std::size_t end) const {
  return std::min(lo + piece_, io::round_up(end, unit_));
}

std::vector<io::IoQueue::Request> NvmeGradient::start(std::size_t offset, std::size_t n, float* slot) {
  ZRT_CHECK(offset % unit_ == 0 && offset + n <= io::round_up(numel_, unit_), "NvmeGradient::start: [", offset, ", ",
            offset + n, ") is not an aligned range of the gradient of ", numel_, " elements");
  std::vector<io::IoQueue::Request> reads;
  const std::size_t hi = offset + n;
  auto it = written_.upper_bound(offset);
  if (it != written_.begin()) --it;
  std::size_t done = offset;  // the units below are read already
  try {
    for (; it != written_.end() && it->first < hi; ++it) {
      const std::size_t lo = std::max({round_down(std::max(it->first, offset), unit_), done});
      const std::size_t up = io::round_up(std::min(it->second, hi), unit_);
      if (lo >= up) continue;
      reads.push_back(queue_.read(file_, at(lo), slot + (lo - offset), (up - lo) * sizeof(float)));
      done = up;
    }
  } catch (...) {
    forget(reads);
    throw;
  }
  return reads;
}

void NvmeGradient::await(std::vector<io::IoQueue::Request>& reads) {
  try {
    while (!reads.empty()) {
      queue_.wait(reads.front());
      reads.erase(reads.begin());
    }
  } catch (...) {
    forget(reads);
    throw;
  }
}

void NvmeGradient::finish(std::size_t offset, std::size_t n, float* slot, std::vector<io::IoQueue::Request>& reads) {
  await(reads);
  zero_unwritten(offset, offset + n, slot);
  if (inv_scale_ != 1.0f) {
    for (std::size_t i = 0; i < n; ++i) slot[i] *= inv_scale_;
  }
}

void NvmeGradient::forget(std::vector<io::IoQueue::Request>& reads) noexcept {
  for (io::IoQueue::Request r : reads) {
    try {
      queue_.wait(r);
    } catch (...) {  // its error, or one already forgotten: either way none of it is in the kernel
    }
  }
  reads.clear();
}

void NvmeGradient::read(std::size_t offset, std::size_t n, float* out) {
  ZRT_CHECK(offset <= numel_ && n <= numel_ - offset, "NvmeGradient::read: [", offset, ", ", offset + n,
            ") lies outside the gradient of ", numel_, " elements");
  const std::size_t end = offset + n;
  for (std::size_t pos = offset; pos < end;) {
    const std::size_t lo = round_down(pos, unit_), hi = window_end(lo, end);
    std::vector<io::IoQueue::Request> reads = start(lo, hi - lo, buffer(0));
    finish(lo, hi - lo, buffer(0), reads);
    const std::size_t stop = std::min(end, hi);
    std::memcpy(out + (pos - offset), buffer(0) + (pos - lo), (stop - pos) * sizeof(float));
    pos = stop;
  }
}

void NvmeGradient::write(std::size_t offset, std::size_t n, const float* in) {
  ZRT_CHECK(offset <= numel_ && n <= numel_ - offset, "NvmeGradient::write: [", offset, ", ", offset + n,
            ") lies outside the gradient of ", numel_, " elements");
  const std::size_t end = offset + n;
  std::vector<io::IoQueue::Request> pending[2], keep;  // per staging buffer its write; the end units' reads
  int k = 0;
  try {
    for (std::size_t pos = offset; pos < end; k ^= 1) {
      const std::size_t lo = round_down(pos, unit_), hi = window_end(lo, end), stop = std::min(end, hi);
      float* buf = buffer(k);
      await(pending[k]);  // the buffer's last write is done
      // The end units keep their written elements outside [pos, stop) (See Note [gradient in the file]).
      if (pos > lo && written_in(lo, pos)) keep.push_back(queue_.read(file_, at(lo), buf, unit_ * sizeof(float)));
      const std::size_t tail = hi - unit_;
      if (stop < hi && written_in(stop, hi) && !(tail == lo && !keep.empty())) {
        keep.push_back(queue_.read(file_, at(tail), buf + (tail - lo), unit_ * sizeof(float)));
      }
      await(keep);
      std::memcpy(buf + (pos - lo), in + (pos - offset), (stop - pos) * sizeof(float));
      pending[k].push_back(queue_.write(file_, at(lo), buf, (hi - lo) * sizeof(float)));
      pos = stop;
    }
    await(pending[0]);
    await(pending[1]);
  } catch (...) {
    for (auto* reads : {&pending[0], &pending[1], &keep}) forget(*reads);
    throw;
  }
  mark_written(offset, end);
}

GradStats NvmeGradient::check(float inv_scale) {
  ZRT_CHECK(inv_scale_ == 1.0f, "NvmeGradient::check: the gradient is unscaled already (check() twice before zero())");
  GradStats stats;
  std::vector<io::IoQueue::Request> reads[2];
  auto piece_end = [&](std::size_t lo) { return std::min(numel_, lo + piece_); };
  try {
    if (numel_ > 0) reads[0] = start(0, piece_end(0), buffer(0));
    for (std::size_t lo = 0, k = 0; lo < numel_; lo += piece_, k ^= 1) {
      const std::size_t next = lo + piece_;  // read the next piece while this one is checked
      if (next < numel_) reads[k ^ 1] = start(next, piece_end(next) - next, buffer(static_cast<int>(k ^ 1)));
      const std::size_t n = piece_end(lo) - lo;
      finish(lo, n, buffer(static_cast<int>(k)), reads[k]);
      unscale_and_check_more(buffer(static_cast<int>(k)), n, inv_scale, stats);  // pieces start on its blocks
    }
  } catch (...) {
    forget(reads[0]);
    forget(reads[1]);
    throw;
  }
  inv_scale_ = inv_scale;
  return stats;
}

}  // namespace zerort
