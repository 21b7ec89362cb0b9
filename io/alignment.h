// The alignment direct I/O needs on the filesystem that holds a path. See Note [Direct I/O alignment].
#pragma once

#include <cstddef>
#include <string>

namespace zerort::io {

// Note [Direct I/O alignment]
// With O_DIRECT the kernel moves data between the device and the caller's memory with no
// page cache in between, so the buffer's address, the file offset and the length must all
// be multiples of what the device can address: its logical block size (512 or 4096 bytes).
// The filesystem says so through statx(STATX_DIOALIGN) (Linux 6.1+: stx_dio_mem_align and
// stx_dio_offset_align); before that, ioctl(BLKSSZGET) on the block device under the file
// gives the logical block size. When neither answers (a filesystem that reports nothing, or
// no readable block device node) we use 4096, a multiple of every logical block size in use.
// A misaligned request fails with EINVAL, so every layer above aligns to this one value:
// the pool's buffers (AlignedBufferPool), the file's size (DirectFile) and every offset and
// length an IoQueue submits.
constexpr std::size_t kDefaultDirectIoAlignment = 4096;

// The alignment (a power of two, >= 512) for O_DIRECT I/O on `path` (a file or directory
// that exists). Never fails: falls back to kDefaultDirectIoAlignment.
std::size_t direct_io_alignment(const std::string& path);

// `bytes` rounded up to a multiple of `alignment` (a power of two).
inline std::size_t round_up(std::size_t bytes, std::size_t alignment) {
  return (bytes + alignment - 1) & ~(alignment - 1);
}

}  // namespace zerort::io
