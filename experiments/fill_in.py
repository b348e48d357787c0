r"""Fill-in with a judge, end to end: supervised generator -> judge -> GRPO (several seeds).

  GRPO_JAX_DATA=../shared/data/tinyshakespeare.txt python experiments/fill_in.py --baseline
  python experiments/fill_in.py --root=/tmp/fillin_exp --seeds=0,1,2 --baseline
  python experiments/fill_in.py --root=/tmp/fillin_exp --report_only   # tables from workdirs

Runs, with the committed defaults of configs/fill_in.py (each through the CLI, so the commands
in the report are the ones that ran; a stage whose workdir already holds its last step is not
rerun, so a stopped script resumes and --report_only only reads):
  1. --mode=pretrain                       ROOT/gen     the supervised generator
  2. --mode=train_judge (negatives_from=gen) ROOT/judge  the judge
  3. GRPO from gen against judge, one run per seed       ROOT/grpo_s{seed}
  --baseline adds one GRPO run (seed 0) with the previous GRPO defaults (BASELINE_GRPO)
  against the same judge (ROOT/grpo_base).
Then fill_in.single_char_optimum: the exact per-window optimum of the GRPO objective on
held-out single-char spans (what a perfect optimiser of the same judge would reach).

The step-0 row of every GRPO table is the supervised generator evaluated by the same
held-out code (eval.seed fixes the spans, so every seed sees the same windows). Writes
experiments/results/fill_in.md, fill_in.json and fill_in_curves.png; the ablation table is
read from experiments/results/fill_in_ablation.json (separate runs, described there).
"""

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/fill_in.py"
EVAL_KEYS = (
    "eval/judge_reward",
    "eval/fill_accuracy",
    "eval/sampled_fill_accuracy",
    "eval/pass@1",
    "eval/pass@4",
)
BASELINE_GRPO = [  # the GRPO defaults before this tuning (the judge is the same)
    "--config.group.temperature=1.0",
    "--config.grpo.beta=1.0",
    "--config.train.batch_size=16",
    "--config.group.size=16",
    "--config.optim.learning_rate=0.0001",
    "--config.train.num_steps=600",
    "--config.train.eval_every=100",
]
WHY = """Why: a judge trained against the generator's own samples estimates
logit ≈ log p_data(fill) / π_ref(fill) + const, and the KL-regularised optimum of
E_π[r] − β KL(π‖π_ref) is π ∝ π_ref · exp(r/β). The policy and its KL are those of the
tempered generator softmax(z/T), so in the generator's own logits the optimum is
z = z_ref + (T/β)·r: T = β = 0.5 aims at the same greedy fill as T = β = 1
(π ∝ π_ref · exp(logit), the judge-corrected generator) while the group's samples fall on
the few plausible chars whose order decides that fill."""
READING = """* Reading: the judge carries the information (its exact optimum raises greedy
accuracy), and GRPO raises the train reward, the judge reward, sampled accuracy and pass@k,
but in a CPU-sized run it learns only part of that optimum's per-window correction. Greedy
accuracy is decided by near-ties of the top two chars; in the ablation runs the change GRPO
makes to the top-1 minus top-2 margin correlates {corr} with the optimum's at {slope} of its
size (`top2_margin` in the ablation file), so it flips about as many right argmaxes away as
wrong ones right. Supervised distillation of the exact single-char optimum into the
generator (not GRPO; rows `distill_*`) did no better on 2-3-char spans."""


def read_metrics(workdir: Path):
    path = workdir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_config(flags=()):
    """configs/fill_in.py with --config.KEY=VALUE flags applied (typed like the default)."""
    sys.path.insert(0, str(ROOT))
    from grpo_jax.config_blocks import load_config as load

    cfg = load(str(ROOT / CONFIG))
    for flag in flags:
        key, value = flag.removeprefix("--config.").split("=", 1)
        parent, leaf = key.rsplit(".", 1) if "." in key else ("", key)
        old = (cfg[parent] if parent else cfg)[leaf]
        cfg.update_from_flattened_dict({key: type(old)(value) if old is not None else value})
    return cfg


