"""The training monitor: one row per optimizer step, from rank 0, to CSV and TensorBoard.

    "monitor": {"csv": true, "tensorboard": true, "output_path": "runs", "job_name": "gpt"}
    (DeepSpeed's form: "csv_monitor" / "tensorboard": {"enabled", "output_path", "job_name"})

Every accumulation boundary (skipped steps included) writes: the step, the loss (the sum of
the window's backward() losses over gradient_accumulation_steps, averaged over ranks: the
window's mean loss, whether each backward() is given a micro-step's mean loss or, as
zerort.integrations.hf.Trainer does, one already divided by its own accumulation), the
lr of each param group after the update (the next update's, as DeepSpeed's monitor writes
it), the loss scale, the global gradient norm (before clipping), whether the step was
skipped, the skipped steps so far, the non-finite gradient values, tokens per second (the elements of the first
integer tensor given to engine(...) in training mode, else its first tensor's first
dimension, on every rank, over the wall time since the previous row) and each rank's memory peak over the
window as its allocator saw it (zerort.accounting.phases; torch's statistics on CUDA). With the
optimizer states on NVMe (offload_optimizer.device "nvme") three more: the MiB the state files
(and stage 3's parameter files, with offload_param "nvme") were read and written since the
previous row, summed over ranks, and the most seconds a rank waited for that I/O. The figures
of other ranks travel in one all-gather per step, made only while a monitor is on.

CSV: OUTPUT_PATH/JOB_NAME/metrics.csv, one header and one row per step, flushed at each
row; a run that finds the file (a resumed one) appends to it, when its columns are the
same. TensorBoard: event files in OUTPUT_PATH/JOB_NAME/, written with the tensorboard
package's writer (scalars under "train/"). python -m zerort.monitoring.plot
OUTPUT_PATH/JOB_NAME draws them.
"""
import csv
import os
import time

import torch
from zerort.errors import ConfigError

CSV_NAME = "metrics.csv"
EVENTS_NAME = "events.csv"  # write_events' rows: name, value, step
MIB = 1 << 20


