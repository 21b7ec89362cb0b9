"""Runs an unchanged DeepSpeed training script on zerort.

    python -m zerort.integrations.deepspeed.launcher --num_gpus 2 train.py --deepspeed_config ds.json

It takes the `deepspeed` launcher's common flags and starts the ranks with torchrun's
machinery (torch.distributed.run), or with mpirun for `--launcher openmpi`. Each rank runs
zerort.integrations.deepspeed.run, which resolves `import deepspeed` and `import
deepspeed.X` to zerort's drop-in (zerort.integrations.deepspeed.alias) and then the script as
__main__, with `--local_rank=N` first among its arguments as DeepSpeed's launcher passes it
(unless --no_local_rank). Not one line of the script changes, and a real DeepSpeed
installation is neither imported nor touched. One line on stdout says zerort runs the job.

Ranks: --num_gpus (or --num_accelerators) per node; --include / --exclude / --hostfile
("host slots=N" lines) pick them as DeepSpeed does. On a machine without a GPU each rank
is a CPU process. Several nodes: run this launcher on each node with --num_nodes,
--node_rank, --master_addr and --master_port (torchrun's static rendezvous), or give
--launcher openmpi and a hostfile (mpirun starts every host's ranks). DeepSpeed's default
of reaching every host over pdsh/ssh is not done here: it is an error that says so.
"""
import argparse
import os
import shlex
import subprocess
import sys

from zerort.config import read_config_file
from zerort.errors import ConfigError

RUN = "zerort.integrations.deepspeed.run"
MAX_SLOTS_DIGITS = 6  # slots=N in a hostfile: processes on one host


def parser():
    p = argparse.ArgumentParser(prog="python -m zerort.integrations.deepspeed.launcher",
                                description="Runs an unchanged DeepSpeed script on zerort "
                                            "(DeepSpeed's launcher flags).")
    p.add_argument("-H", "--hostfile", default=None, help="lines 'host slots=N'")
    p.add_argument("-i", "--include", default="", help="e.g. 'localhost:0,1' or 'host1@host2:0'")
    p.add_argument("-e", "--exclude", default="")
    p.add_argument("--num_nodes", type=int, default=-1)
    p.add_argument("--min_elastic_nodes", type=int, default=-1)
    p.add_argument("--max_elastic_nodes", type=int, default=-1)
    p.add_argument("--num_gpus", "--num_accelerators", dest="num_gpus", type=int, default=-1)
    p.add_argument("--master_port", type=int, default=29500)
    p.add_argument("--master_addr", default="")
    p.add_argument("--node_rank", type=int, default=-1)
    p.add_argument("--launcher", default="torchrun", help="torchrun (zerort's default) or openmpi")
    p.add_argument("--launcher_args", default="")
    p.add_argument("--module", action="store_true", help="the script is a module name (python -m)")
    p.add_argument("--no_python", action="store_true")
    p.add_argument("--no_local_rank", action="store_true")
    p.add_argument("--no_ssh", action="store_true")
    p.add_argument("--no_ssh_check", action="store_true")
    p.add_argument("--force_multi", action="store_true")
    p.add_argument("--save_pid", action="store_true")
    p.add_argument("--enable_each_rank_log", default="None")
    p.add_argument("--autotuning", default="")
    p.add_argument("--elastic_training", action="store_true")
    p.add_argument("--bind_cores_to_rank", action="store_true")
    p.add_argument("--bind_core_list", default=None)
    p.add_argument("user_script")
    p.add_argument("user_args", nargs=argparse.REMAINDER)
    return p


