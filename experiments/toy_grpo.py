"""The toy bandit end to end: SFT vs GRPO per context, RLVR over seeds, group-size ablation.

  python experiments/toy_grpo.py                 # writes experiments/results/toy_*
  python experiments/toy_grpo.py --seeds=0,1,2 --out=experiments/results
  python experiments/toy_grpo.py --seeds=0 --groups=2,exhaustive --steps=20 --early=10 \
      --smooth=5 --out=/tmp/toy_smoke             # a quick smoke run (not the committed table)

Every run goes through grpo_jax.trainer.train_and_evaluate with configs/toy_bandit.py, i.e.
exactly what `python -m grpo_jax.main --config=configs/toy_bandit.py:rm|rlvr` runs.
Outputs (under --out):
  toy_table.md                    SFT vs GRPO (RM, RLVR) true reward per context (seed 0),
                                  RLVR accuracy / sampled accuracy per seed, the ablation's
                                  true reward at iteration --early and at the end per group
                                  (G, and the exhaustive group of all V actions)
  toy_group_size_ablation.png     the policy's RM reward in training (reward_policy_mean,
                                  smoothed, mean ± sample std over seeds) vs iteration, per group
  toy_group_size_true_reward.png  the policy's exact true reward vs iteration, per group
  toy_summary.json                the figures above, machine-readable
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from absl import logging

from grpo_jax import config_blocks, plots, trainer
from grpo_jax.metric_writers import read_metrics
from grpo_jax.tasks import build_task
from grpo_jax.tasks.toy_bandit import ToyWorld

ROOT = Path(__file__).resolve().parents[1]


def run(arg, seed, workdir, steps=0, **overrides):
    """configs/toy_bandit.py:<arg> with the seed and dotted-key overrides, trained in workdir
    (for ``steps`` GRPO iterations; 0 = the config's)."""
    if steps:
        overrides = {"train.num_steps": steps, **overrides}
    cfg = config_blocks.load_config(
        "toy_bandit", arg, seed=seed, **{"logging.progress": False, **overrides}
    )
    _, last = trainer.train_and_evaluate(cfg, str(workdir), "train")
    return cfg, last, read_metrics(workdir)


def sft_eval(cfg):
    task = build_task(cfg, "train")
    return task.evaluate(task.init_params(jax.random.PRNGKey(cfg.seed)))[0]


def smooth(values, window):
    values = np.asarray(values, float)
    if len(values) < window:
        return values
    return np.convolve(values, np.ones(window) / window, mode="valid")


ABLATION_EVAL_EVERY = 10  # the ablation's evaluation cadence: --early must be one of its steps
EVAL_KEYS = ("eval/accuracy", "eval/sampled_accuracy", "eval/true_reward", "eval/kl_to_sft")


def parse_args(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "experiments/results"))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument(
        "--groups", default="2,4,8,16,exhaustive", help="group sizes G, and/or 'exhaustive' (V)"
    )
    ap.add_argument("--early", type=int, default=100, help="also report the true reward here")
    ap.add_argument("--smooth", type=int, default=30, help="moving-average window (iterations)")
    ap.add_argument("--steps", type=int, default=0, help="GRPO iterations (0 = the config's)")
    args = ap.parse_args(argv)
    try:
        args.seeds = [int(s) for s in args.seeds.split(",")]
        args.groups = [g if g == "exhaustive" else int(g) for g in args.groups.split(",")]
    except ValueError:
        sys.exit(
            "error: --seeds takes integers, --groups integers or 'exhaustive', comma-separated"
        )
    steps = args.steps or config_blocks.load_config("toy_bandit", "rm").train.num_steps
    # checked before any training: the ablation reads this iteration only at its very end
    if not 0 < args.early <= steps or (args.early % ABLATION_EVAL_EVERY and args.early != steps):
        sys.exit(
            f"error: --early={args.early} is not an evaluated iteration: choose a multiple of "
            f"{ABLATION_EVAL_EVERY} up to {steps}, or {steps}"
        )
    return args