def run_stage(name, workdir, mode, flags, num_steps, args, times):
    cmd = [sys.executable, "-m", "grpo_jax.main", f"--config={CONFIG}", f"--mode={mode}"]
    cmd += [f"--workdir={workdir}", "--config.logging.progress=False", *flags]
    shown = " ".join(["python", *cmd[1:]])
    if max((r["step"] for r in read_metrics(workdir)), default=0) >= num_steps:
        print(f"[{name}] done already in {workdir}")
        return shown
    if args.report_only:
        raise SystemExit(f"error: {workdir} has no finished {name} run (drop --report_only)")
    print(f"[{name}] {shown}", flush=True)
    t0 = time.perf_counter()
    with open(workdir.parent / f"{workdir.name}.log", "w") as f:
        subprocess.run(shlex.split(args.prefix) + cmd, cwd=ROOT, stdout=f, stderr=f, check=True)
    times[name] = round(time.perf_counter() - t0, 1)
    return shown


def step0_eval(cfg_flags, gen: Path, judge: Path):
    """The supervised generator on the GRPO run's held-out set, judged by the GRPO judge."""
    from grpo_jax import trainer
    from grpo_jax.task import build_task

    cfg = load_config(cfg_flags)
    cfg.init_from, cfg.judge.checkpoint = str(gen), str(judge)
    task = build_task(cfg, "eval")
    scalars, _ = task.evaluate(trainer.initial_params(cfg, task))
    return scalars


def optimum_diagnostic(gen: Path, judge: Path, policies, num_windows=2048):
    """fill_in.single_char_optimum with the committed config, the GRPO judge and policies."""
    import jax
    import jax.numpy as jnp

    from grpo_jax import checkpoint as ckpt_lib
    from grpo_jax import data as data_lib
    from grpo_jax import fill_in
    from grpo_jax import judge as judge_lib

    cfg = load_config()
    cfg.judge.checkpoint = str(judge)
    v, length = data_lib.load_corpus(cfg.data).vocab.size, cfg.data.window_len
    judge_params = judge_lib.load_judge(cfg, judge_lib.make_judge_model(cfg.judge, v, length), v)
    zeros = jnp.zeros((1, length), jnp.int32)
    template = fill_in.make_generator(cfg, v).init(jax.random.PRNGKey(0), zeros)["params"]
    load = lambda path: ckpt_lib.load_params(str(path), template)
    pols = [load(p) for p in policies]
    return fill_in.single_char_optimum(cfg, load(gen), judge_params, pols, num_windows)


def metric_keys(cfg):
    """EVAL_KEYS and the greedy accuracy per span length (eval/fill_accuracy/lenK)."""
    spans = range(cfg.data.span_min, cfg.data.span_max + 1)
    return (*EVAL_KEYS, *(f"eval/fill_accuracy/len{k}" for k in spans))


def grpo_summary(workdir: Path, step0: dict, window: int, keys):
    rows = read_metrics(workdir)
    evals = [{"step": 0, **{k: step0[k] for k in keys}}]
    evals += [{"step": r["step"], **{k: r[k] for k in keys}} for r in rows if keys[0] in r]
    train = [r for r in rows if "reward_mean" in r]
    stats = ("reward_mean", "sample_fill_accuracy", "kl", "entropy")
    windows = []
    for lo in range(0, max(r["step"] for r in train), window):
        sel = [r for r in train if lo < r["step"] <= lo + window]
        if sel:
            means = {k: float(np.mean([r[k] for r in sel])) for k in stats}
            windows.append({"steps": f"{lo + 1}-{lo + window}", **means})
    curve = [{k: r[k] for k in ("step", "reward_mean", "sample_fill_accuracy")} for r in train]
    return {"eval": evals, "train_windows": windows, "train_curve": curve}


