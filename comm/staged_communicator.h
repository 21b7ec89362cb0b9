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

class Mover {
 public:
  virtual ~Mover() = default;
  virtual std::shared_ptr<char> host_buffer(size_t bytes) = 0;  // staging (pinned for CUDA)
  // Copies between caller memory and staging, finished when they return.
  virtual void to_host(void* host, const void* buf, size_t bytes) = 0;
  virtual void from_host(void* buf, const void* host, size_t bytes) = 0;
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
