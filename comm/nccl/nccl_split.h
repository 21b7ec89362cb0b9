// The split of an NCCL communicator into parts (Note [nccl parts]): the NCCL half of
// make_nccl_part (comm/nccl/nccl_communicator.h).
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "comm/nccl/nccl_work.h"

namespace zerort {

// Note [nccl parts]
// A part of an nccl communicator (two-hop's node and cross-node groups, hybrid sharding's shard
// and replica groups, hpZ's secondary groups: zerort.comm.topology.grid_parts) is made by
// ncclCommSplit over the parent: the ranks that pass the same color, numbered by key. It is a
// collective over the parent, so every rank splits the same parts in the same order.
// - Bounded: the child is nonblocking and settled against the timeout, as the parent's init.
//   A failed or timed-out split throws naming the group ("row 1 of 2 (ranks 2,3)") and the
//   parent rank, and leaves the parent unusable (its later calls throw, naming the split):
//   NCCL may still be working on it. A half-made child is left to the process's exit, as a
//   timed-out init is (ncclCommAbort on one crashed the process).
// - Its own: the part has its own ncclComm and stream (no shared resources), so its
//   collectives never wait behind the parent's; destroyed (finalized) when its last owner
//   drops it, the engine's Communicator objects holding it as they hold the mpi parts.

struct NcclSplit {
  std::shared_ptr<NcclState> state;  // the part's communicator, settled; stream not yet made
  int rank = 0, size = 0;            // this rank's place in the part
};

// parent: the state of rank `parent_rank` of `parent_size`; holds parent.mu while splitting.
NcclSplit split_nccl_state(NcclState& parent, int parent_rank, int parent_size, int color, int key,
                           const std::string& group, std::chrono::milliseconds timeout);

}  // namespace zerort
