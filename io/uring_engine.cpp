#include "io/uring_engine.h"

#include <liburing.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "io/aligned_buffer_pool.h"

namespace zerort::io {

namespace {

class UringEngine final : public IoEngine {
 public:
  explicit UringEngine(unsigned queue_depth) : init_rc_(io_uring_queue_init(queue_depth, &ring_, 0)) {}
  ~UringEngine() override {
    if (init_rc_ == 0) io_uring_queue_exit(&ring_);
  }
  UringEngine(const UringEngine&) = delete;
  UringEngine& operator=(const UringEngine&) = delete;

  int init_rc() const { return init_rc_; }

  const char* name() const override { return "io_uring"; }

  bool register_buffers(const AlignedBufferPool& pool) override {
    std::vector<iovec> iovs(pool.buffer_count());
    for (std::size_t i = 0; i < iovs.size(); ++i) iovs[i] = {pool.base() + i * pool.buffer_size(), pool.buffer_size()};
    if (io_uring_register_buffers(&ring_, iovs.data(), static_cast<unsigned>(iovs.size())) != 0) return false;
    pool_ = &pool;
    return true;
  }

  void prepare(std::uint64_t tag, int fd, bool is_write, char* buffer, std::uint32_t bytes,
               std::uint64_t offset) override {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    ZRT_CHECK(sqe != nullptr, "IoQueue: no free io_uring submission entry");  // the caller keeps <= depth out
    long index = pool_ ? pool_->index_of(buffer) : -1;
    bool fixed = index >= 0 && pool_->index_of(buffer + bytes - 1) == index;
    if (fixed && is_write) {
      io_uring_prep_write_fixed(sqe, fd, buffer, bytes, offset, static_cast<int>(index));
    } else if (fixed) {
      io_uring_prep_read_fixed(sqe, fd, buffer, bytes, offset, static_cast<int>(index));
    } else if (is_write) {
      io_uring_prep_write(sqe, fd, buffer, bytes, offset);
    } else {
      io_uring_prep_read(sqe, fd, buffer, bytes, offset);
    }
    io_uring_sqe_set_data64(sqe, tag);
  }

  // io_uring_sq_ready: entries prepared and not yet taken by the kernel. Counted on the ring:
  // a reap between two calls may have submitted some with its own.
  bool submit() override {
    while (io_uring_sq_ready(&ring_) > 0) {
      int rc = io_uring_submit(&ring_);
      if (rc == -EAGAIN || rc == -EBUSY) return false;  // the kernel wants completions reaped first
      ZRT_CHECK(rc >= 0 || rc == -EINTR, "IoQueue: io_uring_submit failed: ", std::strerror(-rc), " (errno ", -rc, ")");
    }
    return true;
  }

  bool reap(bool block, std::chrono::milliseconds timeout, std::vector<Completion>& done) override {
    io_uring_cqe* cqe = nullptr;
    if (block) {
      auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::max(timeout, std::chrono::milliseconds(0)));
      __kernel_timespec ts{static_cast<long long>(ns.count() / 1000000000),
                           static_cast<long long>(ns.count() % 1000000000)};
      int rc;
      do {
        rc = io_uring_wait_cqe_timeout(&ring_, &cqe, &ts);
      } while (rc == -EINTR);
      if (rc == -ETIME) return false;
      ZRT_CHECK(rc == 0, "IoQueue: waiting for a completion failed: ", std::strerror(-rc), " (errno ", -rc, ")");
    }
    while (io_uring_peek_cqe(&ring_, &cqe) == 0) {
      done.push_back({io_uring_cqe_get_data64(cqe), cqe->res});
      io_uring_cqe_seen(&ring_, cqe);
    }
    return true;
  }

 private:
  struct io_uring ring_ {};
  int init_rc_;  // io_uring_queue_init's: 0, or -errno (then the ring was never made)
  const AlignedBufferPool* pool_ = nullptr;
};

}  // namespace

std::unique_ptr<IoEngine> make_uring_engine(unsigned queue_depth, int& error) {
  auto engine = std::make_unique<UringEngine>(queue_depth);
  if (engine->init_rc() == 0) return engine;
  error = -engine->init_rc();
  return nullptr;
}

}  // namespace zerort::io
