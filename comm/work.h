// Work: the handle every collective returns. wait() blocks with a deadline and never hangs.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace zerort {

enum class Collective : int32_t {
  kAllReduce = 1,
  kReduceScatter,
  kReduceScatterAccumulate,
  kAllGather,
  kAllToAll,
  kBroadcast,
  kBarrier,
};
const char* collective_name(Collective kind);

constexpr int64_t kNoTag = -1;

// What a collective was asked to do; errors and timeouts are phrased from it.
struct CollectiveDesc {
  Collective kind = Collective::kBarrier;
  int rank = 0;
  int world = 1;
  size_t count = 0;  // elements: per-rank chunk for scatter/gather/all-to-all, else the buffer
  DType dtype = DType::kFloat32;
  ReduceOp op = ReduceOp::kSum;
  int root = 0;
  // What the collective serves, chosen by the caller (a reduce bucket's or a stage-3
  // unit's index; kNoTag when none). The cross-rank check requires every rank to pass the
  // same tag, so ranks that reduce or gather different buckets of equal size are caught.
  int64_t tag = kNoTag;
  std::string backend;

  // "all_reduce(count=7, dtype=bf16, op=sum) on rank 1 of 4 [mpi]"
  std::string to_string() const;
};

class Work : public std::enable_shared_from_this<Work> {
 public:
  Work(CollectiveDesc desc, std::chrono::milliseconds default_timeout);
  virtual ~Work() = default;
  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;

  // Blocks until the collective is done and its output is valid. Throws CommTimeoutError
  // naming the collective, rank and sizes when it is not done within the timeout, and
  // zerort::Error when the backend failed. Waiting again after success is a no-op; after a
  // timeout every later wait throws again (the collective is abandoned, and the
  // communicator should be considered broken: exit the job).
  void wait();
  void wait(std::chrono::milliseconds timeout);

  // Runs fn on the waiting thread once the transfer is done, before wait() returns (after
  // any function given before).
  void then(std::function<void()> fn);

  // Keeps an internal buffer alive while the backend may still write to it, including
  // after a timeout (it is then parked for the life of the process, never freed early).
  void keep_alive(std::shared_ptr<void> buffer);

  const CollectiveDesc& desc() const { return desc_; }

  // Device backends: the compute stream (Note [stream order], comm/stream_order.h) waits for
  // the transfer instead of the host, and the backend's watchdog keeps the deadline (Note
  // [stream-waited work], comm/deadline_watchdog.h). False when it cannot (host backends, a
  // result that then() finishes on the host): call wait() instead.
  virtual bool join_compute_stream() { return false; }

 protected:
  bool has_then() {
    std::lock_guard<std::mutex> lock(mu_);
    return has_then_locked();
  }
  // The same inside wait_until, which wait() calls with its lock held.
  bool has_then_locked() const { return static_cast<bool>(then_); }
  // True once the transfer finished by `deadline`; false on timeout. Throws on failure.
  virtual bool wait_until(std::chrono::steady_clock::time_point deadline) = 0;
  // Called once when a wait expires, before the CommTimeoutError is thrown.
  virtual void on_timeout() {}
  // Parks the kept-alive buffers for the rest of the process: for backends whose
  // transfer may still land after the Work is gone (a timeout, a Work dropped unwaited).
  void retire_buffers();

 private:
  CollectiveDesc desc_;
  std::chrono::milliseconds default_timeout_;
  // wait() checks for exited peers this often, and trusts a notice this old (peer_exits.h).
  static constexpr std::chrono::milliseconds kPeerExitPoll{200};
  static constexpr std::chrono::milliseconds kPeerExitSettle{1000};
  std::mutex mu_;
  bool done_ = false;
  std::string timeout_message_;  // set once a wait timed out
  std::string then_error_;       // set once the then() functions failed: every later wait throws it
  std::function<void()> then_;
  std::vector<std::shared_ptr<void>> keep_alive_;
};

using WorkPtr = std::shared_ptr<Work>;

// The engine's wait for a transfer that only its later device work reads: a stream wait where
// the backend has one (Note [stream order], comm/stream_order.h), else the host's wait().
inline void wait_in_stream_order(const WorkPtr& w) {
  if (w && !w->join_compute_stream()) w->wait();
}

// A Work that is done when created: count-0 and single-rank collectives.
class CompletedWork final : public Work {
 public:
  using Work::Work;

 protected:
  bool wait_until(std::chrono::steady_clock::time_point) override { return true; }
};

}  // namespace zerort
