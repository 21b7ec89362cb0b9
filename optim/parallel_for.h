// parallel_for: splits [0, n) into fixed blocks and runs them on all cores. Block edges do
// not depend on the thread count, so per-block reductions combined in block order give the
// same bits on any machine (the gradient norm relies on this).
#pragma once

#include <cstddef>
#include <functional>

namespace zerort {

// Threads used by the CPU kernels: ZERORT_NUM_THREADS if set, else the hardware's count.
int cpu_threads();

// Calls fn(block_index, begin, end) once per block of `block` elements (the last may be
// shorter). Blocks are spread over cpu_threads() threads; the caller's thread works too.
void parallel_for(size_t n, size_t block, const std::function<void(size_t, size_t, size_t)>& fn);

}  // namespace zerort
