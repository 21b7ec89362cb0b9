// StepOverlap (runtime/step_overlap.h): a wait returns once its unit is done (not before), units
// done at start never block, the worker's error reaches every wait and every later finish() and start() (it is final), the report
// counts the forward's waits, and the test hook holds the last unit until the first wait. See
// Note [overlapped step]. No timing is asserted: the order is forced by latches.
#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "runtime/step_overlap.h"

namespace zerort {
namespace {

// A gate the job waits at until the test opens it.
struct Gate {
  std::mutex mu;
  std::condition_variable cv;
  bool open = false;
  void pass() {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return open; });
  }
  void release() {
    {
      std::lock_guard<std::mutex> lock(mu);
      open = true;
    }
    cv.notify_all();
  }
};

TEST(StepOverlap, AWaitReturnsOnceItsUnitIsDoneAndNotBefore) {
  StepOverlap overlap;
  Gate gate;
  std::atomic<int> stage{0};
  overlap.start(3, {}, [&] {
    overlap.done(2);  // the next forward's first unit
    gate.pass();
    stage = 1;
    overlap.done(0);
    overlap.done(1);
  });
  overlap.wait(2);  // done before the gate: returns while the job is held
  EXPECT_EQ(stage.load(), 0);
  std::thread opener([&] { gate.release(); });
  overlap.wait(1);  // only after the gate: the job wrote stage 1 before done(1)
  EXPECT_EQ(stage.load(), 1);
  opener.join();
  overlap.finish();
  const OverlapReport r = overlap.report();
  EXPECT_EQ(r.units, 3u);
  EXPECT_TRUE(r.first_wait_seen);
  EXPECT_LE(r.done_at_first_wait, 1u);  // units 0 and 1 were held behind the gate
  EXPECT_FALSE(overlap.running());
  overlap.wait(0);  // no update running: at once
}

TEST(StepOverlap, UnitsDoneAtStartNeverBlockAndUncountedWaitsLeaveTheReport) {
  StepOverlap overlap;
  Gate gate;
  overlap.start(2, {1}, [&] {
    gate.pass();
    overlap.done(0);
  });
  overlap.wait(1, Waiter::kCaller);
  EXPECT_FALSE(overlap.report().first_wait_seen);
  gate.release();
  overlap.finish();
  EXPECT_EQ(overlap.report().waits, 0u);
}

// A wait that may block: the caller's other waits (step()'s gathers, W = 1's prefetch) count apart
// from the forward's and do not release the test hook; the comm thread's count nowhere. (Whether the
// caller's wait blocked at all is up to the threads, so its seconds are not asserted.)
TEST(StepOverlap, TheCallersOtherWaitsCountApartAndTheCommThreadsNowhere) {
  for (Waiter who : {Waiter::kCaller, Waiter::kCommThread}) {
    StepOverlap overlap;
    Gate gate;
    overlap.start(2, {}, [&] {
      gate.pass();
      overlap.done(0);
      overlap.done(1);
    });
    std::thread opener([&] { gate.release(); });
    overlap.wait(1, who);  // blocks until the gate opens
    opener.join();
    overlap.finish();
    const OverlapReport r = overlap.report();
    EXPECT_FALSE(r.first_wait_seen);
    EXPECT_EQ(r.waits, 0u);
    EXPECT_EQ(r.waited_seconds, 0.0);
    if (who == Waiter::kCommThread) EXPECT_EQ(r.caller_waited_seconds, 0.0);
  }
}

TEST(StepOverlap, TheWorkersErrorReachesWaitsAndIsFinal) {
  StepOverlap overlap;
  overlap.start(2, {}, [&] {
    overlap.done(0);
    throw std::runtime_error("unit 1's update failed");
  });
  try {
    overlap.wait(0);  // done before the error: returns, or raises it once the job has ended; never hangs
  } catch (const std::runtime_error&) {
  }
  EXPECT_THROW(overlap.wait(1), std::runtime_error);  // the job ended without done(1)
  EXPECT_THROW(overlap.finish(), std::runtime_error);
  // Note [a failed update is final]: half the units were updated, so nothing goes on.
  EXPECT_THROW(overlap.finish(), std::runtime_error);
  bool ran = false;
  EXPECT_THROW(overlap.start(1, {}, [&] { ran = true; }), std::runtime_error);
  EXPECT_FALSE(ran);
}

TEST(StepOverlap, TheHookHoldsTheLastUnitUntilTheFirstWait) {
  StepOverlap overlap;
  overlap.hold_last_unit(true);
  overlap.start(3, {}, [&] {
    overlap.done(0);
    overlap.done(1);
    overlap.done(2);  // held here until wait(0) below
  });
  overlap.wait(0);
  overlap.finish();
  const OverlapReport r = overlap.report();
  EXPECT_FALSE(r.hold_timed_out);
  EXPECT_LT(r.done_at_first_wait, 3u);                         // the first wait came before the last unit was done
  EXPECT_THROW(overlap.start(1, {4}, [] {}), std::exception);  // unit 4 of 1
}

}  // namespace
}  // namespace zerort
