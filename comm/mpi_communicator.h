// MPI backend: CPU buffers under mpirun, non-blocking MPI collectives polled to a deadline.
#pragma once

#include <memory>

#include "comm/communicator.h"

namespace zerort {

// Initialises MPI on first use (MPI_THREAD_MULTIPLE when offered) and finalises it at exit,
// unless a collective timed out with its request still pending (finalize would hang).
// Each communicator works on its own duplicate of MPI_COMM_WORLD; with color >= 0, on the part
// of it that MPI_Comm_split gives the ranks of that color, ordered by key (a two-hop pattern's
// intra-node and inter-node communicators: Note [two hops]). The split itself is blocking:
// the duplicate's creation, which times out, has just seen every rank arrive.
std::unique_ptr<Communicator> make_mpi_communicator(CommOptions options = {}, int color = -1, int key = 0);

}  // namespace zerort