def read_hostfile(path):
    """{host: slots} from DeepSpeed's hostfile format; an error names the file and line."""
    hosts = {}
    try:
        lines = read_config_file(path, "--hostfile").decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise ConfigError([f"--hostfile {path}: not UTF-8 text (byte {e.start})"]) from None
    for n, line in enumerate(lines, 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        slots = parts[1][6:] if len(parts) == 2 and parts[1].startswith("slots=") else ""
        if not (slots.isascii() and slots.isdigit() and len(slots) <= MAX_SLOTS_DIGITS):
            raise ConfigError([f"--hostfile {path}, line {n}: {line!r}; each line is 'hostname slots=N'"])
        hosts[parts[0]] = int(slots)
    if not hosts:
        raise ConfigError([f"--hostfile {path}: no hosts in it"])
    return hosts


def _filter(spec):
    """'h1:0,1@h2' -> {h1: [0, 1], h2: None (all)}."""
    out = {}
    for part in filter(None, spec.split("@")):
        host, _, slots = part.partition(":")
        out[host] = [int(s) for s in slots.split(",")] if slots else None
    return out


def plan(args, gpus_here):
    """{host: [slot, ...]}: the ranks of each node, DeepSpeed's rules for --hostfile,
    --include, --exclude, --num_nodes and --num_gpus."""
    if args.hostfile and os.path.exists(args.hostfile):
        hosts = {h: list(range(n)) for h, n in read_hostfile(args.hostfile).items()}
    elif args.hostfile and args.hostfile != "/job/hostfile":
        raise ConfigError([f"--hostfile {args.hostfile}: no such file"])
    else:
        hosts = {"localhost": list(range(args.num_gpus if args.num_gpus > 0 else max(1, gpus_here)))}
    if args.include and args.exclude:
        raise ConfigError(["--include and --exclude: give one of them (as DeepSpeed's launcher requires)"])
    if args.include:
        picked = _filter(args.include)
        unknown = [h for h in picked if h not in hosts]
        if unknown and list(hosts) == ["localhost"] and len(picked) == 1:  # --include without a hostfile
            hosts = {unknown[0]: hosts["localhost"]}
        hosts = {h: (slots if picked[h] is None else picked[h]) for h, slots in hosts.items() if h in picked}
    for h, slots in _filter(args.exclude).items():
        if h in hosts:
            hosts[h] = [] if slots is None else [s for s in hosts[h] if s not in slots]
    hosts = {h: s for h, s in hosts.items() if s}
    if args.num_nodes > 0:
        hosts = dict(list(hosts.items())[:args.num_nodes])
    if args.num_gpus > 0:
        hosts = {h: s[:args.num_gpus] for h, s in hosts.items()}
    if not hosts:
        raise ConfigError(["--include / --exclude / --hostfile leave no rank to run"])
    return hosts


def _gpus_here():
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


def command(args, hosts):
    """(argv, env) of the process that starts the ranks of this node (or of all nodes)."""
    env = dict(os.environ)
    if args.no_local_rank:
        env["ZERORT_DS_NO_LOCAL_RANK"] = "1"
    if args.module:
        env["ZERORT_DS_MODULE"] = "1"
    rank_cmd = [RUN, args.user_script] + args.user_args
    per_node = {len(s) for s in hosts.values()}
    if len(per_node) != 1:
        raise ConfigError([f"hosts with different rank counts {dict((h, len(s)) for h, s in hosts.items())}: "
                           "zerort's launcher starts the same number of ranks on every node"])
    nproc = per_node.pop()
    slots = list(hosts.values())[max(0, args.node_rank) % len(hosts)]
    if _gpus_here() and slots != list(range(len(slots))):
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(s) for s in slots)
    extra = shlex.split(args.launcher_args)
    if args.launcher == "openmpi":
        host_list = ",".join(f"{h}:{len(s)}" for h, s in hosts.items())
        mpirun = ["mpirun", "-np", str(nproc * len(hosts)), "-H", host_list] + extra
        if os.geteuid() == 0:
            mpirun.append("--allow-run-as-root")
        if args.master_addr:
            mpirun += ["-x", f"MASTER_ADDR={args.master_addr}", "-x", f"MASTER_PORT={args.master_port}"]
        for name in ("ZERORT_DS_NO_LOCAL_RANK", "ZERORT_DS_MODULE", "PYTHONPATH"):  # to the other hosts' ranks too
            if name in env:
                mpirun += ["-x", name]
        return mpirun + [sys.executable, "-u", "-m"] + rank_cmd, env
    if args.launcher != "torchrun":
        raise ConfigError([f"--launcher {args.launcher}: zerort's launcher starts ranks with torchrun (the default) "
                           "or openmpi; pdsh, slurm, mvapich, mpich and impi are not here"])
    nodes = len(hosts) if args.num_nodes <= 0 else args.num_nodes
    if nodes > 1 and args.node_rank < 0:
        raise ConfigError([f"{nodes} nodes: zerort's launcher does not reach other hosts over ssh (pdsh); run it on "
                           "each node with --num_nodes, --node_rank, --master_addr and --master_port, or pass "
                           "--launcher openmpi with a hostfile"])
    addr = args.master_addr or "127.0.0.1"
    torchrun = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--nnodes={nodes}",
                f"--node_rank={max(0, args.node_rank)}", f"--master_addr={addr}",
                f"--master_port={args.master_port}"] + extra
    if args.no_python:
        raise ConfigError(["--no_python: zerort's launcher runs the script in Python (it resolves `import "
                           "deepspeed` there); leave --no_python out"])
    return torchrun + ["-m"] + rank_cmd, env


def main(argv=None):
    args = parser().parse_args(argv)
    for flag in ("autotuning", "elastic_training"):
        if getattr(args, flag):
            raise SystemExit(f"zerort launcher: --{flag} is DeepSpeed's and zerort does not have it; leave it out")
    try:
        hosts = plan(args, _gpus_here())
        argv, env = command(args, hosts)
    except ConfigError as e:
        raise SystemExit(f"zerort launcher: {e}") from None
    world = sum(len(s) for s in hosts.values())
    if max(0, args.node_rank) == 0:
        print(f"zerort: running {args.user_script} on zerort's DeepSpeed drop-in (not DeepSpeed): W={world} ranks "
              f"on {len(hosts)} node(s), started by {args.launcher}", flush=True)
    return subprocess.call(argv, env=env)


if __name__ == "__main__":
    sys.exit(main())
