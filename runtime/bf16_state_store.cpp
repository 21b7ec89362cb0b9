#include "runtime/bf16_state_store.h"

#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/logical_not.h>

#include <algorithm>

#include "core/error.h"
#include "optim/adamw_bf16_master.h"
#include "runtime/kernel_dispatch.h"

namespace zerort {

namespace {

void check_range(const at::Tensor& whole, size_t offset, size_t n) {
  ZRT_CHECK(offset <= static_cast<size_t>(whole.numel()) && n <= static_cast<size_t>(whole.numel()) - offset,
            "Bf16MasterStateStore: range [", offset, ", ", offset + n, ") lies outside the state of ", whole.numel(),
            " elements");
}

at::Tensor range_of(const at::Tensor& whole, size_t offset, size_t n) {
  check_range(whole, offset, n);
  return whole.narrow(0, static_cast<int64_t>(offset), static_cast<int64_t>(n));
}

// n values of `type` at p, in memory on `device`.
at::Tensor blob(const void* p, size_t n, at::ScalarType type, const c10::Device& device) {
  return at::from_blob(const_cast<void*>(p), {static_cast<int64_t>(n)}, at::TensorOptions().dtype(type).device(device));
}

at::ScalarType type_of(DType states) { return states == DType::kBFloat16 ? at::kBFloat16 : at::kFloat; }

}  // namespace

Bf16MasterStateStore::Bf16MasterStateStore(at::Tensor master, DType state_dtype)
    : state_dtype_(state_dtype), master_(std::move(master)) {
  ZRT_CHECK(
      master_.defined() && master_.scalar_type() == at::kBFloat16 && master_.dim() == 1 && master_.is_contiguous(),
      "Bf16MasterStateStore: master must be a contiguous 1-D bfloat16 tensor");
  check_device_supported(master_.device(), "Bf16MasterStateStore's master");
  const auto bf16 = at::TensorOptions().dtype(at::kBFloat16).device(master_.device());
  exp_avg_ = at::zeros({master_.numel()}, bf16.dtype(type_of(state_dtype_)));
  exp_avg_sq_ = at::zeros({master_.numel()}, bf16.dtype(type_of(state_dtype_)));
  grad_ = at::zeros({master_.numel()}, bf16);
}

void Bf16MasterStateStore::read_grad(size_t offset, size_t n, float* out) {
  blob(out, n, at::kFloat, device()).copy_(range_of(grad_, offset, n));  // widening: exact
}

void Bf16MasterStateStore::write_grad(size_t offset, size_t n, const float* in) {
  range_of(grad_, offset, n).copy_(blob(in, n, at::kFloat, device()));  // rounded to nearest even once
}

GradStats Bf16MasterStateStore::unscale_and_check_grad(float inv_scale) {
  // In pieces, so the FP32 copy never holds more than kPiece elements of the shard.
  constexpr int64_t kPiece = int64_t{1} << 20;
  GradStats out;
  for (int64_t at = 0; at < grad_.numel(); at += kPiece) {
    const at::Tensor x = grad_.narrow(0, at, std::min(kPiece, grad_.numel() - at)).to(at::kFloat).mul_(inv_scale);
    out.nonfinite += at::logical_not(at::isfinite(x)).sum().item<int64_t>();
    out.sum_squares += x.to(at::kDouble).square().sum().item<double>();
  }
  grad_unscale_ = inv_scale;
  return out;
}

void Bf16MasterStateStore::zero_grad() {
  grad_.zero_();
  grad_unscale_ = 1.0f;
}

void Bf16MasterStateStore::update(const ChunkFn& fn) {
  AdamWBuffers b = bf16_master_buffers(grad_.data_ptr(), DType::kBFloat16, static_cast<uint16_t*>(master_.data_ptr()),
                                       exp_avg_.data_ptr(), exp_avg_sq_.data_ptr(), state_dtype_,
                                       static_cast<size_t>(master_.numel()));
  b.grad_unscale = grad_unscale_;
  fn(0, b);
}

void Bf16MasterStateStore::read_range(size_t offset, size_t n, float* master, void* exp_avg, void* exp_avg_sq) {
  const at::ScalarType states = type_of(state_dtype_);
  if (master) blob(master, n, at::kFloat, at::kCPU).copy_(range_of(master_, offset, n));
  if (exp_avg) blob(exp_avg, n, states, at::kCPU).copy_(range_of(exp_avg_, offset, n));
  if (exp_avg_sq) blob(exp_avg_sq, n, states, at::kCPU).copy_(range_of(exp_avg_sq_, offset, n));
}

void Bf16MasterStateStore::write_range(size_t offset, size_t n, const float* master, const void* exp_avg,
                                       const void* exp_avg_sq) {
  const at::ScalarType states = type_of(state_dtype_);
  if (master) range_of(master_, offset, n).copy_(blob(master, n, at::kFloat, at::kCPU));
  if (exp_avg) range_of(exp_avg_, offset, n).copy_(blob(exp_avg, n, states, at::kCPU));
  if (exp_avg_sq) range_of(exp_avg_sq_, offset, n).copy_(blob(exp_avg_sq, n, states, at::kCPU));
}

}  // namespace zerort
