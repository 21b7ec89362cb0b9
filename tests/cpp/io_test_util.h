// Helpers for the io/ tests: a scratch directory, a mount for the fault cases, a byte pattern.
#pragma once

#include <stdlib.h>
#include <sys/mount.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>

namespace zerort::io::testing {

// A fresh directory under $ZERORT_IO_TEST_DIR (default /tmp: a disk filesystem with O_DIRECT
// here), removed with everything in it at the end.
class TempDir {
 public:
  TempDir() {
    const char* root = std::getenv("ZERORT_IO_TEST_DIR");
    std::string tmpl = std::string(root ? root : "/tmp") + "/zerort_io_XXXXXX";
    char* made = ::mkdtemp(tmpl.data());
    if (made == nullptr) throw std::runtime_error("mkdtemp failed for " + tmpl);
    path_ = made;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string sub(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// A filesystem mounted at `dir` for a test (root only), unmounted at the end. ok() is false,
// with why() saying why, when the mount fails (no root, or no CAP_SYS_ADMIN in a container).
class ScopedMount {
 public:
  ScopedMount(const std::string& dir, const char* fstype, unsigned long flags) : dir_(dir) {
    if (::geteuid() != 0) {
      why_ = "not root, cannot mount " + std::string(fstype);
    } else if (::mount("none", dir.c_str(), fstype, flags, nullptr) != 0) {
      why_ = "mount -t " + std::string(fstype) + " on " + dir + " failed: " + std::strerror(errno);
    } else {
      mounted_ = true;
    }
  }
  ~ScopedMount() {
    if (mounted_) ::umount2(dir_.c_str(), MNT_DETACH);
  }
  bool ok() const { return mounted_; }
  const std::string& why() const { return why_; }

 private:
  std::string dir_;
  std::string why_;
  bool mounted_ = false;
};

// Bytes that differ at every offset and for every seed (splitmix64), so a piece written to the
// wrong offset, or read from one, cannot compare equal.
inline void fill_pattern(void* buffer, std::size_t bytes, std::uint64_t seed) {
  auto* p = static_cast<unsigned char*>(buffer);
  for (std::size_t i = 0; i < bytes; i += 8) {
    std::uint64_t z = seed * 0x9e3779b97f4a7c15ULL + i + 1;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    z ^= z >> 31;
    std::memcpy(p + i, &z, std::min<std::size_t>(8, bytes - i));
  }
}

}  // namespace zerort::io::testing
