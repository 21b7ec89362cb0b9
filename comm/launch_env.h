// Who am I? Rank and world from the launcher's environment variables.
#pragma once

#include <functional>
#include <optional>
#include <string>

namespace zerort {

enum class Launcher { kNone, kTorchrun, kOpenMpi, kPmi };
const char* launcher_name(Launcher launcher);

struct LaunchEnv {
  Launcher launcher = Launcher::kNone;
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;        // among this node's ranks: picks the GPU
  int local_world_size = 1;  // ranks on this node
  std::string master_addr;   // torchrun only
  int master_port = 0;       // torchrun only
};

// Resolution order: torchrun (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT), then Open MPI (OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE), then PMI
// (PMI_RANK, PMI_SIZE; the node-local rank from MPICH's MPI_LOCALRANKID, else
// PMI_LOCAL_RANK, else Slurm's SLURM_LOCALID, and the node's size from MPI_LOCALNRANKS or
// PMI_LOCAL_SIZE; Slurm's SLURM_NTASKS_PER_NODE is a requested maximum, not used); none of
// them means a single rank. A missing
// node-local rank is 0 and a missing node size is the world's (one node). A malformed or inconsistent value raises an error naming the
// variable. `getenv` is injectable for tests.
using EnvLookup = std::function<std::optional<std::string>(const std::string&)>;
LaunchEnv detect_launch_env();
LaunchEnv detect_launch_env(const EnvLookup& getenv);

}  // namespace zerort
