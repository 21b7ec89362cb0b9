"""Two hosts on this machine (scripts/two_hosts.sh: network namespaces joined by a veth, the link
shaped with tc to each rate of --rates, each way), examples/gpt.py's GPT at W = 2 x --per-host
ranks under torchrun and gloo: tokens/s against DDP's and the bytes that cross between the hosts
per step, one launch per runtime and rate, one table per rate.

    .venv/bin/python bench/two_hosts.py                      # 1gbit, 300mbit, 100mbit; 50M GPT; 2 ranks per host
    .venv/bin/python bench/two_hosts.py --rates 1gbit 100mbit --model tiny --steps 5 \
        --rows ddp zerort2 zerort2-auto --plot /tmp/rates.png
    .venv/bin/python bench/two_hosts.py --rate "" --model tiny --per-host 4 --rows zerort2 zerort2-two-hop

Rows: DDP, FSDP2, FSDP2 HSDP (a 2-D mesh: replicate across hosts, shard within one), zerort
stages 2 and 3 flat and two-hop (comm.topology two_hop, inter_node_dtype bf16 unless the row says
fp32: Note [two hops]), zerort with the default comm config (the -auto rows: comm.topology auto,
chosen at init by zerort.comm.probe, whose banner line is printed under the table), stage 2 with
overlap_param_gather (flat and two-hop) and with int8 between the nodes (Note [int8 blocks]),
stage 3 with int8 weight gathers (stage3.gather_dtype), and hybrid sharding at stages 2 and 3
(shard_size "node": Note [hybrid sharding]; the gradient shards summed across the hosts in bf16 or
int8; the -auto-groups rows let comm.topology auto's probe choose them, shard_size "auto"), and
stage 3 with hpZ's secondary shards (stage3.secondary_shard_size "node": Note
[secondary shards]) alone and with int8 gathers and int8 two-hop gradients (ZeRO++'s three).
The last column is the model state a rank holds after the last step, the largest rank's: for
zerort its memory report's measured total (the state, its buffers, the units held), for the torch
runtimes the parameters, gradients and optimizer state they hold (bench/e2e_worker.py). Step times
are the slowest rank's (bench/e2e_worker.py: from a step's start to the next one's, so work left in
flight counts), median and p90 over steps 2..N; ratios are against the DDP row of the same rate;
the cross-host bytes are the hosts' own kernel counters (the veth, /proc/net/dev in each
namespace), median per step. --plot draws tokens/s against the link rate, one line per row
(bench/two_hosts_plot.py); --loss-plot each rate's training loss per step. Needs root (namespaces).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import e2e
import two_hosts_plot

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TWO_HOP = {"comm": {"topology": "two_hop", "inter_node_dtype": "bf16"}}
AUTO_LINE = "zerort: comm.topology auto -> "  # rank 0's banner line for comm.topology auto (zerort.comm.probe)
FLAT = {"comm": {"topology": "flat"}}
OVERLAP = {**FLAT, "overlap_param_gather": True}
HYBRID = {"shard_size": "node", "comm": {"topology": "flat", "inter_node_dtype": "bf16"}}  # Note [hybrid sharding]
HYBRID_INT8 = {**HYBRID, "comm": {"topology": "flat", "inter_node_dtype": "int8"}}
AUTO_GROUPS = {"shard_size": "auto", "comm": {"inter_node_dtype": "bf16"}}  # zerort.comm.probe: node groups or not
INT8_GATHERS = {"gather_dtype": "int8"}  # stage 3's weight gathers as int8 blocks (Note [int8 blocks])
HPZ = {"secondary_shard_size": "node"}  # Note [secondary shards]
ROWS = {"ddp": ("DDP", "ddp", None), "fsdp2": ("FSDP2", "fsdp2", None),
        "fsdp2-hsdp": ("FSDP2 HSDP (2-D mesh)", "fsdp2-hsdp", None),
        "zerort2": ("zerort stage 2, flat", "zerort2", FLAT),
        "zerort2-two-hop": ("zerort stage 2, two-hop, bf16 between the nodes", "zerort2", TWO_HOP),
        "zerort2-overlap": ("zerort stage 2, flat, overlap_param_gather", "zerort2", OVERLAP),
        "zerort2-two-hop-overlap": ("zerort stage 2, two-hop, overlap_param_gather", "zerort2",
                                    {**TWO_HOP, "overlap_param_gather": True}),
        "zerort2-two-hop-fp32": ("zerort stage 2, two-hop, fp32 between the nodes", "zerort2",
                                 {"comm": {"topology": "two_hop", "inter_node_dtype": "fp32"}}),
        "zerort2-two-hop-int8": ("zerort stage 2, two-hop, int8 between the nodes", "zerort2",
                                 {"comm": {"topology": "two_hop", "inter_node_dtype": "int8"}}),
        "zerort2-auto": ("zerort stage 2, default comm config (topology auto)", "zerort2", None),
        "zerort3": ("zerort stage 3, flat", "zerort3", FLAT),
        "zerort3-auto": ("zerort stage 3, default comm config (topology auto)", "zerort3", None),
        "zerort3-two-hop": ("zerort stage 3, two-hop, bf16 between the nodes", "zerort3", TWO_HOP),
        "zerort3-two-hop-fp32": ("zerort stage 3, two-hop, fp32 between the nodes", "zerort3",
                                 {"comm": {"topology": "two_hop", "inter_node_dtype": "fp32"}}),
        "zerort3-int8": ("zerort stage 3, flat, int8 weight gathers", "zerort3", {**FLAT, "stage3": INT8_GATHERS}),
        "zerort3-two-hop-int8": ("zerort stage 3, two-hop, int8 between the nodes and int8 weight gathers", "zerort3",
                                 {"comm": {"topology": "two_hop", "inter_node_dtype": "int8"}, "stage3": INT8_GATHERS}),
        "zerort2-hybrid": ("zerort stage 2, hybrid (shard_size node), bf16 across", "zerort2", HYBRID),
        "zerort2-hybrid-int8": ("zerort stage 2, hybrid (shard_size node), int8 across", "zerort2",
                                HYBRID_INT8),
        "zerort3-hybrid": ("zerort stage 3, hybrid (shard_size node), bf16 across", "zerort3", HYBRID),
        "zerort3-hybrid-int8": ("zerort stage 3, hybrid (shard_size node), int8 across", "zerort3",
                                HYBRID_INT8),
        "zerort2-auto-groups": ("zerort stage 2, topology and shard_size auto, bf16 across", "zerort2", AUTO_GROUPS),
        "zerort3-auto-groups": ("zerort stage 3, topology and shard_size auto, bf16 across", "zerort3", AUTO_GROUPS),
        "zerort3-hpz": ("zerort stage 3, flat, hpZ (secondary shards of a node)", "zerort3", {**FLAT, "stage3": HPZ}),
        "zerort3-zero++": ("zerort stage 3, ZeRO++'s three: int8 gathers, hpZ, two-hop int8 gradients", "zerort3",
                           {"comm": {"topology": "two_hop", "inter_node_dtype": "int8"},
                            "stage3": {**HPZ, **INT8_GATHERS}})}


DEFAULT_RATES = ["1gbit", "300mbit", "100mbit"]


def launch(a, rate, kind, extra, out):
    """One runtime across the two hosts with the link at rate; its e2e_worker result (or {"error": ...}),
    with "auto": rank 0's comm.topology auto line where it printed one."""
    cmd = ["bash", os.path.join(ROOT, "scripts", "two_hosts.sh"), "torchrun", os.path.join(ROOT, "bench",
                                                                                           "e2e_worker.py"),
           out, "--model", a.model, "--steps", str(a.steps), "--runtimes", kind]
    if extra:
        cmd += ["--zerort-config", json.dumps(extra)]
    env = dict(os.environ, RATE=rate, PER_HOST=str(a.per_host), PY=sys.executable)
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
    if p.returncode == 77:
        sys.exit(p.stdout.strip().splitlines()[-1])
    if p.returncode != 0 or not os.path.exists(out):
        return {"error": f"exit {p.returncode}: {(p.stdout + p.stderr)[-1500:]}"}
    with open(out) as f:
        result = json.load(f)["results"][kind]
    auto = [line.split(AUTO_LINE, 1)[1] for line in p.stdout.splitlines() if AUTO_LINE in line]
    return dict(result, auto=auto[0] if auto else None)


