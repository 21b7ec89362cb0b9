// ShardCopies: this rank's low-precision shard of each released stage-3 unit, kept apart from the
// FP32 master when the master is off memory (See Note [state tiers], runtime/engine_tiers.cpp):
// tensors in the model's memory, buffers in host memory reached through a Mover (offload_param
// "cpu" for a model on a device), or one region each of a file (offload_param.device "nvme").
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "comm/staged_communicator.h"
#include "io/region_file.h"
#include "runtime/optimizer_state.h"

namespace zerort {

// Where the copies go in a file: the directory (nvme_path) and the I/O's shape (aio's).
struct ShardFileOptions {
  std::string directory;
  int rank = 0;  // names the file: zerort-params-rank<rank>.bin
  unsigned queue_depth = 8;
  std::size_t block_size = std::size_t{1} << 20;
  io::IoBackend io_backend = io::IoBackend::kAuto;
};

// Copy b is written with begin_write(b) (a buffer of bytes(b) to fill) and end_write(b), and read
// with read(b, out); see Note [RegionFile] (io/region_file.h) for the file's rules, which the
// memory form keeps too (one write prepared at a time). A bucket without a copy has bytes 0.
class ShardCopies {
 public:
  ShardCopies() = default;  // no copies
  // bytes[b]: bucket b's copy in bytes (0: none). file: nullptr keeps them in memory, on
  // `device` (begin_write then hands out device memory, and read copies on the device).
  // With a file and a mover, read() goes through host staging of the largest copy and the
  // mover (the model's memory may be a device's); mover must outlive the copies.
  ShardCopies(const std::vector<std::size_t>& bytes, const ShardFileOptions* file, c10::Device device = at::kCPU,
              Mover* file_mover = nullptr);
  // In host memory (mover's host buffers): begin_write hands out host memory, and read copies to
  // the device with the mover. mover must outlive the copies.
  ShardCopies(const std::vector<std::size_t>& bytes, Mover& mover);

  bool has(std::size_t bucket) const { return bucket < bytes_.size() && bytes_[bucket] > 0; }
  void* begin_write(std::size_t bucket);
  void end_write(std::size_t bucket);
  void read(std::size_t bucket, void* out);             // out: the model's memory
  bool on_host() const { return mover_ != nullptr; }    // in the mover's host buffers
  bool host_writes() const { return mover_ || file_; }  // begin_write's buffers are host memory
  // The copies held in memory, the model's or the host's (0 in a file: its staging is
  // stats().pool_bytes).
  std::size_t memory_bytes() const;
  // In a file: its path, size, staging and I/O (tier kNvme); in memory: tier kMemory only.
  StateTierStats stats() const;

 private:
  std::vector<std::size_t> bytes_;
  std::vector<at::Tensor> memory_;
  std::vector<std::shared_ptr<char>> host_;  // on_host(): one per bucket (null: none)
  Mover* mover_ = nullptr;
  std::unique_ptr<io::RegionFile> file_;
  Mover* file_mover_ = nullptr;             // a file's reads go through staging_ and it
  std::shared_ptr<char> staging_;           // the largest copy, host memory (the mover's)
  std::unique_ptr<std::mutex> staging_mu_;  // readers on the comm thread and the caller's
};

}  // namespace zerort
