// RegionFile: whole regions of one O_DIRECT file through two staging buffers. See Note [RegionFile].
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/region_file.h"
#include "io_test_util.h"

namespace zerort::io {
namespace {

using testing::fill_pattern;
using testing::TempDir;

// Sizes that are 0, 1, not a multiple of the alignment, a multiple of it, and past one block.
const std::vector<std::size_t> kSizes = {0, 1, 4095, 4096, 4097, 3 * 4096 + 5, 70001};

RegionFile make(const TempDir& dir, std::vector<std::size_t> sizes = kSizes) {
  return RegionFile(dir.path(), "regions.bin", std::move(sizes), 4, 8192);
}

std::vector<unsigned char> pattern(std::size_t bytes, std::uint64_t seed) {
  std::vector<unsigned char> out(bytes);
  fill_pattern(out.data(), bytes, seed);
  return out;
}

void write_region(RegionFile& f, std::size_t r, std::uint64_t seed) {
  const auto values = pattern(f.bytes(r), seed);
  void* buffer = f.begin_write(r);
  if (!values.empty()) std::memcpy(buffer, values.data(), values.size());
  f.end_write(r);
}

// Region r read into an odd address (the caller's memory is never aligned for it).
std::vector<unsigned char> read_region(RegionFile& f, std::size_t r) {
  std::vector<unsigned char> out(f.bytes(r) + 1, 0xAB);
  f.read(r, out.data() + 1);
  return std::vector<unsigned char>(out.begin() + 1, out.end());
}

TEST(RegionFile, EveryRegionReadsBackWhatWasWrittenLast) {
  TempDir dir;
  RegionFile f = make(dir);
  for (std::size_t r = 0; r < kSizes.size(); ++r) write_region(f, r, 100 + r);
  write_region(f, 3, 7);  // rewritten while the others may still be in flight
  for (std::size_t r = 0; r < kSizes.size(); ++r) {
    EXPECT_EQ(read_region(f, r), pattern(kSizes[r], r == 3 ? 7 : 100 + r)) << "region " << r;
  }
}

TEST(RegionFile, TheFileHoldsEachRegionAtItsAlignedOffset) {
  TempDir dir;
  RegionFile f = make(dir);
  std::uint64_t offset = 0;
  for (std::size_t r = 0; r < kSizes.size(); ++r) write_region(f, r, 50 + r);
  f.flush();
  const int fd = ::open(f.path().c_str(), O_RDONLY);  // the page cache: not the code under test
  ASSERT_GE(fd, 0);
  for (std::size_t r = 0; r < kSizes.size(); ++r) {
    std::vector<unsigned char> got(kSizes[r]);
    ASSERT_EQ(::pread(fd, got.data(), got.size(), static_cast<off_t>(offset)), static_cast<ssize_t>(got.size()));
    EXPECT_EQ(got, pattern(kSizes[r], 50 + r)) << "region " << r;
    offset += (kSizes[r] + 4095) / 4096 * 4096;
  }
  ::close(fd);
  EXPECT_EQ(f.file_bytes(), offset);
}

TEST(RegionFile, ARegionWhoseWriteIsInFlightReadsItsNewBytes) {
  TempDir dir;
  RegionFile f = make(dir);
  write_region(f, 6, 1);
  write_region(f, 5, 2);  // both buffers now hold writes that may be in flight
  EXPECT_EQ(read_region(f, 6), pattern(kSizes[6], 1));
  void* open = f.begin_write(4);  // a read while a write is prepared uses the other buffer
  fill_pattern(open, kSizes[4], 3);
  EXPECT_EQ(read_region(f, 5), pattern(kSizes[5], 2));
  f.end_write(4);
  EXPECT_EQ(read_region(f, 4), pattern(kSizes[4], 3));
}

TEST(RegionFile, TheStagingIsTwoOfTheLargestRoomWhateverTheRegionCount) {
  TempDir dir;
  RegionFile few = RegionFile(dir.path(), "few.bin", {5000}, 4, 8192);
  RegionFile many = RegionFile(dir.path(), "many.bin", std::vector<std::size_t>(300, 5000), 4, 8192);
  EXPECT_EQ(few.staging_bytes(), 2u * 8192);
  EXPECT_EQ(many.staging_bytes(), 2u * 8192);
  EXPECT_EQ(many.file_bytes(), 300u * 8192);
}

TEST(RegionFile, MisuseIsAUsageErrorNamingTheRegion) {
  TempDir dir;
  RegionFile f = make(dir);
  EXPECT_THROW(f.read(kSizes.size(), nullptr), UsageError);
  f.begin_write(2);
  try {
    f.begin_write(3);
    ADD_FAILURE() << "a second begin_write was accepted";
  } catch (const UsageError& e) {
    EXPECT_NE(std::string(e.what()).find("region 2 is still being written"), std::string::npos) << e.what();
  }
  EXPECT_THROW(f.end_write(3), UsageError);
  f.end_write(2);
  EXPECT_THROW(f.end_write(2), UsageError);
}

TEST(RegionFile, AShortReadNamesTheFileAndChangesNothing) {
  TempDir dir;
  RegionFile f = make(dir);
  write_region(f, 6, 4);
  f.flush();
  ASSERT_EQ(::truncate(f.path().c_str(), 4096), 0);  // region 6 now lies past the end
  try {
    read_region(f, 6);
    ADD_FAILURE() << "a read past the end succeeded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(f.path()), std::string::npos) << e.what();
  }
  write_region(f, 1, 5);  // a failed read leaves the file usable
  EXPECT_EQ(read_region(f, 1), pattern(kSizes[1], 5));
}

TEST(RegionFile, AMissingDirectoryIsAConfigErrorNamingIt) {
  TempDir dir;
  const std::string missing = dir.sub("nope");
  try {
    RegionFile f(missing, "r.bin", {10}, 4, 8192);
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find(missing), std::string::npos) << e.what();
  }
}

TEST(RegionFile, TheFileIsRemovedWithTheObject) {
  TempDir dir;
  std::string path;
  {
    RegionFile f = make(dir);
    write_region(f, 6, 9);  // left in flight: the destructor waits for it
    path = f.path();
    EXPECT_TRUE(std::filesystem::exists(path));
  }
  EXPECT_FALSE(std::filesystem::exists(path));
}

}  // namespace
}  // namespace zerort::io
