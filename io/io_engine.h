// IoEngine: what moves an IoQueue's pieces between files and buffers. See Note [IoQueue backends]
// (io/io_backend.h); the requests, pieces and errors are the IoQueue's (Note [IoQueue requests]).
#pragma once

#include <chrono>
#include <cstdint>
#include <vector>

namespace zerort::io {

class AlignedBufferPool;

class IoEngine {
 public:
  // One piece done: the IoQueue's tag for it, and the bytes moved or -errno.
  struct Completion {
    std::uint64_t tag;
    int result;
  };

  virtual ~IoEngine() = default;
  // "io_uring" or "threads".
  virtual const char* name() const = 0;
  // Registers the pool's buffers (a saving only); false when there is nothing to register or
  // the kernel refuses. Called only with nothing in flight.
  virtual bool register_buffers(const AlignedBufferPool& pool) = 0;
  // Prepares one piece; submit() hands the prepared ones over. The caller keeps at most
  // queue_depth pieces prepared or in flight.
  virtual void prepare(std::uint64_t tag, int fd, bool is_write, char* buffer, std::uint32_t bytes,
                       std::uint64_t offset) = 0;
  // Hands every prepared piece over; false when the engine is busy and completions must be
  // reaped before it takes more (then call it again).
  virtual bool submit() = 0;
  // Appends the pieces done to `done`; when `block`, first waits up to `timeout` for one.
  // False on that timeout.
  virtual bool reap(bool block, std::chrono::milliseconds timeout, std::vector<Completion>& done) = 0;
};

}  // namespace zerort::io
