// ShmQueue: the one worker thread of a shared-memory communicator, which runs its calls in
// the order they were issued (FIFO), whichever threads issue them; and ShmWork, the pending
// handle of one call.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "comm/serial_queue.h"
#include "comm/work.h"

namespace zerort {

class ShmSegment;

class ShmQueue {
 public:
  // One call: the worker runs `body` with the call's deadline, then marks it done (or failed).
  struct Op {
    std::function<void(std::chrono::steady_clock::time_point)> body;
    std::chrono::steady_clock::time_point deadline;  // issue time + comm.timeout_s
    std::mutex mu;
    std::condition_variable cv;
    bool done = false;
    bool timed_out = false;
    std::string error;  // set when the body threw
  };

  // The calls still queued when it is dropped run then, and fail at once on a closed segment.
  ShmQueue() = default;
  ShmQueue(const ShmQueue&) = delete;
  ShmQueue& operator=(const ShmQueue&) = delete;

  std::shared_ptr<Op> post(std::function<void(std::chrono::steady_clock::time_point)> body,
                           std::chrono::milliseconds timeout);

 private:
  void run(Op& op);  // on the worker; never throws
  void finish(Op& op, bool timed_out, const std::string& error);

  std::mutex mu_;
  std::string broken_;  // the first failure: every later call fails with it
  SerialQueue worker_;  // last: its queued calls run (and end) while the members above exist
};

class ShmWork final : public Work {
 public:
  ShmWork(const CollectiveDesc& d, std::chrono::milliseconds timeout, std::shared_ptr<ShmQueue::Op> op,
          std::shared_ptr<ShmSegment> segment);
  ~ShmWork() override;

 protected:
  bool wait_until(std::chrono::steady_clock::time_point deadline) override;
  // The peers fail at once rather than at their own timeout (the call is abandoned).
  void on_timeout() override;

 private:
  std::shared_ptr<ShmQueue::Op> op_;
  std::shared_ptr<ShmSegment> segment_;
};

}  // namespace zerort
