#include "comm/communicator_factory.h"

#include "comm/inprocess_communicator.h"
#include "core/error.h"
#include "zerort/config.h"
#if ZERORT_WITH_MPI
#include "comm/mpi_communicator.h"
#endif
#if ZERORT_WITH_NCCL
#include "comm/nccl/nccl_communicator.h"
#endif

namespace zerort {

std::string resolve_backend(const std::string& backend, const LaunchEnv& env) {
  if (backend != "auto") return backend;
  switch (env.launcher) {
    case Launcher::kTorchrun: return "gloo";
    case Launcher::kOpenMpi:
    case Launcher::kPmi: return "mpi";
    case Launcher::kNone: return "inprocess";
  }
  return "inprocess";
}

std::unique_ptr<Communicator> make_communicator(const std::string& backend, const LaunchEnv& env, CommOptions options) {
  const std::string name = resolve_backend(backend, env);
  if (name == "inprocess") {
    ZRT_CHECK(env.world_size == 1,
              "comm.backend 'inprocess' from a launcher gives one rank per "
              "process, but ",
              launcher_name(env.launcher), " started ", env.world_size,
              " ranks; use 'mpi' or 'gloo', or InProcessGroup for threads");
    return InProcessGroup::create(1, options)->communicator(0);
  }
  if (name == "mpi") {
#if ZERORT_WITH_MPI
    return make_mpi_communicator(options);
#else
    ZRT_THROW_AS(CommError, "comm.backend 'mpi' is not in this build (MPI was not found at configure time); "
                            "install libopenmpi-dev and rebuild, or use 'gloo' under torchrun");
#endif
  }
  if (name == "nccl") {
#if ZERORT_WITH_NCCL
    if (env.launcher == Launcher::kNone) return make_nccl_communicator(0, 1, 0, nccl_unique_id(), options);
    ZRT_CHECK(env.launcher != Launcher::kTorchrun,
              "comm.backend 'nccl' under torchrun exchanges its unique "
              "id through c10d's TCPStore: create it from Python with zerort.comm.init(backend='nccl')");
    return make_nccl_communicator_mpi(-1, options);
#else
    ZRT_THROW_AS(CommError,
                 "comm.backend 'nccl' is not in this build (nvcc was not found at configure time); "
                 "install the CUDA toolkit and nvidia-nccl-cu13 and rebuild, or use 'mpi' or 'gloo' for CPU tensors");
#endif
  }
  if (name == "gloo") {
    ZRT_THROW("comm.backend 'gloo' wraps a torch.distributed process group; create it from "
              "Python with zerort.comm.init(backend='gloo') under torchrun");
  }
  ZRT_THROW_AS(ConfigError, "unknown comm.backend '", backend, "'; use one of auto, mpi, gloo, nccl, inprocess");
}

}  // namespace zerort
