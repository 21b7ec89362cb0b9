"""One rank of the reliability tests (test_reliability.py), under mpirun, torchrun, or
started by the test itself with torchrun's environment variables (no launcher).

    reliability_worker.py mismatch OUT                 models that differ across ranks
    reliability_worker.py fault STAGE PHASE TIMEOUT     rank 1 raises in PHASE at step 3
    reliability_worker.py stuck STAGE TIMEOUT           rank 1 stops taking part at step 3
    reliability_worker.py nonfinite OUT                 NaN gradients in named parameters
    reliability_worker.py kill STAGE DIR TIMEOUT [RANK] checkpoint every 2 steps; rank RANK (1)
                                                        SIGKILLs itself right after the step-4 save
    reliability_worker.py verify STAGE DIR              load DIR/ckpt, compare with DIR/ref_<tag>.pt
"""
import json
import os
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import zerort  # noqa: E402
from zerort.errors import ModelMismatchError  # noqa: E402
from zerort.errors import NonFiniteError  # noqa: E402

FAULT_STEP = 3


class PoisonGrad(torch.autograd.Function):
    """Identity forward; a NaN gradient backward."""

    @staticmethod
    def forward(ctx, w):
        return w * 1

    @staticmethod
    def backward(ctx, g):
        return g * float("nan")


class PLinear(nn.Linear):
    """A Linear whose weight and/or bias can be given NaN gradients."""

    poison = ()

    def forward(self, x):
        w = PoisonGrad.apply(self.weight) if "weight" in self.poison else self.weight
        b = PoisonGrad.apply(self.bias) if "bias" in self.poison else self.bias
        return F.linear(x, w, b)


class Net(nn.Module):
    def __init__(self, variant="same"):
        super().__init__()
        torch.manual_seed(7)
        self.a = PLinear(6, 16)
        self.b = PLinear(16, 16 if variant != "shape" else 17)
        if variant == "name":
            self.d = self.b
            del self.b
        self.c = PLinear(16 if variant != "shape" else 17, 3)
        if variant == "dtype":
            self.c.bias.data = self.c.bias.data.double()
        if variant == "count":
            self.c.register_parameter("extra", nn.Parameter(torch.zeros(2)))  # one parameter more, last

    def forward(self, x):
        b = self.b if hasattr(self, "b") else self.d
        return self.c(torch.tanh(b(torch.tanh(self.a(x)))))


def data(step, rank):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def train_step(engine, step, rank, loss_factor=1.0, phase_hook=None):
    x, y = data(step, rank)
    if phase_hook:
        phase_hook("forward")
    loss = F.mse_loss(engine(x).float(), y) * loss_factor
    if phase_hook:
        phase_hook("backward")
    engine.backward(loss)
    if phase_hook:
        phase_hook("step")
    return engine.step()


def config(stage, precision="bf16", timeout=120, **extra):
    return dict({"stage": stage, "precision": precision, "optimizer": {"lr": 1e-2},
                 "reduce_bucket_numel": 200, "comm": {"timeout_s": timeout}}, **extra)


# ---- 2. the same model on every rank ------------------------------------------------------

def mismatch(out):
    comm = zerort.comm.init("auto", timeout_s=60)
    results = {}
    for variant in ("same", "shape", "name", "dtype", "count"):
        model = Net(variant if comm.rank == 1 else "same")
        try:
            zerort.initialize(model, config(2), comm=comm)
            results[variant] = "ok"
        except ModelMismatchError as e:
            results[variant] = str(e)
    with open(f"{out}.{comm.rank}.json", "w") as f:
        json.dump(results, f)
    print(f"WORKER DONE rank {comm.rank}", flush=True)


# ---- 3. one rank raises, or stops --------------------------------------------------------

def fault(stage, phase, timeout):
    engine = zerort.initialize(Net(), config(stage, timeout=timeout))
    rank = engine.rank

    def hook(where):
        if rank == 1 and step == FAULT_STEP and where == phase:
            raise RuntimeError(f"injected fault in {phase} on rank 1 at step {step}")

    for step in range(8):
        train_step(engine, step, rank, phase_hook=hook)
    print(f"WORKER FINISHED rank {rank}", flush=True)  # never reached by a correct engine


def stuck(stage, timeout):
    engine = zerort.initialize(Net(), config(stage, timeout=timeout))
    for step in range(8):
        if engine.rank == 1 and step == FAULT_STEP:
            print("rank 1 stops taking part", flush=True)
            time.sleep(600)
        train_step(engine, step, engine.rank)
    print(f"WORKER FINISHED rank {engine.rank}", flush=True)


# ---- 4. non-finite gradients ------------------------------------------------------------

POISONED = {"a": ("bias",), "c": ("weight",)}
EXPECTED = ["a.bias", "c.weight"]  # named_parameters() order: a.weight a.bias b.* c.weight c.bias


