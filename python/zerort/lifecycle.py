"""Everything zerort started is stopped at exit, while the interpreter is still whole.

Why: a thread that still runs when the interpreter finalizes is ended by CPython (with
pthread_exit) as soon as it asks for the GIL, and when that unwinds through a C++
destructor the process aborts with "terminate called without an active exception". A gloo
Communicator holds a reference to torch's c10d ProcessGroupGloo, so an engine still alive
at exit keeps gloo's worker threads running past dist.destroy_process_group() and into
finalization; a worker that then drops a finished collective whose tensors Python created
(torch.distributed calls, DDP, FSDP2) takes the GIL and aborts the process, after
training has finished. The Engine's own comm thread is joined the same way.

So at exit (an atexit hook, registered when zerort creates its first communicator or
engine, so it runs before the hooks registered earlier, torch's among them), close_all():
1. closes every engine still alive, newest first: its C++ half goes, and with it the comm
   thread (joined once a collective in flight has finished or timed out);
2. closes every communicator still alive: its C++ object goes, without the GIL, so a gloo
   communicator's last reference to c10d's backend lets ProcessGroupGloo join its workers
   while they can still take the GIL;
3. destroys the torch.distributed process group that zerort.comm.init created, if it
   created one and it is still there (a group the program created is the program's to
   destroy).
An engine or communicator is unusable once closed. A program may call close_all() itself.
zerort.engine.failfast's os._exit skips all of this: no destructor runs and no thread unwinds.
"""
import atexit
import gc
import sys
import weakref

_engines = []  # weak references, oldest first
_comms = []
_state = {"registered": False, "group": None}


def _track(refs, obj):
    if not _state["registered"]:
        atexit.register(close_all)
        _state["registered"] = True
    refs[:] = [r for r in refs if r() is not None]
    refs.append(weakref.ref(obj))


def track_engine(engine):
    """engine is closed at exit if it is still alive (Engine._close)."""
    _track(_engines, engine)


def engines():
    """The engines still alive, oldest first."""
    return [e for e in (r() for r in _engines) if e is not None]


def track_comm(comm):
    """comm is closed at exit if it is still alive, after every engine (Communicator._close)."""
    _track(_comms, comm)


def created_process_group(group):
    """zerort.comm.init created torch.distributed's default group `group`: destroy it at exit."""
    _state["group"] = group


def _close_each(refs, what):
    live = [r() for r in reversed(refs)]
    refs.clear()
    for obj in live:
        if obj is None:
            continue
        try:
            obj._close()
        except Exception as e:  # a close that fails must not stop the others
            sys.stderr.write(f"zerort: closing a {what} at exit failed: {type(e).__name__}: {e}\n")


def close_all():
    """Closes every live engine, then every live communicator, then the process group
    zerort created (see the module docstring). Safe to call more than once."""
    _close_each(_engines, "engine")
    gc.collect()  # anything else that only a reference cycle kept holding a communicator
    _close_each(_comms, "communicator")
    group, _state["group"] = _state["group"], None
    if group is not None:
        import torch.distributed as dist

        if dist.is_initialized() and dist.group.WORLD is group:
            dist.destroy_process_group()