def fmt(x, nd=4):
    return f"{x:.{nd}f}"


def table(head, rows):
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def short(key):
    return key.removeprefix("eval/")


def eval_table(evals, keys):
    rows = [[str(e["step"]), *(fmt(e[k]) for k in keys)] for e in evals]
    return table(["step", *map(short, keys)], rows)


def mean_std_table(runs, keys):
    """Eval metrics mean ± std over seeds at each eval step."""
    rows = []
    for i, e in enumerate(runs[0]["eval"]):
        vals = [np.array([r["eval"][i][k] for r in runs]) for k in keys]
        cell = lambda v: f"{v.mean():.4f} ± {v.std(ddof=1) if len(v) > 1 else 0.0:.4f}"
        rows.append([str(e["step"]), *map(cell, vals)])
    return table(["step", *map(short, keys)], rows)


def windows_table(runs, seeds):
    head = ["steps", *(f"reward_mean s{s}" for s in seeds), "reward_mean (mean)"]
    head += ["sample_fill_accuracy (mean)", "kl (mean)"]
    rows = []
    for i, w in enumerate(runs[0]["train_windows"]):
        at = lambda k: [r["train_windows"][i][k] for r in runs]
        rs = at("reward_mean")
        means = (np.mean(rs), np.mean(at("sample_fill_accuracy")), np.mean(at("kl")))
        rows.append([w["steps"], *map(fmt, rs), *map(fmt, means)])
    return table(head, rows)


def ablation_section(ab):
    if ab is None:
        return []
    judges = [
        [k, j["corruptions"], str(j["steps"]), fmt(j["held_out_accuracy"])]
        + [fmt(j["optimum_greedy_1char"])]
        for k, j in ab["judges"].items()
    ]
    head = ["run", "judge", "change vs old defaults", "lr schedule", "Δ greedy"]
    head += ["Δ greedy len1", "Δ greedy len3", "Δ sampled", "Δ pass@1", "Δ judge reward"]
    head += ["train reward_mean first→last 10%", "1-char greedy"]
    rows = []
    for r in ab["runs"]:
        d = lambda k, nd=4: f"{r['d_' + k]:+.{nd}f}"
        reward = "-"
        if "reward_mean_first" in r:
            reward = f"{r['reward_mean_first']:.3f} → {r['reward_mean_last']:.3f}"
        cells = [d("fill_accuracy"), d("fill_accuracy/len1"), d("fill_accuracy/len3")]
        cells += [d("sampled_fill_accuracy"), d("pass@1"), d("judge_reward", 3)]
        rows.append([r["run"], r["judge"], r["change"], r["schedule"], *cells, reward])
        rows[-1].append(fmt(r["greedy_1char"]))
    jhead = ["judge", "corruptions", "steps", "held-out accuracy", "exact optimum, 1-char greedy"]
    return [
        "## Ablation (what was tried; separate runs, `fill_in_ablation.json`)",
        "",
        ab["note"],
        "",
        *table(jhead, judges),
        "",
        *table(head, rows),
        "",
    ]


