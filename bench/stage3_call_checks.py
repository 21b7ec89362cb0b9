"""What stage 3's checked calls cost (Note [checked calls] in comm/communicator.h), two ways.

1. Step time: the same GPT, data and steps under zerort stage 3 with every collective
   checked across ranks first (the default at stage 3) and without (comm.debug: false), at
   W = 2 under torchrun + gloo (bench/e2e_worker.py, one launch per setting, alternating
   for --pairs pairs, so load on the machine falls on both alike). Per setting: the median
   and p90 of the step times over steps 3..N of all its launches (the slowest rank's time
   per step), the median's ratio to the unchecked one's, and the loss at step N (the
   checks move no number).
2. Counted: under torchrun (gloo) and mpirun (MPI), the collectives a checked step hands
   the backend (bench/call_check_worker.py: the data's and one probe before each), the
   probe's own round trip (a 12-value int64 all-reduce, median and p90 of 400), and their
   product: the comm thread's time in probes per step, against the step time of the same
   run. An upper bound on what the probes can add: the comm thread works beside compute.

    .venv/bin/python bench/stage3_call_checks.py                 (about 12 minutes)
    .venv/bin/python bench/stage3_call_checks.py --model demo --steps 20 --pairs 1
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import e2e  # noqa: E402

SETTINGS = {"unchecked (comm.debug: false)": {"comm": {"debug": False}},
            "checked (stage 3's default)": {}}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="50m", choices=sorted(e2e.STEPS))
    ap.add_argument("--steps", type=int, default=18, help="steps per launch (the first 2 are not timed)")
    ap.add_argument("--pairs", type=int, default=3, help="A/B pairs of launches per launcher")
    a = ap.parse_args()
    print(f"1. zerort stage 3, model {a.model}, W=2, torchrun + gloo, {a.pairs} launches per setting, alternating, "
          f"{a.steps} steps each (timed: steps {e2e.WARMUP + 1}..N)")
    print("| setting | steps timed | step ms (median) | p90 | median vs unchecked | loss at step N |")
    print("|---|---:|---:|---:|---:|---:|")
    times, last = measure(a)
    base = statistics.median(times[next(iter(SETTINGS))])
    for name, t in times.items():
        med = statistics.median(t)
        print(f"| {name} | {len(t)} | {1e3 * med:.1f} | {1e3 * e2e.pct(t, 0.9):.1f} | {med / base:.3f} "
              f"| {last[name]['losses'][-1]:.6f} |", flush=True)
    print(f"\n2. counted: model {a.model}, stage 3 (checked), W=2, 8 steps (timed: steps 3..8), 400 probes")
    print("| launcher, backend | collectives per step | probes per step | probe us (median) | p90 "
          "| probes x median per step, ms | step ms (median) | share of the step |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for launcher in ("torchrun", "mpirun"):
        r = count(a.model, launcher)
        calls, probe, step = r["calls"][-1], statistics.median(r["probe_s"]), statistics.median(r["step_s"][2:])
        print(f"| {launcher}, {r['backend']} | {calls} | {calls // 2} | {1e6 * probe:.0f} "
              f"| {1e6 * e2e.pct(r['probe_s'], 0.9):.0f} | {1e3 * probe * calls / 2:.2f} | {1e3 * step:.0f} "
              f"| {probe * calls / 2 / step:.2%} |", flush=True)


def count(model, launcher):
    """bench/call_check_worker.py's results under this launcher."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "count.json")
        cmd = (e2e.torchrun(2) if launcher == "torchrun" else e2e.mpirun(2)) + [
            os.path.join(HERE, "call_check_worker.py"), out, "--model", model]
        subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1",
                                                 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1"),
                       stdout=subprocess.DEVNULL, timeout=1800)
        with open(out) as f:
            return json.load(f)


def measure(a):
    """{setting: step times of all its launches}, {setting: its last launch's results}."""
    times, last = {k: [] for k in SETTINGS}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(a.pairs):
            for name, extra in SETTINGS.items():
                out = os.path.join(tmp, f"{pair}_{len(times[name])}.json")
                res = e2e.launch(a.model, ["zerort3"], a.steps, out, zerort_config=json.dumps(extra))["zerort3"]
                if res.get("error"):
                    sys.exit(f"{name}: {res['error']}")
                times[name] += res["step_s"][e2e.WARMUP:]
                last[name] = res
    return times, last


if __name__ == "__main__":
    main()
