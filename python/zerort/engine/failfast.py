"""One rank's uncaught exception ends the whole job, instead of leaving its peers waiting.

Once an engine runs on more than one rank, an uncaught exception on any rank prints its
traceback with the rank, then ends the process at once with exit status 1, skipping
interpreter shutdown. Shutdown would otherwise run MPI_Finalize (which in Open MPI waits
for every peer, and the peers are waiting in a collective for this rank) or c10d's
teardown. mpirun and torchrun both end the remaining ranks when one exits non-zero; a
peer that is not ended by a launcher fails its next collective within comm.timeout_s
(CommTimeoutError naming the collective and its rank), which comes here in turn.
"""
import os
import sys

_installed = {"rank": None}


def _hook(previous):
    def hook(kind, value, tb):
        try:
            previous(kind, value, tb)
            rank, world = _installed["rank"]
            sys.stderr.write(f"zerort: rank {rank} of {world}: uncaught {kind.__name__}; ending this "
                             "process with exit status 1 so the launcher stops the other ranks "
                             "(a rank left waiting fails its collective within comm.timeout_s)\n")
            sys.stderr.flush()
            sys.stdout.flush()
        finally:
            os._exit(1)
    return hook


def install(rank, world):
    """Installs the hook (once per process) when world > 1. KeyboardInterrupt included: a
    rank stopped by Ctrl-C is as gone to its peers as one that crashed."""
    if world <= 1:
        return
    if _installed["rank"] is None:
        sys.excepthook = _hook(sys.excepthook)
    _installed["rank"] = (rank, world)
