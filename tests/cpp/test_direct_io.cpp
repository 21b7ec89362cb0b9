// IoQueue: round trips with O_DIRECT, many requests in flight, failures and timeouts, each case
// on both backends, io_uring and threads (skipped where io_uring is not built or not allowed).
// See Note [IoQueue requests] and Note [IoQueue backends].
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/aligned_buffer_pool.h"
#include "io/direct_file.h"
#include "io/io_backend.h"
#include "io/io_queue.h"
#include "io_test_util.h"

namespace zerort::io {
namespace {

using testing::fill_pattern;
using testing::TempDir;

constexpr std::size_t kBlock = 16384;
constexpr unsigned kDepth = 4;

// What the file holds at [offset, offset + bytes), read through the page cache (not O_DIRECT),
// so the check does not rely on the code under test.
std::vector<unsigned char> read_back(const std::string& path, std::uint64_t offset, std::size_t bytes) {
  std::vector<unsigned char> out(bytes);
  int fd = ::open(path.c_str(), O_RDONLY);
  EXPECT_GE(fd, 0);
  EXPECT_EQ(::pread(fd, out.data(), bytes, static_cast<off_t>(offset)), static_cast<ssize_t>(bytes));
  ::close(fd);
  return out;
}

// Writes `bytes` of a pattern at `offset`, reads them back through the queue into a zeroed
// buffer, and compares both with the pattern bit for bit.
void round_trip(IoQueue& q, const DirectFile& f, AlignedBufferPool& pool, std::uint64_t offset, std::size_t bytes) {
  char* out = static_cast<char*>(pool.acquire());
  char* in = static_cast<char*>(pool.acquire());
  fill_pattern(out, bytes, offset + bytes);
  std::memset(in, 0, pool.buffer_size());
  q.wait(q.write(f, offset, out, bytes));
  q.wait(q.read(f, offset, in, bytes));
  EXPECT_EQ(std::memcmp(in, out, bytes), 0) << bytes << " bytes at " << offset;
  if (bytes > 0) {
    std::vector<unsigned char> disk = read_back(f.path(), offset, bytes);
    EXPECT_EQ(std::memcmp(disk.data(), out, bytes), 0) << bytes << " bytes at " << offset << " (on disk)";
  }
  pool.release(out);
  pool.release(in);
}

// Each case runs on each backend: GetParam(). io_uring is skipped, saying why, where this build
// or this kernel has none.
class IoQueueTest : public ::testing::TestWithParam<IoBackend> {
 protected:
  void SetUp() override {
    if (GetParam() != IoBackend::kIoUring) return;
    if (!io_uring_built()) GTEST_SKIP() << "io_uring: this build has no liburing";
    try {
      IoQueue probe(1, kBlock, IoBackend::kIoUring);
    } catch (const ConfigError& e) {
      GTEST_SKIP() << "io_uring: " << e.what();
    }
  }
  IoBackend backend() const { return GetParam(); }
};

INSTANTIATE_TEST_SUITE_P(Backends, IoQueueTest, ::testing::Values(IoBackend::kIoUring, IoBackend::kThreads),
                         [](const ::testing::TestParamInfo<IoBackend>& info) {
                           return info.param == IoBackend::kIoUring ? std::string("IoUring") : std::string("Threads");
                         });

// A scratch directory with one file, a pool (of `buffers` buffers of `buffer_bytes`, default
// the file's size) and a queue of kDepth x kBlock on `backend`.
struct Rig {
  Rig(IoBackend backend, const std::string& name, std::size_t bytes, std::size_t buffers = 1,
      std::size_t buffer_bytes = 0)
      : file(dir.path(), name, bytes), pool(buffers, buffer_bytes ? buffer_bytes : file.size(), file.alignment()),
        queue(kDepth, kBlock, backend) {}
  char* buffer() const { return pool.base(); }

