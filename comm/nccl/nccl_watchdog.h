// NcclWatchdog: the deadlines of collectives that the host does not wait for.
//
// Note [stream-waited work]
// The engine's reduces and gathers are waited for by the compute stream (Work::
// join_compute_stream), not by the host, so no host wait is left to notice a peer that never
// comes. The watchdog does: one thread per communicator polls each such Work's completion
// event and the communicator's async error about every millisecond, off the step's path.
// - Done: the Work (and the buffers it keeps alive) is dropped, so its buffers are freed in
//   order, never parked.
// - An NCCL error or the deadline passed: the communicator is aborted (its kernels stop, so
//   the waiting streams move on) and every later call on it throws, naming the collective
//   that failed: a hang becomes an error at the engine's next collective or step.
// - stop() (the communicator's destructor) waits for what is watched up to its deadlines,
//   then drops it; a Work joined after that is waited for by the host.
#pragma once

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace zerort {

class NcclWork;

class NcclWatchdog {
 public:
  NcclWatchdog() = default;
  ~NcclWatchdog() { stop(); }
  NcclWatchdog(const NcclWatchdog&) = delete;
  NcclWatchdog& operator=(const NcclWatchdog&) = delete;

  // Watches `work` until done or its deadline; false once stopped (the caller waits itself).
  bool watch(std::shared_ptr<NcclWork> work, std::chrono::steady_clock::time_point deadline);
  void stop();
  size_t watched() const;  // Works not finished yet

 private:
  void loop();

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::pair<std::shared_ptr<NcclWork>, std::chrono::steady_clock::time_point>> works_;
  bool stopping_ = false;
  bool stopped_ = false;
  std::thread thread_;
};

}  // namespace zerort
