#include "io/region_file.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "core/error.h"
#include "io/alignment.h"

namespace zerort::io {

namespace {

// The rooms' alignment: the directory's direct-I/O alignment, and never below the default,
// so that the file's own (checked once it is made) divides it.
std::size_t room_alignment(const std::string& directory) {
  return std::max(direct_io_alignment(directory), kDefaultDirectIoAlignment);
}

std::vector<std::uint64_t> region_offsets(const std::vector<std::size_t>& bytes, std::size_t alignment) {
  std::vector<std::uint64_t> out{0};
  for (std::size_t b : bytes) out.push_back(out.back() + round_up(b, alignment));
  return out;  // one past the last region: the file's size
}

std::size_t largest_room(const std::vector<std::size_t>& bytes, std::size_t alignment) {
  std::size_t most = alignment;  // a pool buffer is never empty
  for (std::size_t b : bytes) most = std::max(most, round_up(b, alignment));
  return most;
}

}  // namespace

// See Note [RegionFile].
RegionFile::RegionFile(const std::string& directory, const std::string& name, std::vector<std::size_t> region_bytes,
                       unsigned queue_depth, std::size_t block_size, IoBackend backend)
    : bytes_(std::move(region_bytes)), offsets_(region_offsets(bytes_, room_alignment(directory))),
      file_(directory, name, std::max<std::uint64_t>(offsets_.back(), 1)),
      pool_(2, largest_room(bytes_, room_alignment(directory)), room_alignment(directory)),
      queue_(queue_depth, block_size, backend) {
  ZRT_CHECK(room_alignment(directory) % file_.alignment() == 0, "RegionFile: ", file_.path(),
            " needs a direct-I/O alignment of ", file_.alignment(), " bytes, above the ", room_alignment(directory),
            " its regions were laid out with");
  for (Staging& s : staging_) s.data = pool_.acquire();
  queue_.register_pool(pool_);
}

RegionFile::~RegionFile() {
  std::lock_guard<std::mutex> lock(mu_);
  for (Staging& s : staging_) {
    try {
      if (s.writing >= 0) queue_.wait(s.request);
    } catch (const Error&) {  // nothing reads the file again: it is removed
    }
    pool_.release(s.data);
  }
}

std::size_t RegionFile::bytes(std::size_t region) const {
  ZRT_CHECK_AS(UsageError, region < bytes_.size(), "RegionFile ", file_.path(), ": no region ", region, " (",
               bytes_.size(), " regions)");
  return bytes_[region];
}

std::uint64_t RegionFile::room(std::size_t region) const { return offsets_[region + 1] - offsets_[region]; }

void RegionFile::check(std::size_t region, const char* call) const {
  bytes(region);
  ZRT_CHECK(failure_.empty(), "RegionFile::", call, ": ", file_.path(),
            " is not usable after an earlier write failed, so its regions may mix old and new bytes: ", failure_);
}

void RegionFile::wait_write(Staging& s) {
  if (s.writing < 0) return;
  const long region = s.writing;
  s.writing = -1;
  try {
    queue_.wait(s.request);
  } catch (const Error& e) {
    failure_ = detail::concat("the write of region ", region, " failed: ", e.what());
    throw;
  }
}

void RegionFile::read(std::size_t region, void* out) {
  std::lock_guard<std::mutex> lock(mu_);
  check(region, "read");
  for (Staging& s : staging_) {
    if (s.writing == static_cast<long>(region)) wait_write(s);
  }
  Staging& s = staging_[open_ == 0 ? 1 : 0];
  wait_write(s);
  if (bytes_[region] == 0) return;
  queue_.wait(queue_.read(file_, offsets_[region], s.data, room(region)));
  std::memcpy(out, s.data, bytes_[region]);
}

void* RegionFile::begin_write(std::size_t region) {
  std::lock_guard<std::mutex> lock(mu_);
  check(region, "begin_write");
  ZRT_CHECK_AS(UsageError, open_ < 0, "RegionFile::begin_write(", region, "): region ", open_region_,
               " is still being written; call end_write for it first");
  // The buffer free of writes, else the one whose write started first.
  long pick = staging_[0].writing < 0 ? 0 : staging_[1].writing < 0 ? 1 : staging_[0].order < staging_[1].order ? 0 : 1;
  wait_write(staging_[pick]);
  open_ = pick;
  open_region_ = region;
  std::memset(static_cast<char*>(staging_[pick].data) + bytes_[region], 0, room(region) - bytes_[region]);
  return staging_[pick].data;
}

void RegionFile::end_write(std::size_t region) {
  std::lock_guard<std::mutex> lock(mu_);
  ZRT_CHECK_AS(UsageError, open_ >= 0 && open_region_ == region, "RegionFile::end_write(", region, "): no begin_write(",
               region, ") is open");
  Staging& s = staging_[open_];
  open_ = -1;
  if (bytes_[region] == 0) return;
  s.request = queue_.write(file_, offsets_[region], s.data, room(region));
  s.writing = static_cast<long>(region);
  s.order = ++writes_;
}

void RegionFile::flush() {
  std::lock_guard<std::mutex> lock(mu_);
  for (Staging& s : staging_) wait_write(s);
}

std::uint64_t RegionFile::bytes_read() const {
  std::lock_guard<std::mutex> lock(mu_);
  return queue_.bytes_read();
}

std::uint64_t RegionFile::bytes_written() const {
  std::lock_guard<std::mutex> lock(mu_);
  return queue_.bytes_written();
}

double RegionFile::wait_seconds() const {
  std::lock_guard<std::mutex> lock(mu_);
  return queue_.wait_seconds();
}

}  // namespace zerort::io
