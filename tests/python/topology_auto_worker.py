"""One rank of tests/python/test_topology_auto.py: builds a stage-2 engine at comm.topology
TOPOLOGY over gloo or mpi, trains one step, and writes what comm.topology chose to
OUT_PREFIX.rankR.json. Pinned topologies make zerort.comm.probe.decide raise, so a probe
they ran would fail the job.

    topology_auto_worker.py OUT_PREFIX TOPOLOGY [PER_NODE [SHARD_SIZE INTER_NODE_DTYPE [FORCE]]]

PER_NODE: pretend the ranks form nodes of that many consecutive ranks on this one host (the
launcher's local rank and local world size are rewritten before zerort reads them); without
it the launcher's own nodes (scripts/two_hosts.sh) count. SHARD_SIZE, INTER_NODE_DTYPE: the
config's shard_size ("auto": the probe may choose node groups) and comm.inter_node_dtype;
FORCE ("node" or "world"): what shard_size auto's rule (probe.choose_node_groups) decides on
rank 0, whatever was measured. Three steps; the losses after each are written.
"""
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import zerort  # noqa: E402
from engine_models import CONFIG, batch, loss_fn, make_model  # noqa: E402
from zerort.comm import probe  # noqa: E402


def fake_nodes(per_node):
    """torchrun's or Open MPI's local rank and node size, as if nodes held per_node ranks."""
    env = zerort.comm.detect_launch_env()
    local = "LOCAL_RANK" if env["launcher"] == "torchrun" else "OMPI_COMM_WORLD_LOCAL_RANK"
    size = "LOCAL_WORLD_SIZE" if env["launcher"] == "torchrun" else "OMPI_COMM_WORLD_LOCAL_SIZE"
    os.environ[local], os.environ[size] = str(env["rank"] % per_node), str(per_node)


def refuse(*args, **kwargs):
    raise AssertionError("zerort.comm.probe.decide ran under a pinned comm.topology")


def main(out, topology, per_node=None, shard_size=None, inter_dtype="fp32", force=None):
    if per_node:
        fake_nodes(int(per_node))
    if topology != "auto":
        probe.decide = refuse
    if force and int(os.environ["RANK"]) == 0:  # rank 0 decides: the broadcast carries it to the others
        probe.choose_node_groups = lambda layout_s: force == "node"
    cfg = dict(CONFIG, stage=2, precision="bf16", comm={"topology": topology, "timeout_s": 120,
                                                         "inter_node_dtype": inter_dtype})
    if shard_size:
        cfg["shard_size"] = shard_size if shard_size in ("auto", "node") else int(shard_size)
    t0 = time.perf_counter()
    engine = zerort.initialize(make_model("mlp"), cfg)
    init_s = time.perf_counter() - t0
    comm = engine.comm
    losses = []
    for step in range(3):
        x, y = batch("mlp", step, comm.rank, 0)
        loss = loss_fn("mlp", engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    d = comm.topology_decision
    row = {"rank": comm.rank, "backend": comm.backend, "init_s": init_s,
           "choice": d and d.topology, "probe_s": d and d.probe_s, "probe_bytes": d and d.probe_bytes,
           "predicted_s": d and d.predicted_s, "line": d and d.line(), "node_groups": d and d.node_groups,
           "layout_s": d and d.layout_s, "shard_size": engine.runtime.shard_size, "losses": losses}
    with open(f"{out}.rank{comm.rank}.json", "w") as f:
        json.dump(row, f)
    print(f"TOPOLOGY WORKER OK rank {comm.rank}/{comm.size} {comm.backend}", flush=True)
    engine.destroy()


if __name__ == "__main__":
    main(*sys.argv[1:])
