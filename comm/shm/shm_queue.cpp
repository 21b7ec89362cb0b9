#include "comm/shm/shm_queue.h"

#include "comm/shm/shm_segment.h"
#include "core/error.h"

namespace zerort {

namespace {

// The worker gives up at the call's own deadline and names the ranks that did not arrive; a
// waiter whose deadline is as late gives it this long to say so before the generic timeout.
constexpr auto kWorkerGrace = std::chrono::milliseconds(500);

}  // namespace

std::shared_ptr<ShmQueue::Op> ShmQueue::post(std::function<void(std::chrono::steady_clock::time_point)> body,
                                             std::chrono::milliseconds timeout) {
  auto op = std::make_shared<Op>();
  op->body = std::move(body);
  const auto now = std::chrono::steady_clock::now();
  op->deadline = timeout >= std::chrono::duration_cast<std::chrono::milliseconds>(
                                std::chrono::steady_clock::time_point::max() - now)
                     ? std::chrono::steady_clock::time_point::max()
                     : now + timeout;
  worker_.push([this, op] { run(*op); });
  return op;
}

void ShmQueue::run(Op& op) {
  std::string broken;
  {
    std::lock_guard<std::mutex> lock(mu_);
    broken = broken_;
  }
  if (!broken.empty()) {
    finish(op, false, "the shm communicator failed at an earlier call: " + broken);
    return;
  }
  try {
    op.body(op.deadline);
    finish(op, false, "");
  } catch (const CommTimeoutError& e) {
    finish(op, true, e.message());
  } catch (const Error& e) {
    finish(op, false, e.message());
  } catch (const std::exception& e) {
    finish(op, false, e.what());
  }
}

void ShmQueue::finish(Op& op, bool timed_out, const std::string& error) {
  if (!error.empty()) {
    std::lock_guard<std::mutex> lock(mu_);
    if (broken_.empty()) broken_ = error;
  }
  std::lock_guard<std::mutex> lock(op.mu);
  op.body = nullptr;
  op.timed_out = timed_out;
  op.error = error;
  op.done = true;
  op.cv.notify_all();
}

ShmWork::ShmWork(const CollectiveDesc& d, std::chrono::milliseconds timeout, std::shared_ptr<ShmQueue::Op> op,
                 std::shared_ptr<ShmSegment> segment)
    : Work(d, timeout), op_(std::move(op)), segment_(std::move(segment)) {}

ShmWork::~ShmWork() {
  std::lock_guard<std::mutex> lock(op_->mu);
  if (!op_->done) retire_buffers();  // the worker may still write into them
}

bool ShmWork::wait_until(std::chrono::steady_clock::time_point deadline) {
  std::unique_lock<std::mutex> lock(op_->mu);
  auto done = [&] { return op_->done; };
  if (!op_->cv.wait_until(lock, deadline, done)) {
    const bool worker_times_out = op_->deadline != std::chrono::steady_clock::time_point::max();
    if (deadline < op_->deadline || !worker_times_out) return false;
    if (!op_->cv.wait_until(lock, op_->deadline + kWorkerGrace, done)) return false;
  }
  if (op_->timed_out) throw CommTimeoutError(__FILE__, __LINE__, op_->error);
  if (!op_->error.empty()) throw CommError(__FILE__, __LINE__, op_->error);
  return true;
}

void ShmWork::on_timeout() { segment_->abort(desc().to_string() + " timed out on this rank"); }

}  // namespace zerort
