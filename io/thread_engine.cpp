#include "io/thread_engine.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>

namespace zerort::io {

ThreadEngine::ThreadEngine(unsigned queue_depth) {
  const unsigned n = std::max(1u, std::min(queue_depth, kMaxThreads));
  workers_.reserve(n);
  for (unsigned i = 0; i < n; ++i) workers_.emplace_back([this] { work(); });
}

ThreadEngine::~ThreadEngine() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  work_ready_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadEngine::prepare(std::uint64_t tag, int fd, bool is_write, char* buffer, std::uint32_t bytes,
                           std::uint64_t offset) {
  prepared_.push_back(Piece{tag, fd, is_write, buffer, bytes, offset});
}

bool ThreadEngine::submit() {
  if (prepared_.empty()) return true;
  {
    std::lock_guard<std::mutex> lock(mu_);
    submitted_.insert(submitted_.end(), prepared_.begin(), prepared_.end());
  }
  prepared_.clear();
  work_ready_.notify_all();
  return true;
}

bool ThreadEngine::reap(bool block, std::chrono::milliseconds timeout, std::vector<Completion>& done) {
  std::unique_lock<std::mutex> lock(mu_);
  if (block &&
      !piece_done_.wait_for(lock, std::max(timeout, std::chrono::milliseconds(0)), [this] { return !done_.empty(); })) {
    return false;
  }
  done.insert(done.end(), done_.begin(), done_.end());
  done_.clear();
  return true;
}

void ThreadEngine::work() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    work_ready_.wait(lock, [this] { return stopping_ || !submitted_.empty(); });
    if (submitted_.empty()) return;  // stopping, and nothing left to move
    Piece piece = submitted_.front();
    submitted_.pop_front();
    lock.unlock();
    const int result = move(piece);
    lock.lock();
    done_.push_back({piece.tag, result});
    piece_done_.notify_one();
  }
}

int ThreadEngine::move(const Piece& piece) {
  const auto offset = static_cast<off_t>(piece.offset);
  ssize_t n;
  do {
    n = piece.is_write ? ::pwrite(piece.fd, piece.buffer, piece.bytes, offset)
                       : ::pread(piece.fd, piece.buffer, piece.bytes, offset);
  } while (n < 0 && errno == EINTR);
  return n < 0 ? -errno : static_cast<int>(n);
}

}  // namespace zerort::io
