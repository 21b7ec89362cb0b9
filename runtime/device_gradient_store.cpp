#include "runtime/device_gradient_store.h"

#include <algorithm>

#include "core/error.h"

namespace zerort {

DeviceGradientStore::DeviceGradientStore(std::unique_ptr<OptimizerStateStore> inner, at::Tensor grad, Mover& mover,
                                         std::size_t piece_elements)
    : inner_(std::move(inner)), grad_(std::move(grad)), mover_(mover), piece_elements_(piece_elements) {
  ZRT_CHECK(inner_ != nullptr, "DeviceGradientStore: no inner store");
  ZRT_CHECK_AS(ConfigError, piece_elements_ >= 1, "DeviceGradientStore: piece_elements must be >= 1");
  ZRT_CHECK(grad_.defined() && grad_.scalar_type() == at::kFloat && grad_.dim() == 1 && grad_.is_contiguous() &&
                grad_.numel() == inner_->numel(),
            "DeviceGradientStore: the gradient must be a contiguous 1-D float32 tensor of the state's ",
            inner_->numel(), " elements");
  ZRT_CHECK(inner_->master_dtype() == DType::kFloat32, "DeviceGradientStore: the inner store's master is ",
            dtype_name(inner_->master_dtype()), "; it takes an FP32 master only");
  ZRT_CHECK(inner_->device().is_cpu(), "DeviceGradientStore: the inner store steps on ", inner_->device().str(),
            "; master, m and v must be off the device, on the host");
  piece_ = mover_.host_buffer(piece_bytes());
}

StateTierStats DeviceGradientStore::tier_stats() const {
  StateTierStats s = inner_->tier_stats();
  s.pool_bytes += piece_bytes();
  s.gradient_on_device = true;
  return s;
}

void DeviceGradientStore::in_pieces(size_t offset, const AdamWBuffers& chunk, const ChunkFn& fn) {
  float* host = reinterpret_cast<float*>(piece_.get());
  const float* device = grad_.data_ptr<float>();
  for (size_t done = 0; done < chunk.n;) {
    const size_t n = std::min(piece_elements_, chunk.n - done);
    mover_.settled_to_host(host, device + offset + done, n * sizeof(float));  // See Note: the host waited
    AdamWBuffers piece = elements_of(chunk, done, n);
    piece.grad = host;
    piece.grad_dtype = DType::kFloat32;
    fn(offset + done, piece);
    done += n;
  }
}

void DeviceGradientStore::update(const ChunkFn& fn) {
  inner_->update([&](size_t offset, const AdamWBuffers& chunk) { in_pieces(offset, chunk, fn); });
}

void DeviceGradientStore::update_ranges(const std::vector<std::pair<size_t, size_t>>& ranges, const ChunkFn& fn) {
  inner_->update_ranges(ranges, [&](size_t offset, const AdamWBuffers& chunk) { in_pieces(offset, chunk, fn); });
}

}  // namespace zerort
