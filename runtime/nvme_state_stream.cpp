// NvmeStateStore's update: the state streamed through the pool, chunk by chunk, in offset order
// (update) or in the order of the caller's ranges (update_ranges). See Note [NVMe state store].
#include <algorithm>
#include <cstring>
#include <exception>
#include <utility>
#include <vector>

#include "core/error.h"
#include "runtime/nvme_state_store.h"

namespace zerort {

bool NvmeStateStore::read_ahead(std::size_t c, bool block) {
  const auto is_c = [c](const InFlight& f) { return f.chunk == c; };
  if (!block &&
      (std::any_of(writes_.begin(), writes_.end(), is_c) || std::any_of(reads_.begin(), reads_.end(), is_c))) {
    return false;  // its write is still in flight, or an earlier visit's read still to be stepped
  }
  finish_write_of(c);  // never read a record before its last write is done
  void* buffer = take_buffer(writes_, block);
  if (buffer == nullptr) return false;
  reads_.push_back({c, buffer, 0});
  reads_.back().request = queue_.read(file_, chunk_offset(c), buffer, chunk_stride_);
  return true;
}

void NvmeStateStore::prefetch() {
  check_usable("prefetch");
  try {
    retire_done_writes(writes_);
    const std::size_t ahead = std::min(read_order_.size(), pool_.buffer_count());
    while (reads_.size() < ahead && read_ahead(read_order_[reads_.size()], false)) {
    }
  } catch (const std::exception& e) {
    drain(reads_, writes_, detail::concat("prefetch() failed: ", e.what()));
    throw;
  }
}

void NvmeStateStore::update(const ChunkFn& fn) {
  std::vector<Part> parts;
  for (std::size_t c = 0; c < chunk_count(); ++c) parts.push_back({c, c * chunk_elements_, chunk_numel(c)});
  stream(parts, fn);
}

// See Note [NVMe state store]: order.
void NvmeStateStore::update_ranges(const std::vector<std::pair<size_t, size_t>>& ranges, const ChunkFn& fn) {
  check_usable("update_ranges");
  check_ranges_tile(ranges, static_cast<size_t>(numel_), "NvmeStateStore::update_ranges");
  std::vector<std::pair<size_t, size_t>> given;  // the ranges that hold elements, in order
  for (const auto& range : ranges) {
    if (range.second > 0) given.push_back(range);
  }
  const auto end = [&](std::size_t k) { return given[k].first + given[k].second; };
  std::vector<Part> parts;
  for (std::size_t k = 0; k < given.size(); ++k) {
    const auto [offset, n] = given[k];
    // Down where it meets its neighbour at its start: it ends where the last range began, or
    // (not going on from the last one's end) the next range ends where it begins.
    const bool after_down = k > 0 && end(k) == given[k - 1].first, after_up = k > 0 && offset == end(k - 1);
    const bool down = after_down || (!after_up && k + 1 < given.size() && end(k + 1) == offset);
    const std::size_t first = offset / chunk_elements_, last = (offset + n - 1) / chunk_elements_;
    for (std::size_t i = 0; i <= last - first; ++i) {
      const std::size_t c = down ? last - i : first + i, start = c * chunk_elements_;
      const std::size_t lo = std::max(offset, start), hi = std::min(offset + n, start + chunk_numel(c));
      parts.push_back({c, lo, hi - lo});
    }
  }
  stream(parts, fn);
}

// See Note [NVMe state store]: the pipeline.
void NvmeStateStore::stream(const std::vector<Part>& parts, const ChunkFn& fn) {
  check_usable("update");
  // Visits: runs of consecutive parts of one chunk, each read and written once. The file's, in
  // order, are what the next prefetch() reads first.
  std::vector<std::size_t> visit_start, file_chunks;
  for (std::size_t k = 0; k < parts.size(); ++k) {
    if (k > 0 && parts[k].chunk == parts[k - 1].chunk) continue;
    visit_start.push_back(k);
    if (parts[k].chunk >= ram_chunks_) file_chunks.push_back(parts[k].chunk);
  }
  visit_start.push_back(parts.size());
  void* computing = nullptr;  // the buffer fn is working on, out of both lists
  try {
    // Reads prefetch() started for another order are of no use to this one.
    for (std::size_t j = 0; j < reads_.size(); ++j) {
      if (j >= file_chunks.size() || reads_[j].chunk != file_chunks[j]) {
        drop_reads();
        break;
      }
    }
    read_order_ = file_chunks;
    std::size_t next = reads_.size(), stepped = 0;  // file visits read (or reading), and stepped
    for (std::size_t v = 0; v + 1 < visit_start.size(); ++v) {
      const std::size_t c = parts[visit_start[v]].chunk;
      const bool in_file = c >= ram_chunks_;
      // A file visit must be in flight (waiting for a write when no buffer is free); later ones
      // are read ahead as far as free buffers allow, also while RAM records are stepped.
      while (next < file_chunks.size() && next - stepped < pool_.buffer_count() &&
             read_ahead(file_chunks[next], in_file && next == stepped)) {
        ++next;
      }
      for (InFlight& r : reads_) start_grad(r);  // prefetch() read the records only
      void* record = ram_chunks_ > c ? static_cast<void*>(ram_record(c)) : nullptr;
      if (in_file) {
        ZRT_CHECK(!reads_.empty() && reads_.front().chunk == c, "NvmeStateStore::update: chunk ", c,
                  " is not being read (pool of ", pool_.buffer_count(), ")");  // unreachable
        queue_.wait(reads_.front().request);
        if (file_grad_) {
          file_grad_->finish(c * chunk_elements_, chunk_numel(c), grad_slot(reads_.front().buffer),
                             reads_.front().grad_reads);
        }
        record = computing = reads_.front().buffer;
        reads_.pop_front();
      }
      const AdamWBuffers whole = view(c, record);
      for (std::size_t k = visit_start[v]; k < visit_start[v + 1]; ++k) {
        fn(parts[k].offset, elements_of(whole, parts[k].offset - c * chunk_elements_, parts[k].n));
      }
      if (!in_file) continue;  // a RAM record is stepped in place (See Note: split)
      writes_.push_back({c, computing, queue_.write(file_, chunk_offset(c), computing, chunk_stride_)});
      computing = nullptr;
      ++stepped;
      retire_done_writes(writes_);
    }
    // The last writes stay in flight, hidden behind what the caller does next; every other
    // call waits for the ones it needs (See Note [NVMe state store]).
  } catch (const std::exception& e) {
    if (computing != nullptr) pool_.release(computing);
    drain(reads_, writes_, detail::concat("update() failed: ", e.what()));
    throw;
  }
}

}  // namespace zerort
