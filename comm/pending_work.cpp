#include "comm/pending_work.h"

#include <utility>

namespace zerort {

void PendingWork::finish(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (finished_) return;
    finished_ = true;
    error_ = std::move(error);
  }
  cv_.notify_all();
}

bool PendingWork::wait_until(std::chrono::steady_clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_until(lock, deadline, [&] { return finished_; })) return false;
  if (error_) std::rethrow_exception(error_);
  return true;
}

}  // namespace zerort
