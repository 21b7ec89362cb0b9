// See Note [nccl parts] (nccl_split.h).
#include "comm/nccl/nccl_split.h"

#include <nccl.h>

#include <mutex>

#include "core/cuda_check.h"
#include "core/error.h"

namespace zerort {

namespace {

// The parent's later calls throw `reason`: NCCL may still be splitting it, so it is neither
// used nor aborted (the process exits with it).
void retire_parent(NcclState& parent, const std::string& reason) {
  std::lock_guard<std::mutex> lock(parent.call_mu);
  if (parent.aborted.load()) return;
  parent.abort_reason = reason;
  parent.aborted.store(true);
}

}  // namespace

NcclSplit split_nccl_state(NcclState& parent, int parent_rank, int parent_size, int color, int key,
                           const std::string& group, std::chrono::milliseconds timeout) {
  const std::string where = detail::concat("NCCL: splitting off ", group, " on rank ", parent_rank, " of ", parent_size,
                                           " (color ", color, ", key ", key, ")");
  ZRT_CHECK_AS(ConfigError, color >= 0 && key >= 0, where, ": color and key must be >= 0");
  std::lock_guard<std::mutex> lock(parent.mu);  // no collective of the parent meanwhile
  parent.check_usable();
  CudaDeviceGuard guard(parent.device);
  NcclSplit out;
  out.state = std::make_shared<NcclState>();
  NcclState& child = *out.state;
  child.device = parent.device;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  bool settled = false;
  try {
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // settled below against the timeout
    {
      std::lock_guard<std::mutex> calls(parent.call_mu);
      ZRT_CHECK_NCCL(ncclCommSplit(parent.comm, color, key, &child.comm, &config), parent.comm);
    }
    ZRT_CHECK_AS(CommError, child.comm != nullptr, "ncclCommSplit gave no communicator for color ", color);
    settled = child.settle(deadline, "ncclCommSplit") && parent.settle(deadline, "ncclCommSplit (parent)");
  } catch (const CommError& e) {
    retire_parent(parent, detail::concat(where, " failed"));
    throw CommError(__FILE__, __LINE__, detail::concat(where, ": ", e.message()));
  }
  if (!settled) {
    child.comm = nullptr;  // half made: left to the process's exit (Note [nccl parts])
    retire_parent(parent, detail::concat(where, " timed out"));
    ZRT_THROW_AS(CommTimeoutError, where, ": the group did not form within ", timeout.count(),
                 " ms; a rank of it is missing or did not split (every rank splits the same parts in the same "
                 "order: zerort.comm.topology.grid_parts)");
  }
  std::lock_guard<std::mutex> calls(child.call_mu);
  ZRT_CHECK_NCCL(ncclCommCount(child.comm, &out.size), child.comm);
  ZRT_CHECK_NCCL(ncclCommUserRank(child.comm, &out.rank), child.comm);
  return out;
}

}  // namespace zerort
