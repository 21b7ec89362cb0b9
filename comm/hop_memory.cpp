// The host HopMemory (comm/hop_memory.h): scratch on the heap, work done when the call returns.
#include "comm/hop_memory.h"

#include <cstring>

#include "comm/local_reduce.h"

namespace zerort {

namespace {

class HostHopMemory final : public HopMemory {
 public:
  void after_caller() override {}
  std::shared_ptr<char> scratch(size_t bytes) override {
    return std::shared_ptr<char>(new char[bytes > 0 ? bytes : 1], std::default_delete<char[]>());
  }
  void copy(void* to, const void* from, size_t bytes) override { std::memcpy(to, from, bytes); }
  void sum_chunks(const void* chunks, DType dtype, size_t world, size_t n, float* out, bool accumulate) override {
    sum_chunks_to_f32(chunks, dtype, world, n, out, accumulate);
  }
  void sum_over_wire(Communicator& comm, const float* parts, size_t n, InterNodeWire wire, float* out,
                     bool accumulate) override {
    zerort::sum_over_wire(comm, parts, n, wire, out, accumulate);
  }
  void settle() override {}
};

}  // namespace

std::unique_ptr<HopMemory> make_host_hop_memory() { return std::make_unique<HostHopMemory>(); }

}  // namespace zerort
