// ParamGathers (runtime/param_gathers.h): the window when not overlapped, one bucket's wait,
// and wait_all's errors. See Note [overlapped parameter gather].
#include <gtest/gtest.h>

#include <chrono>
#include <memory>
#include <stdexcept>
#include <vector>

#include "runtime/param_gathers.h"

namespace zerort {
namespace {

// A Work that records the order it is waited in (its bucket), and fails when told to.
class ScriptedWork final : public Work {
 public:
  ScriptedWork(size_t bucket, std::vector<size_t>* waited, bool fails)
      : Work(CollectiveDesc{}, std::chrono::milliseconds(1000)), bucket_(bucket), waited_(waited), fails_(fails) {}

 protected:
  bool wait_until(std::chrono::steady_clock::time_point) override {
    waited_->push_back(bucket_);
    if (fails_) throw std::runtime_error("gather of bucket " + std::to_string(bucket_) + " failed");
    return true;
  }

 private:
  size_t bucket_;
  std::vector<size_t>* waited_;
  bool fails_;
};

struct Gathers {
  std::vector<size_t> waited;
  ParamGathers gathers;
  void start(size_t bucket, bool overlapped, bool fails = false) {
    gathers.start(bucket, std::make_shared<ScriptedWork>(bucket, &waited, fails), overlapped);
  }
};

TEST(ParamGathers, NotOverlappedKeepsAWindowOfTwoWaitingForTheOldest) {
  Gathers g;
  for (size_t b = 0; b < 5; ++b) g.start(b, false);
  EXPECT_EQ(g.waited, (std::vector<size_t>{0, 1, 2}));
  EXPECT_EQ(g.gathers.in_flight(), (std::vector<size_t>{3, 4}));
  g.gathers.wait_all();
  EXPECT_EQ(g.waited, (std::vector<size_t>{0, 1, 2, 3, 4}));
  EXPECT_TRUE(g.gathers.in_flight().empty());
}

TEST(ParamGathers, OverlappedWaitsForTheBucketAskedForOnly) {
  Gathers g;
  for (size_t b = 0; b < 4; ++b) g.start(b, true);
  EXPECT_TRUE(g.waited.empty());
  g.gathers.wait(3);  // the forward's first bucket is the last one started
  g.gathers.wait(3);  // a second wait is a no-op
  g.gathers.wait(7);  // so is a bucket without a gather
  EXPECT_EQ(g.waited, (std::vector<size_t>{3}));
  EXPECT_EQ(g.gathers.in_flight(), (std::vector<size_t>{0, 1, 2}));
  g.gathers.wait_all();
  EXPECT_EQ(g.waited, (std::vector<size_t>{3, 0, 1, 2}));
}

TEST(ParamGathers, WaitAllWaitsForEveryOneBeforeRaisingTheFirstError) {
  Gathers g;
  g.start(0, true);
  g.start(1, true, true);
  g.start(2, true, true);
  g.start(3, true);
  EXPECT_THROW(
      {
        try {
          g.gathers.wait_all();
        } catch (const std::exception& e) {
          EXPECT_NE(std::string(e.what()).find("bucket 1"), std::string::npos) << e.what();
          throw;
        }
      },
      std::exception);
  EXPECT_EQ(g.waited, (std::vector<size_t>{0, 1, 2, 3}));  // none left writing
  EXPECT_TRUE(g.gathers.in_flight().empty());
}

}  // namespace
}  // namespace zerort