def sft_vs_grpo(seeds, tmp, steps):
    """SFT against GRPO (RM reward) per context in the first seed's world; RLVR per seed."""
    s0 = seeds[0]
    cfg_rm, last_rm, _ = run("rm", s0, tmp / f"rm_s{s0}", steps)
    sft = sft_eval(cfg_rm)
    rlvr, rlvr_ctx = {}, None
    for s in seeds:
        cfg_v, last_v, _ = run("rlvr", s, tmp / f"rlvr_s{s}", steps)
        rlvr[s] = {k: last_v[k] for k in EVAL_KEYS}
        if s == s0:  # the per-context column: the RLVR run in the RM run's world
            rlvr_ctx = last_v
        print(
            f"rlvr seed {s}: accuracy {last_v['eval/accuracy']:.3f} "
            f"sampled_accuracy {last_v['eval/sampled_accuracy']:.4f}",
            flush=True,
        )
    t = cfg_rm.toy
    world = ToyWorld(s0, t.num_contexts, t.context_dim, t.vocab_size, t.pref_temperature)
    per_ctx = [
        {
            "context": c,
            "best_token": int(world.best[c]),
            "optimum": float(world.prefs[c].max()),
            **{
                name: scalars[f"eval/true_reward/ctx{c}"]
                for name, scalars in (("sft", sft), ("grpo_rm", last_rm), ("grpo_rlvr", rlvr_ctx))
            },
        }
        for c in range(t.num_contexts)
    ]
    return {
        "num_steps": cfg_rm.train.num_steps,
        "vocab_size": t.vocab_size,
        "group_size": {"rm": cfg_rm.group.size, "rlvr": cfg_v.group.size},
        "optimum": float(world.prefs.max(-1).mean()),
        "per_context": per_ctx,
        "sft": {k: v for k, v in sft.items() if "/ctx" not in k},
        "grpo_rm": {k: last_rm[k] for k in EVAL_KEYS},
        "rlvr": rlvr,
    }


def ablation_runs(g, seeds, tmp, steps):
    """One group's RM runs, one per training seed, all in the first seed's world (so the band
    is training noise only). Returns the policy's RM reward per logged iteration per seed,
    and the evaluated iterations with their exact true reward per seed."""
    # exhaustive: the group is all V actions, learning by the exact all-action gradient
    group = {"group.mode": "exhaustive"} if g == "exhaustive" else {"group.size": g}
    rewards, true = [], []
    for s in seeds:
        _, _, rows = run(
            "rm",
            s,
            tmp / f"abl_g{g}_s{s}",
            steps,
            **group,
            **{"train.log_every": 1, "train.eval_every": ABLATION_EVAL_EVERY},
            **{"toy.world_seed": seeds[0]},
        )
        # the policy's expected RM reward Σ π_old·R: for sampled groups the samples' mean,
        # for the exhaustive group (a plain mean over all actions says nothing of π) not
        rewards.append([r["reward_policy_mean"] for r in rows if "reward_policy_mean" in r])
        true.append([r["eval/true_reward"] for r in rows if "eval/true_reward" in r])
    evaluated = [r["step"] for r in rows if "eval/true_reward" in r]
    return np.array(rewards), evaluated, np.array(true)


def seed_std(x):
    """The sample standard deviation over seeds (axis 0, ddof=1), as in every other report; 0
    for a single seed."""
    x = np.asarray(x, float)
    return x.std(0, ddof=1) if len(x) > 1 else np.zeros(x.shape[1:])


def ablation(args, vocab_size, tmp):
    """The group-size ablation: curves for the two figures and the table's figures."""
    curves, true_curves, rows = {}, {}, {}
    for g in args.groups:
        rewards, evaluated, true = ablation_runs(g, args.seeds, tmp, args.steps)
        label = f"exhaustive (V={vocab_size})" if g == "exhaustive" else f"G={g}"
        sm = np.stack([smooth(r, args.smooth) for r in rewards])
        curves[label] = (np.arange(sm.shape[1]) + args.smooth, sm.mean(0), seed_std(sm))
        true_curves[label] = (evaluated, true.mean(0), seed_std(true))
        at = evaluated.index(args.early)
        rows[label] = {
            "early": [float(true[:, at].mean()), float(seed_std(true[:, at]))],
            "final": [float(true[:, -1].mean()), float(seed_std(true[:, -1]))],
        }
        m, sd = rows[label]["final"]
        print(f"{label}: final true reward {m:.4f} ± {sd:.4f}", flush=True)
    return curves, true_curves, rows


def plot(curves, true_curves, summary, out):
    s0, n = summary["seeds"][0], len(summary["seeds"])
    plots.learning_curves(
        curves,
        out / "toy_group_size_ablation.png",
        f"policy's RM reward ({summary['smooth']}-iteration average)",
        f"Toy bandit (world {s0}): group, mean ± std over {n} seeds",
    )
    plots.learning_curves(
        true_curves,
        out / "toy_group_size_true_reward.png",
        "eval/true_reward (exact)",
        f"Toy bandit (world {s0}): true reward vs group ({n} seeds)",
    )


