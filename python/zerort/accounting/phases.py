"""Memory measured by the allocator, per phase of a step (public as zerort.accounting.memory.Phases).

On CPU the figures come from zerort's counting allocator (zerort._C, installed over torch's
CPU allocator on first use: only storages allocated after that are counted); on CUDA from
torch.cuda.memory_allocated / max_memory_allocated. Both count the bytes tensors asked for
(the CUDA caching allocator rounds them up to its blocks, 512 bytes or more).

    phases = zerort.accounting.memory.Phases("cpu")
    with phases("forward"):
        loss = model(x).sum()
    with phases("backward"):
        loss.backward()
    phases.result["forward"].growth   # bytes the forward added at its peak

A phase can also be opened and closed from different places (module hooks) with
begin(name) / end(name). The allocator's peak is one per process and device, so every open
phase on a device shares it: opening a phase folds the peak so far into the phases already
open and then starts a new window, so nested and overlapping phases all stay exact. Reset
the peak only through reset_peak() here, never with zerort._C.reset_allocator_peak or
torch.cuda.reset_peak_memory_stats directly, or the open phases lose their peak.

EngineMemory is an engine's own record (Engine.__init__ makes it; Engine.__call__,
backward and step open its phases); engine.memory_report() reads it.

Note [one crossing per phase mark]: each time a phase opens or closes, everything it reads
from C++ (the counting allocator's current and peak bytes, its reset, and at stage 3 the
engine's gathered-units counter and its reset) comes from one zerort._C.phase_mark call,
and the allocator is installed once per process: memory accounting costs two crossings per
phase (tests/python/test_crossings.py counts them).
"""
import dataclasses
import threading

import torch

from zerort import _C
from zerort.errors import DeviceError, Error, UsageError

PHASES = ("forward", "backward", "step")


_installed = False  # install_counting_allocator() succeeded in this process


def install_counting_allocator():
    """Installs zerort's counting CPU allocator, once per process (later calls do nothing).
    Raises when another CPU allocator of higher priority keeps it from being torch's."""
    global _installed
    if _installed:
        return
    if not _C.install_counting_allocator():
        raise Error("zerort's counting CPU allocator is installed but not in use: another CPU "
                           "allocator of higher priority was set with c10::SetCPUAllocator, so zerort "
                           "cannot measure CPU memory")
    _installed = True


def _key(device):
    d = torch.device(device)
    if d.type == "cpu":
        return "cpu"
    if d.type == "cuda":
        return f"cuda:{torch.cuda.current_device() if d.index is None else d.index}"
    raise DeviceError(f"memory phases are measured on 'cpu' or 'cuda' devices, not '{d}'")


def allocated(device="cpu"):
    """(current, peak) bytes allocated on the device: live now, and the most since the last
    reset_peak(). CPU installs the counting allocator if it is not yet."""
    key = _key(device)
    if key == "cpu":
        install_counting_allocator()
        s = _C.allocator_stats()
        return s["current"], s["peak"]
    return torch.cuda.memory_allocated(key), torch.cuda.max_memory_allocated(key)


@dataclasses.dataclass
class PhaseMemory:
    """One phase's bytes: start and end are what was live when its last call began and
    ended; peak the most live during any call; growth the most any call added at its peak
    over what was live when it began (peak - start of that call)."""
    start: int = 0
    peak: int = 0
    end: int = 0
    growth: int = 0
    calls: int = 0
    last_peak: int = 0  # the peak of the last call alone


class _Window:
    def __init__(self, start):
        self.start = self.peak = start


_lock = threading.Lock()
_open = {}  # device key -> windows open on it, in any order


