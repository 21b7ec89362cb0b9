// Shared by the tests that run under mpirun: one MPI communicator per process, and a gtest
// main that prints only rank 0's report (every rank's failure still sets its exit code).
#pragma once

#include "comm/communicator.h"

namespace zerort::testing {

Communicator& mpi_comm();  // 60 s timeout, created on first use

}  // namespace zerort::testing