def sft_table(summary):
    s0, g = summary["seeds"][0], summary["group_size"]
    sft, rm = summary["sft"], summary["grpo_rm"]
    rlvr0 = summary["rlvr"][str(s0)]
    lines = [
        "# Toy bandit: SFT vs GRPO",
        "",
        "Generated by `python experiments/toy_grpo.py` (configs/toy_bandit.py, "
        f"{summary['num_steps']} iterations, seed {s0}). True reward = Σ_v π(v|c)·p(c,v), "
        "exact; the optimum is max_v p(c,v).",
        "",
        f"| context | best token | optimum | SFT | GRPO (RM, G={g['rm']}) "
        f"| GRPO (RLVR, G={g['rlvr']}) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['context']} | {r['best_token']} | {r['optimum']:.4f} | {r['sft']:.4f} | "
        f"{r['grpo_rm']:.4f} | {r['grpo_rlvr']:.4f} |"
        for r in summary["per_context"]
    ]
    return lines + [
        f"| **mean** | | {summary['optimum']:.4f} | {sft['eval/true_reward']:.4f} | "
        f"{rm['eval/true_reward']:.4f} | {rlvr0['eval/true_reward']:.4f} |",
        "",
        f"SFT accuracy (greedy = best token) {sft['eval/accuracy']:.2f}, sampled accuracy "
        f"{sft['eval/sampled_accuracy']:.4f}; GRPO (RM) {rm['eval/accuracy']:.2f} / "
        f"{rm['eval/sampled_accuracy']:.4f}, KL to SFT {rm['eval/kl_to_sft']:.4f}.",
    ]


def rlvr_table(summary):
    lines = [
        "",
        f"## RLVR (binary verifiable reward, G={summary['group_size']['rlvr']}), final "
        "evaluation per seed",
        "",
        "| seed | eval/accuracy | eval/sampled_accuracy | eval/true_reward | eval/kl_to_sft |",
        "|---:|---:|---:|---:|---:|",
    ]
    for s, r in summary["rlvr"].items():
        lines.append(
            f"| {s} | {r['eval/accuracy']:.3f} | {r['eval/sampled_accuracy']:.4f} | "
            f"{r['eval/true_reward']:.4f} | {r['eval/kl_to_sft']:.4f} |"
        )
    return lines


def ablation_table(summary):
    early = summary["early"]
    lines = [
        "",
        f"## Group-size ablation (RM reward, {summary['num_steps']} iterations, world "
        f"{summary['seeds'][0]}, training seeds {', '.join(map(str, summary['seeds']))})",
        "",
        "Curves: `toy_group_size_ablation.png` (the policy's RM reward in training, "
        "`reward_policy_mean`, smoothed), "
        "`toy_group_size_true_reward.png` (exact true reward of the policy).",
        "",
        f"Optimum {summary['optimum']:.4f}. Exhaustive: every one of the "
        f"V={summary['vocab_size']} actions is forced and scored, and the step follows the "
        "exact all-action gradient Σ_a π(a)·Â(a)·∇log π(a) (`group.mode=exhaustive`, "
        "grpo_jax/single_step.py). ± is the sample standard deviation over the training seeds.",
        "",
        f"| group | eval/true_reward at iteration {early} | final eval/true_reward (mean ± std) |",
        "|---:|---:|---:|",
    ]
    return lines + [
        f"| {g} | {r['early'][0]:.4f} ± {r['early'][1]:.4f} | "
        f"{r['final'][0]:.4f} ± {r['final'][1]:.4f} |"
        for g, r in summary["ablation"].items()
    ]


def markdown(summary) -> str:
    """toy_table.md from toy_summary.json's record (after a JSON round trip: string seeds)."""
    return "\n".join(sft_table(summary) + rlvr_table(summary) + ablation_table(summary)) + "\n"


def main():
    args = parse_args()
    logging.set_verbosity(logging.WARNING)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="toy_grpo_"))
    t0 = time.time()
    summary = {"seeds": args.seeds, "group_sizes": args.groups}
    summary["early"], summary["smooth"] = args.early, args.smooth
    summary.update(sft_vs_grpo(args.seeds, tmp, args.steps))
    curves, true_curves, summary["ablation"] = ablation(args, summary["vocab_size"], tmp)
    plot(curves, true_curves, summary, out)
    summary = json.loads(json.dumps(summary))  # the table renders from what the record holds
    (out / "toy_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "toy_table.md").write_text(markdown(summary))
    print(markdown(summary), end="")
    print(f"wrote {out}/toy_* in {time.time() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
