// TwoHopCommunicator (Note [two hops]) on in-process groups playing N nodes of G ranks: the
// two-hop reduce-scatter against the exact sum within the stated bound and bitwise the same on
// every run, its accumulate, the two-hop all-gather against the flat one (in place too), and
// the numbering and dtype it refuses. Sizes 0, 1, odd; 2 x 2, 2 x 4 and 3 x 2 ranks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "comm/inprocess_communicator.h"
#include "comm/int8_blocks.h"
#include "comm/two_hop_communicator.h"
#include "core/error.h"
#include "core/half.h"
#include "two_hop_nodes.h"

namespace zerort::testing {
namespace {

std::vector<std::string> run_nodes(int nodes, int per_node, InterNodeWire wire,
                                   const std::function<void(Communicator&, Communicator&, int)>& fn,
                                   bool abort_inter = false) {
  Nodes shape;
  shape.nodes = nodes;
  shape.per_node = per_node;
  shape.wire = wire;
  shape.abort_inter = abort_inter;
  return testing::run_nodes(shape, fn);
}

using Case = std::tuple<int, int, DType, InterNodeWire>;  // nodes, ranks per node, input dtype, inter-node wire
class TwoHopReduceScatter : public ::testing::TestWithParam<Case> {};

TEST_P(TwoHopReduceScatter, IsWithinTheBoundOfTheExactSumAndTheSameOnEveryRun) {
  const auto [nodes, g, dtype, inter] = GetParam();
  const int world = nodes * g;
  // Rounding between the hops, relative to each node's sum: fp32 and bf16 (Note [two hops]).
  const double u = inter == InterNodeWire::kBf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -24);
  for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{1001}}) {
    auto errors = run_nodes(nodes, g, inter, [&, n](Communicator& two, Communicator&, int r) {
      const std::vector<uint16_t> in = input(dtype, r, world, n);
      std::vector<float> out(n, -1.0f), again(n, -2.0f);
      two.reduce_scatter_accumulate(in.data(), dtype, out.data(), n)->wait();
      two.reduce_scatter_accumulate(in.data(), dtype, again.data(), n)->wait();
      ASSERT_TRUE(n == 0 || std::memcmp(out.data(), again.data(), n * sizeof(float)) == 0) << "not the same bits twice";
      auto node_sum = [&](int k, size_t i) {
        double s = 0;
        for (int l = 0; l < g; ++l) s += value(k * g + l, r, i);
        return s;
      };
      for (size_t i = 0; i < n; ++i) {
        double exact = 0, node_sums = 0, magnitudes = 0, int8_steps = 0;
        for (int k = 0; k < nodes; ++k) {
          for (int l = 0; l < g; ++l) magnitudes += std::fabs(value(k * g + l, r, i));
          exact += node_sum(k, i);
          node_sums += std::fabs(node_sum(k, i));
          if (inter == InterNodeWire::kInt8 || inter == InterNodeWire::kFp8) {  // Note [int8 blocks]
            double a = 0;                                                       // the largest partial of i's block
            for (size_t j = i / kInt8Block * kInt8Block; j < std::min(n, (i / kInt8Block + 1) * kInt8Block); ++j) {
              a = std::max(a, std::fabs(node_sum(k, j)) * (1 + std::ldexp(1.0, -23)));  // as rounded to FP32
            }
            const double p = std::fabs(node_sum(k, i)) * (1 + std::ldexp(1.0, -23));
            int8_steps += inter == InterNodeWire::kInt8
                              ? (1.0 / 254 + std::ldexp(1.0, -22)) * a
                              : std::ldexp(p, -4) + (std::ldexp(1.0, -10) / 448 + std::ldexp(1.0, -22)) * a;
          }
        }
        const double bound =
            std::ldexp(std::fabs(exact), -24) + u * node_sums + int8_steps + std::ldexp(magnitudes, -53) * world;
        ASSERT_LE(std::fabs(out[i] - exact), bound) << "element " << i << " of rank " << r << ", n " << n;
      }
      two.reduce_scatter_accumulate(in.data(), dtype, again.data(), n, true)->wait();  // adds a second sum
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(again[i], out[i] + out[i]) << "accumulate, element " << i;
    });
    for (const auto& e : errors) EXPECT_EQ(e, "") << "n " << n;
  }
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const auto [nodes, g, dtype, inter] = info.param;
  const char* wire = inter == InterNodeWire::kInt8   ? "int8"
                     : inter == InterNodeWire::kFp8  ? "fp8"
                     : inter == InterNodeWire::kBf16 ? "bf16"
                                                     : "f32";
  return std::to_string(nodes) + "x" + std::to_string(g) + "_" + dtype_name(dtype) + "_inter_" + wire;
}

