// ShardLayout property tests: many random parameter lists, W = 1..16, alignments 1..8,
// including empty parameters, empty shards and parameters spanning 3+ shards.
#include <gtest/gtest.h>

#include <random>

#include "core/error.h"
#include "partition/shard_layout.h"

namespace zerort {
namespace {

// Checks every property against a brute-force owner map of the flat buffer.
void check_layout(const std::vector<size_t>& numels, int world, size_t alignment) {
  ShardLayout layout(numels, world, alignment);
  size_t total = 0;
  for (size_t n : numels) total += n;
  const size_t unit = static_cast<size_t>(world) * alignment;
  ASSERT_EQ(layout.numel(), total);
  ASSERT_EQ(layout.padded_numel() % unit, 0u);
  ASSERT_GE(layout.padded_numel(), total);
  ASSERT_LT(layout.padded_numel() - total, unit);
  ASSERT_EQ(layout.shard_numel() % alignment, 0u);

  // owner[f] = parameter index owning flat element f, or -1 for padding.
  std::vector<long> owner(layout.padded_numel(), -1);
  size_t offset = 0;
  for (size_t p = 0; p < numels.size(); ++p) {
    ASSERT_EQ(layout.param_offset(p), offset);
    for (size_t k = 0; k < numels[p]; ++k) owner[offset + k] = static_cast<long>(p);
    offset += numels[p];
  }

  std::vector<int> seen(layout.padded_numel(), 0);
  size_t prev_end = 0;
  for (int r = 0; r < world; ++r) {
    Range shard = layout.shard_range(r);
    ASSERT_EQ(shard.begin, prev_end);
    ASSERT_EQ(shard.size(), layout.shard_numel());
    prev_end = shard.end;
    size_t last = shard.begin;
    for (const ParamSlice& s : layout.slices_in_shard(r)) {
      ASSERT_GT(s.numel, 0u);
      ASSERT_EQ(s.rank, r);
      ASSERT_GE(s.flat_offset, last);  // sorted, disjoint
      ASSERT_LE(s.flat_offset + s.numel, shard.end);
      ASSERT_EQ(s.shard_offset, s.flat_offset - shard.begin);
      ASSERT_EQ(s.flat_offset, layout.param_offset(s.param) + s.param_offset);
      last = s.flat_offset + s.numel;
      for (size_t k = 0; k < s.numel; ++k) {
        ASSERT_EQ(owner[s.flat_offset + k], static_cast<long>(s.param));
        ++seen[s.flat_offset + k];
      }
    }
  }
  ASSERT_EQ(prev_end, layout.padded_numel());
  for (size_t f = 0; f < owner.size(); ++f) ASSERT_EQ(seen[f], owner[f] >= 0 ? 1 : 0) << "flat " << f;

  // slices_of_param covers each parameter exactly, in rank order, matching slices_in_shard.
  for (size_t p = 0; p < numels.size(); ++p) {
    size_t covered = 0;
    int prev_rank = -1;
    for (const ParamSlice& s : layout.slices_of_param(p)) {
      ASSERT_EQ(s.param_offset, covered);
      ASSERT_GT(s.rank, prev_rank);
      prev_rank = s.rank;
      covered += s.numel;
      auto in_shard = layout.slices_in_shard(s.rank);
      bool found = false;
      for (const auto& t : in_shard) {
        found |= t.param == p && t.param_offset == s.param_offset && t.numel == s.numel;
      }
      ASSERT_TRUE(found);
    }
    ASSERT_EQ(covered, numels[p]);
  }
}

TEST(ShardLayout, RandomProperties) {
  std::mt19937 gen(1234);
  for (int trial = 0; trial < 400; ++trial) {
    int world = 1 + static_cast<int>(gen() % 16);
    size_t alignment = 1 + gen() % 8;
    size_t params = gen() % 9;
    std::vector<size_t> numels(params);
    for (auto& n : numels) n = (gen() % 4 == 0) ? 0 : gen() % 200;
    SCOPED_TRACE(::testing::Message() << "trial " << trial << " W=" << world << " align=" << alignment);
    check_layout(numels, world, alignment);
  }
}

TEST(ShardLayout, EdgeCases) {
  check_layout({}, 4, 1);         // nothing at all: every shard empty
  check_layout({0, 0, 0}, 3, 2);  // only empty parameters
  check_layout({1}, 16, 1);       // one element: 15 shards of pure padding
  check_layout({7, 0, 1000, 3}, 8, 4);
  ShardLayout big({100}, 10, 1);  // one parameter spanning all 10 shards
  EXPECT_EQ(big.slices_of_param(0).size(), 10u);
  ShardLayout three({2, 10, 2}, 4, 1);  // middle parameter spans ranks 0..3
  EXPECT_GE(three.slices_of_param(1).size(), 3u);
}

TEST(ShardLayout, ExactPaddingExample) {
  ShardLayout l({5, 6}, 4, 2);  // 11 elements, unit 8 -> padded 16, shards of 4
  EXPECT_EQ(l.padded_numel(), 16u);
  EXPECT_EQ(l.padding(), 5u);
  EXPECT_EQ(l.shard_range(2), (Range{8, 12}));
  auto s = l.slices_in_shard(1);  // [4, 8): param 0 element 4, param 1 elements 0..2
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s[0].param, 0u);
  EXPECT_EQ(s[0].numel, 1u);
  EXPECT_EQ(s[1].param, 1u);
  EXPECT_EQ(s[1].numel, 3u);
  EXPECT_TRUE(l.slices_in_shard(3).empty());  // [12, 16) is all padding
}

TEST(ShardLayout, BadArguments) {
  EXPECT_THROW(ShardLayout({1}, 0, 1), Error);
  EXPECT_THROW(ShardLayout({1}, 2, 0), Error);
  ShardLayout l({3}, 2, 1);
  EXPECT_THROW(l.shard_range(2), Error);
  EXPECT_THROW(l.slices_of_param(1), Error);
}

}  // namespace
}  // namespace zerort
