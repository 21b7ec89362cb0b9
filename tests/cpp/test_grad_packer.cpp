// GradPacker (runtime/grad_packer.h): the pack pool, one-off buffers, pack and release.
// See Note [grad packer].
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "runtime/grad_packer.h"

namespace zerort {
namespace {

const at::TensorOptions kBytes = at::TensorOptions().dtype(at::kByte);

// Three float buckets of 4, 8 and 2 elements (one, two and one parameters).
GradPacker three_buckets(bool pooled) {
  return GradPacker({{1, 16, at::kFloat}, {2, 32, at::kFloat}, {1, 8, at::kFloat}}, pooled, kBytes);
}

at::Tensor param_with_grad(std::vector<float> values) {
  at::Tensor p = at::zeros({static_cast<int64_t>(values.size())}).requires_grad_(true);
  p.mutable_grad() = at::tensor(values);
  return p;
}

const float* floats(GradPacker& packer, size_t b) { return static_cast<const float*>(packer.data(b)); }

TEST(GradPacker, TwoPoolSlotsEachAsLargeAsTheLargestBucket) {
  GradPacker packer = three_buckets(true);
  EXPECT_EQ(packer.buffer_bytes(), 2u * 32u);
  EXPECT_TRUE(packer.acquire(0));
  EXPECT_TRUE(packer.acquire(0));  // it holds one already
  EXPECT_TRUE(packer.acquire(1));
  EXPECT_FALSE(packer.acquire(2));  // both slots taken
  EXPECT_FALSE(packer.holds(2));
  packer.release(0);
  EXPECT_FALSE(packer.holds(0));
  EXPECT_TRUE(packer.acquire(2));  // the released slot
  EXPECT_EQ(packer.buffer_bytes(), 2u * 32u);
}

TEST(GradPacker, EnsureFallsBackToAOneOffBufferCountedByItsPeak) {
  GradPacker packer = three_buckets(true);
  ASSERT_TRUE(packer.acquire(0));
  ASSERT_TRUE(packer.acquire(2));
  packer.ensure(1);  // no free slot: a one-off buffer of bucket 1's 32 bytes
  EXPECT_TRUE(packer.holds(1));
  EXPECT_EQ(packer.buffer_bytes(), 2u * 32u + 32u);
  packer.release(1);
  EXPECT_FALSE(packer.holds(1));
  EXPECT_EQ(packer.buffer_bytes(), 2u * 32u + 32u);  // the peak stays
}

TEST(GradPacker, UnpooledEveryBufferIsAOneOff) {
  GradPacker packer = three_buckets(false);
  EXPECT_EQ(packer.buffer_bytes(), 0u);
  EXPECT_FALSE(packer.acquire(0));
  packer.ensure(0);
  packer.ensure(2);
  EXPECT_TRUE(packer.holds(0) && packer.holds(2));
  EXPECT_EQ(packer.buffer_bytes(), 16u);  // the largest one-off so far
}

TEST(GradPacker, PackCopiesTheGradientIntoItsPlaceAndFreesIt) {
  GradPacker packer = three_buckets(true);
  at::Tensor a = param_with_grad({1, 2, 3}), b = param_with_grad({4, 5});
  ASSERT_TRUE(packer.acquire(1));
  packer.pack(1, 1, 5, b);  // the second parameter, at element 5
  EXPECT_FALSE(b.grad().defined());
  EXPECT_TRUE(packer.packed(1, 1));
  EXPECT_FALSE(packer.packed(1, 0));
  packer.pack(1, 0, 0, a);
  const float* got = floats(packer, 1);
  const float want[8] = {1, 2, 3, 0, 0, 4, 5, 0};  // padding and gaps stay zero
  for (int i = 0; i < 8; ++i) EXPECT_EQ(got[i], want[i]) << i;
}

TEST(GradPacker, AParameterIsPackedOncePerRound) {
  GradPacker packer = three_buckets(false);
  packer.ensure(0);
  at::Tensor p = param_with_grad({1, 1, 1, 1});
  packer.pack(0, 0, 0, p);
  p.mutable_grad() = at::tensor(std::vector<float>{9, 9, 9, 9});
  packer.pack(0, 0, 0, p);  // already packed this round: nothing happens
  EXPECT_TRUE(p.grad().defined());
  EXPECT_EQ(floats(packer, 0)[0], 1.0f);
  packer.new_round();
  EXPECT_FALSE(packer.packed(0, 0));
  packer.pack(0, 0, 0, p);
  EXPECT_EQ(floats(packer, 0)[0], 9.0f);
}

TEST(GradPacker, AParameterWithoutAGradientLeavesZeros) {
  GradPacker packer = three_buckets(true);
  ASSERT_TRUE(packer.acquire(0));
  at::Tensor p = param_with_grad({7, 7, 7, 7});
  packer.pack(0, 0, 0, p);
  packer.release(0);
  ASSERT_TRUE(packer.acquire(2));  // the same slot, handed out zeroed
  at::Tensor none = at::zeros({2}).requires_grad_(true);
  packer.pack(2, 0, 0, none);
  EXPECT_TRUE(packer.packed(2, 0));
  EXPECT_EQ(floats(packer, 2)[0], 0.0f);
  EXPECT_EQ(floats(packer, 2)[1], 0.0f);
}

TEST(GradPacker, DataOfABucketWithoutABufferIsAnError) {
  GradPacker packer = three_buckets(true);
  EXPECT_THROW(packer.data(0), std::exception);
}

}  // namespace
}  // namespace zerort
