// nvme_state_bench: one AdamW pass over the optimizer state through NvmeStateStore's pipeline
// (See Note [NVMe state store]) beside the same pass in memory, and the pipeline's I/O alone.
//
//   build/runtime/nvme_state_bench [directory (default /tmp)] [million elements (default 32)] [buffers]
//
// With `buffers`, only that nvme row (run each in its own process: a file just deleted by the
// row before can slow the next one's I/O on some disks).
//
// Rows: the in-memory tier (InMemoryStateStore: AdamW only); the nvme tier with 1 buffer (no
// overlap: read, AdamW, write, one after the other), 2 and 4 (read ahead and write back
// while AdamW runs); the nvme tier's I/O alone (a pass whose fn does nothing). With the
// pipeline working, the 4-buffer row is near max(AdamW, I/O) rather than their sum.
#include <ATen/ops/arange.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "optim/adamw.h"
#include "runtime/nvme_state_store.h"

using zerort::AdamWBuffers;
using zerort::AdamWStep;
using zerort::DType;
using zerort::OptimizerStateStore;

namespace {

// Seconds of the best of `reps` passes of update(): AdamW on each chunk, or nothing.
double best_pass(OptimizerStateStore& state, bool adamw, int reps) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    AdamWStep step;
    step.step = r + 1;
    const auto t0 = std::chrono::steady_clock::now();
    state.update([&](size_t, const AdamWBuffers& chunk) {
      if (adamw) zerort::adamw_step(chunk, step);
    });
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string dir = argc > 1 ? argv[1] : "/tmp";
  const int64_t numel = (argc > 2 ? std::atoll(argv[2]) : 32) * 1000000;
  const at::Tensor master = at::arange(numel, at::kFloat).mul_(1e-7f);
  const double state_gb = static_cast<double>(numel) * 12 / 1e9;  // master, m, v (f32)
  std::printf("state: %lld elements, %.2f GB of master+m+v (f32) in %s\n", static_cast<long long>(numel), state_gb,
              dir.c_str());
  zerort::InMemoryStateStore in_memory(master.clone(), DType::kFloat32);
  std::printf("%-34s %8.3f s\n", "in memory: AdamW", best_pass(in_memory, true, 3));
  std::vector<std::size_t> rows = {1, 2, 4};
  if (argc > 3) rows = {static_cast<std::size_t>(std::atoll(argv[3]))};
  for (std::size_t buffers : rows) {
    zerort::NvmeStateOptions o;
    o.directory = dir;
    o.buffer_count = buffers;
    o.queue_depth = 32;
    zerort::NvmeStateStore nvme(master, DType::kFloat32, o);
    const double io = best_pass(nvme, false, 2), step = best_pass(nvme, true, 2);
    std::printf("nvme, %zu buffer(s), pool %6.1f MB: AdamW %8.3f s (I/O alone %.3f s, %.2f GB/s read+write), I/O "
                "through %s\n",
                buffers, static_cast<double>(nvme.pool_bytes()) / 1e6, step, io, 2 * state_gb / io,
                nvme.tier_stats().io_backend.c_str());
  }
  return 0;
}
