#include "comm/hop_pair.h"

#include <string>
#include <utility>

#include "core/error.h"

namespace zerort {

HopPair::HopPair(const CollectiveDesc& desc, std::chrono::milliseconds timeout, std::shared_ptr<void> scratch)
    : work_(std::make_shared<PendingWork>(desc, timeout)), scratch_(std::move(scratch)) {}

std::exception_ptr HopPair::run_hop(const char* hop, const std::function<void()>& fn) const {
  try {
    fn();
    return nullptr;
  } catch (const Error& e) {
    const std::string msg = detail::concat(work_->desc().to_string(), ", ", hop, ": ", e.message());
    if (dynamic_cast<const CollectiveMismatchError*>(&e))
      return std::make_exception_ptr(CollectiveMismatchError(__FILE__, __LINE__, msg));
    if (dynamic_cast<const CommTimeoutError*>(&e))
      return std::make_exception_ptr(CommTimeoutError(__FILE__, __LINE__, msg));
    if (dynamic_cast<const CommError*>(&e)) return std::make_exception_ptr(CommError(__FILE__, __LINE__, msg));
    return std::make_exception_ptr(Error(__FILE__, __LINE__, msg));
  } catch (const std::exception& e) {  // std::bad_alloc and the like, from the hop's own buffers
    return std::make_exception_ptr(
        Error(__FILE__, __LINE__, detail::concat(work_->desc().to_string(), ", ", hop, ": ", e.what())));
  }
}

void HopPair::finish(std::exception_ptr error) {
  std::shared_ptr<void> scratch;
  {
    std::lock_guard<std::mutex> lock(mu_);
    scratch = std::move(scratch_);
  }
  scratch.reset();  // the hops' buffers count as scratch until the Work completes
  work_->finish(std::move(error));
}

void HopPair::run_first(const char* hop, const std::function<void()>& fn) {
  std::exception_ptr error = run_hop(hop, fn);
  {
    std::lock_guard<std::mutex> lock(mu_);
    first_ = error ? First::kFailed : First::kDone;
  }
  cv_.notify_all();
  if (error) finish(std::move(error));
}

void HopPair::run_second(const char* hop, const std::function<void()>& fn) {
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return first_ != First::kRunning; });
    if (first_ == First::kFailed) return;  // the Work already carries hop 1's error
  }
  finish(run_hop(hop, fn));
}

}  // namespace zerort
