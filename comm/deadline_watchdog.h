// DeadlineWatchdog: the deadlines of device work that the host does not wait for.
//
// Note [stream-waited work]
// The engine's reduces and gathers are waited for by the compute stream (Work::
// join_compute_stream), not by the host, so no host wait is left to notice a peer that never
// comes. A watchdog does: one thread per communicator polls each such Work about every
// millisecond, off the step's path (Watched::poll(deadline), NcclWork's: its completion
// event and the communicator's async error).
// - Done: the Work (and the buffers it keeps alive) is dropped, so its buffers are freed in
//   order, never parked.
// - An error, or the deadline passed: poll aborts the communicator (its kernels stop, so the
//   waiting streams move on) and reports done; every later call on the communicator throws,
//   naming the collective that failed: a hang becomes an error at the engine's next
//   collective or step.
// - stop() (the communicator's destructor) polls what is watched until each is done or past
//   its deadline, then drops it; a Work joined after that is waited for by the host.
#pragma once

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace zerort {

// Watched: `bool poll(std::chrono::steady_clock::time_point deadline)`, true once it needs no
// more watching (done, failed, or expired and aborted); it must not throw.
template <typename Watched>
class DeadlineWatchdog {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr std::chrono::milliseconds kPollEvery{1};

  DeadlineWatchdog() = default;
  ~DeadlineWatchdog() { stop(); }
  DeadlineWatchdog(const DeadlineWatchdog&) = delete;
  DeadlineWatchdog& operator=(const DeadlineWatchdog&) = delete;

  // Watches `work` until done or its deadline; false once stopped (the caller waits itself).
  bool watch(std::shared_ptr<Watched> work, Clock::time_point deadline) {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return false;
    works_.emplace_back(std::move(work), deadline);
    if (!thread_.joinable()) thread_ = std::thread([this] { loop(); });
    cv_.notify_all();
    return true;
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
      cv_.notify_all();
    }
    if (thread_.joinable()) thread_.join();
    std::lock_guard<std::mutex> lock(mu_);
    works_.clear();
  }

  size_t watched() const {  // Works still watched
    std::lock_guard<std::mutex> lock(mu_);
    return works_.size();
  }

 private:
  void loop() {
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
        if (!work->poll(deadline)) pending.emplace_back(std::move(work), deadline);
      }
      polled.clear();  // finished Works free their buffers here, off the engine's threads
      lock.lock();
      for (auto& entry : pending) works_.push_back(std::move(entry));
      if (!works_.empty()) cv_.wait_for(lock, kPollEvery, [] { return false; });
    }
  }

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::pair<std::shared_ptr<Watched>, Clock::time_point>> works_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace zerort
