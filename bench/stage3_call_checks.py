"""What stage 3's checked calls cost (Note [checked calls] in comm/communicator.h): the same
GPT, data and steps under zerort stage 3 with every collective checked across ranks first
(the default at stage 3) and without (comm.debug: false), at W = 2 under torchrun + gloo.

    .venv/bin/python bench/stage3_call_checks.py                 (about 10 minutes)
    .venv/bin/python bench/stage3_call_checks.py --model demo --steps 20 --pairs 1

The two settings alternate, launch after launch (--pairs A/B pairs), so load on the machine
falls on both alike. Each launch is one bench/e2e_worker.py run (see bench/e2e.py). The
table gives, per setting, the median and p90 of the step times over steps 3..N of all its
launches (the slowest rank's time per step) and the median's ratio to the unchecked one's,
with the loss at step N (the checks move no number: the losses are equal).
"""
import argparse
import json
import os
import statistics
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
    ap.add_argument("--pairs", type=int, default=2, help="A/B pairs of launches")
    a = ap.parse_args()
    times = {k: [] for k in SETTINGS}
    last = {}
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(a.pairs):
            for name, extra in SETTINGS.items():
                out = os.path.join(tmp, f"{pair}_{len(times[name])}.json")
                res = e2e.launch(a.model, ["zerort3"], a.steps, out, zerort_config=json.dumps(extra))["zerort3"]
                if res.get("error"):
                    sys.exit(f"{name}: {res['error']}")
                times[name] += res["step_s"][e2e.WARMUP:]
                last[name] = res
    base = statistics.median(times[next(iter(SETTINGS))])
    print(f"zerort stage 3, model {a.model} ({last[name]['numel'] / 1e6:.1f}M parameters), W=2 torchrun + gloo, "
          f"{a.pairs} launches per setting alternating, {a.steps} steps each (timed: steps {e2e.WARMUP + 1}..N)")
    print("| setting | steps timed | step ms (median) | p90 | vs unchecked | loss at step N |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, t in times.items():
        med = statistics.median(t)
        print(f"| {name} | {len(t)} | {1e3 * med:.1f} | {1e3 * e2e.pct(t, 0.9):.1f} | {med / base:.3f} "
              f"| {last[name]['losses'][-1]:.6f} |")


if __name__ == "__main__":
    main()
