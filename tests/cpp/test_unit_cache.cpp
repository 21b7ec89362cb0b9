// UnitCache (runtime/unit_cache.h): the released/gathering/gathered machine, storage,
// views and gathered bytes. See Note [unit cache] and Note [released storage].
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "runtime/unit_cache.h"

namespace zerort {
namespace {

using State = UnitCache::State;

size_t storage_bytes(const at::Tensor& t) { return static_cast<size_t>(t.storage().nbytes()); }

// Unit 0: persistent, over params[0] (2x2) at element 0. Unit 1: gathered on use, over
// params[1] (3 elements) at element 1 of 6 floats.
struct Cache {
  std::vector<at::Tensor> params{at::zeros({2, 2}), at::zeros({3})};
  UnitCache units;
  Cache() {
    units.add(at::arange(4, at::kFloat), 16, true, {{&params[0], 0, 4, {2, 2}}}, "");
    units.add(at::arange(6, at::kFloat), 24, false, {{&params[1], 1, 3, {3}}}, "layers.0 (Block)");
    units.set_views(0, true);
    units.set_views(1, false);
  }
};

TEST(UnitCache, APersistentUnitStartsGatheredAndStaysSo) {
  Cache c;
  EXPECT_EQ(c.units.state(0), State::kGathered);
  EXPECT_TRUE(at::equal(c.params[0], at::arange(4, at::kFloat).view({2, 2})));
  EXPECT_FALSE(c.units.releasable(0));
  c.units.release(0);
  EXPECT_EQ(c.units.state(0), State::kGathered);
  EXPECT_FALSE(c.units.begin_gather(0));
  EXPECT_EQ(c.units.gathered_bytes(), 0u);  // persistent units are not counted
}

TEST(UnitCache, AUnitStartsReleasedWithNoBytesAndAnEmptyParameter) {
  Cache c;
  EXPECT_EQ(c.units.state(1), State::kReleased);
  EXPECT_EQ(storage_bytes(c.units.full(1)), 0u);
  EXPECT_EQ(c.params[1].numel(), 0);
  EXPECT_FALSE(c.units.releasable(1));
  EXPECT_EQ(c.units.name(1), "layers.0 (Block)");
}

TEST(UnitCache, AGatherAllocatesCountsAndViewsTheSameStorage) {
  Cache c;
  ASSERT_TRUE(c.units.begin_gather(1));
  EXPECT_EQ(c.units.state(1), State::kGathering);
  EXPECT_FALSE(c.units.begin_gather(1));  // one gather at a time
  EXPECT_EQ(storage_bytes(c.units.full(1)), 24u);
  EXPECT_EQ(c.units.gathered_bytes(), 24u);
  EXPECT_EQ(c.units.gathered_peak(), 24u);
  c.units.full(1).copy_(at::arange(6, at::kFloat) * 10);  // the gather's writes
  c.units.end_gather(1);
  c.units.view_gathered(1);
  EXPECT_EQ(c.units.state(1), State::kGathered);
  EXPECT_TRUE(at::equal(c.params[1], at::arange(1, 4, at::kFloat) * 10));
}

TEST(UnitCache, AReleaseEmptiesTheStorageInPlaceAndKeepsThePeak) {
  Cache c;
  ASSERT_TRUE(c.units.begin_gather(1));
  c.units.end_gather(1);
  c.units.view_gathered(1);
  const at::Tensor saved = c.params[1].detach();  // a view, as autograd would keep one
  ASSERT_TRUE(c.units.releasable(1));
  c.units.release(1);
  EXPECT_EQ(c.units.state(1), State::kReleased);
  EXPECT_EQ(storage_bytes(saved), 0u);  // the saved view shares the emptied storage
  EXPECT_EQ(c.params[1].numel(), 0);
  EXPECT_EQ(c.units.gathered_bytes(), 0u);
  EXPECT_EQ(c.units.gathered_peak(), 24u);
  c.units.reset_peak();
  EXPECT_EQ(c.units.gathered_peak(), 0u);
  ASSERT_TRUE(c.units.begin_gather(1));  // into the same storage: the saved view sees it
  c.units.full(1).fill_(5);
  c.units.end_gather(1);
  EXPECT_EQ(storage_bytes(saved), 24u);
  EXPECT_TRUE(at::equal(saved, at::full({3}, 5.0f)));
}

TEST(UnitCache, HeldUnitsAreNotReleasedUntilTheLastHoldEnds) {
  Cache c;
  c.units.hold();
  c.units.hold();
  ASSERT_TRUE(c.units.begin_gather(1));
  c.units.end_gather(1);
  EXPECT_FALSE(c.units.releasable(1));
  c.units.release(1);
  EXPECT_EQ(c.units.state(1), State::kGathered);
  EXPECT_FALSE(c.units.unhold());
  EXPECT_TRUE(c.units.unhold());
  EXPECT_TRUE(c.units.releasable(1));
  EXPECT_THROW(c.units.unhold(), std::exception);
}

TEST(UnitCache, AHandedOffReleaseLeavesWhatWasTakenItsBytes) {
  Cache c;
  ASSERT_TRUE(c.units.begin_gather(1));
  c.units.full(1).fill_(7);
  c.units.end_gather(1);
  c.units.view_gathered(1);
  const at::Tensor taken = c.params[1].detach();
  c.units.release(1, /*hand_off=*/true);
  EXPECT_EQ(storage_bytes(taken), 24u);  // the old storage, still owned by `taken`
  EXPECT_TRUE(at::equal(taken, at::full({3}, 7.0f)));
  EXPECT_EQ(storage_bytes(c.units.full(1)), 0u);  // the unit has a new, empty one
  EXPECT_EQ(c.units.full(1).numel(), 6);
  EXPECT_EQ(c.units.gathered_bytes(), 0u);
}

}  // namespace
}  // namespace zerort
