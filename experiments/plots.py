"""PNG plots of an acceptance sweep and of a regime sweep. Optional: needs matplotlib
(`pip install -e '.[experiments]'`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from experiments import metrics
from experiments.datasets import set_label


def available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def label(row: dict, fields: tuple[str, ...]) -> str:
    names = {"block_size": "b", "temperature": "T"}
    parts = []
    for field in fields:
        value = row[field]
        if value is None:
            continue
        parts.append(f"{names[field]}={value:g}" if field in names else str(value))
    return " ".join(parts)


def write_plots(records: list[dict], rows: list[dict], out: Path) -> list[str]:
    """Write the plots into `out`; returns their file names. `rows`: metrics.summarize per configuration."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    config_fields = ("dataset", "drafter", "scheduler", "block_size", "temperature")
    drafting = [r for r in rows if r["acceptance_by_position"]]
    written = []

    def save(fig, ax, name: str) -> None:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))  # beside the axes: lines stay visible
        fig.savefig(out / name, dpi=120, bbox_inches="tight")
        plt.close(fig)
        written.append(name)

    # 1. tau by dataset and drafter (mean over prompts and over the drafter's schedulers, block sizes, temperatures).
    by_drafter = metrics.summarize(records, ("dataset", "drafter"))
    datasets = list(dict.fromkeys(r["dataset"] for r in by_drafter))
    drafters = list(dict.fromkeys(r["drafter"] for r in by_drafter))
    tau = {(r["dataset"], r["drafter"]): r["mean_tau"] for r in by_drafter}
    fig, ax = plt.subplots(figsize=(max(4, 1.5 * len(datasets) * len(drafters)), 3.5))
    width = 0.8 / len(drafters)
    for j, drafter in enumerate(drafters):
        xs = [i + (j - (len(drafters) - 1) / 2) * width for i in range(len(datasets))]
        ax.bar(xs, [tau.get((d, drafter), 0.0) for d in datasets], width, label=drafter)
    ax.set_xticks(range(len(datasets)), datasets)
    ax.set_ylabel("tau (tokens per verifier forward)")
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    save(fig, ax, "tau_by_dataset.png")

    if drafting:
        # 2. acceptance rate by block position, one line per configuration.
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in drafting:
            positions = range(1, len(r["acceptance_by_position"]) + 1)
            ax.plot(positions, r["acceptance_by_position"], marker="o", ms=3, label=label(r, config_fields))
        ax.set_xlabel("block position i")
        ax.set_ylabel("P(first i drafted tokens accepted | drafted >= i)")
        ax.set_ylim(0, 1.02)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        save(fig, ax, "acceptance_by_position.png")

        # 3. histogram of accepted lengths per drafting step, one outline per configuration.
        fig, ax = plt.subplots(figsize=(6, 4))
        for r in drafting:
            histogram = r["accepted_length_histogram"]
            fractions = [n / sum(histogram) for n in histogram]
            ax.stairs(fractions, [n - 0.5 for n in range(len(histogram) + 1)], label=label(r, config_fields))
        ax.set_xlabel("accepted tokens in a drafting step")
        ax.set_ylabel("fraction of drafting steps")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        save(fig, ax, "accepted_lengths.png")

    # 4. tau and tokens/s vs block size (a tree drafter's node budget), one line per (drafter, scheduler,
    # temperature), datasets pooled; plain model.generate's tokens/s dashed.
    line_fields = ("drafter", "scheduler", "temperature")
    by_block = [r for r in metrics.summarize(records, (*line_fields, "block_size")) if r["block_size"] is not None]
    if by_block:
        fig, (tau_ax, speed_ax) = plt.subplots(1, 2, figsize=(10, 4))
        lines: dict[str, list[dict]] = {}
        for r in by_block:
            lines.setdefault(label(r, line_fields), []).append(r)
        for name, points in lines.items():
            points.sort(key=lambda r: r["block_size"])
            sizes = [r["block_size"] for r in points]
            tau_ax.plot(sizes, [r["mean_tau"] for r in points], marker="o")
            speed_ax.plot(sizes, [r["tokens_per_s"] for r in points], marker="o", label=name)
        plain = [r["baseline_tokens_per_s"] for r in by_block if r["baseline_tokens_per_s"]]
        if plain:
            speed_ax.axhline(sum(plain) / len(plain), color="gray", lw=0.8, ls="--", label="plain model.generate")
        tau_ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        tau_ax.set_ylabel("tau (tokens per verifier forward)")
        speed_ax.set_ylabel("tokens/s")
        for ax in (tau_ax, speed_ax):
            ax.set_xlabel("block size (max_draft_len) or node budget (trees)")
            ax.set_xticks(sorted({r["block_size"] for r in by_block}))
        save(fig, speed_ax, "tau_and_speed_vs_block_size.png")
    return written


def write_regimes_plot(rows: list[dict], drafting: list[str], path: Path) -> None:
    """experiments.regimes' cells: one panel per temperature, each drafting method's tokens/s over the better of
    plain `generate` and hybrid-none against the batch size, one line per (prompt set, method); above the dashed
    line the drafts pay."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temperatures = sorted({r["temperature"] for r in rows})
    fig, axes = plt.subplots(1, len(temperatures), figsize=(4.5 * len(temperatures), 3.8), sharey=True, squeeze=False)
    for ax, t in zip(axes[0], temperatures):
        lines: dict[str, list[tuple[int, float]]] = {}
        for r in rows:
            for m in drafting:
                if r["temperature"] == t and r["over_best_baseline"].get(m) is not None:
                    name = set_label(r["dataset"]) if len(drafting) == 1 else f"{set_label(r['dataset'])} {m}"
                    lines.setdefault(name, []).append((r["batch_size"], r["over_best_baseline"][m]))
        for name, points in lines.items():
            points.sort()
            ax.plot([b for b, _ in points], [x for _, x in points], marker="o", label=name)
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        sizes = sorted({r["batch_size"] for r in rows})
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.set_xlabel("batch size")
        ax.set_title("greedy" if t == 0 else f"T = {t:g}")
    axes[0][0].set_ylabel(f"{' / '.join(drafting)} tok/s over max(plain, none)")
    handles, labels = axes[0][-1].get_legend_handles_labels()
    if handles:
        axes[0][-1].legend(handles, labels, fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
