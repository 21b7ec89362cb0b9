// StepOverlap: See Note [overlapped step] (step_overlap.h).
#include "runtime/step_overlap.h"

#include <chrono>

#include "core/error.h"

namespace zerort {

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

StepOverlap::~StepOverlap() {
  try {
    finish();
  } catch (...) {  // a destructor cannot raise
  }
}

void StepOverlap::start(std::size_t units, const std::vector<std::size_t>& done_now, std::function<void()> job) {
  std::lock_guard<std::mutex> lock(mu_);
  if (failed_) std::rethrow_exception(failed_);  // Note [a failed update is final]
  ZRT_CHECK(!running_, "StepOverlap.start: the previous update is still running");
  done_.assign(units, false);
  done_count_ = 0;
  for (std::size_t u : done_now) {
    ZRT_CHECK(u < units, "StepOverlap.start: unit ", u, " of only ", units);
    if (!done_[u]) ++done_count_;
    done_[u] = true;
  }
  running_ = true;
  ended_ = false;
  error_ = nullptr;
  report_ = OverlapReport{};
  report_.units = units;
  worker_ = std::thread([this, job = std::move(job)] {
    const auto t0 = std::chrono::steady_clock::now();
    std::exception_ptr error;
    try {
      job();
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(mu_);
    error_ = error;
    ended_ = true;
    report_.update_seconds = seconds_since(t0);
    cv_.notify_all();
  });
}

void StepOverlap::done(std::size_t unit) {
  std::unique_lock<std::mutex> lock(mu_);
  ZRT_CHECK(unit < done_.size(), "StepOverlap.done: unit ", unit, " of only ", done_.size());
  if (done_[unit]) return;
  if (hold_ && done_count_ + 1 == done_.size()) {  // the test hook: see hold_last_unit
    const bool seen = cv_.wait_for(lock, std::chrono::minutes(1), [&] { return report_.first_wait_seen; });
    report_.hold_timed_out = !seen;
  }
  done_[unit] = true;
  ++done_count_;
  cv_.notify_all();
}

void StepOverlap::wait(std::size_t unit, Waiter who) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!running_) return;
  const bool forward = who == Waiter::kForward;
  if (forward && !report_.first_wait_seen) {
    report_.first_wait_seen = true;
    report_.done_at_first_wait = done_count_;
    cv_.notify_all();  // a worker held by hold_last_unit goes on
  }
  const bool known = unit < done_.size();
  if (known && !done_[unit] && !ended_) {
    const auto t0 = std::chrono::steady_clock::now();
    cv_.wait(lock, [&] { return done_[unit] || ended_; });
    if (forward) {
      report_.waited_seconds += seconds_since(t0);
      ++report_.waits;
    } else if (who == Waiter::kCaller) {
      report_.caller_waited_seconds += seconds_since(t0);
    }
  }
  if (error_) std::rethrow_exception(error_);
}

void StepOverlap::finish() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_) std::rethrow_exception(failed_);
    if (!running_) return;
  }
  {
    std::lock_guard<std::mutex> join_lock(join_mu_);  // two threads may settle at once
    if (worker_.joinable()) worker_.join();
  }
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(mu_);
    running_ = false;
    error = error_;
    error_ = nullptr;
    if (error) failed_ = error;
  }
  if (error) std::rethrow_exception(error);
}

bool StepOverlap::running() const {
  std::lock_guard<std::mutex> lock(mu_);
  return running_;
}

OverlapReport StepOverlap::report() const {
  std::lock_guard<std::mutex> lock(mu_);
  return report_;
}

void StepOverlap::hold_last_unit(bool hold) {
  std::lock_guard<std::mutex> lock(mu_);
  hold_ = hold;
}

}  // namespace zerort
