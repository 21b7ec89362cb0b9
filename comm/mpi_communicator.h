// MPI backend: CPU buffers under mpirun, non-blocking MPI collectives polled to a deadline.
#pragma once

#include <memory>

#include "comm/communicator.h"

namespace zerort {

// Initialises MPI on first use (MPI_THREAD_MULTIPLE when offered) and finalises it at exit,
// unless a collective timed out with its request still pending (finalize would hang).
// Each communicator works on its own duplicate of MPI_COMM_WORLD.
std::unique_ptr<Communicator> make_mpi_communicator(CommOptions options = {});

}  // namespace zerort
