#include "runtime/counting_allocator.h"

#include <limits>
#include <mutex>
#include <new>

#include <c10/core/CPUAllocator.h>

#include "core/error.h"

namespace zerort {

namespace {

// Sits in the kHeaderBytes in front of the data of every counted allocation.
struct Header {
  size_t nbytes;
  uint64_t generation;
  CountingAllocator* owner;
  void* inner_context;
  c10::DeleterFnPtr inner_deleter;
};
static_assert(sizeof(Header) <= CountingAllocator::kHeaderBytes, "the header must fit in front of the data");

Header* header_of(void* data) {
  return reinterpret_cast<Header*>(static_cast<char*>(data) - CountingAllocator::kHeaderBytes);
}

std::atomic<CountingAllocator*> g_installed{nullptr};

}  // namespace

CountingAllocator::CountingAllocator(c10::Allocator* inner) : inner_(inner) {
  ZRT_CHECK(inner != nullptr, "CountingAllocator needs an allocator to wrap");
}

c10::DataPtr CountingAllocator::allocate(size_t n) {
  const c10::Device cpu(c10::DeviceType::CPU);
  if (n == 0) return c10::DataPtr(nullptr, nullptr, &free_counted, cpu);  // as torch's: no memory
  ZRT_CHECK(n <= static_cast<size_t>(std::numeric_limits<int64_t>::max()) - kHeaderBytes, "CPU allocation of ", n,
            " bytes is too large");
  c10::DataPtr inner = inner_->allocate(n + kHeaderBytes);
  ZRT_CHECK(inner.get() != nullptr, "the wrapped CPU allocator returned no memory for ", n, " bytes");
  char* base = static_cast<char*>(inner.get());
  const c10::DeleterFnPtr inner_deleter = inner.get_deleter();
  void* inner_context = inner.release_context();  // from here on the header owns it
  new (base) Header{n, generation_.load(), this, inner_context, inner_deleter};
  since_mark_.fetch_add(static_cast<int64_t>(n));
  const int64_t now = current_.fetch_add(static_cast<int64_t>(n)) + static_cast<int64_t>(n);
  raise_peak(now);
  void* data = base + kHeaderBytes;
  return c10::DataPtr(data, data, &free_counted, cpu);
}

void CountingAllocator::free_counted(void* data) {
  if (data == nullptr) return;
  const Header h = *header_of(data);
  h.owner->current_.fetch_sub(static_cast<int64_t>(h.nbytes));
  if (h.generation == h.owner->generation_.load()) h.owner->since_mark_.fetch_sub(static_cast<int64_t>(h.nbytes));
  if (h.inner_deleter != nullptr) h.inner_deleter(h.inner_context);
}

c10::DeleterFnPtr CountingAllocator::raw_deleter() const { return &free_counted; }

void CountingAllocator::copy_data(void* dest, const void* src, std::size_t count) const {
  default_copy_data(dest, src, count);
}

void CountingAllocator::raise_peak(int64_t now) {
  int64_t peak = peak_.load();
  while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
  }
}

AllocatorStats CountingAllocator::stats() const {
  AllocatorStats s;
  s.current = current_.load();
  s.peak = peak_.load();
  s.since_mark = since_mark_.load();
  return s;
}

void CountingAllocator::mark() {
  generation_.fetch_add(1);
  since_mark_.store(0);
}

bool CountingAllocator::allocated_since_mark(const c10::DataPtr& data) const {
  if (data.get() == nullptr || data.get_deleter() != &free_counted) return false;
  const Header* h = header_of(data.get());
  return h->owner == this && h->generation == generation_.load();
}

void CountingAllocator::reset_peak() {
  peak_.store(current_.load());
  raise_peak(current_.load());  // an allocation between the load and the store still counts
}

PhaseMark CountingAllocator::mark_phase(bool reset) {
  const AllocatorStats s = stats();
  PhaseMark m;
  m.current = m.start = s.current;
  m.peak = s.peak;
  if (reset) {
    reset_peak();
    m.start = current_.load();
  }
  return m;
}

bool install_counting_allocator() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Leaked on purpose: tensors it allocated may be freed during process exit.
    auto* counting = new CountingAllocator(c10::GetCPUAllocator());
    c10::SetCPUAllocator(counting, kCountingAllocatorPriority);
    g_installed.store(counting);
  });
  return c10::GetCPUAllocator() == g_installed.load();
}

CountingAllocator* installed_counting_allocator() { return g_installed.load(); }

}  // namespace zerort
