"""One rank of the Python engine tests, under mpirun or torchrun. Trains every requested
(model, stage, precision, accumulation) case and saves per-rank results for the test.

    engine_worker.py OUT_PREFIX [--staged cpu | --topology two_hop] CASE [CASE ...]
    CASE = model:stage:precision:gas:steps[:inf@STEP][:noclip][:overlap][:bucket@NUMEL][:int8gather][:shard@S]
           [:hpz@G][:wire@DTYPE]
--staged cpu: the launcher's communicator pushes every buffer through the host staging code
of the CUDA-over-mpi/gloo path (zerort.comm.init(staged='cpu')). shard@S: hybrid sharding with
shard_size S (a number or "node"); hpz@G: stage 3's secondary shards in groups of G
(stage3.secondary_shard_size); wire@DTYPE: comm.inter_node_dtype. --topology two_hop: the
reduce-scatter and all-gather in two hops, within the node and across nodes (zerort.comm.topology).
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import torch  # noqa: E402

import zerort  # noqa: E402
from engine_models import CONFIG, batch, loss_fn, make_model, model_config  # noqa: E402


def run_case(case, comm):
    parts = case.split(":")
    name, stage, precision, gas, steps = parts[0], int(parts[1]), parts[2], int(parts[3]), int(parts[4])
    flags = parts[5:]
    inject = next((int(f.split("@")[1]) for f in flags if f.startswith("inf@")), -1)
    model = make_model(name)
    cfg = dict(CONFIG, **model_config(name), stage=stage, precision=precision, gradient_accumulation_steps=gas)
    if "noclip" in flags:
        cfg["gradient_clipping"] = 0.0
    if "overlap" in flags:
        cfg["overlap_param_gather"] = True
    cfg["stage3"] = {"gather_dtype": "int8"} if "int8gather" in flags else {}
    for f in flags:
        if f.startswith("bucket@"):
            cfg["reduce_bucket_numel"] = int(f.split("@")[1])
        if f.startswith("wire@"):  # comm.inter_node_dtype: shard_size's sum across groups
            cfg["comm"] = {"inter_node_dtype": f.split("@")[1]}
        if f.startswith(("shard@", "hpz@")):
            size = f.split("@")[1]
            key = "shard_size" if f.startswith("shard@") else "secondary_shard_size"
            (cfg if key == "shard_size" else cfg["stage3"])[key] = size if size == "node" else int(size)
    world_calls = comm.backend_calls  # the world's communicator serves every case of the launch
    engine = zerort.initialize(model, cfg, comm=comm)
    losses, scales, skipped = [], [], []
    for step in range(steps):
        total = 0.0
        for micro in range(gas):
            x, y = batch(name, step, comm.rank, micro)
            loss = loss_fn(name, engine(x), y)
            if step == inject and comm.rank == 1:
                loss = loss * float("inf")  # an fp16 overflow on one rank only
            engine.backward(loss)
            engine.step()
            total += loss.item() / gas
        mean = torch.tensor([total], dtype=torch.float64)
        comm.all_reduce(mean)
        losses.append(mean.item() / comm.size)
        scales.append(engine.loss_scale)
        skipped.append(engine.stats["skipped"])
    saved = None
    if "int8gather" in flags:  # the 16-bit export: the master's values, not the int8-decoded weights
        engine.save_16bit_model(os.environ["ENGINE_WORKER_DIR"], f"int8gather_{name}.bin")
        saved = torch.load(os.path.join(os.environ["ENGINE_WORKER_DIR"], f"int8gather_{name}.bin"))
    impl = engine.runtime
    # This case's collectives on each communicator: the world, shard_size's group and replicas, hpZ's group.
    calls = [comm.backend_calls - world_calls] + [c.backend_calls if c else 0 for c in engine.shard_comms]
    return {"losses": losses, "scales": scales, "skipped": skipped, "saved16": saved, "shard_size": impl.shard_size,
            "backend_calls": calls,
            "own_master": impl.read_state("master", 0, impl.state_numel),  # this rank's shard: replicas compare it
            "master": engine.full_state_dict(master=True), "params": engine.full_state_dict(),
            "memory": engine.memory_report().to_dict()}


def run_cases(run, out_prefix, cases, label, timeout_s=120, staged=None, topology="flat"):
    """Every case through run(case, comm) on one communicator; the results saved per rank
    as OUT_PREFIX.rankR.pt, then a line saying the rank is done."""
    comm = zerort.comm.init("auto", timeout_s=timeout_s, staged=staged, topology=topology)
    results = {case: run(case, comm) for case in cases}
    torch.save(results, f"{out_prefix}.rank{comm.rank}.pt")
    print(f"{label} OK rank {comm.rank}/{comm.size} {comm.backend}", flush=True)


def main():
    cases, options = sys.argv[2:], {}
    if cases[:1] in (["--staged"], ["--topology"]):
        options[cases[0][2:]], cases = cases[1], cases[2:]
    os.environ["ENGINE_WORKER_DIR"] = os.path.dirname(os.path.abspath(sys.argv[1]))  # files the cases write
    run_cases(run_case, sys.argv[1], cases, "ENGINE WORKER", **options)


if __name__ == "__main__":
    main()
