#include "runtime/shard_copies.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include <algorithm>

#include "core/error.h"

namespace zerort {

ShardCopies::ShardCopies(const std::vector<std::size_t>& bytes, const ShardFileOptions* file, c10::Device device,
                         Mover* file_mover)
    : bytes_(bytes) {
  if (file != nullptr) {
    file_ = std::make_unique<io::RegionFile>(file->directory, detail::concat("zerort-params-rank", file->rank, ".bin"),
                                             bytes_, file->queue_depth, file->block_size, file->io_backend);
    if (file_mover != nullptr) {
      std::size_t largest = 0;
      for (std::size_t b : bytes_) largest = std::max(largest, b);
      file_mover_ = file_mover;
      staging_ = file_mover->host_buffer(largest);
      staging_mu_ = std::make_unique<std::mutex>();
    }
    return;
  }
  for (std::size_t b : bytes_) {
    memory_.push_back(at::empty({static_cast<int64_t>(b)}, at::TensorOptions().dtype(at::kByte).device(device)));
  }
}

ShardCopies::ShardCopies(const std::vector<std::size_t>& bytes, Mover& mover) : bytes_(bytes), mover_(&mover) {
  for (std::size_t b : bytes_) host_.push_back(b > 0 ? mover.host_buffer(b) : nullptr);
}

void* ShardCopies::begin_write(std::size_t bucket) {
  ZRT_CHECK(has(bucket), "ShardCopies: bucket ", bucket, " has no shard copy");
  return file_ ? file_->begin_write(bucket) : mover_ ? host_[bucket].get() : memory_[bucket].data_ptr();
}

void ShardCopies::end_write(std::size_t bucket) {
  if (file_) file_->end_write(bucket);
}

void ShardCopies::read(std::size_t bucket, void* out) {
  ZRT_CHECK(has(bucket), "ShardCopies: bucket ", bucket, " has no shard copy");
  if (file_ && file_mover_) {  // to host staging, then to the model's memory
    std::lock_guard<std::mutex> lock(*staging_mu_);
    file_->read(bucket, staging_.get());
    file_mover_->from_host(out, staging_.get(), bytes_[bucket]);
    return;
  }
  if (file_) {
    file_->read(bucket, out);
    return;
  }
  if (mover_) {
    mover_->from_host(out, host_[bucket].get(), bytes_[bucket]);
    return;
  }
  const at::Tensor& copy = memory_[bucket];
  at::from_blob(out, {copy.numel()}, copy.options()).copy_(copy);
}

std::size_t ShardCopies::memory_bytes() const {
  if (file_) return 0;
  std::size_t total = 0;
  for (std::size_t b : bytes_) total += b;
  return total;
}

StateTierStats ShardCopies::stats() const {
  StateTierStats s;
  if (!file_) return s;
  s.tier = StateTier::kNvme;
  s.path = file_->path();
  s.file_bytes = file_->file_bytes();
  s.pool_bytes = file_->staging_bytes();
  s.bytes_read = file_->bytes_read();
  s.bytes_written = file_->bytes_written();
  s.io_wait_seconds = file_->wait_seconds();
  s.io_backend = file_->io_backend();
  s.io_backend_why = file_->io_backend_why();
  return s;
}

}  // namespace zerort