def _mark(key, reset, engine=None):
    """One boundary's readings (See Note [one crossing per phase mark]): (current, peak) of
    the device, and with reset a new peak window and the bytes live at its start; with
    engine (a stage-3 zerort._C.Engine) its gathered_peak and, after resetting it with reset,
    its gathered_bytes. Returns (current, peak, start, gathered_peak, gathered_bytes)."""
    cpu = key == "cpu"
    if cpu:
        install_counting_allocator()
    if cpu or engine is not None:
        marks = _C.phase_mark(reset, cpu, engine)
    if cpu:
        return marks
    current, peak = torch.cuda.memory_allocated(key), torch.cuda.max_memory_allocated(key)
    start = current
    if reset:
        torch.cuda.reset_peak_memory_stats(key)
        start = torch.cuda.memory_allocated(key)
    gathered = marks[3:] if engine is not None else (0, 0)
    return (current, peak, start) + tuple(gathered)


def _fold(key, reset, engine=None):
    """The allocator's peak so far into every window open on the device (under _lock), then
    with reset a new peak window. Returns (start, gathered_peak, gathered_bytes) of _mark."""
    current, peak, start, gathered_peak, gathered_bytes = _mark(key, reset, engine)
    for w in _open.get(key, []):
        w.peak = max(w.peak, peak, current)
    return start, gathered_peak, gathered_bytes


def reset_peak(device="cpu"):
    """Starts a new peak window on the device without losing the peak of the open phases."""
    key = _key(device)
    with _lock:
        _fold(key, True)


class Phases:
    """The allocator's figures per named phase on one device ("cpu", "cuda", "cuda:1")."""

    def __init__(self, device="cpu"):
        self.key = _key(device)
        self.result = {}
        self._windows = {}
        if self.key == "cpu":
            install_counting_allocator()

    def begin(self, name):
        self.begin_marked(name)

    def end(self, name):
        return self.end_marked(name)[0]

    def begin_marked(self, name, engine=None):
        """begin(name), reading a stage-3 engine's gathered-units counter in the same
        crossing: returns its (gathered_peak before the reset, gathered_bytes)."""
        if name in self._windows:
            raise UsageError(f"memory phase '{name}' is already open; end() it first")
        with _lock:
            start, gathered_peak, gathered_bytes = _fold(self.key, True, engine)
            w = _Window(start)
            _open.setdefault(self.key, []).append(w)
        self._windows[name] = w
        return gathered_peak, gathered_bytes

    def end_marked(self, name, engine=None):
        """end(name), with the engine's (gathered_peak, gathered_bytes) as begin_marked:
        returns (PhaseMemory, gathered_peak, gathered_bytes)."""
        w = self._windows.pop(name, None)
        if w is None:
            raise UsageError(f"memory phase '{name}' is not open; begin() it first")
        with _lock:
            end, gathered_peak, gathered_bytes = _fold(self.key, False, engine)
            _open[self.key].remove(w)
        r = self.result.setdefault(name, PhaseMemory())
        r.start, r.end, r.calls = w.start, end, r.calls + 1
        r.peak, r.last_peak = max(r.peak, w.peak), w.peak
        r.growth = max(r.growth, w.peak - w.start)
        return r, gathered_peak, gathered_bytes

    def __call__(self, name):
        return _Scope(self, name)

    def to_dict(self):
        return {name: dataclasses.asdict(r) for name, r in self.result.items()}


class _Scope:
    def __init__(self, phases, name):
        self.phases, self.name = phases, name

    def __enter__(self):
        self.phases.begin(self.name)
        return self.phases

    def __exit__(self, *exc):
        self.phases.end(self.name)
        return False


def _storage_key(t):
    """(data pointer, bytes) of t's storage; None for a tensor that holds no memory."""
    if t is None or t.is_meta:
        return None
    s = t.untyped_storage()
    return (s.data_ptr(), s.nbytes()) if s.nbytes() else None


