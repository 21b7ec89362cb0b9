// UringEngine: an IoQueue's pieces through io_uring (liburing). See Note [Why io_uring]
// (io/io_queue.h) and Note [IoQueue backends] (io/io_backend.h). Built only with liburing.
#pragma once

#include <memory>

#include "io/io_engine.h"

namespace zerort::io {

// An engine with a ring of queue_depth entries, or nullptr with `error` set to the errno of
// io_uring_queue_init (ENOSYS, EPERM: the kernel refuses io_uring).
std::unique_ptr<IoEngine> make_uring_engine(unsigned queue_depth, int& error);

}  // namespace zerort::io
