"""One rank of the CUDA engine tests (alone or under torchrun; NCCL): trains each case on the
GPU and saves the losses, skipped steps and the gathered FP32 master for test_gpu_engine.py.

    gpu_engine_worker.py OUT [--staged] CASE [CASE ...]      CASE = model:stage:precision:gas:steps[:offload]
offload: offload_optimizer.device (none by default; cpu puts the states in host memory; cpu+params
puts stage 3's parameter shards there too, offload_param "cpu").
--staged: over mpi (under mpirun) or gloo (under torchrun) with every CUDA buffer staged
through pinned host memory, so W ranks share one GPU (NCCL refuses two ranks on a device).
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import torch  # noqa: E402

import zerort  # noqa: E402
from engine_models import CONFIG, batch, loss_fn, make_model  # noqa: E402


def run_case(case, comm):
    name, stage, precision, gas, steps, *offload = case.split(":")
    gas, steps = int(gas), int(steps)
    model = make_model(name).cuda()
    device, *more = (offload[0] if offload else "none").split("+")
    cfg = dict(CONFIG, stage=int(stage), precision=precision, gradient_accumulation_steps=gas,
               offload={"optimizer": {"device": device}, **({"param": {"device": "cpu"}} if "params" in more else {})})
    engine = zerort.initialize(model, cfg, comm=comm)
    losses = []
    for step in range(steps):
        total = 0.0
        for micro in range(gas):
            x, y = (t.cuda() for t in batch(name, step, comm.rank, micro))
            loss = loss_fn(name, engine(x), y)
            engine.backward(loss)
            engine.step()
            total += loss.item() / gas
        losses.append(total)
    master = {k: v.float().cpu() for k, v in engine.full_state_dict(master=True).items()}
    return {"losses": losses, "master": master, "skipped": engine.skipped_steps}


def main():
    out, cases = sys.argv[1], sys.argv[2:]
    if cases[:1] == ["--staged"]:
        cases = cases[1:]
        comm = zerort.comm.init("auto", timeout_s=120, staged="cuda")
        assert comm.backend.endswith("+staged-cuda") and comm.device.type == "cuda", (comm.backend, comm.device)
    else:
        comm = zerort.comm.init("nccl", timeout_s=120)
        assert comm.backend == "nccl" and comm.device.type == "cuda", (comm.backend, comm.device)
    results = {}
    for case in cases:
        print(f"case {case} ...", flush=True)
        results[case] = run_case(case, comm)
        r = results[case]
        print(f"case {case} done: loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}, {r['skipped']} skipped",
              flush=True)
    torch.save(results, f"{out}.rank{comm.rank}.pt")
    print(f"GPU ENGINE WORKER OK rank {comm.rank}/{comm.size} on {comm.device}", flush=True)


if __name__ == "__main__":
    main()
