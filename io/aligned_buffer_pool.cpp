#include "io/aligned_buffer_pool.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "core/error.h"

namespace zerort::io {

// See Note [The pool never grows].
AlignedBufferPool::AlignedBufferPool(std::size_t buffer_count, std::size_t buffer_size, std::size_t alignment)
    : buffer_count_(buffer_count), buffer_size_(buffer_size), alignment_(alignment) {
  ZRT_CHECK_AS(ConfigError, buffer_count > 0, "AlignedBufferPool: buffer_count must be positive, got 0");
  ZRT_CHECK_AS(ConfigError, alignment >= 512 && (alignment & (alignment - 1)) == 0,
               "AlignedBufferPool: the alignment must be a power of two >= 512, got ", alignment);
  ZRT_CHECK_AS(ConfigError, buffer_size > 0 && buffer_size % alignment == 0, "AlignedBufferPool: buffer_size (",
               buffer_size, ") must be a positive multiple of the direct-I/O alignment ", alignment);
  ZRT_CHECK_AS(ConfigError, buffer_size <= SIZE_MAX / buffer_count, "AlignedBufferPool: ", buffer_count, " buffers of ",
               buffer_size, " bytes overflow size_t");
  void* p = nullptr;
  int rc = ::posix_memalign(&p, alignment, buffer_count * buffer_size);
  ZRT_CHECK_AS(ConfigError, rc == 0, "AlignedBufferPool: cannot allocate ", buffer_count, " buffers of ", buffer_size,
               " bytes (", buffer_count * buffer_size,
               " bytes of RAM); lower buffer_count or buffer_size: ", std::strerror(rc));
  base_ = static_cast<char*>(p);
  std::memset(base_, 0, bytes());  // touch every page now, so the RAM is committed up front
  free_.reserve(buffer_count);
  for (std::size_t i = buffer_count; i > 0; --i) free_.push_back(i - 1);
  out_.assign(buffer_count, false);
}

AlignedBufferPool::~AlignedBufferPool() { std::free(base_); }

void* AlignedBufferPool::try_acquire() {
  std::lock_guard<std::mutex> lock(mu_);
  if (free_.empty()) return nullptr;
  std::size_t i = free_.back();
  free_.pop_back();
  out_[i] = true;
  return base_ + i * buffer_size_;
}

void* AlignedBufferPool::acquire() {
  void* p = try_acquire();
  ZRT_CHECK_AS(UsageError, p != nullptr, "AlignedBufferPool: all ", buffer_count_, " buffers of ", buffer_size_,
               " bytes are in use; release one (wait for its I/O) before acquiring another");
  return p;
}

void AlignedBufferPool::release(void* buffer) {
  long i = index_of(buffer);
  ZRT_CHECK_AS(UsageError, i >= 0 && static_cast<char*>(buffer) == base_ + i * buffer_size_,
               "AlignedBufferPool::release: ", buffer, " is not the start of one of this pool's buffers");
  std::lock_guard<std::mutex> lock(mu_);
  ZRT_CHECK_AS(UsageError, out_[i], "AlignedBufferPool::release: buffer ", i, " was not acquired (double release?)");
  out_[i] = false;
  free_.push_back(static_cast<std::size_t>(i));
}

std::size_t AlignedBufferPool::available() const {
  std::lock_guard<std::mutex> lock(mu_);
  return free_.size();
}

long AlignedBufferPool::index_of(const void* buffer) const {
  auto p = reinterpret_cast<std::uintptr_t>(buffer);
  auto b = reinterpret_cast<std::uintptr_t>(base_);
  if (p < b || p - b >= bytes()) return -1;
  return static_cast<long>((p - b) / buffer_size_);
}

}  // namespace zerort::io
