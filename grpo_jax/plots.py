"""Figures from a run's logs (matplotlib, headless): learning curves and the first-char
heatmap of exhaustive runs."""

import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np


def char_heatmap(stats_path, out_path):
    """Per first char, over training: mean return of forcing it (left) and how often it is
    the group's best (right), from an exhaustive run's char_stats.jsonl."""
    rows = [json.loads(line) for line in open(stats_path) if line.strip()]
    if not rows:
        return None
    chars = rows[0]["chars"]
    labels = [repr(ch)[1:-1] for ch in chars]
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(14, 11))
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
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path


def learning_curves(series: dict, out_path, ylabel: str, title: str = ""):
    """series: {label: (steps, values) or (steps, mean, spread)}; spread drawn as a band."""
    fig, ax = plt.subplots(figsize=(6, 4))
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
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
    return out_path
