#!/usr/bin/env bash
# mpirun with what this machine needs: --oversubscribe (more ranks than cores) and, as root,
# Open MPI's run-as-root consent. Usage: scripts/mpirun.sh -np 2 <program> [args]
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
exec mpirun --oversubscribe "$@"
