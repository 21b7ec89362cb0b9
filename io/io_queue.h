// IoQueue: asynchronous direct reads and writes, through io_uring or a pool of threads
// (See Note [IoQueue backends], io/io_backend.h).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "io/io_backend.h"
#include "io/io_engine.h"

namespace zerort::io {

class AlignedBufferPool;
class DirectFile;

// Note [Why io_uring]
// The NVMe tier needs many direct reads and writes in flight from one thread. We use io_uring
// (liburing) rather than Linux AIO (libaio):
//   - libaio is asynchronous only for O_DIRECT, and even then io_submit blocks inside the call
//     whenever a request cannot be queued at once (the device's queue is full, the filesystem
//     must read metadata or allocate blocks). io_uring hands such a request to a kernel worker
//     and io_uring_submit returns;
//   - io_uring takes a whole batch (up to queue_depth blocks) in one io_uring_enter syscall,
//     and reaps completions from a shared ring without any syscall;
//   - it can register the buffer pool with the kernel once (fixed buffers), so each request
//     skips pinning and unpinning its pages;
//   - liburing is a small Debian package (liburing-dev), as libaio is.

// Note [IoQueue requests]
// A request (one read or one write of `bytes` at `offset`) is cut into block_size pieces, and
// at most queue_depth pieces are in the kernel (or with the engine's threads) at once; the rest wait in the queue and go in
// as earlier ones complete. Pieces complete in any order, across requests too. A request is
// done when all its pieces are; wait(request) blocks until then (or the timeout) and poll()
// says whether it is, without blocking. A piece that fails, or moves fewer bytes than asked
// (a short read past the end of a truncated file), fails its request with an Error naming the
// file, the offset and the errno or the byte count: the request's later pieces are not
// submitted, and the error is thrown only once no piece of it is still in the kernel, so
// the caller can reuse the buffer at once. There is never a silent partial result.
// Buffers, offsets and lengths must be multiples of the file's alignment
// (See Note [Direct I/O alignment]); a buffer must stay valid until its request is done.
class IoQueue {
 public:
  using Request = std::uint64_t;

  // queue_depth: pieces in the kernel at once (1..32768); block_size: the piece size, a
  // positive multiple of 512 (and of each file's alignment, checked at submit). backend: See
  // Note [IoQueue backends]; ConfigError when an explicit one cannot be had, saying why.
  static constexpr unsigned kMaxDepth = 32768;  // io_uring's most entries in one ring
  IoQueue(unsigned queue_depth, std::size_t block_size, IoBackend backend = IoBackend::kAuto);
  // Waits for every piece still in the kernel (their buffers may be freed after this).
  ~IoQueue();
  IoQueue(const IoQueue&) = delete;
  IoQueue& operator=(const IoQueue&) = delete;

  // Registers the pool's buffers with the kernel (io_uring fixed buffers); later pieces inside
  // the pool use them. Returns false (and changes nothing) when the kernel refuses, e.g. over
  // RLIMIT_MEMLOCK, or the backend has none (threads): the I/O works the same, only without
  // the saving. At most one pool, and
  // only while nothing is in flight; the pool must outlive the queue.
  bool register_pool(const AlignedBufferPool& pool);

  // Starts a read of `bytes` bytes at `offset` of `file` into `buffer`, or a write from it.
  // Throws zerort::UsageError for a misaligned buffer, offset or length, or a range past the
  // file's size. `file` must outlive the request.
  Request read(const DirectFile& file, std::uint64_t offset, void* buffer, std::size_t bytes);
  Request write(const DirectFile& file, std::uint64_t offset, const void* buffer, std::size_t bytes);

  // Blocks until `request` is done, then forgets it. Throws zerort::Error for a failed request
  // (See Note [IoQueue requests]) and for a timeout (the request then stays in flight; wait again).
  void wait(Request request, std::chrono::milliseconds timeout = std::chrono::minutes(5));
  // Reaps what has completed without blocking; true (and the request forgotten) when `request`
  // is done. Throws as wait() does for a failed request.
  bool poll(Request request);
  // Waits for every request (as wait() on each, in submit order; the first error is thrown).
  void wait_all(std::chrono::milliseconds timeout = std::chrono::minutes(5));

  // The engine that moves the pieces: "io_uring" or "threads"; and why it was chosen when that
  // is not simply what was asked for (an "auto" that fell back, ZERORT_IO_BACKEND), else "".
  const char* backend() const { return engine_->name(); }
  const std::string& backend_why() const { return backend_why_; }
  unsigned queue_depth() const { return queue_depth_; }
  std::size_t block_size() const { return block_size_; }
  // Pieces in the kernel now, and requests not yet waited for.
  unsigned pieces_in_flight() const { return in_kernel_; }
  std::size_t requests_open() const { return requests_.size(); }
  // Bytes moved by completed pieces since the queue was made.
  std::uint64_t bytes_read() const { return bytes_read_; }
  std::uint64_t bytes_written() const { return bytes_written_; }
  // Seconds the caller spent blocked in wait() (and so wait_all()), a failed wait's too: the
  // I/O that was not hidden behind the caller's work.
  double wait_seconds() const { return wait_seconds_; }

 private:
  struct Piece {
    Request request;
    std::uint64_t offset;
    char* buffer;
    std::uint32_t bytes;
  };
  struct RequestState {
    const DirectFile* file;
    bool is_write;
    std::uint64_t offset;
    std::size_t bytes;
    std::size_t pieces_left;  // pieces not yet completed (queued or in the kernel)
    std::string error;        // the first failure, empty when none
  };

  Request start(const DirectFile& file, bool is_write, std::uint64_t offset, char* buffer, std::size_t bytes);
  void submit_queued();
  // Reaps completions; blocks up to `timeout` for the first one when `block`. False on timeout.
  bool reap(bool block, std::chrono::milliseconds timeout);
  void complete(const IoEngine::Completion& done);
  void finish(Request request);  // forgets a done request; throws its error

  unsigned queue_depth_;
  std::size_t block_size_;
  std::unique_ptr<IoEngine> engine_;
  std::string backend_why_;
  const AlignedBufferPool* pool_ = nullptr;
  std::vector<Piece> slots_;                       // the pieces in the kernel, by slot (the engine's tag)
  std::vector<IoEngine::Completion> completions_;  // reap()'s scratch
  std::vector<std::uint64_t> free_slots_;
  std::deque<Piece> queued_;  // pieces waiting for a slot, in submit order
  std::map<Request, RequestState> requests_;
  Request next_request_ = 1;
  unsigned in_kernel_ = 0;
  std::uint64_t bytes_read_ = 0;
  std::uint64_t bytes_written_ = 0;
  double wait_seconds_ = 0;
};

}  // namespace zerort::io
