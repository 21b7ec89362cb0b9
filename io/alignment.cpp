#include "io/alignment.h"

#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>

namespace zerort::io {

namespace {

bool is_power_of_two(std::size_t v) { return v != 0 && (v & (v - 1)) == 0; }

// ioctl(BLKSSZGET) on the block device that holds `st_dev`, through /dev/block/MAJ:MIN.
std::size_t block_device_sector_size(dev_t dev) {
  std::string node = "/dev/block/" + std::to_string(major(dev)) + ":" + std::to_string(minor(dev));
  int fd = ::open(node.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return 0;
  int sector = 0;
  bool ok = ::ioctl(fd, BLKSSZGET, &sector) == 0;
  ::close(fd);
  return ok && sector > 0 ? static_cast<std::size_t>(sector) : 0;
}

}  // namespace

// See Note [Direct I/O alignment].
std::size_t direct_io_alignment(const std::string& path) {
  std::size_t align = 0;
#ifdef STATX_DIOALIGN
  struct statx sx {};
  if (::statx(AT_FDCWD, path.c_str(), 0, STATX_DIOALIGN, &sx) == 0 && (sx.stx_mask & STATX_DIOALIGN) &&
      sx.stx_dio_offset_align != 0) {
    align = std::max<std::size_t>(sx.stx_dio_offset_align, sx.stx_dio_mem_align);
  }
#endif
  if (align == 0) {
    struct stat st {};
    if (::stat(path.c_str(), &st) == 0) align = block_device_sector_size(st.st_dev);
  }
  if (!is_power_of_two(align)) align = kDefaultDirectIoAlignment;
  return std::max<std::size_t>(align, 512);
}

}  // namespace zerort::io
