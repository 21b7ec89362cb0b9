"""Exit notices through torchrun's store (Note [goodbye messages] in comm/mpi_communicator.cpp
is mpirun's way): a rank that ends records it there, and every rank's watcher thread notes
a peer's notice in comm/peer_exits.h, so a collective that peer can never join ends at once
with a CommTimeoutError naming it instead of after comm.timeout_s.

The notice is written at interpreter exit (atexit: a normal end, sys.exit, or an uncaught
exception without zerort's failfast; failfast's os._exit writes none, and ends every rank
through the launcher instead). The watcher asks the store every POLL_S seconds (one small
round trip), less often in large jobs so that the store serves at most about 128 such
queries a second (every 8 s at 1,024 ranks), and is stopped and joined in the same atexit
hook, before the interpreter finalizes: a thread still inside the store's C++ then would
be ended by CPython mid-unwind.
"""
import atexit
import threading

from zerort import _C

POLL_S = 0.5
_COUNT = "zerort/exits"
_state = {"started": False}


def _key(rank):
    return f"zerort/exited/{rank}"


def watch(store, rank, world):
    """Starts this process's watcher and exit notice once (later calls do nothing)."""
    if _state["started"] or world < 2:
        return
    _state["started"] = True
    stop = threading.Event()
    interval = POLL_S * max(1.0, world / 64)

    def run():
        noted = set()
        while not stop.wait(interval):
            try:
                if store.add(_COUNT, 0) <= len(noted):
                    continue
                for r in range(world):
                    if r != rank and r not in noted and store.check([_key(r)]):
                        noted.add(r)
                        _C.note_peer_exit(r, "exited")
            except Exception:  # the store is gone (its host exited): nothing more to learn from it
                return

    thread = threading.Thread(target=run, name="zerort-peer-exits", daemon=True)
    thread.start()

    def at_exit():
        stop.set()
        thread.join(timeout=2 * POLL_S)
        try:
            store.set(_key(rank), "exited")
            store.add(_COUNT, 1)
        except Exception:  # the store's host is gone already: nobody is left to tell
            pass

    atexit.register(at_exit)
