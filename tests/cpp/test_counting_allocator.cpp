// The counting CPU allocator: exact counts over an allocator that records its frees, the
// raw interface, concurrent allocation, and, installed, torch's own tensors.
#include <gtest/gtest.h>

#include <ATen/ops/empty.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "runtime/counting_allocator.h"

namespace zerort::testing {
namespace {

// An inner allocator whose context is not the data, so the wrapper must hand the wrapped
// deleter its own context back; it counts what is still live.
std::atomic<int64_t> g_spy_live{0};

struct SpyContext {
  void* data;
};

void spy_free(void* ctx) {
  auto* c = static_cast<SpyContext*>(ctx);
  std::free(c->data);
  delete c;
  g_spy_live.fetch_sub(1);
}

struct SpyAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    void* data = std::aligned_alloc(64, (n + 63) / 64 * 64);
    g_spy_live.fetch_add(1);
    return c10::DataPtr(data, new SpyContext{data}, &spy_free, c10::Device(c10::DeviceType::CPU));
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
};

class CountingAllocatorSizes : public ::testing::TestWithParam<size_t> {};

TEST_P(CountingAllocatorSizes, CountsExactlyTheRequestedBytes) {
  const size_t n = GetParam();
  SpyAllocator spy;
  CountingAllocator counting(&spy);
  {
    c10::DataPtr a = counting.allocate(n);
    EXPECT_EQ(counting.stats().current, static_cast<int64_t>(n));
    EXPECT_EQ(counting.stats().peak, static_cast<int64_t>(n));
    EXPECT_EQ(a.get() == nullptr, n == 0);
    EXPECT_EQ(a.get(), a.get_context());
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a.get()) % c10::gAlignment, 0u);
    if (n) std::memset(a.get(), 0x5a, n);  // the whole range is ours to write
    EXPECT_EQ(g_spy_live.load(), n ? 1 : 0);
    c10::DataPtr b = counting.allocate(n);
    EXPECT_EQ(counting.stats().peak, static_cast<int64_t>(2 * n));
  }
  EXPECT_EQ(g_spy_live.load(), 0);  // the wrapped deleter ran with its own context
  EXPECT_EQ(counting.stats().current, 0);
  EXPECT_EQ(counting.stats().peak, static_cast<int64_t>(2 * n));
  counting.reset_peak();
  EXPECT_EQ(counting.stats().peak, 0);
}

TEST_P(CountingAllocatorSizes, RawInterfaceAndClone) {
  const size_t n = GetParam();
  CountingAllocator counting(c10::GetDefaultCPUAllocator());
  ASSERT_NE(counting.raw_deleter(), nullptr);
  void* raw = counting.raw_allocate(n);
  EXPECT_EQ(counting.stats().current, static_cast<int64_t>(n));
  std::vector<unsigned char> pattern(n);
  for (size_t i = 0; i < n; ++i) pattern[i] = static_cast<unsigned char>(i * 7 + 1);
  if (n) std::memcpy(raw, pattern.data(), n);
  {
    c10::DataPtr copy = counting.clone(raw, n);
    EXPECT_EQ(counting.stats().current, static_cast<int64_t>(2 * n));
    if (n) {
      EXPECT_EQ(std::memcmp(copy.get(), pattern.data(), n), 0);
    }
  }
  counting.raw_deallocate(raw);
  EXPECT_EQ(counting.stats().current, 0);
}

INSTANTIATE_TEST_SUITE_P(Sizes, CountingAllocatorSizes,
                         ::testing::Values(size_t{0}, size_t{1}, size_t{77}, (size_t{1} << 24) + 3));

