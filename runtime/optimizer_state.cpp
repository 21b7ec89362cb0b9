#include "runtime/optimizer_state.h"

#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>

#include <algorithm>

#include "core/error.h"
#include "runtime/kernel_dispatch.h"

namespace zerort {

const char* tier_name(StateTier tier) {
  return tier == StateTier::kNvme ? "nvme" : tier == StateTier::kHost ? "cpu" : "memory";
}

InMemoryStateStore::InMemoryStateStore(at::Tensor master, DType state_dtype, bool with_gradient)
    : state_dtype_(state_dtype), master_(std::move(master)) {
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(master_.device());
  const auto states = f32.dtype(state_dtype_ == DType::kBFloat16 ? at::kBFloat16 : at::kFloat);
  exp_avg_ = at::zeros({master_.numel()}, states);
  exp_avg_sq_ = at::zeros({master_.numel()}, states);
  if (with_gradient) grad_ = at::zeros({master_.numel()}, f32);
}

at::Tensor& InMemoryStateStore::grad() {
  ZRT_CHECK_AS(UsageError, grad_.defined(), "InMemoryStateStore::grad(): this store was made without a gradient; ",
               "its DeviceGradientStore holds it (Note [gradient on the device])");
  return grad_;
}

void InMemoryStateStore::update(const ChunkFn& fn) {
  AdamWBuffers b;
  b.grad = grad_.defined() ? grad_.data_ptr<float>() : nullptr;
  b.grad_dtype = DType::kFloat32;
  b.master = master_.data_ptr<float>();
  b.exp_avg = exp_avg_.data_ptr();
  b.exp_avg_sq = exp_avg_sq_.data_ptr();
  b.state_dtype = state_dtype_;
  b.n = static_cast<size_t>(master_.numel());
  fn(0, b);
}

void check_ranges_tile(const std::vector<std::pair<size_t, size_t>>& ranges, size_t numel, const char* who) {
  std::vector<std::pair<size_t, size_t>> sorted(ranges);
  std::sort(sorted.begin(), sorted.end());
  size_t covered = 0;  // [0, covered) is tiled by the ranges so far
  for (const auto& [offset, n] : sorted) {
    ZRT_CHECK(offset <= numel && n <= numel - offset, who, ": range [", offset, ", ", offset + n,
              ") lies outside the state of ", numel, " elements");
    if (n == 0) continue;
    ZRT_CHECK(offset == covered, who, ": the ranges must cover each element of the state once; ",
              offset < covered ? "two cover element " : "none covers element ", std::min(offset, covered));
    covered = offset + n;
  }
  ZRT_CHECK(covered == numel, who, ": the ranges end at element ", covered, " of a state of ", numel,
            " elements; they must cover each element once");
}

void InMemoryStateStore::update_ranges(const std::vector<std::pair<size_t, size_t>>& ranges, const ChunkFn& fn) {
  check_ranges_tile(ranges, static_cast<size_t>(master_.numel()), "InMemoryStateStore::update_ranges");
  const size_t state_bytes = dtype_size(state_dtype_);
  for (const auto& [offset, n] : ranges) {
    AdamWBuffers b;
    b.grad = grad_.defined() ? grad_.data_ptr<float>() + offset : nullptr;
    b.grad_dtype = DType::kFloat32;
    b.master = master_.data_ptr<float>() + offset;
    b.exp_avg = static_cast<char*>(exp_avg_.data_ptr()) + offset * state_bytes;
    b.exp_avg_sq = static_cast<char*>(exp_avg_sq_.data_ptr()) + offset * state_bytes;
    b.state_dtype = state_dtype_;
    b.n = n;
    fn(offset, b);
  }
}

namespace {

// [offset, offset + n) of `whole` beside a host array of the same dtype (copies cross devices).
std::pair<at::Tensor, at::Tensor> host_and_range(const at::Tensor& whole, size_t offset, size_t n, const void* host) {
  ZRT_CHECK(offset <= static_cast<size_t>(whole.numel()) && n <= static_cast<size_t>(whole.numel()) - offset,
            "OptimizerStateStore: range [", offset, ", ", offset + n, ") lies outside the state of ", whole.numel(),
            " elements");
  at::Tensor h = at::from_blob(const_cast<void*>(host), {static_cast<int64_t>(n)}, whole.options().device(at::kCPU));
  return {h, whole.narrow(0, static_cast<int64_t>(offset), static_cast<int64_t>(n))};
}

}  // namespace

void OptimizerStateStore::read_grad(size_t offset, size_t n, float* out) {
  auto [h, range] = host_and_range(grad(), offset, n, out);
  h.copy_(range);
}

void OptimizerStateStore::write_grad(size_t offset, size_t n, const float* in) {
  auto [h, range] = host_and_range(grad(), offset, n, in);
  range.copy_(h);
}

GradStats OptimizerStateStore::unscale_and_check_grad(float inv_scale) {
  at::Tensor& g = grad();
  return unscale_and_check_on(g.device(), g.data_ptr<float>(), static_cast<size_t>(g.numel()), inv_scale);
}

void InMemoryStateStore::read_range(size_t offset, size_t n, float* master, void* exp_avg, void* exp_avg_sq) {
  const std::pair<const at::Tensor*, void*> arrays[] = {
      {&master_, master}, {&exp_avg_, exp_avg}, {&exp_avg_sq_, exp_avg_sq}};
  for (const auto& [whole, host] : arrays) {
    if (host == nullptr) continue;
    auto [h, range] = host_and_range(*whole, offset, n, host);
    h.copy_(range);
  }
}

void InMemoryStateStore::write_range(size_t offset, size_t n, const float* master, const void* exp_avg,
                                     const void* exp_avg_sq) {
  const std::pair<at::Tensor*, const void*> arrays[] = {
      {&master_, master}, {&exp_avg_, exp_avg}, {&exp_avg_sq_, exp_avg_sq}};
  for (const auto& [whole, host] : arrays) {
    if (host == nullptr) continue;
    auto [h, range] = host_and_range(*whole, offset, n, host);
    range.copy_(h);
  }
}

}  // namespace zerort
