#include "runtime/kernel_dispatch.h"

#include "core/error.h"
#include "optim/adamw_bf16_master.h"
#include "optim/cast.h"
#include "zerort/config.h"
#if ZERORT_WITH_CUDA
#include "comm/cuda_streams.h"
#include "comm/local_reduce_cuda.h"
#include "core/cuda_check.h"
#include "optim/adamw_cuda.h"
#include "optim/cast_cuda.h"
#endif

namespace zerort {

namespace {

#if ZERORT_WITH_CUDA
int index_of(const c10::Device& device) { return device.index() < 0 ? 0 : device.index(); }

// The stream the user's work is on (Note [stream order], comm/stream_order.h).
cudaStream_t compute_stream(const c10::Device& device) { return cuda_stream_order(index_of(device)).compute(); }
#endif

}  // namespace

void check_device_supported(const c10::Device& device, const char* what) {
  if (device.is_cpu()) return;
  ZRT_CHECK_AS(DeviceError, device.is_cuda() && ZERORT_WITH_CUDA, what, " is on ", device.str(),
               "; this build of zerort runs on ",
               ZERORT_WITH_CUDA ? "CPU and CUDA tensors" : "CPU tensors only (nvcc was not found at build time)");
}

void cast_from_f32_on(const c10::Device& device, const float* in, void* out, DType out_dtype, size_t n) {
  if (device.is_cpu()) return cast_from_f32(in, out, out_dtype, n);
#if ZERORT_WITH_CUDA
  CudaDeviceGuard guard(index_of(device));
  const cudaStream_t stream = compute_stream(device);
  if (out_dtype == DType::kFloat32) {  // FP32 modules: a plain copy
    if (n > 0 && in != out) {
      ZRT_CHECK_CUDA(cudaMemcpyAsync(out, in, n * sizeof(float), cudaMemcpyDeviceToDevice, stream));
    }
    return;
  }
  cast_from_f32_cuda(in, out, out_dtype, n, stream);
#else
  check_device_supported(device, "cast_from_f32's buffer");
#endif
}

void cast_to_f32_on(const c10::Device& device, const void* in, DType in_dtype, float* out, size_t n) {
  if (device.is_cpu()) return cast_to_f32(in, in_dtype, out, n);
#if ZERORT_WITH_CUDA
  CudaDeviceGuard guard(index_of(device));
  cast_to_f32_cuda(in, in_dtype, out, n, compute_stream(device));
#else
  check_device_supported(device, "cast_to_f32's buffer");
#endif
}

void sum_chunks_to_f32_on(const c10::Device& device, const void* chunks, DType dtype, size_t world, size_t n,
                          float* out, bool accumulate) {
  if (device.is_cpu()) return sum_chunks_to_f32(chunks, dtype, world, n, out, accumulate);
#if ZERORT_WITH_CUDA
  CudaDeviceGuard guard(index_of(device));
  sum_chunks_to_f32_cuda(chunks, dtype, world, n, out, accumulate, compute_stream(device));
#else
  check_device_supported(device, "sum_chunks_to_f32's buffer");
#endif
}

void adamw_step_on(const c10::Device& device, const AdamWBuffers& buffers, const AdamWStep& step) {
  const bool bf16_master = buffers.master_bf16 != nullptr;
  if (device.is_cpu()) return bf16_master ? adamw_step_bf16_master(buffers, step) : adamw_step(buffers, step);
#if ZERORT_WITH_CUDA
  CudaDeviceGuard guard(index_of(device));
  if (bf16_master) {
    check_bf16_master_buffers(buffers, step, "adamw_step_bf16_master_cuda");  // the CPU kernel's checks
    adamw_step_bf16_master_cuda(buffers, step, compute_stream(device));
    return;
  }
  check_adamw_hyper(step.hyper, "adamw_step_cuda");  // adamw_step checks them on the CPU
  adamw_step_cuda(buffers, step, compute_stream(device));
#else
  check_device_supported(device, "the AdamW shard");
#endif
}

GradStats unscale_and_check_on(const c10::Device& device, float* grad, size_t n, float inv_scale) {
  if (device.is_cpu()) return unscale_and_check(grad, n, inv_scale);
#if ZERORT_WITH_CUDA
  CudaDeviceGuard guard(index_of(device));
  // The step's decision needs these values on the host: Note [allowed host waits].
  CudaStreamOrder& order = cuda_stream_order(index_of(device));
  order.count_host_wait(HostWait::kStepDecision);
  return unscale_and_check_cuda(grad, n, inv_scale, order.compute());
#else
  check_device_supported(device, "the gradient shard");
  return {};
#endif
}

}  // namespace zerort
