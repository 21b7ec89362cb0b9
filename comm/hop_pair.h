// HopPair: one two-hop collective's two hops, run on two workers (Note [pipelined hops],
// comm/two_hop_communicator.h): the second waits for the first, and the Work the caller got
// completes when the last hop ends, or with the first hop's failure.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>

#include "comm/pending_work.h"

namespace zerort {

class HopPair {
 public:
  // scratch: the token that counts the hops' buffers (Communicator::track_scratch), released
  // when the Work completes.
  HopPair(const CollectiveDesc& desc, std::chrono::milliseconds timeout, std::shared_ptr<void> scratch);

  WorkPtr work() const { return work_; }

  // Runs hop 1 (named `hop` in errors) on the calling worker. A failure completes the Work
  // with the same kind of error, naming the collective and the hop (Note [two hops]).
  void run_first(const char* hop, const std::function<void()>& fn);
  // Waits for hop 1 (on this worker: it holds that worker's later work back, which keeps its
  // order), then runs hop 2 unless hop 1 failed, and completes the Work.
  void run_second(const char* hop, const std::function<void()>& fn);

 private:
  // fn's failure as the same kind of error, naming the collective and the hop; null on success.
  std::exception_ptr run_hop(const char* hop, const std::function<void()>& fn) const;
  void finish(std::exception_ptr error);

  std::shared_ptr<PendingWork> work_;
  std::mutex mu_;
  std::condition_variable cv_;
  enum class First { kRunning, kDone, kFailed } first_ = First::kRunning;
  std::shared_ptr<void> scratch_;
};

}  // namespace zerort