class EngineMemory:
    """What an engine's memory looks like to the allocator: the bytes it holds (allocated by
    zerort.initialize and still live when it returns) and the peak of each phase, forward
    (Engine.__call__), backward (Engine.backward) and step (Engine.step), on the engine's
    device. At stage 3 each phase also records the engine's own counter of gathered units
    (its gathered_peak, reset at the phase's start like the allocator's peak), so the report
    can put zerort's bookkeeping beside the allocator's figure.

    Engine.__init__ makes it: begin_initialize() before the Engine allocates anything,
    end_initialize() after (held is None only for one made otherwise)."""

    def __init__(self, device, stage3=False):
        self.key = _key(device)
        self.stage3 = stage3      # the engine's gathered-units counter is read too
        self.phases = Phases(device)
        self.held = None          # bytes allocated by initialize and live when it returned
        self.other_tensors = 0    # of those, the model tensors the Engine made (see end_initialize)
        self.gathered = {}        # phase -> the most the engine's gathered units grew in one call
        self.gathered_most = {}   # phase -> the most they held at once during it
        self._depth = {}
        self._gwindows = {}  # open phase -> [gathered bytes at its start, peak so far]

    @staticmethod
    def begin_initialize(model):
        """Before the engine exists: installs the counting CPU allocator and notes what is
        allocated. Returns the token end_initialize takes.

        The engine replaces the model's FP32 parameters (and casts some buffers), and those
        may be freed while it allocates; what it holds is measured apart from them. On CPU
        the allocator's generation mark does it (bytes allocated after the mark and still
        live; freeing older memory leaves that count alone). On CUDA, torch's statistics
        have no such count, so the model's own tensors are kept alive until end_initialize
        (a model built on the meta device holds no memory, so this costs nothing)."""
        import itertools

        install_counting_allocator()
        keep, before = [], {}
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # else nothing is on CUDA yet
            if isinstance(model, torch.nn.Module):  # anything else: the Engine raises
                keep = [t.detach() for t in itertools.chain(model.parameters(), model.buffers()) if t.is_cuda]
            for i in range(torch.cuda.device_count()):
                before[f"cuda:{i}"] = torch.cuda.memory_allocated(i)
        _C.mark_allocator()
        return keep, before

    @classmethod
    def end_initialize(cls, token, engine):
        """After the engine is made: the bytes it holds, and which of them are model tensors
        it made outside its buffers (frozen parameters in the working precision and their
        FP32 copies, buffers cast to the compute dtype, counted by their storages)."""
        keep, before = token
        self = cls(engine.device, engine.config.stage == 3)
        trainable = {id(p) for p in engine.param_index.params}
        tensors = [p for p in engine.module.parameters() if id(p) not in trainable]
        tensors += list(engine.module.buffers()) + list(engine.frozen_masters.values())
        tensors = [t for t in tensors if t.device == engine.device]
        if self.key == "cpu":
            self.held = _C.allocator_since_mark()
            made = {_storage_key(t) for t in tensors if _C.allocated_since_mark(t)}
        else:
            self.held = allocated(self.key)[0] - before.get(self.key, 0)
            old = {_storage_key(t) for t in keep}  # alive, so no new storage has their address
            made = {_storage_key(t) for t in tensors} - old
        self.other_tensors = sum(k[1] for k in made if k is not None)
        return self

    def begin(self, name, impl):
        if self._depth.get(name):  # a phase inside itself (engine(x) called from a forward): the outer one counts
            self._depth[name] += 1
            return
        engine = impl if self.stage3 else None
        peak, now = self.phases.begin_marked(name, engine)
        if engine is not None:  # the engine's counter has one peak, as the allocator
            for w in self._gwindows.values():
                w[1] = max(w[1], peak)
            self._gwindows[name] = [now, now]
        self._depth[name] = 1

    def end(self, name, impl):
        self._depth[name] -= 1
        if self._depth[name]:
            return
        w = self._gwindows.pop(name, None)
        _, peak, _ = self.phases.end_marked(name, impl if w is not None else None)
        if w is not None:
            most = max(w[1], peak)
            self.gathered[name] = max(self.gathered.get(name, 0), most - w[0])
            self.gathered_most[name] = max(self.gathered_most.get(name, 0), most)

    def gathered_peak(self, impl):
        """The most the engine's gathered units held at once in training (forward, backward,
        step), by its counter; before any phase ran, since initialize. Gathers outside the
        phases (engine.gathered_parameters() for evaluation or export, which holds every
        unit) are not training memory and do not count."""
        return max(self.gathered_most.values()) if self.gathered_most else impl.gathered_peak
