// NvmeStateStore::update_ranges: the ranges in the order given, each record visited once where
// the order moves through the state up or down, and the in-memory store's bits in any order. See
// Note [NVMe state store], order. Files go under $ZERORT_IO_TEST_DIR (default /tmp).
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "io_test_util.h"
#include "nvme_state_test_util.h"
#include "runtime/nvme_state_store.h"

namespace zerort::testing {
namespace {

using io::testing::TempDir;

// update_ranges in the order given: fn sees each range whole before the next (walked down where
// a range ends at the last one's start), the state ends as the in-memory store's, and an order
// that moves through the state up or down visits each record once; one that jumps, more (the
// records' bytes alone are checked without the gradient in the file).
void expect_ordered_stream(const std::vector<std::pair<size_t, size_t>>& ranges, size_t numel, double ram_fraction,
                           bool each_record_once, size_t buffers = 3, bool gradient_in_file = false) {
  TempDir dir;
  const at::Tensor master = start_master(static_cast<int64_t>(numel));
  InMemoryStateStore in_memory(master.clone(), DType::kFloat32);
  NvmeStateStore store(master, DType::kFloat32, small_options(dir.path(), buffers, gradient_in_file, ram_fraction));
  // 0.75 x + g into the master, the new master added to m: the same bits in any order.
  const auto step = [](const AdamWBuffers& b) {
    auto* m = static_cast<float*>(b.exp_avg);
    const auto* g = static_cast<const float*>(b.grad);
    for (size_t i = 0; i < b.n; ++i) {
      b.master[i] = b.master[i] * 0.75f + g[i];
      m[i] += b.master[i];
    }
  };
  for (int round = 0; round < 2; ++round) {
    fill_grad(in_memory, round);
    fill_grad(store, round);
    in_memory.update_ranges(ranges, [&](size_t, const AdamWBuffers& b) { step(b); });
    std::vector<size_t> seen;  // the range of each call, in call order
    const uint64_t read_before = store.bytes_read(), written_before = store.bytes_written();
    // Reads ahead: in round 1 in round 0's order; with jumps in round 0 in offset order, which the
    // update drops.
    if (round == 1 || !each_record_once) store.prefetch();
    store.update_ranges(ranges, [&](size_t offset, const AdamWBuffers& b) {
      size_t r = 0;
      while (r < ranges.size() && !(offset >= ranges[r].first && offset < ranges[r].first + ranges[r].second)) ++r;
      ASSERT_LT(r, ranges.size()) << offset;
      EXPECT_LE(offset + b.n, ranges[r].first + ranges[r].second) << "a call crosses the end of range " << r;
      if (seen.empty() || seen.back() != r) seen.push_back(r);
      step(b);
    });
    std::vector<size_t> in_order;
    for (size_t r = 0; r < ranges.size(); ++r)
      if (ranges[r].second > 0) in_order.push_back(r);
    EXPECT_EQ(seen, in_order) << "each range whole, in the order given";
    float probe;
    store.read_range(0, 0, &probe, nullptr, nullptr);  // waits for the last writes
    const uint64_t file = store.records_bytes();
    if (gradient_in_file) continue;
    if (each_record_once) {
      EXPECT_EQ(store.bytes_read() - read_before, file) << "round " << round;
      EXPECT_EQ(store.bytes_written() - written_before, file) << "round " << round;
    } else {
      EXPECT_GT(store.bytes_written() - written_before, file) << "round " << round;
    }
  }
  const Snapshot a = snapshot(in_memory), b = snapshot(store);
  EXPECT_EQ(a.master, b.master);
  EXPECT_EQ(a.exp_avg, b.exp_avg);
}

TEST(NvmeStateStore, RangesStreamInTheOrderGiven) {
  TempDir probe;
  const size_t chunk = smallest_chunk(probe.path()), numel = 6 * chunk + 77;
  // Cut at places inside chunks: [0, a) [a, b) [b, c) [c, numel).
  const size_t a = chunk / 2, b = 2 * chunk + 5, c = 4 * chunk + chunk / 3;
  const std::vector<std::pair<size_t, size_t>> up = {{0, a}, {a, b - a}, {b, c - b}, {c, numel - c}};
  const std::vector<std::pair<size_t, size_t>> down = {{c, numel - c}, {b, c - b}, {a, b - a}, {0, a}};
  const std::vector<std::pair<size_t, size_t>> jumps = {{b, c - b}, {0, a}, {c, numel - c}, {a, 0}, {a, b - a}};
  for (double fraction : {0.0, 0.5}) {
    expect_ordered_stream(up, numel, fraction, true);
    expect_ordered_stream(down, numel, fraction, true);
    expect_ordered_stream(jumps, numel, fraction, false);
  }
  for (size_t buffers : {size_t{1}, size_t{2}}) {  // revisits with the fewest buffers, the gradient in the file
    expect_ordered_stream(jumps, numel, 0.0, false, buffers);
    expect_ordered_stream(jumps, numel, 0.0, false, buffers, true);
    expect_ordered_stream(down, numel, 0.0, true, buffers, true);
  }
}

// Ranges that do not tile the state are refused by both stores, naming the element, before any update.
TEST(NvmeStateStore, RangesThatDoNotCoverTheStateOnceAreRefused) {
  TempDir dir;
  NvmeStateStore store(start_master(20), DType::kFloat32, small_options(dir.path(), 1));
  InMemoryStateStore in_memory(start_master(20), DType::kFloat32);
  const auto none = [](size_t, const AdamWBuffers&) { FAIL() << "an update ran"; };
  const std::vector<std::pair<std::vector<std::pair<size_t, size_t>>, const char*>> bad = {
      {{{0, 4}}, "end at element 4"},                  // short
      {{{8, 16}}, "outside"},                          // past the end
      {{{0, 10}, {0, 10}}, "two cover element 0"},     // twice, the rest never
      {{{0, 5}, {10, 10}}, "none covers element 5"}};  // a gap
  for (const auto& [ranges, words] : bad) {
    for (OptimizerStateStore* s :
         {static_cast<OptimizerStateStore*>(&store), static_cast<OptimizerStateStore*>(&in_memory)}) {
      try {
        s->update_ranges(ranges, none);
        ADD_FAILURE() << words << ": accepted";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
      }
    }
  }
  EXPECT_TRUE(store.failure().empty()) << "a refused call leaves the store usable";
}

}  // namespace
}  // namespace zerort::testing