def plot(runs, seeds, base, out: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    for r, s in zip(runs, seeds, strict=True):
        st = [c["step"] for c in r["train_curve"]]
        rw = np.convolve([c["reward_mean"] for c in r["train_curve"]], np.ones(5) / 5, "same")
        ax[0].plot(st, rw, label=f"seed {s}")
        es = [e["step"] for e in r["eval"]]
        ax[1].plot(es, [e["eval/judge_reward"] for e in r["eval"]], "o-", label=f"seed {s}")
        ax[2].plot(es, [e["eval/fill_accuracy"] for e in r["eval"]], "o-", label=f"greedy s{s}")
        sampled = [e["eval/sampled_fill_accuracy"] for e in r["eval"]]
        ax[2].plot(es, sampled, "s--", label=f"sampled s{s}")
    if base is not None:
        es = [e["step"] for e in base["eval"]]
        greedy = [e["eval/fill_accuracy"] for e in base["eval"]]
        ax[2].plot(es, greedy, "k:", label="greedy, old GRPO defaults")
    ax[0].set(title="train reward_mean (judge logit, 5-log moving avg)", xlabel="step")
    ax[1].set(title="held-out judge reward of greedy fills", xlabel="step")
    ax[2].set(title="held-out fill accuracy", xlabel="step")
    for a in ax:
        a.legend(fontsize=7)
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def verdict(runs, seeds, opt, base, ab, keys):
    first = {k: np.array([r["eval"][0][k] for r in runs]) for k in keys}
    final = {k: np.array([r["eval"][-1][k] for r in runs]) for k in keys}
    sd = lambda x: float(np.std(x, ddof=1)) if len(x) > 1 else 0.0
    md = []
    for k in keys:
        d = final[k] - first[k]
        md.append(
            f"* {short(k)}: {first[k].mean():.4f} → {final[k].mean():.4f} (Δ {d.mean():+.4f}, "
            f"per seed {', '.join(f'{x:+.4f}' for x in d)}; seed std of the final "
            f"{sd(final[k]):.4f})"
        )
    w0 = [r["train_windows"][0]["reward_mean"] for r in runs]
    w1 = [r["train_windows"][-1]["reward_mean"] for r in runs]
    pairs = ", ".join(f"{a:.3f}→{b:.3f}" for a, b in zip(w0, w1, strict=True))
    md.append(f"* train reward_mean, first vs last window: per seed {pairs}")
    rises = {short(k): bool(np.all(final[k] > first[k])) for k in keys}
    gain = final["eval/fill_accuracy"] - first["eval/fill_accuracy"]
    word = "RISES" if rises["fill_accuracy"] else "does NOT rise"
    md.append(
        f"* Held-out greedy fill accuracy {word} in every seed (mean Δ {gain.mean():+.4f}, "
        f"{gain.mean() / max(sd(gain), 1e-9):.1f} seed-standard-deviations of the Δ). Rises "
        f"in every seed: {', '.join(k for k, v in rises.items() if v) or 'none'}; not: "
        f"{', '.join(k for k, v in rises.items() if not v) or 'none'}."
    )
    ref, pol = opt["reference"], opt["policies"]
    named = [f"s{s} {fmt(a)} ({a - ref:+.4f})" for s, a in zip(seeds, pol, strict=False)]
    if base is not None:
        named.append(f"old GRPO defaults {fmt(pol[-1])} ({pol[-1] - ref:+.4f})")
    md.append(
        f"* Exact optimum of the same objective on {opt['num_windows']} held-out single-char "
        f"spans (z_ref + (T/β)·r over all V fills, `fill_in.single_char_optimum`): reference "
        f"greedy {fmt(ref)}, optimum {fmt(opt['optimum'])} ({opt['optimum'] - ref:+.4f}); "
        f"final policies {', '.join(named)}."
    )
    if ab is not None and not rises["fill_accuracy"]:  # why greedy accuracy lags
        grpo_runs = {k: v for k, v in ab["top2_margin"]["runs"].items() if "distill" not in k}
        t2 = np.array(list(grpo_runs.values()))
        corr = f"{t2[:, 0].min():.2f}-{t2[:, 0].max():.2f}"
        md.append(READING.format(corr=corr, slope=f"{t2[:, 1].min():.2f}-{t2[:, 1].max():.2f}"))
    return md


def report(args, root, cfg, cmds, times, judge_eval, gen_eval, runs, seeds, opt, base, ab):
    c, keys = cfg, metric_keys(cfg)
    minutes = sum(times.values()) / 60
    gen_line = (
        f"Supervised generator after {gen_eval['step']} steps (its last held-out eval while "
        f"pretraining, = step 0 below): greedy {fmt(gen_eval['eval/fill_accuracy'])}, sampled "
        f"{fmt(gen_eval['eval/sampled_fill_accuracy'])}."
    )
    judge_rows = [[short(k), fmt(v)] for k, v in judge_eval.items() if k.startswith("eval/")]
    md = [
        "# Single-step fill-in with a judge: GRPO against a frozen judge",
        "",
        f"Device: {args.device}; no accelerator. Produced by `experiments/fill_in.py` (root "
        f"`{root}`) with the committed defaults of `{CONFIG}`.",
        "",
        "## Commands",
        "",
        "```bash",
        "export GRPO_JAX_DATA=/work/shared/data/tinyshakespeare.txt",
        f"python experiments/fill_in.py --root={root} --seeds={','.join(map(str, seeds))}"
        + (" --baseline" if base else ""),
        "# which ran:",
        *cmds.values(),
        "```",
        "",
        "Wall-clock per stage (s; the 2-core CPU was shared with another process): "
        + ", ".join(f"{k} {v}" for k, v in times.items())
        + f"; total {minutes:.1f} min.",
        "",
        "## Setting",
        "",
        f"* Window {c.data.window_len} chars, one masked span of {c.data.span_min}-"
        f"{c.data.span_max} chars; generator and judge are {c.model.num_layers}x"
        f"{c.model.d_model} bidirectional encoders.",
        f"* Supervised generator (`--mode=pretrain`, {c.pretrain.num_steps} steps): the GRPO "
        "init, the frozen KL reference, and the source of the judge's `generator` negatives.",
        f"* Judge (`--mode=train_judge`, {c.judge.num_steps} steps): real windows vs. windows "
        f"whose span is corrupted by one of `{c.judge.corruptions}`.",
        f"* GRPO: reward = the frozen judge's window `{c.judge.reward}` of the filled window "
        f"(nothing else; it never sees the original), G={c.group.size} fills per window "
        f"sampled at T={c.group.temperature}, {c.train.batch_size} windows/step, "
        f"{c.train.num_steps} steps, lr {c.optim.learning_rate} (cosine over all num_steps x "
        f"mu updates), exact KL to the reference with beta={c.grpo.beta}, advantages "
        f"`{c.grpo.advantage_scale}`, mu={c.grpo.num_iterations}.",
        "",
        WHY,
        "",
        "## Judge (held-out real-vs-corrupted, its own corruptions, fixed val windows)",
        "",
        *table(["metric", "value"], judge_rows),
        "",
        gen_line,
        "",
        f"## GRPO: held-out metrics (mean ± std over seeds {', '.join(map(str, seeds))})",
        "",
        "`fill_accuracy`: greedy fill = original char, share of masked chars (`/lenK`: spans "
        "of K chars); `sampled_fill_accuracy`: mean π(original char) at T = 1; `pass@k`: a "
        "whole span restored in k samples at T = 1 (exact); `judge_reward`: the judge's reward "
        f"of the greedy fills. Step 0 is the supervised generator. All on the same "
        f"{c.eval.num_windows} held-out windows and spans.",
        "",
        *mean_std_table(runs, keys),
        "",
    ]
    for s, r in zip(seeds, runs, strict=True):
        md += [f"Seed {s}:", "", *eval_table(r["eval"], keys), ""]
    md += [
        f"## GRPO: train reward_mean per {args.window}-step window",
        "",
        f"(train `sample_fill_accuracy` is over the T = {c.group.temperature} samples.)",
        "",
        *windows_table(runs, seeds),
        "",
        "## Verdict",
        "",
        *verdict(runs, seeds, opt, base, ab, keys),
        "",
    ]
    if base is not None:
        md += ["## Baseline: the previous GRPO defaults, same judge (seed 0)", ""]
        md += [f"`{' '.join(BASELINE_GRPO)}` (with the lr-schedule fix):", ""]
        md += [*eval_table(base["eval"], keys), ""]
    return md + ablation_section(ab) + ["![learning curves](fill_in_curves.png)", ""]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default="/tmp/fillin_exp", help="workdirs go here")
    ap.add_argument("--seeds", default="0,1,2", help="GRPO seeds (comma-separated)")
    ap.add_argument("--baseline", action="store_true", help="also GRPO with the old defaults")
    ap.add_argument("--report_only", action="store_true", help="read finished workdirs only")
    ap.add_argument("--prefix", default="", help="command prefix, e.g. 'nice -n 10 taskset -c 1'")
    ap.add_argument("--window", type=int, default=300, help="train steps per reward_mean window")
    ap.add_argument("--out", default=str(ROOT / "experiments/results"))
    ap.add_argument("--device", default=f"CPU, {os.cpu_count()} cores ({platform.machine()})")
    args = ap.parse_args()
    if not os.environ.get("GRPO_JAX_DATA"):
        print("warning: GRPO_JAX_DATA is unset; the corpus is looked up as the README says")
    root = Path(args.root).absolute()
    root.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    c = load_config()
    times_path = root / "times.json"
    times = json.loads(times_path.read_text()) if times_path.exists() else {}
    gen, judge = root / "gen", root / "judge"
    cmds = {"gen": run_stage("gen", gen, "pretrain", [], c.pretrain.num_steps, args, times)}
    jflags = [f"--config.judge.negatives_from={gen}"]
    cmds["judge"] = run_stage("judge", judge, "train_judge", jflags, c.judge.num_steps, args, times)
    common = [f"--config.judge.checkpoint={judge}", f"--config.init_from={gen}"]
    step0 = step0_eval([], gen, judge)
    runs = []
    for s in seeds:
        wd, flags = root / f"grpo_s{s}", [*common, f"--config.seed={s}"]
        n = c.train.num_steps
        cmds[f"grpo_s{s}"] = run_stage(f"grpo_s{s}", wd, "train", flags, n, args, times)
        runs.append(grpo_summary(wd, step0, args.window, metric_keys(c)))
    base, policies = None, [root / f"grpo_s{s}" for s in seeds]
    if args.baseline:
        gb, n = root / "grpo_base", load_config(BASELINE_GRPO).train.num_steps
        flags = [*common, *BASELINE_GRPO]
        cmds["grpo_base"] = run_stage("grpo_base", gb, "train", flags, n, args, times)
        step0_base = step0_eval(BASELINE_GRPO, gen, judge)
        base = grpo_summary(gb, step0_base, 100, metric_keys(c))
        policies.append(gb)
    t0 = time.perf_counter()
    opt = optimum_diagnostic(gen, judge, policies)
    times.setdefault("optimum_diagnostic", round(time.perf_counter() - t0, 1))
    times_path.write_text(json.dumps(times, indent=1))

    judge_eval = [r for r in read_metrics(judge) if "eval/judge_accuracy" in r][-1]
    gen_eval = [r for r in read_metrics(gen) if "eval/fill_accuracy" in r][-1]
    out = Path(args.out)
    ab_path = out / "fill_in_ablation.json"
    ab = json.loads(ab_path.read_text()) if ab_path.exists() else None
    summary = {
        "device": args.device,
        "commands": cmds,
        "wall_s": times,
        "seeds": seeds,
        "judge_final_eval": judge_eval,
        "generator_final_eval": gen_eval,
        "grpo": {f"seed{s}": r for s, r in zip(seeds, runs, strict=True)},
        "single_char_optimum": opt,
        "baseline": {"flags": BASELINE_GRPO, "grpo": base} if base else None,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "fill_in.json").write_text(json.dumps(summary, indent=1))
    plot(runs, seeds, base, out / "fill_in_curves.png")
    md = report(args, root, c, cmds, times, judge_eval, gen_eval, runs, seeds, opt, base, ab)
    (out / "fill_in.md").write_text("\n".join(md))
    print(f"wrote {out / 'fill_in.md'}")


if __name__ == "__main__":
    main()
