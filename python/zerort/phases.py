"""Memory measured by the allocator, per phase of a step (public as zerort.memory.Phases).

On CPU the figures come from zerort's counting allocator (zerort._C, installed over torch's
CPU allocator on first use: only storages allocated after that are counted); on CUDA from
torch.cuda.memory_allocated / max_memory_allocated. Both count the bytes tensors asked for
(the CUDA caching allocator rounds them up to its blocks, 512 bytes or more).

    phases = zerort.memory.Phases("cpu")
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
"""
import dataclasses
import threading

import torch

from . import _C

PHASES = ("forward", "backward", "step")


def install_counting_allocator():
    """Installs zerort's counting CPU allocator, once per process (later calls do nothing).
    Raises when another CPU allocator of higher priority keeps it from being torch's."""
    if not _C.install_counting_allocator():
        raise RuntimeError("zerort's counting CPU allocator is installed but not in use: another CPU "
                           "allocator of higher priority was set with c10::SetCPUAllocator, so zerort "
                           "cannot measure CPU memory")


def _key(device):
    d = torch.device(device)
    if d.type == "cpu":
        return "cpu"
    if d.type == "cuda":
        return f"cuda:{torch.cuda.current_device() if d.index is None else d.index}"
    raise ValueError(f"memory phases are measured on 'cpu' or 'cuda' devices, not '{d}'")


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


class _Window:
    def __init__(self, start):
        self.start = self.peak = start


_lock = threading.Lock()
_open = {}  # device key -> windows open on it, in any order


def _fold(key):
    """The allocator's peak so far into every window open on the device; returns current."""
    current, peak = allocated(key)
    for w in _open.get(key, []):
        w.peak = max(w.peak, peak, current)
    return current


def _reset(key):
    if key == "cpu":
        _C.reset_allocator_peak()
    else:
        torch.cuda.reset_peak_memory_stats(key)


def reset_peak(device="cpu"):
    """Starts a new peak window on the device without losing the peak of the open phases."""
    key = _key(device)
    with _lock:
        _fold(key)
        _reset(key)


class Phases:
    """The allocator's figures per named phase on one device ("cpu", "cuda", "cuda:1")."""

    def __init__(self, device="cpu"):
        self.key = _key(device)
        self.result = {}
        self._windows = {}
        if self.key == "cpu":
            install_counting_allocator()

    def begin(self, name):
        if name in self._windows:
            raise RuntimeError(f"memory phase '{name}' is already open; end() it first")
        with _lock:
            _fold(self.key)
            _reset(self.key)
            w = _Window(allocated(self.key)[0])
            _open.setdefault(self.key, []).append(w)
        self._windows[name] = w

    def end(self, name):
        w = self._windows.pop(name, None)
        if w is None:
            raise RuntimeError(f"memory phase '{name}' is not open; begin() it first")
        with _lock:
            end = _fold(self.key)
            _open[self.key].remove(w)
        r = self.result.setdefault(name, PhaseMemory())
        r.start, r.end, r.calls = w.start, end, r.calls + 1
        r.peak = max(r.peak, w.peak)
        r.growth = max(r.growth, w.peak - w.start)
        return r

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
