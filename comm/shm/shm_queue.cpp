#include "comm/shm/shm_queue.h"

#include "comm/shm/shm_segment.h"
#include "core/error.h"

namespace zerort {

namespace {

// The worker gives up at the call's own deadline and names the ranks that did not arrive; a
// waiter whose deadline is as late gives it this long to say so before the generic timeout.
constexpr auto kWorkerGrace = std::chrono::milliseconds(500);

std::chrono::steady_clock::time_point deadline_after(std::chrono::milliseconds timeout) {
  const auto now = std::chrono::steady_clock::now();
  const auto room =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::time_point::max() - now);
  return timeout >= room ? std::chrono::steady_clock::time_point::max() : now + timeout;
}

}  // namespace

ShmWork::ShmWork(const CollectiveDesc& d, std::chrono::milliseconds timeout, std::shared_ptr<ShmSegment> segment)
    : PendingWork(d, timeout), deadline_(deadline_after(timeout)), segment_(std::move(segment)) {}

bool ShmWork::wait_until(std::chrono::steady_clock::time_point deadline) {
  if (PendingWork::wait_until(deadline)) return true;
  const bool worker_times_out = deadline_ != std::chrono::steady_clock::time_point::max();
  if (deadline < deadline_ || !worker_times_out) return false;
  return PendingWork::wait_until(deadline_ + kWorkerGrace);
}

void ShmWork::on_timeout() { segment_->abort(desc().to_string() + " timed out on this rank"); }

void ShmQueue::post(std::shared_ptr<ShmWork> work, std::function<void(std::chrono::steady_clock::time_point)> body) {
  worker_.push([this, work = std::move(work), body = std::move(body)] { run(*work, body); });
}

void ShmQueue::run(ShmWork& work, const std::function<void(std::chrono::steady_clock::time_point)>& body) {
  std::string broken;
  {
    std::lock_guard<std::mutex> lock(mu_);
    broken = broken_;
  }
  if (!broken.empty()) {
    work.finish(std::make_exception_ptr(
        CommError(__FILE__, __LINE__, "the shm communicator failed at an earlier call: " + broken)));
    return;
  }
  std::exception_ptr error;
  std::string message;
  try {
    body(work.deadline());
  } catch (const Error& e) {  // CommTimeoutError stays one: it names the ranks that did not arrive
    error = std::current_exception();
    message = e.message();
  } catch (const std::exception& e) {
    message = e.what();
    error = std::make_exception_ptr(CommError(__FILE__, __LINE__, message));
  }
  if (error) {
    std::lock_guard<std::mutex> lock(mu_);
    if (broken_.empty()) broken_ = message;
  }
  work.finish(error);
}

}  // namespace zerort
