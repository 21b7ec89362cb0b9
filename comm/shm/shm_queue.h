// ShmQueue: the one worker thread of a shared-memory communicator, which runs its calls in
// the order they were issued (FIFO), whichever threads issue them; and ShmWork, the pending
// handle of one call, which the worker completes.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "comm/pending_work.h"
#include "comm/serial_queue.h"

namespace zerort {

class ShmSegment;

class ShmWork final : public PendingWork {
 public:
  ShmWork(const CollectiveDesc& d, std::chrono::milliseconds timeout, std::shared_ptr<ShmSegment> segment);

  // When the worker gives up on this call: issue time + comm.timeout_s (or never).
  std::chrono::steady_clock::time_point deadline() const { return deadline_; }

 protected:
  // A waiter whose own deadline is as late as the worker's gives the worker a grace period to
  // fail first, with its error that names the ranks that did not arrive.
  bool wait_until(std::chrono::steady_clock::time_point deadline) override;
  // The peers fail at once rather than at their own timeout (the call is abandoned).
  void on_timeout() override;

 private:
  std::chrono::steady_clock::time_point deadline_;
  std::shared_ptr<ShmSegment> segment_;
};

class ShmQueue {
 public:
  // The calls still queued when it is dropped run then, and fail at once on a closed segment.
  ShmQueue() = default;
  ShmQueue(const ShmQueue&) = delete;
  ShmQueue& operator=(const ShmQueue&) = delete;

  // Runs body(work->deadline()) on the worker after every call posted before, then finishes
  // work: with body's error, or, once a call has failed, with that failure without running.
  // The queue holds work (and the buffers it keeps alive) until then.
  void post(std::shared_ptr<ShmWork> work, std::function<void(std::chrono::steady_clock::time_point)> body);

 private:
  void run(ShmWork& work, const std::function<void(std::chrono::steady_clock::time_point)>& body);  // never throws

  std::mutex mu_;
  std::string broken_;  // the first failure: every later call fails with it
  SerialQueue worker_;  // last: its queued calls run (and end) while the members above exist
};

}  // namespace zerort