class Monitor:
    def __init__(self, engine):
        c = engine.config
        self.rank, self.world = engine.rank, engine.world_size
        self.groups = len(engine.optimizer.param_groups)
        self.nvme = c.offload.optimizer.device == "nvme"
        self.io_last = self.io_now(engine)
        self.loss_sum, self.loss_count, self.tokens, self.peak = 0.0, 0, 0, 0
        self.started = time.perf_counter()
        self.csv = self.csv_file = self.tensorboard = None
        if self.rank != 0:
            return
        if c.monitor.csv is not None:
            os.makedirs(c.monitor.csv, exist_ok=True)
            path = os.path.join(c.monitor.csv, CSV_NAME)
            header = columns(self.groups, self.world, self.nvme)
            if os.path.exists(path) and os.path.getsize(path):  # a resumed run appends to its file
                with open(path, newline="") as f:
                    first = next(csv.reader(f), None)
                if first != header:
                    raise ConfigError(f"zerort monitor: {path} holds another run's columns ({first}); give this run "
                                     "another monitor output_path or job_name, or remove the file")
            self.csv_file = open(path, "a", newline="")
            self.csv = csv.writer(self.csv_file)
            if not self.csv_file.tell():
                self.csv.writerow(header)
            self.csv_file.flush()
        if c.monitor.tensorboard is not None:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

            self.tensorboard = SummaryWriter(log_dir=c.monitor.tensorboard)

    def forward(self, args, kwargs):
        """Counts a training forward's tokens (evaluation forwards are not training throughput)."""
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        ints = [t for t in tensors if not t.is_floating_point() and t.dim() > 0]
        if ints:
            self.tokens += ints[0].numel()
        elif tensors and tensors[0].dim() > 0:
            self.tokens += tensors[0].shape[0]

    def backward(self, loss):
        self.loss_sum += float(loss.detach().float().sum())
        self.loss_count += 1

    def phase_peak(self, peak):
        self.peak = max(self.peak, peak)

    def io_now(self, engine):
        """This rank's NVMe I/O so far, both files: [bytes read, bytes written, seconds waited] ([] in memory)."""
        if not self.nvme:
            return []
        files = (engine.runtime.state_tier_stats, engine.runtime.param_tier_stats)
        return [sum(t[k] for t in files) for k in ("bytes_read", "bytes_written", "io_wait_seconds")]

    def after_update(self, engine, s):
        """At an accumulation boundary, on every rank (the one all-gather)."""
        io = self.io_now(engine)
        figures = [self.loss_sum, self.loss_count, self.tokens, self.peak] + [a - b for a, b in zip(io, self.io_last)]
        self.io_last = io
        mine = torch.tensor(figures, dtype=torch.float64)
        n = len(figures)
        every = engine.comm.all_gather(mine, torch.empty(n * self.world, dtype=torch.float64)).view(self.world, n)
        now = time.perf_counter()
        elapsed, self.started = now - self.started, now
        self.loss_sum, self.loss_count, self.tokens, self.peak = 0.0, 0, 0, 0
        if self.rank != 0:
            return
        count, gas = float(every[:, 1].sum()), engine.config.batch.gradient_accumulation_steps
        row = {"step": engine.global_steps,
               "loss": float(every[:, 0].sum()) / (self.world * gas) if count else float("nan")}
        row.update({f"lr{k}": g["lr"] for k, g in enumerate(engine.optimizer.param_groups)})
        row.update(loss_scale=s["loss_scale"], grad_norm=s["grad_norm"], skipped=int(s["skipped"]),
                   skipped_steps=engine.skipped_steps, nonfinite=s["nonfinite"],
                   tokens_per_s=float(every[:, 2].sum()) / elapsed if elapsed > 0 else 0.0)
        row.update({f"mem_peak_rank{r}": int(every[r, 3]) for r in range(self.world)})
        if self.nvme:
            row.update(nvme_read_mib=float(every[:, 4].sum()) / MIB, nvme_written_mib=float(every[:, 5].sum()) / MIB,
                       nvme_wait_s=float(every[:, 6].max()))
        if self.csv is not None:
            self.csv.writerow([row[k] for k in columns(self.groups, self.world, self.nvme)])
            self.csv_file.flush()
        if self.tensorboard is not None:
            for k, v in row.items():
                if k != "step":
                    self.tensorboard.add_scalar(f"train/{k}", v, row["step"])
            self.tensorboard.flush()

    enabled = True

    def write_events(self, events):
        """DeepSpeed's monitor.write_events: (name, value, step) tuples of the user's own,
        from rank 0, to TensorBoard (as given) and to OUTPUT_PATH/JOB_NAME/events.csv."""
        if self.rank != 0:
            return
        if self.tensorboard is not None:
            for name, value, step in events:
                self.tensorboard.add_scalar(name, value, step)
            self.tensorboard.flush()
        if self.csv_file is not None:
            path = os.path.join(os.path.dirname(self.csv_file.name), EVENTS_NAME)
            with open(path, "a", newline="") as f:
                csv.writer(f).writerows([name, float(value), int(step)] for name, value, step in events)

    def close(self):
        if self.csv_file is not None:
            self.csv_file.close()
            self.csv_file = self.csv = None
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None


def columns(groups, world, nvme=False):
    return (["step", "loss"] + [f"lr{k}" for k in range(groups)] +
            ["loss_scale", "grad_norm", "skipped", "skipped_steps", "nonfinite", "tokens_per_s"] +
            [f"mem_peak_rank{r}" for r in range(world)] + (["nvme_read_mib", "nvme_written_mib", "nvme_wait_s"]
                                                             if nvme else []))


class _Disabled:
    """engine.monitor when the config asks for none: DeepSpeed's disabled monitor."""
    enabled = False

    def write_events(self, events):
        return None


DISABLED = _Disabled()


def make(engine):
    """The engine's monitor, or None when the config asks for none."""
    c = engine.config
    return Monitor(engine) if c.monitor.csv is not None or c.monitor.tensorboard is not None else None
