// The shared-memory backend ("shm"): ranks on one host exchange through one segment in
// /dev/shm (comm/shm/shm_segment.h), one copy in and one copy out, with no kernel socket.
// Its calls run FIFO on one worker thread of its own (comm/shm/shm_queue.h).
#pragma once

#include <cstddef>
#include <memory>

#include "comm/communicator.h"

namespace zerort {

// Each rank's two windows (Note [shm rounds]): larger calls run in rounds of this size, at
// most 4 MiB, and smaller as the group grows so that the segment (2 windows a rank) stays
// within 32 MiB: half of Docker's default 64 MB /dev/shm, whatever the ranks per host.
constexpr size_t kShmWindowBytes = size_t{4} << 20;
constexpr size_t kShmSegmentBudget = size_t{32} << 20;
size_t shm_window_bytes(int world);

// Collective over `bootstrap`, a communicator of exactly these ranks on one host (the gloo
// group of a node, or MPI): it carries the segment's name once; the result does not use it
// afterwards. Throws CommError naming the path and the fix when the segment cannot be made.
// window_bytes 0: shm_window_bytes(bootstrap.size()).
std::unique_ptr<Communicator> make_shm_communicator(Communicator& bootstrap, CommOptions options = {},
                                                    size_t window_bytes = 0);

}  // namespace zerort
