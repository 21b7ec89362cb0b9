// In-process backend: ranks are threads sharing one InProcessGroup. Used by the fast C++
// tests; it computes every collective with the same local_reduce arithmetic as MPI.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/communicator.h"

namespace zerort {

class InProcessGroup : public std::enable_shared_from_this<InProcessGroup> {
 public:
  static std::shared_ptr<InProcessGroup> create(int world_size, CommOptions options = {});
  // One communicator per rank; call from the thread that plays that rank.
  std::unique_ptr<Communicator> communicator(int rank);
  int world_size() const { return world_; }

  // Marks every pending and future collective of the group failed (a timeout does this).
  void abort(const std::string& reason);

  struct Slot {
    const void* in = nullptr;
    void* out = nullptr;
    CollectiveDesc desc;
  };
  struct Op {
    std::vector<Slot> slots;
    int arrived = 0;
    bool done = false;
    std::string error;  // set when the op failed (mismatch or abort)
  };

  // Posts this rank's arguments for its seq-th collective. The last rank to arrive
  // computes every rank's output. Returns the shared op to wait on.
  std::shared_ptr<Op> post(uint64_t seq, int rank, const void* in, void* out, const CollectiveDesc& desc);
  bool is_done(const std::shared_ptr<Op>& op);
  // False on timeout; throws zerort::Error when the op failed.
  bool wait_done(const std::shared_ptr<Op>& op, std::chrono::steady_clock::time_point deadline);

 private:
  InProcessGroup(int world_size, CommOptions options);
  void execute(Op& op);

  int world_;
  CommOptions options_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<uint64_t, std::shared_ptr<Op>> pending_;
  std::string abort_reason_;
};

}  // namespace zerort