  TempDir dir;
  DirectFile file;
  AlignedBufferPool pool;
  IoQueue queue;
};

TEST_P(IoQueueTest, RoundTripsOfZeroOneOddAndMoreThanTheQueueHolds) {
  TempDir dir;
  const std::size_t big = (kDepth * 5 + 1) * kBlock + 4096;  // > queue_depth * block_size, a partial last piece
  DirectFile f(dir.path(), "rt.bin", 2 * big);
  ASSERT_EQ(kBlock % f.alignment(), 0u);
  AlignedBufferPool pool(2, big, f.alignment());
  IoQueue q(kDepth, kBlock, backend());
  for (std::size_t bytes : {std::size_t{0}, kBlock, 3 * kBlock, 7 * kBlock + f.alignment(), big}) {
    round_trip(q, f, pool, 0, bytes);
    round_trip(q, f, pool, big, bytes);
  }
  EXPECT_EQ(q.pieces_in_flight(), 0u);
  EXPECT_EQ(q.requests_open(), 0u);
}

TEST_P(IoQueueTest, AZeroByteRequestIsDoneAtOnce) {
  Rig rig(backend(), "zero.bin", 4096);
  auto r = rig.queue.read(rig.file, 0, rig.buffer(), 0);
  EXPECT_TRUE(rig.queue.poll(r));
  EXPECT_THROW(rig.queue.wait(r), UsageError);  // already forgotten
}

TEST_P(IoQueueTest, RegisteredPoolBuffersRoundTrip) {
  const std::size_t bytes = 9 * kBlock;
  Rig rig(backend(), "fixed.bin", bytes, 2);
  bool registered = rig.queue.register_pool(rig.pool);
  std::printf("%s: pool registered: %s\n", rig.queue.backend(), registered ? "yes" : "no");
  if (backend() == IoBackend::kThreads) {
    EXPECT_FALSE(registered);  // pread/pwrite have nothing to register
  }
  round_trip(rig.queue, rig.file, rig.pool, 0, bytes);
  // A buffer outside the pool still works (plain, unregistered reads and writes).
  AlignedBufferPool other(2, bytes, rig.file.alignment());
  round_trip(rig.queue, rig.file, other, 0, bytes);
}

// 24 requests of different sizes in flight at once (more pieces than the queue holds), waited
// for in an order of their own; then read back, all in flight, and polled to completion.
TEST_P(IoQueueTest, ManyRequestsInFlightCompleteInAnyOrder) {
  TempDir dir;
  constexpr int kRequests = 24;
  const std::size_t slot = 3 * kBlock;
  DirectFile f(dir.path(), "many.bin", kRequests * slot);
  AlignedBufferPool out(kRequests, slot, f.alignment());
  AlignedBufferPool in(kRequests, slot, f.alignment());
  IoQueue q(kDepth, kBlock, backend());
  std::vector<char*> outs, ins;
  std::vector<std::size_t> sizes;
  std::vector<IoQueue::Request> writes, reads;
  for (int i = 0; i < kRequests; ++i) {
    outs.push_back(static_cast<char*>(out.acquire()));
    ins.push_back(static_cast<char*>(in.acquire()));
    sizes.push_back(f.alignment() * (1 + (i * 7) % (slot / f.alignment())));
    fill_pattern(outs[i], sizes[i], 1000 + i);
    std::memset(ins[i], 0, slot);
    writes.push_back(q.write(f, i * slot, outs[i], sizes[i]));
  }
  EXPECT_EQ(q.requests_open(), static_cast<std::size_t>(kRequests));
  EXPECT_LE(q.pieces_in_flight(), kDepth);
  for (int i = kRequests - 1; i >= 0; i -= 2) q.wait(writes[i]);
  q.wait_all();
  for (int i = 0; i < kRequests; ++i) reads.push_back(q.read(f, i * slot, ins[i], sizes[i]));
  std::vector<bool> done(kRequests, false);
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (std::count(done.begin(), done.end(), true) < kRequests && std::chrono::steady_clock::now() < deadline) {
    for (int i = 0; i < kRequests; ++i) {
      if (!done[i]) done[i] = q.poll(reads[i]);
    }
  }
  for (int i = 0; i < kRequests; ++i) {
    ASSERT_TRUE(done[i]) << i;
    EXPECT_EQ(std::memcmp(ins[i], outs[i], sizes[i]), 0) << "request " << i;
  }
  EXPECT_EQ(q.bytes_read(), q.bytes_written());
}

TEST_P(IoQueueTest, MisalignedOrOutOfRangeRequestsAreUsageErrors) {
  Rig rig(backend(), "bad.bin", 4 * kBlock);
  const DirectFile& f = rig.file;
  IoQueue& q = rig.queue;
  std::size_t a = f.alignment();
  char* buf = rig.buffer();
  EXPECT_THROW(q.read(f, a / 2, buf, a), UsageError);
  EXPECT_THROW(q.read(f, 0, buf, a + 1), UsageError);
  EXPECT_THROW(q.read(f, 0, buf + 1, a), UsageError);
  EXPECT_THROW(q.write(f, 3 * kBlock, buf, 2 * kBlock), UsageError);
  EXPECT_THROW(q.write(f, 8 * kBlock, buf, a), UsageError);
  EXPECT_EQ(q.requests_open(), 0u);
  EXPECT_THROW(IoQueue(0, kBlock, backend()), ConfigError);
  EXPECT_THROW(IoQueue(4, 1000, backend()), ConfigError);
}

// A file cut short behind the queue's back (as a crash or another process might): the read of
// its old length fails naming the file and an offset past the new end; no partial success.
TEST_P(IoQueueTest, AShortReadPastTheEndNamesTheFileAndTheOffset) {
  const std::size_t bytes = 8 * kBlock;
  Rig rig(backend(), "short.bin", bytes);
  const DirectFile& f = rig.file;
  IoQueue& q = rig.queue;
  char* buf = rig.buffer();
  fill_pattern(buf, bytes, 7);
  q.wait(q.write(f, 0, buf, bytes));
  ASSERT_EQ(::truncate(f.path().c_str(), 2 * kBlock), 0);
  std::string msg;
  try {
    q.wait(q.read(f, 0, buf, bytes));
  } catch (const Error& e) {
    msg = e.what();
  }
  ASSERT_FALSE(msg.empty()) << "the short read was not an error";
  EXPECT_NE(msg.find("short read"), std::string::npos) << msg;
  EXPECT_NE(msg.find(f.path()), std::string::npos) << msg;
  auto at = msg.find("at offset ");
  ASSERT_NE(at, std::string::npos) << msg;
  std::uint64_t offset = std::stoull(msg.substr(at + 10));
  EXPECT_GE(offset, 2 * kBlock) << msg;
  EXPECT_EQ(offset % kBlock, 0u) << msg;
  EXPECT_EQ(q.pieces_in_flight(), 0u);  // thrown only once nothing of the request is in the kernel
  EXPECT_EQ(q.requests_open(), 0u);
  // The queue still works after a failed request.
  q.wait(q.read(f, 0, buf, 2 * kBlock));
}

// A queue destroyed with I/O in flight waits for it (ASan would see the kernel write into freed memory).
TEST_P(IoQueueTest, DestroyingTheQueueWaitsForWhatIsInFlight) {
  TempDir dir;
  const std::size_t bytes = 64 * kBlock;
  DirectFile f(dir.path(), "inflight.bin", bytes);
  AlignedBufferPool pool(1, bytes, f.alignment());
  {
    IoQueue q(kDepth, kBlock, backend());
    q.write(f, 0, pool.base(), bytes);
    q.read(f, 0, pool.base(), bytes / 2);
  }
  SUCCEED();
}

// wait() with a timeout that passes gives up with an Error naming the request, and the request
// stays in flight: waiting again finishes it. Never a hang.
TEST_P(IoQueueTest, AWaitThatTimesOutLeavesTheRequestInFlight) {
  const std::size_t bytes = 512 * kBlock;  // 8 MiB in 512 pieces
  Rig rig(backend(), "timeout.bin", bytes);
  IoQueue& q = rig.queue;
  IoQueue::Request r = q.write(rig.file, 0, rig.buffer(), bytes);
  // Pieces complete only when reaped, and 512 cannot all be reaped before the deadline.
  std::string msg;
  try {
    q.wait(r, std::chrono::milliseconds(0));
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("timed out after 0 ms"), std::string::npos) << msg;
  EXPECT_NE(msg.find(rig.file.path()), std::string::npos) << msg;
  EXPECT_EQ(q.requests_open(), 1u);
  q.wait(r);
  EXPECT_EQ(q.requests_open(), 0u);
  EXPECT_EQ(q.bytes_written(), bytes);
}

}  // namespace
}  // namespace zerort::io
