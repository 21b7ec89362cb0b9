// The segment's header and per-rank slots as they lie in shared memory (Note [shm rounds]).
// Only comm/shm/ sees this layout; every process of the segment maps the same bytes.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "comm/shm/shm_segment.h"

namespace zerort {

static_assert(std::atomic<uint32_t>::is_always_lock_free, "shm futex words need lock-free 32-bit atomics");
static_assert(std::atomic<int32_t>::is_always_lock_free, "shm words need lock-free 32-bit atomics");

constexpr uint64_t kShmMagic = 0x7a65726f72742d31ULL;  // "zerort-1"
constexpr size_t kShmReasonBytes = 512;

// Zeroed by ftruncate, then filled by the creating rank before the name is broadcast.
struct ShmSegment::Header {
  uint64_t magic;
  uint64_t nonce;  // rank 0's random number, broadcast with the name: the others check it
  uint64_t world;
  uint64_t window_bytes;
  alignas(64) std::atomic<uint32_t> futex;  // bumped by every arrival and abort; FUTEX_WAIT on it
  std::atomic<uint32_t> sleepers;           // ranks inside FUTEX_WAIT: an arrival wakes only if any
  std::atomic<int32_t> abort_claim;         // rank + 1 of the first rank to abort (0: none)
  std::atomic<int32_t> aborted_by;          // set after abort_reason is written
  char abort_reason[kShmReasonBytes];
};

struct ShmSegment::Slot {
  alignas(64) std::atomic<uint32_t> arrived;  // the last round this rank arrived at
  std::atomic<int32_t> pid;
  std::atomic<int32_t> launch_rank;  // its rank in the launch (torchrun's RANK), -1 when unknown
};

// Where the data windows start: after the header and the slots, page-aligned.
inline size_t shm_data_offset(int world) {
  const size_t used = sizeof(ShmSegment::Header) + static_cast<size_t>(world) * sizeof(ShmSegment::Slot);
  return (used + 4095) / 4096 * 4096;
}

}  // namespace zerort
