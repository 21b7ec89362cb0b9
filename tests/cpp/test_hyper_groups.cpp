// Per-group AdamW hyperparameters in ShardOptimizer (torch's param groups): each region of
// the shard is updated with its group's values, elements outside every region with group
// 0's, and an output segment that crosses regions gets every element's new value. Against
// torch.optim.AdamW's update written out in FP64.
#include <ATen/ops/arange.h>
#include <ATen/ops/zeros.h>
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <vector>

#include "core/error.h"
#include "run_ranks.h"
#include "runtime/shard_optimizer.h"

namespace zerort::testing {
namespace {

TEST(HyperGroups, EachRegionStepsWithItsGroup) {
  const std::vector<AdamWHyper> hypers = {
      {0.1, 0.9, 0.999, 1e-8, 0.0}, {0.01, 0.8, 0.99, 1e-6, 0.5}, {0.0, 0.9, 0.999, 1e-8, 0.1}};
  // Elements 0-2: group 1; 3-4: no region (group 0); 5-7: group 2; 8: group 0; 9-11: group 1.
  const std::vector<std::array<int64_t, 3>> regions = {{9, 3, 1}, {0, 3, 1}, {5, 3, 2}, {8, 1, 0}};
  const std::vector<int> group_of = {1, 1, 1, 0, 0, 2, 2, 2, 0, 1, 1, 1};
  auto errors = run_ranks(1, [&](Communicator& comm) {
    OptimizerOptions o;
    o.precision = DType::kFloat32;
    at::Tensor master = at::arange(12, at::kFloat).div_(10).add_(0.5);
    const std::vector<float> start(master.data_ptr<float>(), master.data_ptr<float>() + 12);
    ShardOptimizer opt(master, comm, o);
    opt.set_hyper_groups(hypers, regions);
    std::vector<float> out(5, -1.0f);  // the working copy of elements 2-6: crosses three regions
    StepStats stats;
    for (int i = 0; i < 12; ++i) opt.grad_shard().data_ptr<float>()[i] = 0.1f * static_cast<float>(i - 5);
    ASSERT_TRUE(opt.step({{2, 5, out.data(), DType::kFloat32}}, stats));
    const float* p = opt.master().data_ptr<float>();
    for (int i = 0; i < 12; ++i) {
      const AdamWHyper& h = hypers[static_cast<size_t>(group_of[static_cast<size_t>(i)])];
      const double g = 0.1 * (i - 5), bc1 = 1 - h.beta1, bc2 = 1 - h.beta2;  // step 1
      const double m = (1 - h.beta1) * g, v = (1 - h.beta2) * g * g;
      double want = start[static_cast<size_t>(i)] * (1 - h.lr * h.weight_decay);
      want -= h.lr / bc1 * m / (std::sqrt(v) / std::sqrt(bc2) + h.eps);
      EXPECT_NEAR(p[i], want, 1e-6) << "element " << i << " (group " << group_of[static_cast<size_t>(i)] << ")";
      if (i >= 2 && i < 7) {
        EXPECT_EQ(out[static_cast<size_t>(i - 2)], p[i]) << "output element " << i;
      }
    }
    EXPECT_EQ(p[6], start[6]);  // group 2 has lr 0: nothing moves
  });
  EXPECT_EQ(errors[0], "");
}

TEST(HyperGroups, BadGroupsAreRefusedWholeAndChangeNothing) {
  auto errors = run_ranks(1, [&](Communicator& comm) {
    OptimizerOptions o;
    o.precision = DType::kFloat32;
    ShardOptimizer opt(at::zeros({8}, at::kFloat), comm, o);
    const AdamWHyper good{}, inf_lr{INFINITY, 0.9, 0.999, 1e-8, 0.0};
    EXPECT_THROW(opt.set_hyper_groups({good, inf_lr}, {{0, 4, 1}}), Error);
    EXPECT_THROW(opt.set_hyper_groups({good, good}, {{0, 4, 1}, {3, 2, 0}}), Error);  // overlap
    EXPECT_THROW(opt.set_hyper_groups({good}, {{0, 4, 1}}), Error);                   // no group 1
    EXPECT_THROW(opt.set_hyper_groups({good}, {{6, 4, 0}}), Error);                   // past the shard
    EXPECT_THROW(opt.set_hyper_groups({}, {}), Error);
    EXPECT_EQ(opt.hyper_groups().size(), 1u);
  });
  EXPECT_EQ(errors[0], "");
}

}  // namespace
}  // namespace zerort::testing
