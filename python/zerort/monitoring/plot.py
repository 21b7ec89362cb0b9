"""Draws a monitored run: the loss curve, with the loss scale and the gradient norm beneath
it, skipped steps marked on all three.

    python -m zerort.monitoring.plot RUN_DIR [--out PNG]

RUN_DIR holds the monitor's metrics.csv (zerort.monitoring.monitor); the PNG goes to
RUN_DIR/metrics.png unless --out says otherwise.
"""
import argparse
import csv
import math
import os

from zerort.monitoring.monitor import CSV_NAME


def read(run_dir):
    """metrics.csv as columns of floats."""
    path = os.path.join(run_dir, CSV_NAME)
    if not os.path.isfile(path):
        raise SystemExit(f"zerort.monitoring.plot: {path} is missing; RUN_DIR is the monitor's "
                         "output_path/job_name folder (config monitor: {\"csv\": true})")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise SystemExit(f"zerort.monitoring.plot: {path} has no steps yet")
    return {k: [float(r[k]) for r in rows] for k in rows[0]}


def plot(run_dir, out=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m = read(run_dir)
    out = out or os.path.join(run_dir, "metrics.png")
    steps = m["step"]
    skipped = [s for s, k in zip(steps, m["skipped"]) if k]
    fig, axes = plt.subplots(3, 1, sharex=True, figsize=(8, 7), gridspec_kw={"height_ratios": [3, 1, 1]})
    for ax, key, label in zip(axes, ("loss", "loss_scale", "grad_norm"), ("loss", "loss scale", "grad norm")):
        ax.plot(steps, m[key], lw=1.2)
        ax.set_ylabel(label)
        for s in skipped:
            ax.axvline(s, color="tab:red", alpha=0.4, lw=1)
    if all(v > 0 and math.isfinite(v) for v in m["loss_scale"]):
        axes[1].set_yscale("log", base=2)
    axes[0].set_title(f"{os.path.basename(os.path.abspath(run_dir))}: {len(steps)} steps, "
                      f"{len(skipped)} skipped (red)")
    axes[-1].set_xlabel("optimizer step")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main():
    ap = argparse.ArgumentParser(prog="python -m zerort.monitoring.plot", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    print(plot(a.run_dir, a.out))


if __name__ == "__main__":
    main()
