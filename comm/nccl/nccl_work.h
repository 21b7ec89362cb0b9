// The NCCL backend's shared state and Work. A collective is enqueued on the communicator's
// own stream and ends with an event. The engine joins it to the compute stream
// (join_compute_stream: a stream wait, its deadline kept by the watchdog, Note [stream-waited
// work]); NcclWork::wait(), for a host that needs the result, polls that event and the
// communicator's async error against the deadline. Either way the communicator is aborted on
// timeout, so a missing peer never hangs the host.
#pragma once

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <memory>
#include <string>
#include <vector>

#include "comm/deadline_watchdog.h"
#include "comm/work.h"

namespace zerort {

// Throws zerort::Error naming the NCCL call, its error string and NCCL's last message.
// ncclInProgress (a nonblocking communicator still working) is not an error.
void check_nccl(ncclResult_t result, const char* call, ncclComm_t comm, const char* file, int line);
#define ZRT_CHECK_NCCL(call, comm) ::zerort::check_nccl((call), #call, (comm), __FILE__, __LINE__)

class NcclWork;

struct NcclState {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;  // the communicator's own stream
  int device = 0;
  std::mutex mu;       // one enqueue at a time (held while it settles)
  std::mutex call_mu;  // every NCCL call, and abort: never held while sleeping
  std::atomic<bool> aborted{false};
  std::string abort_reason;             // written under call_mu before `aborted` is set
  DeadlineWatchdog<NcclWork> watchdog;  // Note [stream-waited work]; stopped by the communicator's destructor

  // Pinned host slots for staged control values (<= kPinnedSlot bytes): allocating and
  // freeing pinned memory per call would synchronise the device every time.
  static constexpr size_t kPinnedSlot = 4096;
  std::vector<void*> pinned_free;
  std::mutex pinned_mu;
  std::shared_ptr<void> pinned(size_t bytes, const std::shared_ptr<NcclState>& self);

  ~NcclState();
  // Polls ncclCommGetAsyncError until the communicator is no longer in progress (in
  // nonblocking mode NCCL may still be launching on its own thread: nothing else may go on
  // its stream before this returns true). Returns false at the deadline; on an NCCL error
  // aborts the communicator and throws.
  bool settle(std::chrono::steady_clock::time_point deadline, const char* what);
  // The communicator's async error (ncclSuccess, ncclInProgress or an error); throws if it
  // was aborted.
  ncclResult_t async_error();
  // ncclCommAbort, once: every later call on this communicator throws `reason`.
  void abort(const std::string& reason);
  void check_usable() const;
};

class NcclWork final : public Work {
 public:
  NcclWork(CollectiveDesc desc, std::chrono::milliseconds timeout, std::shared_ptr<NcclState> state, cudaEvent_t done);
  ~NcclWork() override;

  // The compute stream waits for `done`; the watchdog holds this Work until then.
  bool join_compute_stream() override;
  // The watchdog's check (Note [stream-waited work], comm/deadline_watchdog.h): true once done,
  // or once failed or past `deadline`, when the communicator has been aborted and the buffers
  // parked. Never throws.
  bool poll(std::chrono::steady_clock::time_point deadline);

 protected:
  bool wait_until(std::chrono::steady_clock::time_point deadline) override;
  void on_timeout() override;

 private:
  // Done, pending (false), or an NCCL async error that aborted the communicator (throws).
  bool query();

  std::shared_ptr<NcclState> state_;
  cudaEvent_t done_;
  std::chrono::milliseconds timeout_;
  bool host_wait_counted_ = false;  // wait_until's first call (Note [allowed host waits])
};

}  // namespace zerort
