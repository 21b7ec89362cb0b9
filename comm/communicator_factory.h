// Picks and builds a Communicator by backend name for a process launched by mpirun,
// torchrun or nothing.
#pragma once

#include <memory>
#include <string>

#include "comm/communicator.h"
#include "comm/launch_env.h"

namespace zerort {

// backend: "auto", "mpi", "nccl" (CUDA buffers; under mpirun or one rank), "inprocess" (a
// single-rank group) or "gloo". "auto" picks MPI under mpirun/PMI and a single in-process
// rank with no launcher. gloo needs a c10d process
// group, which torch.distributed makes: from Python use zerort.comm.init(); from C++ call
// make_gloo_communicator (comm/gloo/gloo_communicator.h). Errors list what this build has.
std::unique_ptr<Communicator> make_communicator(const std::string& backend, const LaunchEnv& env,
                                                CommOptions options = {});

// The backend "auto" resolves to for this launch ("mpi", "gloo" or "inprocess").
std::string resolve_backend(const std::string& backend, const LaunchEnv& env);

}  // namespace zerort
