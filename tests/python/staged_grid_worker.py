"""One rank of the staged multi-node tests (tests/python/test_staged_grid.py, tests/gpu/test_staged_grid_gpu.py):
trains engine_worker cases with the ranks pretending to form nodes of PER_NODE consecutive ranks on this
one host, over the launcher's host backend, staged or not, and saves per-rank results.

    staged_grid_worker.py OUT_PREFIX STAGED PER_NODE CASE [CASE ...]
    STAGED: none (the direct mpi/gloo path), cpu (CPU buffers through the staging code) or cuda
            (the model on cuda:LOCAL_RANK % devices, every buffer staged through pinned host memory)
    CASE:   an engine_worker case, optionally prefixed "two_hop@DTYPE/": the world's communicator at
            comm.topology two_hop with comm.inter_node_dtype DTYPE (one communicator per prefix)
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import torch  # noqa: E402

import engine_worker  # noqa: E402
import zerort  # noqa: E402
from topology_auto_worker import fake_nodes  # noqa: E402

ENGINES = []  # the engine each case built, to read its communicators


def recording_initialize(initialize):
    def wrapped(*args, **kwargs):
        engine = initialize(*args, **kwargs)
        ENGINES.append(engine)
        return engine

    return wrapped


def on_cuda():
    """engine_worker's model and batches on the CUDA device that the staged communicator uses."""
    make_model, batch = engine_worker.make_model, engine_worker.batch
    engine_worker.make_model = lambda name: make_model(name).cuda()
    engine_worker.batch = lambda *args: tuple(t.cuda() for t in batch(*args))


def split(case):
    """(topology, inter-node dtype, engine_worker case)."""
    if case.startswith("two_hop@"):
        head, rest = case.split("/", 1)
        return "two_hop", head.split("@")[1], rest
    return "flat", "fp32", case


def main(out_prefix, staged, per_node, *cases):
    fake_nodes(int(per_node))
    os.environ["ENGINE_WORKER_DIR"] = os.path.dirname(os.path.abspath(out_prefix))  # int8gather's 16-bit export
    staged = None if staged == "none" else staged
    zerort.initialize = recording_initialize(zerort.initialize)
    comms, results = {}, {}
    for case in cases:
        topology, wire, run = split(case)
        if (topology, wire) not in comms:
            comms[topology, wire] = zerort.comm.init("auto", timeout_s=120, staged=staged, topology=topology,
                                                     inter_node_dtype=wire)
            if staged == "cuda" and len(comms) == 1:
                on_cuda()
        comm = comms[topology, wire]
        got = engine_worker.run_case(run, comm)
        engine = ENGINES[-1]
        got["backends"] = [comm.backend] + [c.backend if c else None for c in engine.shard_comms]
        got["master"] = {k: v.cpu() for k, v in got["master"].items()}
        got["own_master"] = got["own_master"].cpu()
        got.pop("params"), got.pop("saved16")
        results[case] = got
        engine.destroy()
        print(f"case {case} on {got['backends']}: loss {got['losses'][0]:.5f} -> {got['losses'][-1]:.5f}", flush=True)
    rank = next(iter(comms.values())).rank
    torch.save(results, f"{out_prefix}.rank{rank}.pt")
    print(f"STAGED GRID WORKER OK rank {rank} {staged or 'direct'}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
