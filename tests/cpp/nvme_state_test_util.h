// The NvmeStateStore tests' shared pieces: small chunks and pools, a starting master, gradients
// and a snapshot of the state read back by ranges.
#pragma once

#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>

#include <cmath>
#include <string>
#include <vector>

#include "io/alignment.h"
#include "runtime/nvme_state_store.h"

namespace zerort::testing {

// The chunk NvmeStateStore makes of chunk_elements = 1: one alignment's worth of elements.
inline size_t smallest_chunk(const std::string& dir) { return io::round_up(1, io::direct_io_alignment(dir)); }

inline NvmeStateOptions small_options(const std::string& dir, size_t buffer_count, bool gradient_in_file = false,
                                      double ram_fraction = 0) {
  NvmeStateOptions o;
  o.gradient_in_file = gradient_in_file;
  o.ram_fraction = ram_fraction;
  o.directory = dir;
  o.chunk_elements = 1;
  o.buffer_count = buffer_count;
  o.queue_depth = 4;
  o.block_size = io::direct_io_alignment(dir);
  return o;
}

inline at::Tensor start_master(int64_t numel) { return at::arange(numel, at::kFloat).mul_(0.37f).sin_().mul_(2.0f); }

inline void fill_grad(at::Tensor& grad, int step) {
  float* g = grad.data_ptr<float>();
  for (int64_t i = 0; i < grad.numel(); ++i) g[i] = std::cos(0.11f * static_cast<float>(i) + static_cast<float>(step));
}

// fill_grad's values into the store's gradient, wherever it lives.
inline void fill_grad(OptimizerStateStore& state, int step) {
  at::Tensor g = at::empty({state.numel()}, at::kFloat);
  fill_grad(g, step);
  state.write_grad(0, static_cast<size_t>(g.numel()), g.data_ptr<float>());
}

struct Snapshot {
  std::vector<float> master;
  std::vector<char> exp_avg, exp_avg_sq;
};

inline Snapshot snapshot(OptimizerStateStore& state) {
  const size_t n = static_cast<size_t>(state.numel()), bytes = n * dtype_size(state.state_dtype());
  Snapshot s{std::vector<float>(n), std::vector<char>(bytes), std::vector<char>(bytes)};
  state.read_range(0, n, s.master.data(), s.exp_avg.data(), s.exp_avg_sq.data());
  return s;
}

}  // namespace zerort::testing
