"""Figures from a run's logs: learning curves and the first-char heatmap of exhaustive runs.

Every figure is a bare `matplotlib.figure.Figure`, never a pyplot one: importing this module
sets no backend (a notebook that imports the trainer keeps its inline backend, so its plot
cells show figures), and writing a PNG opens no window and leaves no figure in pyplot's
registry. The `*_figure` functions return the Figure (a notebook displays it inline); the
others write a PNG and return its path. The CLI chooses its own non-interactive backend.
"""

import json

import numpy as np
from matplotlib.figure import Figure


def char_heatmap_figure(stats_path) -> Figure | None:
    """Per first char, over training: mean return of forcing it (left) and how often it is
    the group's best (right), from an exhaustive run's char_stats.jsonl; None when empty."""
    with open(stats_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows:
        return None
    chars = rows[0]["chars"]
    labels = [repr(ch)[1:-1] for ch in chars]
    steps = [r["step"] for r in rows]
    fig = Figure(figsize=(14, 11))
    axes = fig.subplots(1, 2)
    for ax, key, title in zip(
        axes, ("reward", "best"), ("mean return", "share of groups where it is best"), strict=True
    ):
        grid = np.array([r[key] for r in rows]).T  # [V, T]
        im = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest")
        ax.set_yticks(range(len(chars)))
        ax.set_yticklabels(labels, fontsize=7, family="monospace")
        ax.set_xticks(range(len(steps)))
        ax.set_xticklabels(steps, fontsize=7, rotation=90)
        ax.set_xlabel("step")
        ax.set_title(f"first char: {title}")
        fig.colorbar(im, ax=ax, fraction=0.04)
    axes[0].set_ylabel("forced first char")
    fig.tight_layout()
    return fig


def char_heatmap(stats_path, out_path):
    """Writes `char_heatmap_figure` to `out_path`; returns the path (None when no rows)."""
    fig = char_heatmap_figure(stats_path)
    if fig is None:
        return None
    fig.savefig(out_path, dpi=110)
    return out_path


def learning_curves_figure(series: dict, ylabel: str, title: str = "") -> Figure:
    """series: {label: (steps, values) or (steps, mean, spread)}; spread drawn as a band."""
    fig = Figure(figsize=(6, 4))
    ax = fig.subplots()
    for label, s in series.items():
        steps, mean = np.asarray(s[0]), np.asarray(s[1])
        (line,) = ax.plot(steps, mean, label=label)
        if len(s) > 2:
            spread = np.asarray(s[2])
            ax.fill_between(steps, mean - spread, mean + spread, alpha=0.2, color=line.get_color())
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def learning_curves(series: dict, out_path, ylabel: str, title: str = ""):
    """Writes `learning_curves_figure` to `out_path` and returns the path."""
    learning_curves_figure(series, ylabel, title).savefig(out_path, dpi=120)
    return out_path