def poison(model, on):
    for name, parts in POISONED.items():
        getattr(model, name).poison = parts if on else ()


def nonfinite_case(comm, stage, precision, limit, extra, schedule):
    """schedule: per step, 'ok', 'nan' (poisoned params on rank 1) or 'nanloss' (rank 0's
    loss is NaN). Returns what happened, step by step, then the error if one was raised."""
    model = Net()
    engine = zerort.initialize(model, config(stage, precision, max_consecutive_skips=limit, **extra), comm=comm)
    record = {"steps": []}
    for step, what in enumerate(schedule):
        poison(model, what == "nan" and comm.rank == 1)
        before = engine.full_state_dict(master=True)
        scale = engine.loss_scale
        try:
            s = train_step(engine, step, comm.rank, float("nan") if what == "nanloss" and comm.rank == 0 else 1.0)
        except NonFiniteError as e:
            record["error"] = {"message": str(e), "params": e.params, "loss_scale": e.loss_scale,
                               "scale_before": scale, "step": step}
            break
        after = engine.full_state_dict(master=True)
        unchanged = all(torch.equal(before[k], after[k]) for k in before)
        record["steps"].append({"skipped": s["skipped"], "names": s.get("nonfinite_params"),
                                "unchanged": unchanged, "skipped_steps": engine.skipped_steps,
                                "scale": scale})
    return record


def nonfinite(out):
    comm = zerort.comm.init("auto", timeout_s=60)
    fp16 = {"loss_scale": {"initial_scale_power": 8, "hysteresis": 1, "min_scale": 1}}
    results = {}
    for precision in ("bf16", "fp16"):
        for stage in (1, 2, 3):
            results[f"limit:{precision}:{stage}"] = nonfinite_case(
                comm, stage, precision, 3, fp16 if precision == "fp16" else {}, ["ok", "ok"] + ["nan"] * 4)
    for stage in (1, 2, 3):  # the scale reaches its minimum before the limit
        results[f"minscale:{stage}"] = nonfinite_case(
            comm, stage, "fp16", 100, {"loss_scale": {"initial_scale_power": 2, "hysteresis": 1, "min_scale": 1}},
            ["ok", "nan", "nan", "nan", "nan"])
    results["reset"] = nonfinite_case(comm, 2, "bf16", 3, {},
                                      ["nan", "nan", "ok", "nan", "nan", "ok", "nan", "nan", "nan"])
    results["nanloss"] = nonfinite_case(comm, 0, "bf16", 3, {}, ["ok", "nanloss", "ok"])
    with open(f"{out}.{comm.rank}.json", "w") as f:
        json.dump(results, f)
    print(f"WORKER DONE rank {comm.rank}", flush=True)


# ---- 5. a rank killed after a checkpoint ---------------------------------------------------

def kill(stage, directory, timeout, victim=1):
    engine = zerort.initialize(Net(), config(stage, "fp16", timeout=timeout))
    for step in range(10):
        train_step(engine, step, engine.rank)
        if engine.global_step % 2 == 0:
            ref = engine.full_state_dict(master=True)  # gathered by collectives, not from the checkpoint
            if engine.rank == 0:
                torch.save({"master": ref, "global_step": engine.global_step, "scale": engine.loss_scale},
                           os.path.join(directory, f"ref_step{engine.global_step}.pt"))
            engine.save_checkpoint(os.path.join(directory, "ckpt"))
            if engine.global_step == 4 and engine.rank == victim:
                print(f"rank {victim} kills itself after the step-4 checkpoint", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
    print(f"WORKER FINISHED rank {engine.rank}", flush=True)


def verify(stage, directory):
    engine = zerort.initialize(Net(), config(stage, "fp16"))
    tag = os.path.basename(engine.load_checkpoint(os.path.join(directory, "ckpt"))[0])
    ref = torch.load(os.path.join(directory, f"ref_{tag}.pt"))
    got = engine.full_state_dict(master=True)
    same = got.keys() == ref["master"].keys() and all(torch.equal(got[k], ref["master"][k]) for k in got)
    assert same, "the loaded master differs from the one gathered before the save"
    assert (engine.global_step, engine.loss_scale) == (ref["global_step"], ref["scale"])
    s = train_step(engine, engine.global_step, engine.rank)  # and it trains on
    assert s["boundary"] and engine.global_step == ref["global_step"] + 1
    print(f"VERIFIED rank {engine.rank} tag {tag}", flush=True)


def main():
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "mismatch":
        mismatch(args[0])
    elif mode == "fault":
        fault(int(args[0]), args[1], float(args[2]))
    elif mode == "stuck":
        stuck(int(args[0]), float(args[1]))
    elif mode == "nonfinite":
        nonfinite(args[0])
    elif mode == "kill":
        kill(int(args[0]), args[1], float(args[2]), int(args[3]) if len(args) > 3 else 1)
    elif mode == "verify":
        verify(int(args[0]), args[1])
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
