"""The memory estimate's plot (python -m zerort.accounting.memory --plot FILE.png)."""


def plot(results, path, categories):
    """A stacked bar per stage of the model-state bytes per rank, per category, to path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5))
    stages = [r["stage"] for r in results]
    bottom = [0.0] * len(results)
    for k, label in categories:
        vals = [r["exact"][k] / 1e9 for r in results]
        if any(vals):
            ax.bar([f"stage {s}" for s in stages], vals, bottom=bottom, label=label)
            bottom = [b + v for b, v in zip(bottom, vals)]
    r0 = results[0]
    ax.set_ylabel("GB per rank (model states)")
    ax.set_title(f"zerort model-state memory per rank: {r0['numel'] / 1e9:.2f}B parameters, "
                 f"W={r0['world_size']}, {r0['precision']}")
    ax.legend(bbox_to_anchor=(1.02, 1), loc="upper left")
    fig.tight_layout()
    fig.savefig(path)
