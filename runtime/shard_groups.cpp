#include "runtime/shard_groups.h"

#include <ATen/ops/from_blob.h>

#include <algorithm>
#include <vector>

#include "core/error.h"
#include "zerort/config.h"
#if ZERORT_WITH_NCCL
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/DeviceGuard.h>

#include "comm/cuda_streams.h"
#include "comm/wire_sum_cuda.h"
#endif

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

// Replicas that move device memory (nccl parts, Note [nccl parts]): the same pieces, sums and
// gather as on the host, in device scratch on the compute stream (Note [stream order]), the wire's
// kernels bit for bit the host's (comm/wire_sum_cuda.h).
void sum_on_device(Communicator& replicas, float* grad, size_t n, size_t piece, const c10::Device& device,
                   InterNodeWire wire, int64_t tag) {
#if ZERORT_WITH_NCCL
  ZRT_CHECK(device.is_cuda(), "sum_across_replicas: the replicas' '", replicas.backend_name(),
            "' communicator moves device memory, and the gradient is on ", device.str());
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  const auto groups = static_cast<int64_t>(replicas.size()), count = static_cast<int64_t>(n);
  c10::DeviceGuard guard(device);
  at::Tensor parts = at::zeros({groups * static_cast<int64_t>(piece)}, f32);
  at::Tensor mine = at::empty({static_cast<int64_t>(piece)}, f32);
  parts.narrow(0, 0, count).copy_(at::from_blob(grad, {count}, f32));
  const cudaStream_t stream = cuda_stream_order(device.index()).compute();
  sum_over_wire_cuda(replicas, parts.data_ptr<float>(), piece, wire, mine.data_ptr<float>(), false, stream);
  gather_over_wire_cuda(replicas, mine.data_ptr<float>(), piece, wire, parts.data_ptr<float>(), tag, stream);
  at::from_blob(grad, {count}, f32).copy_(parts.narrow(0, 0, count));
#else
  (void)grad, (void)n, (void)piece, (void)device, (void)wire, (void)tag;
  ZRT_THROW("sum_across_replicas: '", replicas.backend_name(), "' moves device memory, and this build has no CUDA");
#endif
}

}  // namespace

void sum_across_replicas(Communicator& replicas, float* grad, size_t n, const c10::Device& device, InterNodeWire wire,
                         int64_t tag) {
  const size_t groups = static_cast<size_t>(replicas.size());
  if (groups == 1 || n == 0) return;
  const size_t piece = (n + groups - 1) / groups;
  if (replicas.device_memory()) return sum_on_device(replicas, grad, n, piece, device, wire, tag);
  std::vector<float> parts(groups * piece, 0.0f), mine(piece);
  const c10::Device host(c10::kCPU);
  copy_f32(grad, device, parts.data(), host, n);
  sum_over_wire(replicas, parts.data(), piece, wire, mine.data(), false);
  gather_over_wire(replicas, mine.data(), piece, wire, parts.data(), tag);
  copy_f32(parts.data(), host, grad, device, n);
}

}  // namespace zerort
