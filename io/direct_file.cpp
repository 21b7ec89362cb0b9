#include "io/direct_file.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/error.h"
#include "io/alignment.h"

namespace zerort::io {

namespace {

std::string errno_text(int err) { return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")"; }

bool read_only_mount(const std::string& directory) {
  struct statvfs vfs {};
  return ::statvfs(directory.c_str(), &vfs) == 0 && (vfs.f_flag & ST_RDONLY);
}

}  // namespace

// See Note [DirectFile checks].
DirectFile::DirectFile(const std::string& directory, const std::string& name, std::uint64_t bytes, bool remove_on_close)
    : remove_on_close_(remove_on_close) {
  ZRT_CHECK_AS(ConfigError, !name.empty() && name.find('/') == std::string::npos,
               "DirectFile: the file name must be a plain name without '/', got '", name, "'");
  check_directory(directory);
  path_ = directory + (directory.back() == '/' ? "" : "/") + name;
  lock_path_ = path_ + ".lock";
  take_lock();
  try {
    if (::unlink(path_.c_str()) != 0 && errno != ENOENT) {
      ZRT_THROW_AS(ConfigError, "DirectFile: cannot remove the stale file ", path_,
                   " left by an earlier job: ", errno_text(errno), "; remove it by hand");
    }
    // From here on whatever is at path_ is ours: the lock is held and any stale file is gone.
    // (open creates the file even when it then fails on O_DIRECT with EINVAL.)
    created_ = true;
    fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_DIRECT | O_CLOEXEC, 0600);
    if (fd_ < 0) {
      int err = errno;
      ZRT_CHECK_AS(ConfigError, err != EINVAL, "DirectFile: the filesystem of ", directory,
                   " does not support O_DIRECT (open of ", path_,
                   " failed with EINVAL); point nvme_path at a directory on a local disk "
                   "filesystem (ext4, xfs, btrfs)");
      ZRT_CHECK_AS(ConfigError, err != EROFS && err != EACCES && err != EPERM, "DirectFile: cannot create ", path_,
                   ": ", errno_text(err), "; make ", directory, " writable or choose another nvme_path");
      ZRT_THROW_AS(Error, "DirectFile: cannot create ", path_, ": ", errno_text(err));
    }
    alignment_ = direct_io_alignment(path_);
    size_ = round_up(bytes, alignment_);
    struct statvfs vfs {};
    ZRT_CHECK_AS(Error, ::fstatvfs(fd_, &vfs) == 0, "DirectFile: statvfs of ", directory,
                 " failed: ", errno_text(errno));
    std::uint64_t free_bytes = static_cast<std::uint64_t>(vfs.f_bavail) * vfs.f_frsize;
    ZRT_CHECK_AS(ConfigError, size_ <= free_bytes, "DirectFile: not enough free space in ", directory, " for ", path_,
                 ": needs ", size_, " bytes, ", free_bytes,
                 " bytes free; free space there or point nvme_path at a larger disk");
    if (size_ > 0) {
      // fallocate, not posix_fallocate: glibc's fallback for a filesystem without it writes
      // one byte per block, which O_DIRECT refuses.
      int rc = ::fallocate(fd_, 0, 0, static_cast<off_t>(size_)) == 0 ? 0 : errno;
      ZRT_CHECK_AS(ConfigError, rc != EOPNOTSUPP, "DirectFile: the filesystem of ", directory, " cannot preallocate ",
                   path_, " (fallocate: ", errno_text(rc),
                   "); point nvme_path at a local disk filesystem (ext4, xfs, btrfs)");
      ZRT_CHECK_AS(ConfigError, rc != ENOSPC, "DirectFile: not enough free space in ", directory, " for ", path_,
                   ": fallocate of ", size_, " bytes failed (", free_bytes,
                   " bytes were free); free space there or point nvme_path at a larger disk");
      ZRT_CHECK_AS(Error, rc == 0, "DirectFile: fallocate of ", size_, " bytes for ", path_,
                   " failed: ", errno_text(rc));
    }
  } catch (...) {
    remove_on_close_ = true;  // what this constructor made (file, lock file) goes with it
    close_all();
    throw;
  }
}

DirectFile::~DirectFile() { close_all(); }

void DirectFile::check_directory(const std::string& directory) const {
  ZRT_CHECK_AS(ConfigError, !directory.empty(), "DirectFile: the directory (nvme_path) is empty; name a directory");
  struct stat st {};
  if (::stat(directory.c_str(), &st) != 0) {
    int err = errno;
    ZRT_CHECK_AS(ConfigError, err != ENOENT, "DirectFile: the directory ", directory,
                 " does not exist; create it (mkdir -p ", directory, ") or point nvme_path at an existing directory");
    ZRT_THROW_AS(ConfigError, "DirectFile: cannot stat ", directory, ": ", errno_text(err));
  }
  ZRT_CHECK_AS(ConfigError, S_ISDIR(st.st_mode), "DirectFile: ", directory,
               " is not a directory; point nvme_path at a directory");
  ZRT_CHECK_AS(ConfigError, !read_only_mount(directory), "DirectFile: ", directory,
               " is on a read-only filesystem; remount it read-write or choose another nvme_path");
  ZRT_CHECK_AS(ConfigError, ::access(directory.c_str(), W_OK | X_OK) == 0, "DirectFile: ", directory,
               " is read-only for this user (", errno_text(errno),
               "); make it writable (chmod u+w) or choose another nvme_path");
}

// flock(LOCK_EX | LOCK_NB) on "<file>.lock". The lock file may be unlinked by the job that held
// it (on close) between our open and our flock, leaving us a lock on a file no one else can
// find; so after locking we check that the path still names the inode we locked, and retry.
void DirectFile::take_lock() {
  for (int attempt = 0; attempt < 100; ++attempt) {
    lock_fd_ = ::open(lock_path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (lock_fd_ < 0) {
      int err = errno;
      ZRT_THROW_AS(ConfigError, "DirectFile: cannot create the lock file ", lock_path_, ": ", errno_text(err),
                   "; make the directory writable or choose another nvme_path");
    }
    if (::flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
      int err = errno;
      ::close(lock_fd_);
      lock_fd_ = -1;
      ZRT_CHECK_AS(ConfigError, err != EWOULDBLOCK, "DirectFile: ", path_,
                   " is in use by another job (it holds the lock ", lock_path_,
                   "); two jobs cannot share one offload file: give each job its own nvme_path");
      ZRT_THROW_AS(Error, "DirectFile: flock on ", lock_path_, " failed: ", errno_text(err));
    }
    struct stat locked {
    }, named{};
    if (::fstat(lock_fd_, &locked) == 0 && ::stat(lock_path_.c_str(), &named) == 0 && locked.st_ino == named.st_ino &&
        locked.st_dev == named.st_dev) {
      return;
    }
    ::close(lock_fd_);
    lock_fd_ = -1;
  }
  ZRT_THROW_AS(Error, "DirectFile: the lock file ", lock_path_, " keeps being replaced; is another job cycling it?");
}

void DirectFile::close_all() noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  if (created_ && remove_on_close_) ::unlink(path_.c_str());
  created_ = false;
  if (lock_fd_ >= 0) {
    // Unlinked while still held, so no other job can lock this inode after we let go. See take_lock().
    if (remove_on_close_) ::unlink(lock_path_.c_str());
    ::close(lock_fd_);
    lock_fd_ = -1;
  }
}

}  // namespace zerort::io
