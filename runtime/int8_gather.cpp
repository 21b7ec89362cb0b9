#include "runtime/int8_gather.h"

#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>

#include <memory>
#include <vector>

#include "comm/int8_blocks.h"
#include "core/error.h"
#include "optim/cast.h"
#include "runtime/kernel_dispatch.h"
#include "zerort/config.h"
#if ZERORT_WITH_NCCL
#include "comm/cuda_streams.h"
#include "comm/int8_blocks_cuda.h"
#endif

namespace zerort {

namespace {

WorkPtr gather_on_host(Communicator& comm, const void* own, DType dtype, size_t n, void* full, int64_t tag) {
  const size_t wire = int8_wire_bytes(n), world = static_cast<size_t>(comm.size());
  std::shared_ptr<char[]> mine(new char[wire + 1]), all(new char[world * wire + 1]);
  auto values = std::make_shared<std::vector<float>>(n);
  cast_to_f32(own, dtype, values->data(), n);
  encode_int8_blocks(values->data(), n, mine.get());
  WorkPtr w = comm.all_gather(mine.get(), all.get(), wire / 4, DType::kInt32, tag);  // opaque 32-bit words
  w->keep_alive(mine);
  w->keep_alive(all);
  auto* out = static_cast<char*>(full);
  w->then([all, values, out, n, wire, world, dtype] {
    for (size_t r = 0; r < world; ++r) {
      decode_int8_blocks(all.get() + r * wire, n, values->data());
      cast_from_f32(values->data(), out + r * n * dtype_size(dtype), dtype, n);
    }
  });
  return w;
}

#if ZERORT_WITH_NCCL
// Tensors as the Work's kept-alive buffers: the device may still write them after a timeout.
std::shared_ptr<void> held(const at::Tensor& t) { return std::make_shared<at::Tensor>(t); }

WorkPtr gather_on_device(Communicator& comm, const void* own, DType dtype, size_t n, void* full, int64_t tag,
                         const c10::Device& device) {
  ZRT_CHECK(comm.device_memory(), "stage3.gather_dtype 'int8': the model is on ", device.str(), " but the '",
            comm.backend_name(), "' communicator moves host memory");
  const auto wire = static_cast<int64_t>(int8_wire_bytes(n)), world = static_cast<int64_t>(comm.size());
  const auto on = at::TensorOptions().device(device);
  at::Tensor values = at::empty({static_cast<int64_t>(n)}, on.dtype(at::kFloat));
  at::Tensor mine = at::empty({wire}, on.dtype(at::kByte)), all = at::empty({world * wire}, on.dtype(at::kByte));
  c10::DeviceGuard guard(device);
  const cudaStream_t stream = cuda_stream_order(device.index()).compute();
  cast_to_f32_on(device, own, dtype, values.data_ptr<float>(), n);  // on the compute stream
  encode_8bit_blocks_cuda(EightBitCode::kInt8, values.data_ptr<float>(), n, mine.data_ptr(), kInt8Block, stream);
  WorkPtr w = comm.all_gather(mine.data_ptr(), all.data_ptr(), static_cast<size_t>(wire) / 4, DType::kInt32, tag);
  w->keep_alive(held(mine));
  w->keep_alive(held(all));
  auto* out = static_cast<char*>(full);
  w->then([all, values, out, n, wire, world, dtype, device] {
    c10::DeviceGuard on_device(device);
    const cudaStream_t s = cuda_stream_order(device.index()).compute();
    for (int64_t r = 0; r < world; ++r) {
      decode_8bit_blocks_cuda(EightBitCode::kInt8, static_cast<const char*>(all.data_ptr()) + r * wire, n,
                              values.data_ptr<float>(), kInt8Block, s);
      cast_from_f32_on(device, values.data_ptr<float>(), out + static_cast<size_t>(r) * n * dtype_size(dtype), dtype,
                       n);
    }
  });
  return w;
}
#endif

}  // namespace

WorkPtr gather_int8_blocks(Communicator& comm, const void* own, DType dtype, size_t n, void* full, int64_t tag,
                           const c10::Device& device) {
  if (device.is_cpu()) return gather_on_host(comm, own, dtype, n, full, tag);
#if ZERORT_WITH_NCCL
  return gather_on_device(comm, own, dtype, n, full, tag, device);
#else
  ZRT_THROW("stage3.gather_dtype 'int8' on ", device.str(), " needs a build with CUDA (nvcc was not found)");
#endif
}

}  // namespace zerort
