"""Figures from a run's logs (matplotlib, headless): learning curves and the first-char
heatmap of exhaustive runs."""

import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np


def char_heatmap(stats_path, out_path, key="reward"):
    """Per-first-char mean return (or best-count share) over training, from char_stats.jsonl."""
    rows = [json.loads(line) for line in open(stats_path) if line.strip()]
    if not rows:
        return None
    chars = rows[0]["chars"]
    grid = np.array([r[key] for r in rows])  # [T, V]
    fig, ax = plt.subplots(figsize=(12, 4))
    im = ax.imshow(grid.T, aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_yticks(range(len(chars)))
    ax.set_yticklabels([repr(ch)[1:-1] for ch in chars], fontsize=5)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r["step"] for r in rows], fontsize=6, rotation=90)
    ax.set_xlabel("step")
    ax.set_ylabel("first char")
    ax.set_title(f"exhaustive group: per-first-char {key}")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
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
