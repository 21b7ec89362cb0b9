// The NCCL backend: CUDA buffers, one communicator per rank and device.
//
//   std::string id = rank == 0 ? nccl_unique_id() : "";   // 128 bytes; send to every rank
//   auto comm = make_nccl_communicator(rank, world, device, id, options);
//
// Under mpirun make_nccl_communicator_mpi() exchanges the id with MPI_Bcast; under torchrun
// zerort.comm.init(backend="nccl") exchanges it through c10d's TCPStore.
//
// Collectives run on the communicator's own high-priority stream, after the work already
// queued on the compute stream (Note [stream order], comm/stream_order.h: the stream the
// user's work is on). Their Work is joined to the compute stream by a stream wait, or waited
// for by the host, with the communicator's timeout either way (Note [stream-waited work]): on
// timeout the communicator is aborted and every later call throws, so nothing hangs. Buffers are
// device memory on `device`; all_reduce and broadcast also take small host buffers
// (control values such as the optimizer's decision), staged through pinned memory.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>
#include <string>

#include "comm/communicator.h"

namespace zerort {

std::string nccl_unique_id();  // ncclGetUniqueId, as 128 raw bytes

std::unique_ptr<Communicator> make_nccl_communicator(int rank, int size, int device, const std::string& unique_id,
                                                     CommOptions options = {});

// This rank's part of `parent` (an nccl communicator): the ranks of the same color, numbered
// by key, through ncclCommSplit; a collective over parent, bounded by options.timeout. group
// names the part in errors ("row 1 of 2 (ranks 2,3)"). See Note [nccl parts] (nccl_split.h).
std::unique_ptr<Communicator> make_nccl_part(Communicator& parent, int color, int key, const std::string& group,
                                             CommOptions options = {});

// Rank and world from MPI (mpi_communicator); rank 0's id reaches the others by MPI_Bcast.
// device < 0 picks the local rank modulo the visible devices.
std::unique_ptr<Communicator> make_nccl_communicator_mpi(int device, CommOptions options = {});

}  // namespace zerort
