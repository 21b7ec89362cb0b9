"""One rank of test_two_hosts.py's checks across two hosts (scripts/two_hosts.sh).

    two_hosts_worker.py where OUT    what the launcher told this rank about its place, as zerort
                                     reads it, beside the host it runs on; writes OUT.rankR.json
    two_hosts_worker.py bytes OUT [TOPOLOGY INTER_DTYPE]
                                     per stage 0-3, the bytes each host's kernel sent during one
                                     training step: on loopback (within the host) and on the veth
                                     (to the other host), read from /proc/net/dev; writes OUT.json
                                     (comm.topology flat by default; two_hop with the partial
                                     sums' dtype between the hops)
"""
import json
import os
import socket
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import torch  # noqa: E402

import zerort  # noqa: E402


def where(out):
    env = zerort.comm.detect_launch_env()
    comm = zerort.comm.init("auto", timeout_s=60)
    mine = torch.zeros(comm.size, dtype=torch.int64)
    mine[comm.rank] = int(socket.gethostname().rsplit("host", 1)[1])  # zt-host0 / zt-host1
    comm.all_reduce(mine)
    hosts = mine.tolist()
    with open(f"{out}.rank{comm.rank}.json", "w") as f:
        json.dump({"rank": comm.rank, "world": comm.size, "backend": comm.backend, "launcher": env["launcher"],
                   "local_rank": env["local_rank"], "local_world_size": env["local_world_size"],
                   "host": socket.gethostname(), "hosts": hosts}, f)
    print(f"WHERE rank {comm.rank}/{comm.size} local {env['local_rank']}/{env['local_world_size']} on "
          f"{socket.gethostname()}", flush=True)


def net_tx():
    """{device: bytes sent} of this process's network namespace (this host)."""
    out = {}
    with open("/proc/self/net/dev") as f:
        for line in f.readlines()[2:]:
            name, fields = line.split(":", 1)
            out[name.strip()] = int(fields.split()[8])
    return out


def step_bytes(comm, engine, x):
    """The bytes this host sent on loopback and on the veth during one step."""
    comm.barrier()
    before = net_tx()
    comm.barrier()  # nothing of the step has started on any rank
    engine.backward(engine(x).pow(2).mean())
    engine.step()
    comm.barrier()  # every rank's step is done
    after = net_tx()
    comm.barrier()
    delta = {k: after[k] - before[k] for k in after}
    veth = sum(v for k, v in delta.items() if k != "lo")
    return delta["lo"], veth


def traffic(out, topology="flat", inter_node_dtype="fp32"):
    import torch.nn as nn

    comm = zerort.comm.init("auto", timeout_s=60, topology=topology, inter_node_dtype=inter_node_dtype)
    results = {}
    for stage in range(4):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(512, 512, bias=False) for _ in range(4)])
        numel = sum(p.numel() for p in model.parameters())  # before stage 3 empties them
        engine = zerort.initialize(model, {"stage": stage, "precision": "bf16", "reduce_bucket_numel": 1 << 18,
                                           "stage3": {"prefetch": 1, "persistence_threshold": 0}}, comm=comm)
        x = torch.randn(8, 512, generator=torch.Generator().manual_seed(comm.rank))
        engine.backward(engine(x).pow(2).mean())  # a first step: anything done once is done
        engine.step()
        lo, veth = step_bytes(comm, engine, x)
        env = zerort.comm.detect_launch_env()
        per_host = torch.zeros(2, 2, dtype=torch.float64)
        if env["local_rank"] == 0:  # one reading per host
            per_host[int(socket.gethostname().rsplit("host", 1)[1])] = torch.tensor([lo, veth], dtype=torch.float64)
        comm.all_reduce(per_host)
        results[stage] = {"numel": numel, "lo": per_host[:, 0].tolist(),
                          "veth": per_host[:, 1].tolist()}
        del engine
    if comm.rank == 0:
        with open(f"{out}.json", "w") as f:
            json.dump(results, f)
    print(f"BYTES rank {comm.rank} done", flush=True)


if __name__ == "__main__":
    {"where": where, "bytes": traffic}[sys.argv[1]](*sys.argv[2:])
