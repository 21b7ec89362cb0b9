// StepOverlap: an update that runs on a worker thread while the next forward starts, each
// unit (bucket) released to its users as soon as its own update is done.
//
// Note [overlapped step]: with the optimizer state off the model's memory (offload_optimizer
// "cpu" or "nvme", EngineOptions::overlap_step), step() takes the step's decision on the
// caller's thread (the non-finite check, the global norm and its clip, the loss scale's next
// value: ShardOptimizer::decide), so nothing is updated before every rank knows whether and
// how, and a skipped step updates no unit. Then it hands AdamW to a worker thread and returns.
// The worker updates the units in the next forward's order (stage 3: the recorded unit order,
// python/zerort/engine/stage3.py; stages 1-2: the reverse of the reduce order), the 'nvme'
// tier's file streamed in that order too (Note [NVMe state store], order). As each unit's new
// low-precision shard is out (copied to the model's memory, or written to its shard copy; at
// stages 1-2 its all-gather started, on the worker, in the worker's order) the worker marks it
// done. The next forward's first use of unit k waits for unit k alone: stage 3's gather
// (Engine::gather, and the comm thread's before it reads the shard), stages 1-2's module hooks
// (python/zerort/engine/param_waits.py, Engine::wait_param_gather). So the forward runs unit 0
// while later units still step, never a step behind (no unit is read before its update), and
// AdamW being elementwise, the order changes no bit. Stage 3's persistent and held units go
// out through gathers that only the caller's thread may issue (the comm thread issues the
// others'), so they come first in the order and step() waits for them and gathers them.
// Everything else that reads or writes the state, the gradient or the working copies first
// waits for the whole update (Engine::settle_update: the next backward and step, the state
// accessors, hold_gathered, refresh_params, the destructor), and so does a collective from
// outside the engine, so that none falls between the worker's gathers on some rank only
// (Engine::finish_update: Python's checkpoints and monitor); an error on the worker is raised
// there, or by a wait. report() says what the last update's waits cost the forward: the seconds
// it waited for units (the device's idle time, on a GPU), and how many units were done when its
// first wait began (fewer than all: the forward started before the update ended).
//
// Note [a failed update is final]: an error on the worker (a file's I/O, a device copy) leaves
// some units updated and the others not, with the step already counted. No call can mend that,
// so the error is kept: every later settle (the next backward, step, state access) raises it
// again, and the engine goes no further. The fix is the user's: restart from a checkpoint.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace zerort {

// Who waits for a unit's update: the forward for its own unit (report().waited_seconds, and the
// first wait that hold_last_unit waits for); another wait on the caller's thread, which keeps the
// compute idle too (step()'s gathers of the units it gathers itself, W = 1's prefetch:
// report().caller_waited_seconds); or the comm thread, while the caller computes (neither).
enum class Waiter { kForward, kCaller, kCommThread };

struct OverlapReport {
  std::size_t units = 0;               // units the last update covered
  double waited_seconds = 0;           // the forward's waits on units, in all
  double caller_waited_seconds = 0;    // the caller's other waits (Waiter::kCaller)
  std::size_t waits = 0;               // waits that found their unit not done yet
  std::size_t done_at_first_wait = 0;  // units done when the first wait began
  bool first_wait_seen = false;        // some wait began while the update ran
  bool hold_timed_out = false;         // hold_last_unit's wait gave up (test hook)
  double update_seconds = 0;           // the worker's time, decision excluded
};

class StepOverlap {
 public:
  StepOverlap() = default;
  ~StepOverlap();  // joins the worker; its error, if any, is dropped
  StepOverlap(const StepOverlap&) = delete;
  StepOverlap& operator=(const StepOverlap&) = delete;

  // Runs job on a new worker thread for an update of `units` units (indices 0..units-1), none
  // done yet except those in `done_now`. The previous update must be finished.
  void start(std::size_t units, const std::vector<std::size_t>& done_now, std::function<void()> job);
  // The worker: unit's new values are out. Before the last unit to be done, with
  // hold_last_unit set, it first waits (up to a minute) for some wait() to begin.
  void done(std::size_t unit);
  // Blocks until unit is done (at once when no update runs); rethrows the worker's error. who:
  // where the time goes in report() (See Waiter).
  void wait(std::size_t unit, Waiter who = Waiter::kForward);
  // Joins the worker; rethrows its error once. A no-op when none runs.
  void finish();
  bool running() const;
  OverlapReport report() const;
  // A test hook (Note [overlapped step]): the worker holds its last unit until the forward's
  // first wait, so a test sees the forward start while an update is still to end.
  void hold_last_unit(bool hold);

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<bool> done_;
  std::size_t done_count_ = 0;
  bool running_ = false;  // start() .. finish()
  bool ended_ = false;    // the job returned or threw
  bool hold_ = false;
  std::exception_ptr error_;
  OverlapReport report_;
  std::exception_ptr failed_;  // a failed update's error, raised by every later start and finish
  std::mutex join_mu_;         // finish()'s join, which two settling threads may reach together
  std::thread worker_;
};

}  // namespace zerort
