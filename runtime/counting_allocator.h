// CountingAllocator: a c10::Allocator for CPU memory that wraps another one (the CPU
// allocator torch had installed) and counts the bytes it has handed out: the bytes live now
// and the peak since the last reset. It is how zerort measures CPU memory (DESIGN, memory).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include <c10/core/Allocator.h>

namespace zerort {

struct AllocatorStats {
  int64_t current = 0;     // bytes of live allocations made through this allocator
  int64_t peak = 0;        // the most `current` has been since construction or reset_peak()
  int64_t since_mark = 0;  // of `current`, the bytes allocated since the last mark()
};

// What a memory phase's boundary reads (zerort.accounting.phases, one call per boundary).
struct PhaseMark {
  int64_t current = 0;  // live bytes before any reset
  int64_t peak = 0;     // the peak before any reset
  int64_t start = 0;    // live bytes after the reset (when there was one): the new window's start
};

// Each allocation of n bytes takes n + kHeaderBytes from the wrapped allocator; the header in
// front of the data records n, the owner, the generation (mark()) it was made in and the
// wrapped allocation's context and deleter.
// So the data pointer is its own context (raw_allocate/raw_deallocate work), the counts are
// exactly the requested bytes (the header is not counted), and memory that this allocator
// did not allocate (tensors made before installation) never touches its counters: their
// DataPtrs carry the wrapped allocator's deleter, not ours. Thread-safe (atomics).
class CountingAllocator final : public c10::Allocator {
 public:
  static constexpr size_t kHeaderBytes = c10::gAlignment;  // keeps the data 64-byte aligned

  // inner: the allocator that provides the memory; it must outlive this one.
  explicit CountingAllocator(c10::Allocator* inner);

  // Every allocation must be freed before this allocator is destroyed (the installed one
  // is never destroyed).
  c10::DataPtr allocate(size_t n) override;
  c10::DeleterFnPtr raw_deleter() const override;
  void copy_data(void* dest, const void* src, std::size_t count) const override;

  // current is read before peak, so peak >= current in the result.
  AllocatorStats stats() const;
  // Starts a new measurement window: peak := current.
  void reset_peak();
  // stats(), then with reset a reset_peak(), then the live bytes again: a phase's boundary
  // in one call (the end of the windows open so far and, with reset, the start of a new one).
  PhaseMark mark_phase(bool reset);
  // Starts a new generation: since_mark := 0, and from now on it counts the bytes allocated
  // after this call that are still live. Freeing memory allocated before the mark leaves it
  // alone, so it measures what a piece of code allocated and kept, whatever older memory
  // that code let go of (zerort.initialize: what the engine holds, though the model's
  // FP32 parameters it replaced are freed). Call it while no other thread allocates: an
  // allocation racing with the mark may be counted in the new generation and freed as old.
  void mark();
  // Whether `data` is memory this allocator handed out after the last mark() (an empty or
  // foreign DataPtr: false).
  bool allocated_since_mark(const c10::DataPtr& data) const;

  c10::Allocator* inner() const { return inner_; }

 private:
  static void free_counted(void* data);
  void raise_peak(int64_t now);

  c10::Allocator* inner_;
  std::atomic<int64_t> current_{0};
  std::atomic<int64_t> peak_{0};
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> since_mark_{0};
};

constexpr uint8_t kCountingAllocatorPriority = 100;  // torch's default CPU allocator has 0

// Installs a CountingAllocator over the CPU allocator torch has now (c10::GetCPUAllocator())
// with c10::SetCPUAllocator(..., kCountingAllocatorPriority). Idempotent: the first call
// creates it (it lives until the process exits), later calls only report. Returns true when
// it is torch's CPU allocator after the call (false: an allocator of higher priority is set).
// Storages made before the call keep their allocator, also when resized later.
bool install_counting_allocator();

// The installed allocator, or nullptr before install_counting_allocator().
CountingAllocator* installed_counting_allocator();

}  // namespace zerort
