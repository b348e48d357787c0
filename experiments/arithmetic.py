r"""The arithmetic task end to end: warm-up, then GRPO, per seed and group mode.

For each seed: the supervised warm-up (``--mode=pretrain``) once, then GRPO from it with each
group mode (sampled G = 16, exhaustive: all V = 16 first tokens forced), every run the default
config's (``configs/arithmetic.py``: Python rewards on decoded text). Writes
``experiments/results/arithmetic.{json,md}`` and ``arithmetic_curves.png``: held-out greedy
accuracy, pass@1 and pass@8 at the warm-up's end (GRPO step 0) and after GRPO, per seed and
mean ± std; the lift over the warm-up; sampled vs exhaustive at equal steps and at equal
training wall time (each mode's eval curve read at the shorter run's total training time).

  python experiments/arithmetic.py --seeds=0,1,2 --workdir=runs/arith_exp
  python experiments/arithmetic.py --report_only      # re-render from the JSON
"""

import argparse
import ast
import json
import platform
import time
from pathlib import Path

import jax
import numpy as np

from grpo_jax import trainer
from grpo_jax.config_blocks import load_config
from grpo_jax.metric_writers import current_names, read_metrics

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
EVAL_KEYS = ("eval/accuracy", "eval/pass_at_1", "eval/pass_at_8", "eval/mean_length")


def curve(workdir: Path) -> list[dict]:
    """Eval rows with the cumulative training time: each log interval's step_time_s × its
    steps, evaluations excluded. The first interval's steps include compiling the step, so
    they are counted at the second interval's step time (the curves compare steady state)."""
    rows = read_metrics(workdir)
    timed = [r for r in rows if "step_time_s" in r]
    t, last_step, out = 0.0, 0, []
    for r in rows:
        if "step_time_s" in r:
            per_step = timed[1]["step_time_s"] if r is timed[0] and len(timed) > 1 else None
            t += (per_step or r["step_time_s"]) * (r["step"] - last_step)
            last_step = r["step"]
        if "eval/accuracy" in r:
            out.append({"step": r["step"], "train_s": round(t, 2)} | {k: r[k] for k in EVAL_KEYS})
    return out


def run(seed: int, mode: str, workdir: Path, overrides: dict) -> dict:
    config = load_config("arithmetic", mode, seed=seed, **overrides)
    warm = workdir / f"seed{seed}" / "pretrain"
    t0 = time.perf_counter()
    if not (warm / "checkpoints").exists():
        trainer.train_and_evaluate(config, str(warm), "pretrain")
        (warm / "wall_s.txt").write_text(f"{time.perf_counter() - t0:.1f}\n")
    config.init_from = str(warm)
    wd = workdir / f"seed{seed}" / mode
    t0 = time.perf_counter()
    trainer.train_and_evaluate(config, str(wd), "train")
    (wd / "wall_s.txt").write_text(f"{time.perf_counter() - t0:.1f}\n")
    return collected(seed, mode, workdir)


def collected(seed: int, mode: str, workdir: Path) -> dict:
    """One run's record from its workdir. GRPO's wall time is the run's own measurement
    (wall_s.txt), or else the span of its files (config.json written after compiling to the
    last metrics row: compile time excluded), marked as such."""
    wd = workdir / f"seed{seed}" / mode
    warm = workdir / f"seed{seed}" / "pretrain" / "wall_s.txt"
    if (wd / "wall_s.txt").exists():
        wall, source = float((wd / "wall_s.txt").read_text()), "measured"
    else:
        files = wd / "metrics.jsonl", wd / "config.json"
        wall, source = files[0].stat().st_mtime - files[1].stat().st_mtime, "file times"
    return {
        "seed": seed,
        "mode": mode,
        "warmup_wall_s": round(float(warm.read_text()), 1),
        "grpo_wall_s": round(wall, 1),
        "grpo_wall_source": source,
        "curve": curve(wd),
    }


def at_time(curve_rows, budget):
    """The last evaluation at or before ``budget`` seconds of training."""
    return [r for r in curve_rows if r["train_s"] <= budget + 1e-9][-1]


def mean_std(xs):
    """Mean ± the sample std over seeds (ddof = 1, as every other report's; it was ddof = 0)."""
    return f"{100 * np.mean(xs):.1f} ± {100 * np.std(xs, ddof=1):.1f}"


