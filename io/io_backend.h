// IoBackend: which engine moves an IoQueue's pieces (io_uring, or a pool of threads), and how
// one is chosen at run time. See Note [IoQueue backends].
#pragma once

#include <memory>
#include <string>

namespace zerort::io {

class IoEngine;

// Note [IoQueue backends]
// An IoQueue (io/io_queue.h) keeps the requests, their pieces and the errors; an IoEngine
// moves the pieces. Two engines, one behaviour (same files, buffers, alignment, pieces,
// errors and timeouts, so the same bits on disk):
//   - "io_uring" (io/uring_engine.h): the kernel runs up to queue_depth pieces at once
//     (See Note [Why io_uring]). Built only when CMake found liburing (ZERORT_HAVE_LIBURING).
//   - "threads" (io/thread_engine.h): a pool of min(queue_depth, 16) threads, each doing one
//     O_DIRECT pread or pwrite at a time. Portable: no library, no io_uring in the kernel.
// Choice, when the queue is made: an explicit backend is used or is an error saying why it
// cannot be; "auto" is the environment's ZERORT_IO_BACKEND when set (so a whole test suite
// can run on one backend), else io_uring when built and the kernel allows it, else threads.
// The kernel refuses io_uring with ENOSYS (gVisor, kernels before 5.1) or EPERM (Docker's
// default seccomp profile, /proc/sys/kernel/io_uring_disabled); any other failure of
// io_uring_queue_init is an error, as it says something is wrong with this machine.
enum class IoBackend { kAuto, kIoUring, kThreads };

// "auto", "io_uring" or "threads".
const char* io_backend_name(IoBackend backend);
// The backend named `value`; ConfigError naming `key` (where the value came from) otherwise.
IoBackend parse_io_backend(const std::string& value, const std::string& key);
// Whether this build has the io_uring engine (liburing was found at configure time).
bool io_uring_built();

// The engine chosen for `requested` (See Note [IoQueue backends]), and why when that is not
// simply what was asked for ("" otherwise). Throws ConfigError when an explicit io_uring is
// not available, naming why and what to set instead.
struct EngineChoice {
  std::unique_ptr<IoEngine> engine;
  std::string why;
};
EngineChoice choose_io_engine(IoBackend requested, unsigned queue_depth);

}  // namespace zerort::io
