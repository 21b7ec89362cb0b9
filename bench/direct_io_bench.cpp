// direct_io_bench: IoQueue's read and write bandwidth at a few block sizes and queue depths, on
// each backend (io_uring where this build and kernel have it, threads), beside the disk's own
// direct-I/O bandwidth measured in the same run.
//
//   build/io/direct_io_bench [directory (default /tmp)] [MiB (default 1024)]
//
// The baseline is what `dd bs=1M oflag=direct` / `iflag=direct` does, done here in-process:
// the same preallocated file opened with O_DIRECT, written then read with synchronous 1 MiB
// pwrite/pread, one at a time. Neither side calls fsync (dd with oflag=direct does not either).
// Each IoQueue row keeps `depth` requests of one block each in flight over the whole file,
// reusing a request's buffer for the next offset as it completes.
#include <sys/statfs.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "io/aligned_buffer_pool.h"
#include "io/direct_file.h"
#include "io/io_queue.h"

using zerort::io::AlignedBufferPool;
using zerort::io::DirectFile;
using zerort::io::IoBackend;
using zerort::io::IoQueue;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// GB/s (1e9 bytes) of synchronous 1 MiB O_DIRECT pwrite (write=true) or pread over the file.
double sync_baseline(const DirectFile& f, AlignedBufferPool& pool, bool write) {
  char* buf = static_cast<char*>(pool.acquire());
  std::memset(buf, 0x5a, pool.buffer_size());
  const std::size_t chunk = std::size_t{1} << 20;
  auto t0 = Clock::now();
  for (std::uint64_t off = 0; off < f.size(); off += chunk) {
    ssize_t n = write ? ::pwrite(f.fd(), buf, chunk, static_cast<off_t>(off))
                      : ::pread(f.fd(), buf, chunk, static_cast<off_t>(off));
    ZRT_CHECK(n == static_cast<ssize_t>(chunk), "baseline ", write ? "pwrite" : "pread", " at ", off, " of ", f.path(),
              ": ", n < 0 ? std::strerror(errno) : "short");
  }
  double s = seconds_since(t0);
  pool.release(buf);
  return f.size() / s / 1e9;
}

// GB/s through an IoQueue on `backend` with `depth` one-block requests in flight.
double queue_pass(const DirectFile& f, std::size_t block, unsigned depth, bool write, IoBackend backend) {
  AlignedBufferPool pool(depth, block, f.alignment());
  IoQueue q(depth, block, backend);
  q.register_pool(pool);
  std::memset(pool.base(), 0xa5, pool.bytes());
  std::deque<std::pair<IoQueue::Request, void*>> inflight;
  auto t0 = Clock::now();
  for (std::uint64_t off = 0; off < f.size(); off += block) {
    void* buf = pool.try_acquire();
    if (buf == nullptr) {
      q.wait(inflight.front().first);
      buf = inflight.front().second;
      inflight.pop_front();
    }
    inflight.emplace_back(write ? q.write(f, off, buf, block) : q.read(f, off, buf, block), buf);
  }
  q.wait_all();
  double s = seconds_since(t0);
  for (auto& r : inflight) pool.release(r.second);
  return f.size() / s / 1e9;
}

const char* fs_name(const std::string& dir) {
  struct statfs sf {};
  if (::statfs(dir.c_str(), &sf) != 0) return "?";
  switch (static_cast<unsigned long>(sf.f_type)) {
    case 0xEF53: return "ext4";
    case 0x58465342: return "xfs";
    case 0x9123683E: return "btrfs";
    case 0x01021994: return "tmpfs";
    default: return "other";
  }
}

std::string size_text(std::size_t bytes) {
  return bytes >= (1u << 20) ? std::to_string(bytes >> 20) + " MiB" : std::to_string(bytes >> 10) + " KiB";
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir = argc > 1 ? argv[1] : "/tmp";
  std::uint64_t mib = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 1024;
  try {
    DirectFile f(dir, "zerort_direct_io_bench.bin", mib << 20);
    AlignedBufferPool one(1, std::size_t{1} << 20, f.alignment());
    std::printf("direct I/O on %s (%s), file %llu MiB, alignment %zu bytes; GB/s = 1e9 bytes/s\n\n", dir.c_str(),
                fs_name(dir), static_cast<unsigned long long>(mib), f.alignment());
    std::printf("%-36s %8s %6s %11s %10s %8s %7s\n", "engine", "block", "depth", "write GB/s", "read GB/s", "write %",
                "read %");
    double base_w = sync_baseline(f, one, true);
    double base_r = sync_baseline(f, one, false);
    std::printf("%-36s %8s %6d %11.2f %10.2f %8s %7s\n", "sync pwrite/pread O_DIRECT (dd-like)", "1 MiB", 1, base_w,
                base_r, "100", "100");
    const std::pair<std::size_t, unsigned> configs[] = {{128 << 10, 8}, {128 << 10, 32}, {1 << 20, 4},
                                                        {1 << 20, 8},   {1 << 20, 16},   {4 << 20, 8}};
    for (IoBackend backend : {IoBackend::kIoUring, IoBackend::kThreads}) {
      const std::string name = std::string("IoQueue (") + zerort::io::io_backend_name(backend) + ")";
      try {
        IoQueue probe(1, std::size_t{1} << 20, backend);
      } catch (const zerort::ConfigError& e) {  // not in this build, or refused by the kernel
        std::printf("%-36s not here: %s\n", name.c_str(), e.what());
        continue;
      }
      for (auto [block, depth] : configs) {
        double w = queue_pass(f, block, depth, true, backend);
        double r = queue_pass(f, block, depth, false, backend);
        std::printf("%-36s %8s %6u %11.2f %10.2f %8.0f %7.0f\n", name.c_str(), size_text(block).c_str(), depth, w, r,
                    100 * w / base_w, 100 * r / base_r);
      }
    }
  } catch (const zerort::Error& e) {
    std::fprintf(stderr, "direct_io_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
