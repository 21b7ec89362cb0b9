// How an IoQueue's backend is chosen (See Note [IoQueue backends]): by name, by the environment,
// and the fall back to threads when the kernel refuses io_uring (a seccomp filter in a child
// process plays Docker's profile and gVisor).
#include <gtest/gtest.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/syscall.h>

#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <optional>
#include <string>

#include "core/error.h"
#include "io/io_backend.h"
#include "io/io_queue.h"

namespace zerort::io {
namespace {

constexpr std::size_t kBlock = 16384;

// ZERORT_IO_BACKEND set (or unset, nullopt) for one scope, then put back.
class ScopedEnv {
 public:
  explicit ScopedEnv(std::optional<std::string> value) {
    if (const char* old = std::getenv("ZERORT_IO_BACKEND")) old_ = old;
    value ? ::setenv("ZERORT_IO_BACKEND", value->c_str(), 1) : ::unsetenv("ZERORT_IO_BACKEND");
  }
  ~ScopedEnv() { old_ ? ::setenv("ZERORT_IO_BACKEND", old_->c_str(), 1) : ::unsetenv("ZERORT_IO_BACKEND"); }

 private:
  std::optional<std::string> old_;
};

std::string message_of_making(IoBackend backend) {
  try {
    IoQueue q(4, kBlock, backend);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(IoBackend, NamesParseAndABadOneNamesItsKey) {
  for (IoBackend b : {IoBackend::kAuto, IoBackend::kIoUring, IoBackend::kThreads}) {
    EXPECT_EQ(parse_io_backend(io_backend_name(b), "k"), b);
  }
  try {
    parse_io_backend("uring", "aio.io_backend");
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("aio.io_backend: got 'uring'; expected 'auto', 'io_uring' or 'threads'"),
              std::string::npos)
        << e.what();
  }
}

TEST(IoBackend, ThreadsWhenAskedAndTheEnvironmentOverridesOnlyAuto) {
  ScopedEnv env("threads");
  IoQueue forced(4, kBlock);
  EXPECT_STREQ(forced.backend(), "threads");
  EXPECT_EQ(forced.backend_why(), "ZERORT_IO_BACKEND=threads");
  IoQueue asked(4, kBlock, IoBackend::kThreads);
  EXPECT_STREQ(asked.backend(), "threads");
  EXPECT_EQ(asked.backend_why(), "");
  if (io_uring_built() && message_of_making(IoBackend::kIoUring).empty()) {
    EXPECT_STREQ(IoQueue(4, kBlock, IoBackend::kIoUring).backend(), "io_uring");  // an explicit choice wins
  }
}

TEST(IoBackend, ABadEnvironmentValueNamesTheVariable) {
  ScopedEnv env("fast");
  std::string msg = message_of_making(IoBackend::kAuto);
  EXPECT_NE(msg.find("the environment variable ZERORT_IO_BACKEND: got 'fast'"), std::string::npos) << msg;
}

TEST(IoBackend, AutoIsIoUringWhereBuiltAndAllowedElseThreadsSayingWhy) {
  ScopedEnv env(std::nullopt);
  IoQueue q(4, kBlock);
  std::printf("auto: %s %s\n", q.backend(), q.backend_why().c_str());
  if (!io_uring_built()) {
    EXPECT_STREQ(q.backend(), "threads");
    EXPECT_EQ(q.backend_why(), "this build has no liburing");
    std::string msg = message_of_making(IoBackend::kIoUring);
    EXPECT_NE(msg.find("this build of zerort has no io_uring"), std::string::npos) << msg;
    EXPECT_NE(msg.find("install liburing-dev"), std::string::npos) << msg;
    EXPECT_NE(msg.find("'threads'"), std::string::npos) << msg;
  } else if (std::string(q.backend()) == "threads") {
    EXPECT_NE(q.backend_why().find("the kernel refused io_uring"), std::string::npos) << q.backend_why();
  } else {
    EXPECT_STREQ(q.backend(), "io_uring");
    EXPECT_EQ(q.backend_why(), "");
  }
}

// In a child process whose io_uring_setup fails with `error` (as under Docker's default seccomp
// profile, EPERM, or gVisor, ENOSYS): "auto" falls back to threads and says why, and an explicit
// io_uring is a ConfigError naming the key, why and what to set. Exits 0 when all holds.
void refused_io_uring(int error) {
  sock_filter filter[] = {
      BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
      BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 0, 1),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (static_cast<unsigned>(error) & SECCOMP_RET_DATA)),
      BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
  };
  sock_fprog program{static_cast<unsigned short>(sizeof(filter) / sizeof(filter[0])), filter};
  if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 || ::prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &program) != 0) {
    std::fprintf(stderr, "seccomp unavailable\n");
    std::exit(3);
  }
  ::unsetenv("ZERORT_IO_BACKEND");
  IoQueue q(4, kBlock);
  bool ok = std::string(q.backend()) == "threads" &&
            q.backend_why().find("the kernel refused io_uring: io_uring_queue_init(4) failed") != std::string::npos;
  std::string msg = message_of_making(IoBackend::kIoUring);
  ok = ok && msg.find("aio.io_backend") != std::string::npos && msg.find("refuses io_uring") != std::string::npos &&
       msg.find("'threads'") != std::string::npos;
  std::fprintf(stderr, "why: %s\nexplicit: %s\n", q.backend_why().c_str(), msg.c_str());
  std::exit(ok ? 0 : 1);
}

TEST(IoBackend, AKernelThatRefusesIoUringFallsBackToThreads) {
  if (!io_uring_built()) GTEST_SKIP() << "this build has no liburing: nothing to fall back from";
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  for (int error : {EPERM, ENOSYS}) {
    EXPECT_EXIT(refused_io_uring(error), ::testing::ExitedWithCode(0), "why: the kernel refused io_uring") << error;
  }
}

}  // namespace
}  // namespace zerort::io
