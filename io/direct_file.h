// DirectFile: one preallocated file opened with O_DIRECT, locked against a second job.
#pragma once

#include <cstdint>
#include <string>

namespace zerort::io {

// Note [DirectFile checks]
// Every way an offload directory can be unusable is found when the file is made, before any
// state is written, and is a zerort::ConfigError that names the path and says how to fix it:
//   - the directory is missing, or is not a directory;
//   - it is read-only (a read-only mount, or no write permission);
//   - another job holds the file's lock: flock(LOCK_EX | LOCK_NB) on "<file>.lock" beside the
//     file, so two jobs on one path are refused (ranks use different file names and do not
//     conflict); the lock goes when the process does, even after a crash;
//   - its filesystem has no O_DIRECT (open fails with EINVAL: tmpfs before Linux 6.6, ramfs,
//     some network and FUSE filesystems);
//   - there is not enough free space (statvfs) for the file, or fallocate finds none.
// The file's size is rounded up to the direct-I/O alignment and allocated in full with
// fallocate, so a later write cannot fail for want of space. A file of that name left by an
// earlier job is removed first: holding the lock proves no live job uses it.
class DirectFile {
 public:
  // Creates (or replaces) `directory`/`name` with `bytes` bytes (rounded up) and opens it
  // read-write with O_DIRECT. When remove_on_close, the destructor deletes the file and its
  // lock file. Throws zerort::ConfigError (See Note [DirectFile checks]) or zerort::Error.
  DirectFile(const std::string& directory, const std::string& name, std::uint64_t bytes, bool remove_on_close = true);
  ~DirectFile();
  DirectFile(const DirectFile&) = delete;
  DirectFile& operator=(const DirectFile&) = delete;

  int fd() const { return fd_; }
  const std::string& path() const { return path_; }
  // The file's size: the bytes asked for, rounded up to alignment().
  std::uint64_t size() const { return size_; }
  // What every buffer address, offset and length must be a multiple of. See Note [Direct I/O alignment].
  std::size_t alignment() const { return alignment_; }

 private:
  void check_directory(const std::string& directory) const;
  void take_lock();
  void close_all() noexcept;

  std::string path_;
  std::string lock_path_;
  std::uint64_t size_ = 0;
  std::size_t alignment_ = 0;
  bool remove_on_close_;
  bool created_ = false;  // path_ holds our file (it may exist with fd_ < 0 after a failed open)
  int fd_ = -1;
  int lock_fd_ = -1;
};

}  // namespace zerort::io
