// The two-hop communicator's pipelined hops (Note [pipelined hops]): reduce-scatters and
// all-gathers issued back to back before any wait give the bits of the same calls run one at a
// time and of the flat communicator, with hops slowed on some ranks too; a failed hop 2 names
// the caller's collective and the hop; a wait honours its timeout. 2 x 2, 3 x 2 and 2 x 3 ranks;
// counts 0, 1, 7, 1000 and 1001.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "core/error.h"
#include "two_hop_nodes.h"

namespace zerort::testing {
namespace {

const std::vector<size_t> kCounts = {0, 1, 7, 1000, 1001};

// Every rank's results of one reduce-scatter (into zeros, then accumulated once more) and one
// all-gather per count.
struct Results {
  std::vector<std::vector<float>> sums;
  std::vector<std::vector<uint16_t>> gathered;
};

Results start(size_t calls) {
  Results res;
  res.sums.resize(calls);
  res.gathered.resize(calls);
  return res;
}

std::vector<uint16_t> own_chunk(int r, size_t n) {
  std::vector<uint16_t> mine(n);
  for (size_t i = 0; i < n; ++i) mine[i] = static_cast<uint16_t>(r * 1000 + i);
  return mine;
}

// Every call issued before any is waited for, reduces and gathers interleaved; waited for in
// reverse. pipelined = false: each waited for at once, on `comm`.
Results run_calls(Communicator& comm, int r, bool pipelined) {
  const int world = comm.size();
  Results res = start(kCounts.size());
  std::vector<std::vector<uint16_t>> ins, mine;
  std::vector<WorkPtr> works;
  for (size_t c = 0; c < kCounts.size(); ++c) {
    const size_t n = kCounts[c];
    ins.push_back(input(DType::kBFloat16, r, world, n));
    mine.push_back(own_chunk(r, n));
    res.sums[c].assign(n, 0.5f);
    res.gathered[c].assign(static_cast<size_t>(world) * n, 7);
  }
  auto issue = [&](WorkPtr w) {
    if (pipelined)
      works.push_back(std::move(w));
    else
      w->wait();
  };
  for (size_t c = 0; c < kCounts.size(); ++c) {
    const size_t n = kCounts[c];
    issue(comm.reduce_scatter_accumulate(ins[c].data(), DType::kBFloat16, res.sums[c].data(), n, true));
    issue(comm.all_gather(mine[c].data(), res.gathered[c].data(), n, DType::kBFloat16));
    issue(comm.reduce_scatter_accumulate(ins[c].data(), DType::kBFloat16, res.sums[c].data(), n, true));
  }
  for (auto it = works.rbegin(); it != works.rend(); ++it) (*it)->wait();
  return res;
}

void expect_same(const Results& a, const Results& b, const std::string& what) {
  for (size_t c = 0; c < kCounts.size(); ++c) {
    const size_t n = kCounts[c];
    EXPECT_TRUE(n == 0 || std::memcmp(a.sums[c].data(), b.sums[c].data(), n * sizeof(float)) == 0)
        << what << ": the sums differ, count " << n;
    EXPECT_EQ(a.gathered[c], b.gathered[c]) << what << ": the gathers differ, count " << n;
  }
}

// The inputs' node sums are exact in FP32 (multiples of 2^-8 below 2^9), so two hops with fp32
// between them give the flat communicator's bits (Note [two hops]).
void expect_serial_and_flat_bits(Nodes shape, const std::string& what) {
  auto errors = run_nodes(shape, [&](Communicator& two, Communicator& flat, int r) {
    const Results piped = run_calls(two, r, true);
    expect_same(piped, run_calls(two, r, false), what + ", against one call at a time");
    expect_same(piped, run_calls(flat, r, false), what + ", against the flat communicator");
  });
  for (const auto& e : errors) EXPECT_EQ(e, "") << what;
}

TEST(TwoHopPipelined, BackToBackCallsGiveTheSerialAndFlatBits) {
  for (auto [nodes, g] : {std::pair{2, 2}, std::pair{3, 2}, std::pair{2, 3}}) {
    Nodes shape;
    shape.nodes = nodes;
    shape.per_node = g;
    expect_serial_and_flat_bits(shape, std::to_string(nodes) + " x " + std::to_string(g));
  }
}

// The second hop of reduces (all_to_all) and the first of gathers (delay_calls) slowed on some
// ranks' inter-node parts: the hops of later calls run ahead on the other worker.
TEST(TwoHopPipelined, SlowedInterNodeHopsGiveTheSameBits) {
  for (auto [nodes, g] : {std::pair{2, 2}, std::pair{3, 2}}) {
    Nodes shape;
    shape.nodes = nodes;
    shape.per_node = g;
    shape.inter_part = [](std::shared_ptr<Communicator> inter, int r) -> std::shared_ptr<Communicator> {
      if (r % 3 != 1) return inter;
      inter->delay_calls(DelayedCalls::kGathers, std::chrono::microseconds(1500));
      return std::make_shared<SlowAllToAll>(std::move(inter), std::chrono::microseconds(2000));
    };
    expect_serial_and_flat_bits(shape, std::to_string(nodes) + " x " + std::to_string(g) + " slowed");
  }
}

// Rank 3's hop 2 comes after its inter-node peer (rank 1) gave up: rank 1's first reduce fails
// with a timeout naming that call and hop 2, rank 3's with the abort, naming them too; the
// call queued behind fails or succeeds, and none hangs.
TEST(TwoHopPipelined, ATimedOutHopTwoNamesTheCallAndTheHop) {
  Nodes shape;
  shape.inter_options.timeout = std::chrono::milliseconds(300);
  shape.inter_part = [](std::shared_ptr<Communicator> inter, int r) -> std::shared_ptr<Communicator> {
    if (r != 3) return inter;
    return std::make_shared<SlowAllToAll>(std::move(inter), std::chrono::milliseconds(1500));
  };
  std::vector<std::string> first(4);
  auto errors = run_nodes(shape, [&](Communicator& two, Communicator&, int r) {
    const size_t n = 7;
    const std::vector<uint16_t> in = input(DType::kBFloat16, r, 4, n);
    std::vector<float> a(n), b(n);
    WorkPtr w1 = two.reduce_scatter_accumulate(in.data(), DType::kBFloat16, a.data(), n, false, 11);
    WorkPtr w2 = two.reduce_scatter_accumulate(in.data(), DType::kBFloat16, b.data(), n, false, 12);
    try {
      w1->wait();
    } catch (const CommTimeoutError& e) {  // rank 1: it gave up waiting for rank 3
      first[static_cast<size_t>(r)] = e.what();
    } catch (const Error& e) {  // rank 3: its peer gave up (the in-process group is aborted)
      first[static_cast<size_t>(r)] = e.what();
    }
    try {
      w2->wait();
    } catch (const Error&) {  // rank 3's part is broken by then: its peer gave up
    }
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
  const std::string& e = first[1];
  EXPECT_NE(e.find("reduce_scatter_accumulate(count=7, dtype=bf16, tag=11) on rank 1 of 4 [inprocess+two-hop], "
                   "hop 2 (across nodes): "),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("did not finish within 300 ms"), std::string::npos) << e;
  EXPECT_NE(first[3].find("tag=11) on rank 3 of 4 [inprocess+two-hop], hop 2 (across nodes): "), std::string::npos)
      << first[3];
  EXPECT_EQ(first[0], "");  // the other inter-node group is not held up
  EXPECT_EQ(first[2], "");
}

// A wait shorter than the hops ends with a CommTimeoutError naming the caller's collective; the
// hops still finish behind it, and the communicator is then dropped without a hang.
TEST(TwoHopPipelined, AWaitHonoursItsTimeout) {
  Nodes shape;
  shape.inter_part = [](std::shared_ptr<Communicator> inter, int) -> std::shared_ptr<Communicator> {
    return std::make_shared<SlowAllToAll>(std::move(inter), std::chrono::milliseconds(400));
  };
  const size_t n = 5;
  // The hops read and write them after the wait gave up, until the communicator is dropped.
  std::vector<std::vector<uint16_t>> ins(4);
  std::vector<std::vector<float>> outs(4, std::vector<float>(n));
  auto errors = run_nodes(shape, [&](Communicator& two, Communicator&, int r) {
    const auto u = static_cast<size_t>(r);
    ins[u] = input(DType::kBFloat16, r, 4, n);
    WorkPtr w = two.reduce_scatter_accumulate(ins[u].data(), DType::kBFloat16, outs[u].data(), n, false, 5);
    try {
      w->wait(std::chrono::milliseconds(20));
      ADD_FAILURE() << "a 20 ms wait on a 400 ms hop returned";
    } catch (const CommTimeoutError& e) {
      EXPECT_NE(std::string(e.what()).find("reduce_scatter_accumulate(count=5, dtype=bf16, tag=5) on rank " +
                                           std::to_string(r) + " of 4 [inprocess+two-hop] did not finish within 20 ms"),
                std::string::npos)
          << e.what();
    }
    two.barrier()->wait();  // the flat communicator: not held back by the hops still running
  });
  for (const auto& e : errors) EXPECT_EQ(e, "");
}

}  // namespace
}  // namespace zerort::testing
