#include "comm/work.h"

#include <sstream>

#include "comm/peer_exits.h"
#include "core/error.h"

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
  if (tag != kNoTag) os << ", tag=" << tag;
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
  if (!timeout_message_.empty()) throw CommTimeoutError(__FILE__, __LINE__, timeout_message_);
  if (!then_error_.empty()) throw CommError(__FILE__, __LINE__, then_error_);
  // Saturate: a huge timeout means "no deadline", never an overflowed one in the past.
  const auto now = std::chrono::steady_clock::now();
  const auto room =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::time_point::max() - now);
  const auto deadline = timeout >= room ? std::chrono::steady_clock::time_point::max() : now + timeout;
  // In slices, so a peer known to have exited ends the wait early (comm/peer_exits.h).
  bool finished = false;
  for (;;) {
    const auto t = std::chrono::steady_clock::now();
    finished = wait_until(deadline - t > kPeerExitPoll ? t + kPeerExitPoll : deadline);
    if (finished || std::chrono::steady_clock::now() >= deadline) break;
    const std::string gone = peer_exits(kPeerExitSettle.count());
    if (!gone.empty()) {
      timeout_message_ = peer_exit_message(desc_.to_string(), gone);
      break;
    }
  }
  if (!finished) {
    if (timeout_message_.empty()) {
      timeout_message_ =
          detail::concat(desc_.to_string(), " did not finish within ", timeout.count(),
                         " ms. A peer rank is missing, stuck, failed its own argument check, or called a "
                         "different collective (comm.debug: true checks every call across ranks and names each "
                         "rank's); raise comm.timeout_s if the peers are just slow");
    }
    on_timeout();
    retire_buffers();
    throw CommTimeoutError(__FILE__, __LINE__, timeout_message_);
  }
  if (then_) {
    auto fn = std::move(then_);  // runs once: a second wait must not redo it
    then_ = nullptr;
    try {
      fn();
    } catch (const Error& e) {
      then_error_ = detail::concat(desc_.to_string(), ": finishing the result failed: ", e.message());
      throw CommError(__FILE__, __LINE__, then_error_);
    }
  }
  done_ = true;
}

void Work::keep_alive(std::shared_ptr<void> buffer) {
  std::lock_guard<std::mutex> lock(mu_);
  keep_alive_.push_back(std::move(buffer));
}

void Work::retire_buffers() {
  static std::mutex graveyard_mu;
  static auto* graveyard = new std::vector<std::shared_ptr<void>>();  // never freed on purpose
  std::lock_guard<std::mutex> lock(graveyard_mu);
  for (auto& b : keep_alive_) graveyard->push_back(std::move(b));
  keep_alive_.clear();
}

void Work::then(std::function<void()> fn) {
  std::lock_guard<std::mutex> lock(mu_);
  ZRT_CHECK(!done_, "Work::then on a finished ", desc_.to_string());
  if (!then_) {
    then_ = std::move(fn);
    return;
  }
  then_ = [first = std::move(then_), next = std::move(fn)] {  // in the order given
    first();
    next();
  };
}

}  // namespace zerort
