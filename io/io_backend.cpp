#include "io/io_backend.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "core/error.h"
#include "io/thread_engine.h"
#if ZERORT_HAVE_LIBURING
#include "io/uring_engine.h"
#endif

namespace zerort::io {

namespace {

constexpr const char* kEnv = "ZERORT_IO_BACKEND";
// Where an explicit choice is made, for the errors: the config key, or the environment.
constexpr const char* kConfigKey = "aio.io_backend (offload.aio.io_backend in zerort's form)";

EngineChoice threads(unsigned queue_depth, std::string why) {
  return {std::make_unique<ThreadEngine>(queue_depth), std::move(why)};
}

}  // namespace

const char* io_backend_name(IoBackend backend) {
  switch (backend) {
    case IoBackend::kIoUring: return "io_uring";
    case IoBackend::kThreads: return "threads";
    default: return "auto";
  }
}

IoBackend parse_io_backend(const std::string& value, const std::string& key) {
  for (IoBackend b : {IoBackend::kAuto, IoBackend::kIoUring, IoBackend::kThreads}) {
    if (value == io_backend_name(b)) return b;
  }
  ZRT_THROW_AS(ConfigError, key, ": got '", value, "'; expected 'auto', 'io_uring' or 'threads'");
}

bool io_uring_built() { return ZERORT_HAVE_LIBURING != 0; }

// See Note [IoQueue backends].
EngineChoice choose_io_engine(IoBackend requested, unsigned queue_depth) {
  IoBackend want = requested;
  std::string from = detail::concat(kConfigKey, " '", io_backend_name(requested), "'");
  const char* env = std::getenv(kEnv);
  if (requested == IoBackend::kAuto && env != nullptr && *env != '\0') {
    want = parse_io_backend(env, detail::concat("the environment variable ", kEnv));
    from = detail::concat(kEnv, "=", env);
  }
  if (want == IoBackend::kThreads) return threads(queue_depth, requested == IoBackend::kThreads ? "" : from);
  const std::string instead = detail::concat("set ", requested == IoBackend::kAuto ? kEnv : kConfigKey,
                                             " to 'threads' (a pool of threads doing O_DIRECT pread/pwrite), "
                                             "or to 'auto'");
  if (!io_uring_built()) {
    ZRT_CHECK_AS(ConfigError, want == IoBackend::kAuto, from,
                 ": this build of zerort has no io_uring (liburing was not found when it was configured); "
                 "install liburing-dev (scripts/install_deps.sh) and rebuild, or ",
                 instead);
    return threads(queue_depth, "this build has no liburing");
  }
  int error = 0;
#if ZERORT_HAVE_LIBURING
  if (auto engine = make_uring_engine(queue_depth, error)) return {std::move(engine), ""};
#endif
  const std::string failed =
      detail::concat("io_uring_queue_init(", queue_depth, ") failed: ", std::strerror(error), " (errno ", error, ")");
  ZRT_CHECK(error == ENOSYS || error == EPERM, "IoQueue: ", failed,
            "; io_uring needs Linux 5.1+ (and, before 5.12, RLIMIT_MEMLOCK room for the ring)");
  if (want == IoBackend::kAuto) return threads(queue_depth, "the kernel refused io_uring: " + failed);
  ZRT_THROW_AS(ConfigError, from, ": the kernel refuses io_uring here: ", failed,
               " (a container's seccomp profile, gVisor, or /proc/sys/kernel/io_uring_disabled); ", instead);
}

}  // namespace zerort::io
