// AlignedBufferPool: a fixed set of equal buffers for direct I/O, allocated once.
#pragma once

#include <cstddef>
#include <mutex>
#include <vector>

namespace zerort::io {

// Note [The pool never grows]
// The RAM that NVMe offload uses for I/O is buffer_count * buffer_size, fixed when the pool is
// made and reported by bytes(): it does not grow with the model, however large. All buffers
// are one allocation, aligned to the direct-I/O alignment (See Note [Direct I/O alignment]),
// so an IoQueue can register the whole pool with the kernel once (io_uring fixed buffers).
// acquire() never allocates: when every buffer is out it throws (try_acquire returns
// nullptr), and the caller waits on its in-flight I/O to get one back.
class AlignedBufferPool {
 public:
  // buffer_size must be a non-zero multiple of `alignment` (a power of two, >= 512).
  AlignedBufferPool(std::size_t buffer_count, std::size_t buffer_size, std::size_t alignment);
  ~AlignedBufferPool();
  AlignedBufferPool(const AlignedBufferPool&) = delete;
  AlignedBufferPool& operator=(const AlignedBufferPool&) = delete;

  // A free buffer, or nullptr when all are in use.
  void* try_acquire();
  // A free buffer; throws zerort::UsageError naming the pool's size when all are in use.
  void* acquire();
  // Gives back a buffer from acquire(); throws UsageError for a pointer that is not one of
  // this pool's buffers, or one that is not out.
  void release(void* buffer);

  std::size_t bytes() const { return buffer_count_ * buffer_size_; }
  std::size_t buffer_count() const { return buffer_count_; }
  std::size_t buffer_size() const { return buffer_size_; }
  std::size_t alignment() const { return alignment_; }
  std::size_t available() const;
  // The one allocation that holds every buffer (bytes() long); buffer i is at base() + i * buffer_size().
  char* base() const { return base_; }
  // The index of `buffer` (any address inside one of the buffers), or -1 when it is not in the pool.
  long index_of(const void* buffer) const;

 private:
  std::size_t buffer_count_;
  std::size_t buffer_size_;
  std::size_t alignment_;
  char* base_ = nullptr;
  mutable std::mutex mu_;
  std::vector<std::size_t> free_;  // indices of the free buffers
  std::vector<bool> out_;          // out_[i]: buffer i is acquired
};

}  // namespace zerort::io
