// ShmSegment: the one shared-memory segment (/dev/shm) through which the ranks of one host
// exchange bytes, and the wait for every rank's arrival at a round. See Note [shm rounds].
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"

namespace zerort {

// Note [shm rounds]: the segment holds a header (magic, world size, a nonce, a futex word
// that every arrival bumps, an abort word), one slot per rank (its arrival counter, pid and
// launch rank) and per rank two data windows of window_bytes each. A collective runs as
// rounds: in round s every rank writes its piece into its own window s % 2, publishes
// arrived = s, waits until every rank has, and reads the windows it needs. Writing window
// (s + 1) % 2 is safe once every rank has arrived at s, because a rank arrives at s only
// after it finished reading round s - 1: so one meeting per round, double-buffered. The name
// is unlinked as soon as every rank has mapped the segment, so nothing is left in /dev/shm
// on any exit path, kill -9 included.
class ShmSegment {
 public:
  // Collective over `bootstrap` (the same ranks, any host backend): its rank 0 creates a
  // uniquely named segment, broadcasts the name, the others map it, every rank says whether
  // it could, and rank 0 unlinks the name. Throws CommError naming the path and the fix.
  static std::unique_ptr<ShmSegment> create(Communicator& bootstrap, size_t window_bytes);
  ~ShmSegment();
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  int rank() const { return rank_; }
  int world() const { return world_; }
  size_t window_bytes() const { return window_bytes_; }
  // Rank r's window for round `round` (round % 2 of its two).
  char* window(int r, uint32_t round) const;

  // This rank's pieces of `round` are in its window: tell the others.
  void arrive(uint32_t round);
  // Returns once every rank has arrived at `round`. Throws CommTimeoutError at `deadline`
  // naming `call` and the ranks that have not arrived, CommError when one of them exited
  // (its pid is gone) or a rank aborted the segment, or when close() was called here.
  void wait_all(uint32_t round, std::chrono::steady_clock::time_point deadline, const std::string& call,
                std::chrono::milliseconds timeout);
  // Every rank's waits end with an error naming this rank and `why` (a timeout or a failure
  // here): the peers fail within one wait slice instead of at their timeout.
  void abort(const std::string& why);
  // This process's waits end (its communicator is closing); the peers are not told.
  void close() { closing_.store(true); }

  struct Header;  // the layout in shared memory: comm/shm/shm_layout.h
  struct Slot;

 private:
  ShmSegment(void* base, size_t bytes, int rank, int world, size_t window_bytes);
  Header& header() const;
  Slot& slot(int r) const;
  bool all_arrived(uint32_t round) const;
  std::string missing(uint32_t round) const;  // "rank 2 (pid 1234), rank 3 (pid 1240)"
  std::string who(int r) const;               // "rank 1 (pid 1234)", with the launch rank when it differs
  void throw_if_aborted(const std::string& call) const;
  void check_peers(uint32_t round, const std::string& call) const;
  void sleep_slice(uint32_t seen, std::chrono::steady_clock::time_point until);

  void* base_;
  size_t bytes_;
  int rank_;
  int world_;
  size_t window_bytes_;
  size_t data_offset_;
  std::vector<bool> watch_pid_;  // per rank: its pid was visible from here at creation
  std::atomic<bool> closing_{false};
};

}  // namespace zerort
