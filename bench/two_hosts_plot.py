"""bench/two_hosts.py's figures (matplotlib, Agg): tokens/s against the link rate, one line per
row, on a log x-axis (--plot); and one rate's training loss per step of each row with its
difference from the first row's (--loss-plot)."""
import re

UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def bits_per_s(rate):
    """tc's rate ("1gbit", "300mbit", "12.5mbps") in bit/s; None for the unshaped link ("")."""
    if not rate:
        return None
    m = re.fullmatch(r"([0-9.]+)\s*([kmgt]?)(bit|bps)", rate.strip().lower())
    if m is None:
        raise ValueError(f"--rates: {rate!r} is not a tc rate such as 1gbit, 300mbit or 12mbps")
    return float(m.group(1)) * UNITS[m.group(2)] * (8 if m.group(3) == "bps" else 1)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def rates(path, names, tokens, title):
    """tokens: {rate: {row: tokens/s or None (failed)}}; names: {row: label}, in the table's
    order. The unshaped link has no place on the axis and is left out, as are failed runs."""
    plt = _pyplot()
    shaped = sorted((bits_per_s(r), r) for r in tokens if bits_per_s(r))
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for row, label in names.items():
        points = [(bps / 1e6, tokens[r][row]) for bps, r in shaped if tokens[r].get(row)]
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", lw=1.2, label=label)
    ax.set_xscale("log")
    ax.set_xticks([bps / 1e6 for bps, _ in shaped], [r for _, r in shaped])
    ax.minorticks_off()
    ax.set_xlabel("link rate between the hosts, each way")
    ax.set_ylabel("tokens/s (median step)")
    ax.set_title(title)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def losses(path, names, results, title):
    """Top: the training loss per step of each row that ran; bottom: each row's minus the first's."""
    plt = _pyplot()
    ok = [row for row in names if not results[row].get("error")]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    first = results[ok[0]]["losses"] if ok else []
    for row in ok:
        curve = results[row]["losses"]
        steps = range(1, len(curve) + 1)
        top.plot(steps, curve, label=names[row], lw=1)
        bottom.plot(steps, [x - y for x, y in zip(curve, first)], label=names[row], lw=1)
    top.set_title(f"{title}; same data and seed")
    top.set_ylabel("training loss (mean over ranks)")
    bottom.set_ylabel(f"minus {names[ok[0]] if ok else ''}")
    bottom.set_xlabel("step")
    top.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")
