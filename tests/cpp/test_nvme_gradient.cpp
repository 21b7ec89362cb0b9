// NvmeGradient (Note [gradient in the file]) against a gradient in a std::vector: ranges written
// at any offset and length keep their neighbours, unwritten elements read as zeros, zero()
// forgets all, check() gives unscale_and_check's bits over more than one staging piece, and a
// short read names the file and the offset. Files go under $ZERORT_IO_TEST_DIR (default /tmp).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/aligned_buffer_pool.h"
#include "io/alignment.h"
#include "io/direct_file.h"
#include "io/io_queue.h"
#include "io_test_util.h"
#include "optim/grad_stats.h"
#include "runtime/nvme_gradient.h"

namespace zerort::testing {
namespace {

using io::testing::TempDir;

// A gradient of numel elements at `base` of a fresh file, beside what it should hold.
struct Fixture {
  Fixture(const std::string& dir, size_t numel, std::uint64_t base = 0, size_t piece = 1)
      : file(dir, "grad.bin", base + NvmeGradient::region_bytes(numel, io::direct_io_alignment(dir))),
        queue(8, file.alignment()), grad(file, queue, base, numel, io::direct_io_alignment(dir), piece),
        want(numel, 0.0f) {}

  void write(size_t offset, size_t n, float seed) {
    std::vector<float> in(n);
    for (size_t i = 0; i < n; ++i) in[i] = std::sin(seed + 0.01f * static_cast<float>(offset + i));
    grad.write(offset, n, in.data());
    std::copy(in.begin(), in.end(), want.begin() + static_cast<long>(offset));
  }
  std::vector<float> read(size_t offset, size_t n) {
    std::vector<float> out(n, -1.0f);
    grad.read(offset, n, out.data());
    return out;
  }
  std::vector<float> expected(size_t offset, size_t n) const {
    return {want.begin() + static_cast<long>(offset), want.begin() + static_cast<long>(offset + n)};
  }

  io::DirectFile file;
  io::IoQueue queue;
  NvmeGradient grad;
  std::vector<float> want;
};

TEST(NvmeGradient, WrittenRangesKeepTheirNeighboursAndTheRestReadsAsZeros) {
  TempDir dir;
  const size_t unit = io::direct_io_alignment(dir.path()) / sizeof(float);
  const size_t numel = 5 * unit + 333;  // not a multiple of the unit
  Fixture f(dir.path(), numel, 3 * io::direct_io_alignment(dir.path()));
  EXPECT_EQ(f.read(0, numel), f.expected(0, numel)) << "a new gradient is zeros";
  // Ranges inside one unit, across units, ending at the last element, of one element, and
  // next to each other (a neighbour's end unit is read and kept).
  const size_t ranges[][2] = {{7, 5},         {unit - 3, 9},   {2 * unit + 1, 2 * unit},
                              {numel - 1, 1}, {12, unit - 20}, {4 * unit + 2, numel - 4 * unit - 2},
                              {0, 1},         {unit + 6, 1}};
  float seed = 1.0f;
  for (const auto& r : ranges) {
    f.write(r[0], r[1], seed += 1.0f);
    ASSERT_EQ(f.read(0, numel), f.expected(0, numel)) << "after writing [" << r[0] << ", " << r[0] + r[1] << ")";
  }
  EXPECT_EQ(f.read(unit - 1, 3), f.expected(unit - 1, 3));
  // Accumulate as the reduces do: read, add, write back.
  std::vector<float> part = f.read(unit / 2, 3 * unit);
  for (float& x : part) x += 0.5f;
  f.grad.write(unit / 2, part.size(), part.data());
  std::copy(part.begin(), part.end(), f.want.begin() + static_cast<long>(unit / 2));
  EXPECT_EQ(f.read(0, numel), f.expected(0, numel));
  f.grad.zero();
  std::fill(f.want.begin(), f.want.end(), 0.0f);
  EXPECT_EQ(f.read(0, numel), f.expected(0, numel)) << "zero() forgets every write";
  f.write(unit + 1, 2, 9.0f);  // only this range is written since: its unit's stale bytes stay hidden
  EXPECT_EQ(f.read(0, numel), f.expected(0, numel));
  EXPECT_THROW(f.grad.read(numel - 1, 2, part.data()), Error);
  EXPECT_THROW(f.grad.write(numel, 1, part.data()), Error);
}

// The decision's sums over a gradient streamed a piece at a time have the whole pass's bits,
// and what is handed out afterwards is the unscaled gradient, bit for bit.
TEST(NvmeGradient, CheckHasTheInMemoryPassBitsAndUnscales) {
  TempDir dir;
  const size_t numel = 3 * kGradStatsBlock + 4321;  // three staging pieces and a part
  Fixture f(dir.path(), numel);
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (size_t at = 0; at < numel;) {  // written runs and gaps of odd lengths
    const size_t n = std::min<size_t>(numel - at, 1 + rng() % 20000);
    if (rng() % 3 != 0) {
      std::vector<float> in(n);
      for (float& x : in) x = normal(rng) * 1e3f;
      f.grad.write(at, n, in.data());
      std::copy(in.begin(), in.end(), f.want.begin() + static_cast<long>(at));
    }
    at += n;
  }
  const float inv = 1.0f / 3072.0f;
  std::vector<float> in_memory = f.want;
  const GradStats want = unscale_and_check(in_memory.data(), numel, inv);
  const GradStats got = f.grad.check(inv);
  EXPECT_EQ(got.nonfinite, want.nonfinite);
  EXPECT_EQ(got.sum_squares, want.sum_squares);  // bitwise: the same order of additions
  EXPECT_EQ(f.read(0, numel), in_memory) << "read() after check() hands out the unscaled gradient";
  // A pipeline's chunk, as NvmeStateStore reads one, into an aligned buffer.
  io::AlignedBufferPool pool(1, kGradStatsBlock * sizeof(float), f.file.alignment());
  float* slot = static_cast<float*>(pool.acquire());
  auto reads = f.grad.start(kGradStatsBlock, kGradStatsBlock, slot);
  f.grad.finish(kGradStatsBlock, kGradStatsBlock, slot, reads);
  EXPECT_EQ(0, std::memcmp(slot, in_memory.data() + kGradStatsBlock, kGradStatsBlock * sizeof(float)));
  pool.release(slot);
  EXPECT_THROW(f.grad.check(inv), Error) << "a second check() before zero() would unscale twice";
  f.grad.zero();
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const float bad[] = {nan, 1.0f, inf};
  f.grad.write(numel - 3, 3, bad);
  EXPECT_EQ(f.grad.check(1.0f).nonfinite, 2);
}

TEST(NvmeGradient, AShortReadNamesTheFileAndOffset) {
  TempDir dir;
  const size_t unit = io::direct_io_alignment(dir.path()) / sizeof(float);
  Fixture f(dir.path(), 4 * unit);
  f.write(0, 4 * unit, 1.0f);
  ASSERT_EQ(::truncate(f.file.path().c_str(), static_cast<off_t>(unit * sizeof(float))), 0);
  try {
    f.read(0, 4 * unit);
    FAIL() << "a read past the cut end returned";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(f.file.path()), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("offset"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace zerort::testing
