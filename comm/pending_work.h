// PendingWork: a Work that another thread completes (finish), for collectives a backend runs
// on threads of its own: the two-hop communicator's hops (Note [pipelined hops]) and the shm
// communicator's worker (ShmWork adds its timeout rules).
#pragma once

#include <condition_variable>
#include <exception>
#include <mutex>

#include "comm/work.h"

namespace zerort {

class PendingWork : public Work {
 public:
  using Work::Work;

  // The collective ended: its output is valid (error null), or every wait rethrows error, as
  // it is (the thread that ran it chose its kind and message). Only the first call counts.
  void finish(std::exception_ptr error = nullptr);

 protected:
  bool wait_until(std::chrono::steady_clock::time_point deadline) override;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool finished_ = false;
  std::exception_ptr error_;
};

}  // namespace zerort
