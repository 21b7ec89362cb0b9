// HopMemory: where the two-hop communicator's hops keep their scratch and do their local work
// (Note [two hops on the device], comm/two_hop_communicator.h): host memory, or one CUDA
// device's, on a stream of its own. One per hop worker: a memory is used by one thread at a time.
#pragma once

#include <cstddef>
#include <memory>

#include "comm/communicator.h"
#include "comm/wire_sum.h"
#include "core/dtype.h"
#include "zerort/config.h"

namespace zerort {

class HopMemory {
 public:
  virtual ~HopMemory() = default;
  // The queued work below starts after what the caller queued before its call (device: the
  // compute stream, Note [stream order]).
  virtual void after_caller() = 0;
  // bytes of scratch, freed (stream-ordered) when the last owner drops it.
  virtual std::shared_ptr<char> scratch(size_t bytes) = 0;
  virtual void copy(void* to, const void* from, size_t bytes) = 0;
  // sum_chunks_to_f32 (comm/local_reduce.h) on this memory.
  virtual void sum_chunks(const void* chunks, DType dtype, size_t world, size_t n, float* out, bool accumulate) = 0;
  // sum_over_wire (comm/wire_sum.h) on this memory, comm moving this memory's buffers.
  virtual void sum_over_wire(Communicator& comm, const float* parts, size_t n, InterNodeWire wire, float* out,
                             bool accumulate) = 0;
  // Blocks until the queued work has finished: before a collective reads what was queued (a
  // sub-communicator orders itself after the caller's stream, not this one) and at a hop's end.
  virtual void settle() = 0;
};

std::unique_ptr<HopMemory> make_host_hop_memory();
#if ZERORT_WITH_NCCL
std::unique_ptr<HopMemory> make_cuda_hop_memory(int device);  // comm/hop_memory_cuda.cpp
#endif

}  // namespace zerort