def summary(r):
    """(median s, p90 s, tokens/s, cross-host MB per step) over the timed steps (steps 2..N; the
    only step when there is one)."""
    steps = r["step_s"][1:] or r["step_s"]
    net = r["net_tx"][1:] or r["net_tx"]
    med = statistics.median(steps)
    return med, e2e.pct(steps, 0.9), r["tokens_per_step"] / med, statistics.median(net) / 1e6


def one_row(row, rate, model, steps, per_host=2, timeout=1800):
    """(median step s, comm.topology auto's choice line or None) of one row at one rate: for
    tests/python/test_topology_auto.py. Exits with the reason where namespaces cannot be made."""
    a = argparse.Namespace(model=model, steps=steps, per_host=per_host, timeout=timeout)
    name, kind, extra = ROWS[row]
    with tempfile.TemporaryDirectory() as tmp:
        r = launch(a, rate, kind, extra, os.path.join(tmp, f"{row}.json"))
    if r.get("error"):
        raise RuntimeError(f"{name} at {rate or 'unshaped'}: {r['error']}")
    return summary(r)[0], r["auto"]


def table(a, rate, results):
    """One rate's table (markdown), ratios against that rate's DDP row, then the auto rows' choices."""
    ddp = results.get("ddp")
    base = summary(ddp)[2] if ddp and not ddp.get("error") else None
    print(f"\nlink {rate or 'unshaped'} each way; {a.model} GPT, 2 hosts x {a.per_host} ranks, {a.steps} steps")
    print("\n| runtime | step s (median) | p90 | tokens/s | vs DDP | cross-host MB/step (both hosts) | loss at step N "
          "| held-out loss | state MB/rank |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in a.rows:
        r = results[row]
        if r.get("error"):
            print(f"| {ROWS[row][0]} | failed: {r['error'][:120]} | | | | | | | |")
            continue
        med, p90, tps, mb = summary(r)
        vs = f"{tps / base:.2f}" if base else "n/a"
        state = max(r["state_bytes"]) / 2 ** 20
        print(f"| {ROWS[row][0]} | {med:.2f} | {p90:.2f} | {tps:.0f} | {vs} | {mb:.0f} | {r['losses'][-1]:.4f} "
              f"| {r['held_out_loss']:.4f} | {state:.0f} |")
    for row in a.rows:
        if results[row].get("auto"):
            print(f"\n{row}: {results[row]['auto']}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", nargs="+", default=DEFAULT_RATES,
                    help="tc's rates of the link, each way, one run of every row at each (\"\": unshaped)")
    ap.add_argument("--rate", help="one rate only (the same as --rates RATE)")
    ap.add_argument("--per-host", type=int, default=2)
    ap.add_argument("--model", default="50m")
    ap.add_argument("--steps", type=int, default=8, help="steps per run; the first is not timed")
    ap.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per launch")
    ap.add_argument("--json")
    ap.add_argument("--plot", help="a PNG of tokens/s against the link rate, one line per row")
    ap.add_argument("--loss-plot", help="a PNG per rate (RATE inserted before .png) of each row's training loss "
                                        "per step and its difference from the first row's")
    a = ap.parse_args()
    rates = [a.rate] if a.rate is not None else a.rates
    print(f"two hosts, {a.per_host} ranks each, links {', '.join(r or 'unshaped' for r in rates)} each way; "
          f"model {a.model}, {a.steps} steps; {os.cpu_count()} cores", flush=True)
    by_rate = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rate in rates:
            results = by_rate[rate] = {}
            for row in a.rows:
                name, kind, extra = ROWS[row]
                results[row] = r = launch(a, rate, kind, extra, os.path.join(tmp, f"{row}.json"))
                print(f"  {rate or 'unshaped'}: {name}: " + (f"failed: {r['error'][:300]}" if r.get("error") else
                                                             f"median {summary(r)[0]:.2f} s"), flush=True)
    for rate in rates:
        table(a, rate, by_rate[rate])
    names = {row: ROWS[row][0] for row in a.rows}
    if a.plot:
        two_hosts_plot.rates(a.plot, names, {rate: {row: None if r.get("error") else summary(r)[2]
                                                   for row, r in results.items()} for rate, results in by_rate.items()},
                             f"{a.model} GPT, 2 hosts x {a.per_host} ranks")
    if a.loss_plot:
        for rate in rates:
            path = a.loss_plot if len(rates) == 1 else a.loss_plot.replace(".png", f".{rate or 'unshaped'}.png")
            two_hosts_plot.losses(path, names, by_rate[rate],
                                  f"{a.model} GPT, 2 hosts x {a.per_host} ranks, link {rate or 'unshaped'}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rates": rates, "per_host": a.per_host, "model": a.model, "results": by_rate}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