TEST(CountingAllocator, ConcurrentAllocationsBalance) {
  CountingAllocator counting(c10::GetDefaultCPUAllocator());
  constexpr int kThreads = 4, kRounds = 2000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&counting, t] {
      std::vector<c10::DataPtr> live;
      for (int i = 0; i < kRounds; ++i) {
        live.push_back(counting.allocate(static_cast<size_t>((i * 131 + t) % 4096 + 1)));
        if (live.size() > 8) live.erase(live.begin());
        if (i % 500 == 0) counting.reset_peak();
      }
    });
  }
  for (auto& th : threads) th.join();
  const AllocatorStats s = counting.stats();
  EXPECT_EQ(s.current, 0);
  EXPECT_GE(s.peak, 0);
  EXPECT_LE(s.peak, int64_t{kThreads} * 9 * 4096);
}

TEST(CountingAllocator, MarkCountsWhatIsAllocatedAfterItAndKept) {
  SpyAllocator spy;
  CountingAllocator counting(&spy);
  c10::DataPtr old = counting.allocate(1000);
  EXPECT_EQ(counting.stats().since_mark, 1000);  // no mark yet: counted from construction
  counting.mark();
  EXPECT_EQ(counting.stats().since_mark, 0);
  c10::DataPtr kept = counting.allocate(300);
  {
    c10::DataPtr temporary = counting.allocate(50);
    EXPECT_EQ(counting.stats().since_mark, 350);
  }
  old.clear();  // freeing what was allocated before the mark does not lower it
  EXPECT_EQ(counting.stats().since_mark, 300);
  EXPECT_EQ(counting.stats().current, 300);
  EXPECT_TRUE(counting.allocated_since_mark(kept));
  counting.mark();  // a second mark: `kept` is old now
  c10::DataPtr fresh = counting.allocate(7);
  EXPECT_FALSE(counting.allocated_since_mark(kept));
  EXPECT_TRUE(counting.allocated_since_mark(fresh));
  EXPECT_FALSE(counting.allocated_since_mark(c10::DataPtr()));
  kept.clear();
  EXPECT_EQ(counting.stats().since_mark, 7);
  EXPECT_EQ(counting.stats().current, 7);
}

// A memory phase's boundary in one call (zerort._C.phase_mark): the window so far, then with
// reset a new one starting at what is live.
TEST(CountingAllocator, MarkPhaseReadsThenStartsANewWindow) {
  SpyAllocator spy;
  CountingAllocator counting(&spy);
  c10::DataPtr kept = counting.allocate(100);
  { c10::DataPtr temporary = counting.allocate(400); }
  PhaseMark m = counting.mark_phase(false);
  EXPECT_EQ(m.current, 100);
  EXPECT_EQ(m.peak, 500);
  EXPECT_EQ(m.start, 100);
  EXPECT_EQ(counting.stats().peak, 500);  // no reset: the window goes on
  m = counting.mark_phase(true);
  EXPECT_EQ(m.peak, 500);  // the peak before the reset
  EXPECT_EQ(m.start, 100);
  EXPECT_EQ(counting.stats().peak, 100);  // the new window starts at what is live
  { c10::DataPtr temporary = counting.allocate(30); }
  EXPECT_EQ(counting.mark_phase(true).peak, 130);
}

TEST(CountingAllocator, InstalledCountsTorchTensorsOnly) {
  at::Tensor before = at::empty({1000}, at::kFloat);  // freed through the old allocator
  ASSERT_TRUE(install_counting_allocator());
  ASSERT_TRUE(install_counting_allocator());  // idempotent
  CountingAllocator* counting = installed_counting_allocator();
  ASSERT_NE(counting, nullptr);
  EXPECT_EQ(c10::GetCPUAllocator(), counting);
  const int64_t base = counting->stats().current;
  {
    at::Tensor t = at::empty({1 << 20}, at::kFloat);
    EXPECT_EQ(counting->stats().current - base, int64_t{4} << 20);
    before = at::Tensor();
    EXPECT_EQ(counting->stats().current - base, int64_t{4} << 20);
  }
  EXPECT_EQ(counting->stats().current, base);
  EXPECT_GE(counting->stats().peak, base + (int64_t{4} << 20));
}

}  // namespace
}  // namespace zerort::testing
