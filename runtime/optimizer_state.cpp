#include "runtime/optimizer_state.h"

#include <ATen/ops/zeros.h>

namespace zerort {

InMemoryStateStore::InMemoryStateStore(at::Tensor master, DType state_dtype)
    : state_dtype_(state_dtype), master_(std::move(master)) {
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(master_.device());
  const auto states = f32.dtype(state_dtype_ == DType::kBFloat16 ? at::kBFloat16 : at::kFloat);
  exp_avg_ = at::zeros({master_.numel()}, states);
  exp_avg_sq_ = at::zeros({master_.numel()}, states);
  grad_ = at::zeros({master_.numel()}, f32);
}

AdamWBuffers InMemoryStateStore::span(size_t offset, size_t n) {
  const size_t state_bytes = dtype_size(state_dtype_);
  AdamWBuffers b;
  b.grad = grad_.data_ptr<float>() + offset;
  b.grad_dtype = DType::kFloat32;
  b.master = master_.data_ptr<float>() + offset;
  b.exp_avg = static_cast<char*>(exp_avg_.data_ptr()) + offset * state_bytes;
  b.exp_avg_sq = static_cast<char*>(exp_avg_sq_.data_ptr()) + offset * state_bytes;
  b.state_dtype = state_dtype_;
  b.n = n;
  return b;
}

}  // namespace zerort
