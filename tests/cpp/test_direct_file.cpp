// DirectFile's checks (See Note [DirectFile checks]) and AlignedBufferPool.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <fstream>
#include <string>

#include "core/error.h"
#include "io/aligned_buffer_pool.h"
#include "io/alignment.h"
#include "io/direct_file.h"
#include "io_test_util.h"

namespace zerort::io {
namespace {

using testing::ScopedMount;
using testing::TempDir;

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

// The ConfigError `make` throws; fails the test when it throws nothing or another type.
template <typename F>
std::string config_error_of(F make) {
  try {
    make();
  } catch (const ConfigError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no ConfigError thrown";
  return "";
}

TEST(DirectFile, PreallocatesTheSizeRoundedUpToTheAlignmentAndRemovesItOnClose) {
  TempDir dir;
  std::string path = dir.sub("rank0.bin");
  {
    DirectFile f(dir.path(), "rank0.bin", 1);
    std::size_t a = f.alignment();
    EXPECT_TRUE(a >= 512 && (a & (a - 1)) == 0) << a;
    EXPECT_EQ(f.size(), a);
    EXPECT_EQ(f.path(), path);
    struct stat st {};
    ASSERT_EQ(::stat(path.c_str(), &st), 0);
    EXPECT_EQ(static_cast<std::uint64_t>(st.st_size), f.size());
    EXPECT_GE(static_cast<std::uint64_t>(st.st_blocks) * 512, f.size());  // allocated, not sparse
    EXPECT_TRUE(exists(path + ".lock"));
  }
  EXPECT_FALSE(exists(path));
  EXPECT_FALSE(exists(path + ".lock"));
}

TEST(DirectFile, KeepsItsFileWhenNotAskedToRemoveIt) {
  TempDir dir;
  { DirectFile f(dir.path(), "keep.bin", 3 * 4096 + 5, /*remove_on_close=*/false); }
  struct stat st {};
  ASSERT_EQ(::stat(dir.sub("keep.bin").c_str(), &st), 0);
  EXPECT_EQ(static_cast<std::uint64_t>(st.st_size) % 512, 0u);
  EXPECT_GE(static_cast<std::uint64_t>(st.st_size), 3u * 4096 + 5);
}

TEST(DirectFile, ReplacesAStaleFileOfTheSameName) {
  TempDir dir;
  { std::ofstream(dir.sub("stale.bin")) << std::string(100000, 'x'); }
  DirectFile f(dir.path(), "stale.bin", 8192);
  struct stat st {};
  ASSERT_EQ(::stat(f.path().c_str(), &st), 0);
  EXPECT_EQ(static_cast<std::uint64_t>(st.st_size), f.size());
}

TEST(DirectFile, AMissingDirectoryIsAConfigErrorNamingIt) {
  TempDir dir;
  std::string missing = dir.sub("no/such/dir");
  std::string msg = config_error_of([&] { DirectFile f(missing, "a.bin", 4096); });
  EXPECT_NE(msg.find(missing), std::string::npos) << msg;
  EXPECT_NE(msg.find("does not exist"), std::string::npos) << msg;
  EXPECT_NE(msg.find("mkdir -p"), std::string::npos) << msg;
}

TEST(DirectFile, AFileInPlaceOfTheDirectoryIsAConfigError) {
  TempDir dir;
  std::string file = dir.sub("plain");
  { std::ofstream(file) << "x"; }
  std::string msg = config_error_of([&] { DirectFile f(file, "a.bin", 4096); });
  EXPECT_NE(msg.find(file + " is not a directory"), std::string::npos) << msg;
}

// Root ignores permission bits, so as root the directory is a read-only tmpfs mount instead.
TEST(DirectFile, AReadOnlyDirectoryIsAConfigErrorNamingIt) {
  TempDir dir;
  std::string ro = dir.sub("ro");
  ASSERT_EQ(::mkdir(ro.c_str(), 0700), 0);
  std::unique_ptr<ScopedMount> mount;
  if (::geteuid() == 0) {
    mount = std::make_unique<ScopedMount>(ro, "tmpfs", MS_RDONLY);
    if (!mount->ok()) GTEST_SKIP() << "running as root and " << mount->why() << "; cannot make a read-only directory";
  } else {
    ASSERT_EQ(::chmod(ro.c_str(), 0500), 0);
  }
  std::string msg = config_error_of([&] { DirectFile f(ro, "a.bin", 4096); });
  EXPECT_NE(msg.find(ro), std::string::npos) << msg;
  EXPECT_NE(msg.find("read-only"), std::string::npos) << msg;
  ::chmod(ro.c_str(), 0700);
}

// tmpfs has O_DIRECT since Linux 6.6; ramfs has none. /dev/shm is used when it lacks it.
TEST(DirectFile, AFilesystemWithoutODirectIsAConfigErrorNamingTheDirectory) {
  std::string target;
  std::unique_ptr<TempDir> holder;
  std::unique_ptr<ScopedMount> mount;
  int probe = ::open("/dev/shm/zerort_odirect_probe", O_RDWR | O_CREAT | O_DIRECT, 0600);
  int probe_errno = errno;
  if (probe >= 0) {
    ::close(probe);
    ::unlink("/dev/shm/zerort_odirect_probe");
    holder = std::make_unique<TempDir>();
    target = holder->sub("ramfs");
    ASSERT_EQ(::mkdir(target.c_str(), 0700), 0);
    mount = std::make_unique<ScopedMount>(target, "ramfs", 0);
    if (!mount->ok()) GTEST_SKIP() << "/dev/shm has O_DIRECT and " << mount->why() << "; no filesystem without it";
  } else if (probe_errno == EINVAL) {
    target = "/dev/shm";
  } else {
    GTEST_SKIP() << "cannot probe /dev/shm: " << std::strerror(probe_errno);
  }
  std::string msg = config_error_of([&] { DirectFile f(target, "zerort_no_odirect.bin", 4096); });
  EXPECT_NE(msg.find(target), std::string::npos) << msg;
  EXPECT_NE(msg.find("does not support O_DIRECT"), std::string::npos) << msg;
  EXPECT_FALSE(exists(target + "/zerort_no_odirect.bin"));
  EXPECT_FALSE(exists(target + "/zerort_no_odirect.bin.lock"));
}

TEST(DirectFile, NotEnoughFreeSpaceIsAConfigErrorWithTheBytesNeededAndFree) {
  TempDir dir;
  struct statvfs vfs {};
  ASSERT_EQ(::statvfs(dir.path().c_str(), &vfs), 0);
  std::uint64_t free_bytes = static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  std::uint64_t want = free_bytes + (std::uint64_t{1} << 30);
  std::string msg = config_error_of([&] { DirectFile f(dir.path(), "big.bin", want); });
  EXPECT_NE(msg.find("not enough free space in " + dir.path()), std::string::npos) << msg;
  EXPECT_NE(msg.find("needs " + std::to_string(want) + " bytes"), std::string::npos) << msg;
  EXPECT_NE(msg.find("bytes free"), std::string::npos) << msg;
  EXPECT_FALSE(exists(dir.sub("big.bin")));
  EXPECT_FALSE(exists(dir.sub("big.bin.lock")));
}

TEST(DirectFile, ASecondOpenOfOnePathIsRefusedByTheLockUntilTheFirstCloses) {
  TempDir dir;
  std::string path = dir.sub("rank0.bin");
  {
    DirectFile first(dir.path(), "rank0.bin", 4096);
    std::string msg = config_error_of([&] { DirectFile second(dir.path(), "rank0.bin", 4096); });
    EXPECT_NE(msg.find(path + " is in use by another job"), std::string::npos) << msg;
    EXPECT_TRUE(exists(path));                             // the refused open left the holder's file alone
    DirectFile other_rank(dir.path(), "rank1.bin", 4096);  // another name: no conflict
  }
  DirectFile again(dir.path(), "rank0.bin", 4096);
}

TEST(DirectFile, AnotherProcessIsRefusedByTheLock) {
  TempDir dir;
  DirectFile held(dir.path(), "rank0.bin", 4096);
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    int code = 3;
    try {
      DirectFile f(dir.path(), "rank0.bin", 4096);
      code = 1;
    } catch (const ConfigError& e) {
      code = std::string(e.what()).find(held.path() + " is in use by another job") != std::string::npos ? 0 : 2;
    } catch (...) {
    }
    ::_exit(code);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "1: the child opened the file; 2: wrong message; 3: wrong error type";
}

TEST(AlignedBufferPool, HandsOutAlignedBuffersAndNeverGrows) {
  AlignedBufferPool pool(3, 8192, 4096);
  EXPECT_EQ(pool.bytes(), 3u * 8192);
  std::vector<void*> got;
  for (int i = 0; i < 3; ++i) {
    void* p = pool.acquire();
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % 4096, 0u);
    EXPECT_GE(pool.index_of(p), 0);
    got.push_back(p);
  }
  EXPECT_EQ(pool.try_acquire(), nullptr);
  EXPECT_THROW(pool.acquire(), UsageError);
  EXPECT_EQ(pool.bytes(), 3u * 8192);
  pool.release(got[1]);
  EXPECT_EQ(pool.available(), 1u);
  EXPECT_EQ(pool.acquire(), got[1]);
  for (void* p : got) pool.release(p);
  EXPECT_EQ(pool.available(), 3u);
}

TEST(AlignedBufferPool, RefusesBadReleasesAndBadSizes) {
  AlignedBufferPool pool(2, 4096, 4096);
  void* p = pool.acquire();
  pool.release(p);
  EXPECT_THROW(pool.release(p), UsageError);  // double release
  int local = 0;
  EXPECT_THROW(pool.release(&local), UsageError);
  EXPECT_THROW(pool.release(static_cast<char*>(pool.base()) + 512), UsageError);  // inside, not a start
  EXPECT_EQ(pool.index_of(&local), -1);
  EXPECT_THROW(AlignedBufferPool(0, 4096, 4096), ConfigError);
  EXPECT_THROW(AlignedBufferPool(1, 1000, 4096), ConfigError);
  EXPECT_THROW(AlignedBufferPool(1, 4096, 1000), ConfigError);
}

TEST(DirectIoAlignment, IsAPowerOfTwoOfAtLeast512) {
  TempDir dir;
  std::size_t a = direct_io_alignment(dir.path());
  EXPECT_GE(a, 512u);
  EXPECT_EQ(a & (a - 1), 0u);
  EXPECT_EQ(direct_io_alignment(dir.sub("missing")), kDefaultDirectIoAlignment);
  EXPECT_EQ(round_up(1, 512), 512u);
  EXPECT_EQ(round_up(0, 512), 0u);
  EXPECT_EQ(round_up(4096, 4096), 4096u);
}

}  // namespace
}  // namespace zerort::io