def render(res: dict) -> str:
    """arithmetic.md from the runner's record; a record from before the pass@k rename
    (arithmetic.json's curves keep eval/pass@k) reads under today's names."""
    res = current_names(res)
    runs, modes, seeds = res["runs"], res["modes"], res["seeds"]
    by = {(r["mode"], r["seed"]): r for r in runs}
    lines = [
        "# Arithmetic: GRPO with a verifiable reward",
        "",
        f"Device: {res['device']}; jax {res['jax']}; float32. Command: `{res['command']}`.",
        "Held-out: 512 problems disjoint from the 16,000 training problems; greedy accuracy is "
        "exact match of the greedy answer, pass@k the unbiased estimator from 8 samples at "
        "temperature 1. Step 0 is the warm-up's end (`pretrain.*` of the config, shared by "
        "the modes of a seed). Training time excludes evaluations and compilation.",
        "",
        "## Greedy accuracy per seed (%)",
        "",
        "| seed | mode | warm-up | after GRPO | lift | pass@1 | pass@8 | wall (warm-up + GRPO) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode in modes:
        for s in seeds:
            r = by[(mode, s)]
            c0, c1 = r["curve"][0], r["curve"][-1]
            lift = 100 * (c1["eval/accuracy"] - c0["eval/accuracy"])
            lines.append(
                f"| {s} | {mode} | {100 * c0['eval/accuracy']:.1f} | "
                f"{100 * c1['eval/accuracy']:.1f} | {lift:+.1f} | "
                f"{100 * c0['eval/pass_at_1']:.1f} → {100 * c1['eval/pass_at_1']:.1f} | "
                f"{100 * c0['eval/pass_at_8']:.1f} → {100 * c1['eval/pass_at_8']:.1f} | "
                f"{r['warmup_wall_s']:.0f} + {r['grpo_wall_s']:.0f} s |"
            )
    lines += ["", "## Mean ± sample std over seeds (%, ddof = 1)", ""]
    lines += ["| mode | warm-up | after GRPO | lift | pass@1 after | pass@8 after |"]
    lines += ["|---|---|---|---|---|---|"]
    for mode in modes:
        first = [by[(mode, s)]["curve"][0] for s in seeds]
        last = [by[(mode, s)]["curve"][-1] for s in seeds]
        acc0 = [c["eval/accuracy"] for c in first]
        acc1 = [c["eval/accuracy"] for c in last]
        lines.append(
            f"| {mode} | {mean_std(acc0)} | {mean_std(acc1)} | "
            f"{mean_std(np.subtract(acc1, acc0))} | "
            f"{mean_std([c['eval/pass_at_1'] for c in last])} | "
            f"{mean_std([c['eval/pass_at_8'] for c in last])} |"
        )
    if len(modes) > 1:
        lines += ["", "## Sampled vs exhaustive first token", ""]
        lines += ["| seed | equal steps: " + " / ".join(modes) + " | equal training time |"]
        lines += ["|---|---|---|"]
        for s in seeds:
            curves = [by[(m, s)]["curve"] for m in modes]
            budget = min(c[-1]["train_s"] for c in curves)
            steps = " / ".join(f"{100 * c[-1]['eval/accuracy']:.1f}" for c in curves)
            reached = [at_time(c, budget) for c in curves]
            timed = " / ".join(
                f"{100 * r['eval/accuracy']:.1f} (step {r['step']})" for r in reached
            )
            lines.append(f"| {s} | {steps} | {timed} at {budget:.0f} s |")
    lines += ["", res.get("note", ""), ""]
    return "\n".join(lines)


def plot(res: dict, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for r in res["runs"]:
        c = r["curve"]
        acc = [100 * x["eval/accuracy"] for x in c]
        style = "-" if r["mode"] == "sampled" else "--"
        label = f"{r['mode']} s{r['seed']}"
        axes[0].plot([x["step"] for x in c], acc, style, label=label)
        axes[1].plot([x["train_s"] for x in c], acc, style, label=label)
    for ax, xl in zip(axes, ("GRPO step", "training time (s)"), strict=True):
        ax.set_xlabel(xl)
        ax.set_ylabel("held-out greedy accuracy (%)")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--modes", default="sampled,exhaustive")
    ap.add_argument("--workdir", default="runs/arith_exp")
    ap.add_argument("--name", default="arithmetic")
    ap.add_argument("--note", default="")
    ap.add_argument("--report_only", action="store_true")
    ap.add_argument("--collect", action="store_true", help="build the JSON from the workdirs")
    ap.add_argument("overrides", nargs="*", help="config overrides key=value (Python literals)")
    args = ap.parse_args()
    out = RESULTS / f"{args.name}.json"
    if args.report_only:
        res = current_names(json.loads(out.read_text()))  # eval/pass@k in old files
    else:
        # config overrides as Python literals (numbers, booleans, strings in quotes)
        overrides = {k: ast.literal_eval(v) for k, v in (o.split("=", 1) for o in args.overrides)}
        overrides.setdefault("logging.progress", False)
        seeds = [int(s) for s in args.seeds.split(",")]
        modes = args.modes.split(",")
        wd = Path(args.workdir)
        if args.collect:  # the runs are in the workdirs already (e.g. an interrupted sweep)
            runs = [collected(s, m, wd) for s in seeds for m in modes]
        else:
            runs = [run(s, m, wd, overrides) for s in seeds for m in modes]
        res = {
            "device": f"{jax.devices()[0].device_kind} ({platform.processor() or 'cpu'})",
            "jax": jax.__version__,
            "command": "python experiments/arithmetic.py "
            + " ".join([f"--seeds={args.seeds}", f"--modes={args.modes}", *args.overrides]),
            "seeds": seeds,
            "modes": modes,
            "runs": runs,
            "note": args.note,
        }
        out.write_text(json.dumps(res, indent=1) + "\n")
    (RESULTS / f"{args.name}.md").write_text(render(res))
    plot(res, RESULTS / f"{args.name}_curves.png")
    print(render(res))


if __name__ == "__main__":
    main()
