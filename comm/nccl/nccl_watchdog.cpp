#include "comm/nccl/nccl_watchdog.h"

#include "comm/nccl/nccl_work.h"

namespace zerort {

namespace {
constexpr auto kPollEvery = std::chrono::milliseconds(1);
}

bool NcclWatchdog::watch(std::shared_ptr<NcclWork> work, std::chrono::steady_clock::time_point deadline) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_ || stopped_) return false;
  works_.emplace_back(std::move(work), deadline);
  if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
  cv_.notify_all();
  return true;
}

size_t NcclWatchdog::watched() const {
  std::lock_guard<std::mutex> lock(mu_);
  return works_.size();
}

void NcclWatchdog::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopped_) return;
    stopping_ = true;
    cv_.notify_all();
  }
  if (thread_.joinable()) thread_.join();
  std::lock_guard<std::mutex> lock(mu_);
  works_.clear();
  stopped_ = true;
}

void NcclWatchdog::loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    if (works_.empty()) {
      if (stopping_) return;
      cv_.wait(lock, [&] { return stopping_ || !works_.empty(); });
      continue;
    }
    auto polled = std::move(works_);
    works_.clear();
    lock.unlock();
    decltype(works_) pending;
    for (auto& [work, deadline] : polled) {
      // poll() aborts the communicator on an error or past the deadline, and says done then too.
      if (!work->poll(deadline)) pending.emplace_back(std::move(work), deadline);
    }
    polled.clear();  // finished Works free their buffers here, off the engine's threads
    lock.lock();
    for (auto& entry : pending) works_.push_back(std::move(entry));
    if (!works_.empty()) cv_.wait_for(lock, kPollEvery, [&] { return false; });
  }
}

}  // namespace zerort
