// SerialQueue: one worker thread that runs the tasks pushed to it, one at a time, in the
// order pushed (the two-hop communicator's worker per sub-communicator, Note [pipelined hops]).
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace zerort {

class SerialQueue {
 public:
  SerialQueue();
  // Runs every task still queued, then joins the thread.
  ~SerialQueue();
  SerialQueue(const SerialQueue&) = delete;
  SerialQueue& operator=(const SerialQueue&) = delete;

  // task runs on the worker after every task pushed before it. It must not throw: a task
  // that does ends the process (std::terminate), as the task's owner keeps its own errors.
  void push(std::function<void()> task);

 private:
  void loop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stop_ = false;
  std::thread thread_;  // last: started once the members above exist
};

}  // namespace zerort
