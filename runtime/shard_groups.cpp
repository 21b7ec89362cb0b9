#include "runtime/shard_groups.h"

#include <ATen/ops/from_blob.h>

#include <algorithm>
#include <vector>

#include "core/error.h"

namespace zerort {

namespace {

// n FP32 values between `grad` (on device) and host memory: a plain copy on the host, else
// one device copy each way (a CUDA model whose world is staged: Note [staging once]).
void copy_f32(const float* from, const c10::Device& from_device, float* to, const c10::Device& to_device, size_t n) {
  if (from_device.is_cpu() && to_device.is_cpu()) {
    std::copy_n(from, n, to);
    return;
  }
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  const auto count = static_cast<int64_t>(n);
  at::from_blob(to, {count}, f32.device(to_device))
      .copy_(at::from_blob(const_cast<float*>(from), {count}, f32.device(from_device)));
}

}  // namespace

void sum_across_replicas(Communicator& replicas, float* grad, size_t n, const c10::Device& device, InterNodeWire wire,
                         int64_t tag) {
  ZRT_CHECK(!replicas.device_memory(), "sum_across_replicas: the replicas' '", replicas.backend_name(),
            "' communicator moves device memory; the sum across groups runs on host scratch");
  const size_t groups = static_cast<size_t>(replicas.size());
  if (groups == 1 || n == 0) return;
  const size_t piece = (n + groups - 1) / groups;
  std::vector<float> parts(groups * piece, 0.0f), mine(piece);
  const c10::Device host(c10::kCPU);
  copy_f32(grad, device, parts.data(), host, n);
  sum_over_wire(replicas, parts.data(), piece, wire, mine.data(), false);
  gather_over_wire(replicas, mine.data(), piece, wire, parts.data(), tag);
  copy_f32(parts.data(), host, grad, device, n);
}

}  // namespace zerort