INSTANTIATE_TEST_SUITE_P(Nodes, TwoHopReduceScatter,
                         ::testing::Combine(::testing::Values(2, 3), ::testing::Values(2, 4),
                                            ::testing::Values(DType::kBFloat16, DType::kFloat16),
                                            ::testing::Values(InterNodeWire::kFp32, InterNodeWire::kBf16,
                                                              InterNodeWire::kInt8, InterNodeWire::kFp8)),
                         case_name);

// With fp32 between the hops and inputs whose node sums are exact in FP32 the result is the
// flat reduce-scatter's, bit for bit (both round the exact sum once).
TEST(TwoHop, ExactNodeSumsGiveTheFlatBits) {
  auto errors = run_nodes(2, 4, InterNodeWire::kFp32, [](Communicator& two, Communicator& flat, int r) {
    const size_t n = 333;
    const std::vector<uint16_t> in = input(DType::kBFloat16, r, 8, n);
    std::vector<float> a(n), b(n);
    two.reduce_scatter_accumulate(in.data(), DType::kBFloat16, a.data(), n)->wait();
    flat.reduce_scatter_accumulate(in.data(), DType::kBFloat16, b.data(), n)->wait();
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), n * sizeof(float)));
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
}

TEST(TwoHop, AllGatherEqualsTheFlatOneInPlaceToo) {
  for (auto [nodes, g] : {std::pair{2, 2}, std::pair{2, 4}, std::pair{3, 2}}) {
    const int world = nodes * g;
    auto errors = run_nodes(nodes, g, InterNodeWire::kFp32, [&](Communicator& two, Communicator& flat, int r) {
      for (size_t n : {size_t{0}, size_t{1}, size_t{5}}) {
        std::vector<uint16_t> mine(n), a(world * n), b(world * n, 7);
        for (size_t i = 0; i < n; ++i) mine[i] = static_cast<uint16_t>(r * 100 + i);
        two.all_gather(mine.data(), a.data(), n, DType::kBFloat16)->wait();
        flat.all_gather(mine.data(), b.data(), n, DType::kBFloat16)->wait();
        ASSERT_EQ(a, b) << "n " << n;
        std::vector<uint16_t> in_place(world * n, 0);
        std::copy(mine.begin(), mine.end(), in_place.begin() + static_cast<long>(r * n));
        two.all_gather(in_place.data() + r * n, in_place.data(), n, DType::kBFloat16)->wait();
        ASSERT_EQ(in_place, b) << "in place, n " << n;
      }
    });
    for (const auto& e : errors) EXPECT_EQ(e, "") << nodes << " x " << g;
  }
}

// A hop that fails names the caller's collective and rank in the whole world, then the hop,
// then the part's own error, with the part's error kind.
TEST(TwoHop, AFailedHopNamesTheCallAndTheHop) {
  auto errors = run_nodes(
      2, 2, InterNodeWire::kFp32,
      [](Communicator& two, Communicator&, int r) {
        const std::vector<uint16_t> in = input(DType::kBFloat16, r, 4, 3);
        std::vector<float> out(3);
        two.reduce_scatter_accumulate(in.data(), DType::kBFloat16, out.data(), 3)->wait();
      },
      true);
  for (int r = 0; r < 4; ++r) {
    const std::string& e = errors[static_cast<size_t>(r)];
    EXPECT_NE(e.find("reduce_scatter_accumulate(count=3"), std::string::npos) << e;
    EXPECT_NE(e.find("on rank " + std::to_string(r) + " of 4 [inprocess+two-hop], hop 2 (across nodes): "),
              std::string::npos)
        << e;
    EXPECT_NE(e.find("the link between the nodes is down"), std::string::npos) << e;
  }
}

TEST(TwoHop, AWrongNumberingAndAnUnknownWireAreRefusedByName) {
  auto flat = InProcessGroup::create(4), a = InProcessGroup::create(2), b = InProcessGroup::create(2);
  // Rank 1 of 4 given local 0 of node 0: not node * 2 + local.
  try {
    make_two_hop_communicator(flat->communicator(1), a->communicator(0), b->communicator(0), InterNodeWire::kFp32, {});
    FAIL() << "a wrong numbering was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("numbered node by node"), std::string::npos) << e.what();
  }
  try {
    parse_inter_node_wire("fp16");
    FAIL() << "an fp16 wire was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("comm.inter_node_dtype: got 'fp16'; expected fp32, bf16, int8 or fp8_e4m3"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace zerort::testing
