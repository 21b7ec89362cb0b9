// ThreadEngine: an IoQueue's pieces through a pool of threads doing O_DIRECT pread/pwrite, for
// machines without io_uring. See Note [IoQueue backends] (io/io_backend.h).
#pragma once

#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "io/io_engine.h"

namespace zerort::io {

// Each worker takes the oldest submitted piece and does one pread or pwrite of it (again on
// EINTR only), so a piece moves its bytes or fewer, or fails with an errno, as an io_uring
// entry does: the IoQueue above turns either into the same error.
class ThreadEngine final : public IoEngine {
 public:
  static constexpr unsigned kMaxThreads = 16;  // an NVMe drive is saturated well below this
  // min(queue_depth, kMaxThreads) workers.
  explicit ThreadEngine(unsigned queue_depth);
  // Stops the workers once their pieces are done (the IoQueue waits for those first).
  ~ThreadEngine() override;
  ThreadEngine(const ThreadEngine&) = delete;
  ThreadEngine& operator=(const ThreadEngine&) = delete;

  const char* name() const override { return "threads"; }
  // Nothing to register: pread and pwrite pin the pages of each call themselves.
  bool register_buffers(const AlignedBufferPool&) override { return false; }
  void prepare(std::uint64_t tag, int fd, bool is_write, char* buffer, std::uint32_t bytes,
               std::uint64_t offset) override;
  bool submit() override;
  bool reap(bool block, std::chrono::milliseconds timeout, std::vector<Completion>& done) override;

  std::size_t threads() const { return workers_.size(); }

 private:
  struct Piece {
    std::uint64_t tag;
    int fd;
    bool is_write;
    char* buffer;
    std::uint32_t bytes;
    std::uint64_t offset;
  };
  void work();                          // a worker's loop
  static int move(const Piece& piece);  // bytes moved, or -errno

  std::vector<Piece> prepared_;  // the caller's thread only
  std::mutex mu_;
  std::condition_variable work_ready_, piece_done_;
  std::deque<Piece> submitted_;   // under mu_
  std::vector<Completion> done_;  // under mu_
  bool stopping_ = false;         // under mu_
  std::vector<std::thread> workers_;
};

}  // namespace zerort::io
