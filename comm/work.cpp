#include "comm/work.h"

#include <sstream>

#include "comm/error.h"

namespace zerort {

const char* collective_name(Collective kind) {
  switch (kind) {
    case Collective::kAllReduce: return "all_reduce";
    case Collective::kReduceScatter: return "reduce_scatter";
    case Collective::kReduceScatterAccumulate: return "reduce_scatter_accumulate";
    case Collective::kAllGather: return "all_gather";
    case Collective::kAllToAll: return "all_to_all";
    case Collective::kBroadcast: return "broadcast";
    case Collective::kBarrier: return "barrier";
  }
  return "unknown_collective";
}

std::string CollectiveDesc::to_string() const {
  std::ostringstream os;
  os << collective_name(kind) << "(count=" << count << ", dtype=" << dtype_name(dtype);
  if (kind == Collective::kAllReduce || kind == Collective::kReduceScatter) {
    os << ", op=" << reduce_op_name(op);
  }
  if (kind == Collective::kBroadcast) os << ", root=" << root;
  os << ") on rank " << rank << " of " << world;
  if (!backend.empty()) os << " [" << backend << "]";
  return os.str();
}

Work::Work(CollectiveDesc desc, std::chrono::milliseconds default_timeout)
    : desc_(std::move(desc)), default_timeout_(default_timeout) {}

void Work::wait() { wait(default_timeout_); }

void Work::wait(std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(mu_);
  if (done_) return;
  auto deadline = std::chrono::steady_clock::now() + timeout;
  if (!wait_until(deadline)) {
    on_timeout();
    throw TimeoutError(__FILE__, __LINE__,
                       detail::concat(desc_.to_string(), " did not finish within ", timeout.count(),
                                      " ms. A peer rank is missing, stuck, or called a different "
                                      "collective; raise comm.timeout_s if the peers are just slow"));
  }
  if (then_) then_();
  done_ = true;
}

void Work::then(std::function<void()> fn) {
  std::lock_guard<std::mutex> lock(mu_);
  ZRT_CHECK(!done_, "Work::then on a finished ", desc_.to_string());
  then_ = std::move(fn);
}

}  // namespace zerort
