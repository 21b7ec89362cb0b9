"""What DeepSpeed prints during training, on rank 0: config steps_per_print and
wall_clock_breakdown.

    [Rank 0] step=10, skipped=0, lr=[0.0003, 0.0003], mom=[(0.9, 0.999), (0.9, 0.999)]
    time (ms) | fwd_microstep: 3.10 | bwd_microstep: 7.92 | bwd_inner_microstep: 6.01 | bwd_allreduce_microstep: 1.91 | step_microstep: 2.40
    time (ms) | fwd: 6.20 | bwd: 15.84 | bwd_inner: 12.02 | bwd_allreduce: 3.82 | step: 2.40

The progress line comes every steps_per_print updates (skipped ones included), as
DeepSpeed's _report_progress. With wall_clock_breakdown, a micro line follows every
step() and a window line (the sums over the accumulation window) every update. zerort's
timings: fwd is engine(...), bwd_inner the autograd pass in engine.backward(),
bwd_allreduce the wait in step() for the gradient reduces that backward started on the
comm thread, step the rest of step() (the decision, AdamW and the parameter gathers), and
bwd is bwd_inner + bwd_allreduce.
"""  # noqa: E501
# (E501 above: the sample micro line is one line of the real output, longer than 120 chars.)
import time

from zerort.config.offload import describe

MICRO = ("fwd", "bwd", "bwd_inner", "bwd_allreduce", "step")


def announce(engine, launch_env):
    """The one line rank 0 prints when an engine is made: what runs where."""
    if engine.rank != 0:
        return
    c, w = engine.config, engine.world_size
    per_node = max(1, launch_env["local_world_size"]) if launch_env["launcher"] != "none" else w
    shape = f"{w // per_node} node(s) x {per_node} ranks" if w % per_node == 0 else "nodes of unequal size"
    s = engine.runtime.shard_size
    sharding = "flat collectives" if s == w else f"state sharded in {w // s} groups of {s} ranks (shard_size)"
    print(f"zerort: ZeRO stage {c.stage}, {c.precision}, W={w} ({shape}, {sharding}), backend "
          f"{engine.comm.backend} on {engine.device}, {describe(c, engine.device)}{nvme_io(engine)}", flush=True)
    if engine.comm.topology_decision is not None:  # comm.topology auto measured (zerort.comm.probe)
        print(f"zerort: {engine.comm.topology_decision.line()}", flush=True)
    for line in c.ignored:  # DeepSpeed keys DeepSpeed ignores too: zerort.config.lenient
        print(f"zerort: ignored {line}", flush=True)


def nvme_io(engine):
    """', NVMe I/O through <backend> (why)' when a tier is on NVMe (C++ Note [IoQueue backends]), else ''."""
    files = [s for s in (engine.runtime.state_tier_stats, engine.runtime.param_tier_stats) if s["io_backend"]]
    if not files:
        return ""
    why = files[0]["io_backend_why"]
    return f", NVMe I/O through {files[0]['io_backend']}" + (f" ({why})" if why else "")


class Progress:
    def __init__(self, engine):  # keeps no reference to the engine, which owns it
        self.every = engine.config.monitor.steps_per_print
        self.clock = engine.config.monitor.wall_clock_breakdown
        self.rank = engine.rank
        self.window = dict.fromkeys(MICRO, 0.0)
        self.step_started = None

    def before_step(self):
        self.step_started = time.perf_counter()

    def after_step(self, s, engine):
        if self.rank != 0:
            return
        if self.clock:
            wall = 1e3 * (time.perf_counter() - self.step_started)
            inner, reduce = 1e3 * getattr(engine, '_t_backward', 0.0), s.get("reduce_ms", 0.0)
            micro = {"fwd": 1e3 * getattr(engine, '_t_forward', 0.0), "bwd": inner + reduce, "bwd_inner": inner,
                     "bwd_allreduce": reduce, "step": max(0.0, wall - reduce)}
            print("time (ms) | " + " | ".join(f"{k}_microstep: {micro[k]:.2f}" for k in MICRO), flush=True)
            for k in MICRO:
                self.window[k] += micro[k]
            if s["boundary"]:
                print("time (ms) | " + " | ".join(f"{k}: {self.window[k]:.2f}" for k in MICRO), flush=True)
                self.window = dict.fromkeys(MICRO, 0.0)
        if s["boundary"] and self.every and engine.global_steps % self.every == 0:
            moms = [tuple(g["betas"]) for g in engine.optimizer.param_groups]
            print(f"[Rank 0] step={engine.global_steps}, skipped={engine.skipped_steps}, lr={engine.get_lr()}, "
                  f"mom={moms}", flush=True)


class ThroughputTimer:
    """engine.tput_timer, DeepSpeed's: samples per second over the updates after the first
    `start_step` (the warm-up ones are left out), timed from the first training forward of
    a window to the step() that ends it."""

    def __init__(self, start_step=2):
        self.start_step = start_step
        self.updates = 0
        self.epoch_count = 0
        self.samples = 0
        self.elapsed = 0.0
        self.started = None

    def start(self):
        if self.started is None:
            self.started = time.perf_counter()

    def stop(self, global_step=False, samples=0, report_speed=False):
        if not global_step or self.started is None:
            return
        self.updates += 1
        if self.updates > self.start_step:
            self.elapsed += time.perf_counter() - self.started
            self.samples += samples
        self.started = None

    def update_epoch_count(self):
        """DeepSpeed's: the training loop says an epoch ended."""
        self.epoch_count += 1

    def avg_samples_per_sec(self):
        """Samples per second over the timed updates (0 before any; the global batch needs
        train_micro_batch_size_per_gpu in the config)."""
        return self.samples / self.elapsed if self.elapsed > 0 else 0.0
