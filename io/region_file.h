// RegionFile: one O_DIRECT file cut into fixed regions, each read and written whole through two
// staging buffers: stage 3's parameter tier keeps one unit's low-precision shard per region
// (runtime/shard_copies.h).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "io/aligned_buffer_pool.h"
#include "io/direct_file.h"
#include "io/io_queue.h"

namespace zerort::io {

// Note [RegionFile]
// Region r holds bytes(r) bytes at an aligned offset; its room in the file is bytes(r) rounded
// up to the direct-I/O alignment, and the file is the rooms end to end. Regions move whole,
// through two staging buffers of the largest room (staging_bytes(), the only RAM the file
// uses, whatever the number of regions):
//   - a write is begin_write(r), which hands out a buffer once that buffer's last write is
//     done, then end_write(r), which starts the write and returns: the caller fills the next
//     region while this one goes to the disk;
//   - read(r, out) first waits for a write of r still in flight, then reads r through a buffer
//     no write is being prepared in, and copies bytes(r) to out (any address).
// One write is prepared at a time. Calls are serialized by a mutex, so a reader on another
// thread is safe. A failed write leaves the file holding some regions' new bytes and others'
// old: the file then refuses every later call (an Error naming the first failure), so a mixed
// state is never read. A failed read changes nothing.
class RegionFile {
 public:
  // Makes `directory`/`name` (See Note [DirectFile checks]: a ConfigError names the path and
  // the bytes needed) with one region per entry of region_bytes (0 is allowed). queue_depth,
  // block_size and backend are the IoQueue's.
  RegionFile(const std::string& directory, const std::string& name, std::vector<std::size_t> region_bytes,
             unsigned queue_depth, std::size_t block_size, IoBackend backend = IoBackend::kAuto);
  ~RegionFile();  // waits for the writes in flight; the file is removed
  RegionFile(const RegionFile&) = delete;
  RegionFile& operator=(const RegionFile&) = delete;

  std::size_t regions() const { return bytes_.size(); }
  std::size_t bytes(std::size_t region) const;
  void read(std::size_t region, void* out);
  void* begin_write(std::size_t region);  // bytes(region) to fill, then end_write(region)
  void end_write(std::size_t region);
  void flush();  // waits for every write

  const std::string& path() const { return file_.path(); }
  std::uint64_t file_bytes() const { return file_.size(); }
  std::size_t staging_bytes() const { return pool_.bytes(); }
  std::uint64_t bytes_read() const;
  std::uint64_t bytes_written() const;
  double wait_seconds() const;                                 // blocked on this file's I/O, since it was made
  const char* io_backend() const { return queue_.backend(); }  // See IoQueue::backend()
  const std::string& io_backend_why() const { return queue_.backend_why(); }

 private:
  struct Staging {
    void* data = nullptr;
    long writing = -1;  // the region whose write is in flight from here
    IoQueue::Request request = 0;
    std::uint64_t order = 0;  // when that write started
  };
  void check(std::size_t region, const char* call) const;  // a region, and the file usable
  void wait_write(Staging& s);                             // its write done (if any)
  std::uint64_t room(std::size_t region) const;

  std::vector<std::size_t> bytes_;
  std::vector<std::uint64_t> offsets_;
  DirectFile file_;
  AlignedBufferPool pool_;
  IoQueue queue_;
  Staging staging_[2];
  long open_ = -1;  // the staging index begin_write handed out, until end_write
  std::size_t open_region_ = 0;
  std::uint64_t writes_ = 0;
  std::string failure_;
  mutable std::mutex mu_;
};

}  // namespace zerort::io
