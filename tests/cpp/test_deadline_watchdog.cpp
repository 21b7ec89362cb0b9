// DeadlineWatchdog (Note [stream-waited work], comm/deadline_watchdog.h) over fake Works: a
// Work that finishes is dropped (its buffers freed), one past its deadline is expired once
// (the NCCL Work aborts its communicator there), and stop() leaves none watched.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>

#include "comm/deadline_watchdog.h"

namespace zerort {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

struct FakeWork {
  std::atomic<bool> done{false};
  std::atomic<int> polls{0};
  std::atomic<int> expired{0};
  bool poll(Clock::time_point deadline) {
    ++polls;
    if (done.load()) return true;
    if (Clock::now() < deadline) return false;
    ++expired;  // NcclWork::poll aborts the communicator here
    return true;
  }
};

// Waits (bounded) until pred holds; the watchdog's thread runs on its own time.
template <typename Pred>
bool eventually(Pred pred) {
  const auto until = Clock::now() + std::chrono::seconds(10);
  while (!pred()) {
    if (Clock::now() > until) return false;
    std::this_thread::sleep_for(milliseconds(1));
  }
  return true;
}

TEST(DeadlineWatchdog, DropsAWorkOnceItIsDone) {
  DeadlineWatchdog<FakeWork> dog;
  auto work = std::make_shared<FakeWork>();
  std::weak_ptr<FakeWork> seen = work;
  ASSERT_TRUE(dog.watch(work, Clock::now() + std::chrono::hours(1)));
  work.reset();  // the engine drops its handle after the stream wait: the watchdog keeps it
  ASSERT_TRUE(eventually([&] { return seen.lock() && seen.lock()->polls.load() > 2; }));
  EXPECT_EQ(dog.watched(), 1u);
  seen.lock()->done = true;
  ASSERT_TRUE(eventually([&] { return seen.expired(); }));  // dropped: its buffers are freed
  EXPECT_EQ(dog.watched(), 0u);
}

TEST(DeadlineWatchdog, ExpiresAWorkPastItsDeadlineOnce) {
  DeadlineWatchdog<FakeWork> dog;
  auto late = std::make_shared<FakeWork>();
  auto fine = std::make_shared<FakeWork>();
  ASSERT_TRUE(dog.watch(late, Clock::now() + milliseconds(20)));
  ASSERT_TRUE(dog.watch(fine, Clock::now() + std::chrono::hours(1)));
  ASSERT_TRUE(eventually([&] { return late->expired.load() == 1; }));
  fine->done = true;
  ASSERT_TRUE(eventually([&] { return dog.watched() == 0; }));
  EXPECT_EQ(late->expired.load(), 1);
  EXPECT_EQ(fine->expired.load(), 0);
}

TEST(DeadlineWatchdog, StopWaitsForWhatIsWatchedThenRefusesMore) {
  auto work = std::make_shared<FakeWork>();
  DeadlineWatchdog<FakeWork> dog;
  ASSERT_TRUE(dog.watch(work, Clock::now() + std::chrono::hours(1)));
  std::thread finisher([&] {
    std::this_thread::sleep_for(milliseconds(30));
    work->done = true;
  });
  dog.stop();  // returns once the work is done (or past its deadline), not before
  finisher.join();
  EXPECT_TRUE(work->done.load());
  EXPECT_EQ(dog.watched(), 0u);
  EXPECT_FALSE(dog.watch(std::make_shared<FakeWork>(), Clock::now()));  // the caller waits itself
}

}  // namespace
}  // namespace zerort
