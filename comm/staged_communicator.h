// StagedCommunicator: a host backend (MPI, gloo) carrying device buffers through host
// memory, so ranks that share one GPU (where NCCL refuses two ranks on one device) run every
// W > 1 path of the CUDA engine. Each collective copies its inputs into host staging
// buffers, runs the host collective there, and copies its outputs back when waited on.
// Memory moves through a Mover: CUDA copies into pinned buffers, or plain host copies (CPU
// buffers through the same code, so the path is tested on machines without a GPU).
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "comm/communicator.h"
#include "zerort/config.h"

namespace zerort {

// Note [staged accumulate]
// reduce_scatter_accumulate(accumulate=true) stages `out` in with the input and asks the host
// communicator to accumulate into that copy: the FP64 sum that includes `out`, rounded once,
// as the direct host path rounds it, so the bits are the mpi/gloo path's (adding the rounded
// sum to `out` afterwards would round twice). `out` is read when the call is made; an earlier
// call into the same `out` that is still in flight is waited for first, so a chain of
// accumulates into one shard sums as on the other backends. Copies: `out` in and out once each.

// Note [staging once]
// The multi-node patterns over a staged communicator (zerort.comm.init(staged=...); the Python
// side, zerort.comm.topology, builds them) copy each buffer between the device and the host
// once per collective the engine makes, never once per hop:
// - two-hop (comm.topology) and its int8/fp8 wire: the staged communicator wraps the host
//   two-hop communicator, whose hops, partial sums and codes all work on host memory. Wrapping
//   each hop's part instead would copy the chunks out and back at both hops.
// - hybrid sharding (shard_size): the shard group, which the engine hands its device buffers,
//   is staged; the replicas stay a host communicator, because sum_across_replicas
//   (runtime/shard_groups.h) copies the FP32 shard into host scratch once and sums there.
// - hpZ (stage3.secondary_shard_size): the node part gathers device pieces into device units,
//   so it is staged.
// The bits are the host path's: the same host collectives on the same values.

class Mover {
 public:
  virtual ~Mover() = default;
  virtual std::shared_ptr<char> host_buffer(size_t bytes) = 0;  // staging (pinned for CUDA)
  // Copies between caller memory and staging, finished when they return. Each is queued after the
  // work on the compute stream so far (Note [stream order]).
  virtual void to_host(void* host, const void* buf, size_t bytes) = 0;
  virtual void from_host(void* buf, const void* host, size_t bytes) = 0;
  // to_host of memory whose last writer the host has already waited for: no wait for the compute
  // stream, whose queued work (a forward beside the overlapped update) it would otherwise follow
  // (Note [gradient on the device], runtime/device_gradient_store.h).
  virtual void settled_to_host(void* host, const void* buf, size_t bytes) { to_host(host, buf, bytes); }
  virtual bool device_memory() const = 0;  // the caller's buffers are device memory
  virtual const char* name() const = 0;    // "host" or "cuda"
};

std::unique_ptr<Mover> make_host_mover();
#if ZERORT_WITH_NCCL
std::unique_ptr<Mover> make_cuda_mover(int device);  // comm/staged_cuda.cpp
#endif

// inner: the host communicator, made without comm.debug: the staged one checks the calls
// (options: its debug flag and the timeout of its own checks; the Works it returns are the
// inner communicator's, so wait() uses the inner one's timeout: give both the same).
std::unique_ptr<Communicator> make_staged_communicator(std::shared_ptr<Communicator> inner,
                                                       std::unique_ptr<Mover> mover, CommOptions options);

}  // namespace zerort
