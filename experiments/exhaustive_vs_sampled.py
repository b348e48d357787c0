"""The exhaustive-GRPO guide's comparison: sampled (G=4) vs exhaustive (V) vs guided groups.

Every mode starts from the same init per seed (``config.seed`` = the run's seed drives both
the init and the step keys, or every run loads ``--config.init_from``) and takes the same
number of optimizer steps through the library's trainer (``trainer.train_and_evaluate``, one
workdir per run), seeds one after another; or, with ``--vmap_seeds``, all seeds of a mode
as one program (``sharding.make_multi_seed_step``: the train step vmapped over a leading seed
axis of the state, purejaxrl-style; the same figures as separate runs, tested to 1e-5 in
tests/test_sharding.py) with a lean loop here: no checkpoints, no char heatmap. Writes,
under ``--out_dir``:

  exhaustive_vs_sampled.md        the table (mean ± std over seeds, and min–max), device, command
  exhaustive_vs_sampled.json      every run's raw figures and eval curves
  exhaustive_vs_sampled_<metric>.png   learning curves, mean ± std band over seeds vs step

The committed CPU-sized run (2 cores, ~20 min for all nine runs):

  GRPO_JAX_DATA=/work/shared/data/tinyshakespeare.txt python experiments/exhaustive_vs_sampled.py \
      --config=configs/shakespeare.py --seeds=3 --modes=sampled,exhaustive,guided \
      --config.model.num_layers=2 --config.model.d_model=64 --config.model.num_heads=2 \
      --config.train.batch_size=4 --config.eval.num_windows=128 \
      --steps=100 --config.train.eval_every=20 --config.train.log_every=5 \
      --workdir_root=/tmp/exhaustive_vs_sampled

(Everything else is the config file's defaults: lr 3e-3, β 1.0, advantage_scale none, the
forward exact KL to the trigram and μ = 2 since the plain config's second retune; runs before
it used the reverse exact KL and μ = 1.)

On one GPU/TPU (``full`` size: 6x384 model, B=32, 2000 steps, 1024 eval windows):

  python experiments/exhaustive_vs_sampled.py --config=configs/shakespeare.py:full --seeds=3

``--report_only`` re-renders the markdown and PNGs from the JSON without running anything;
``--note="..."`` adds an Observations section (the committed table's was written that way).

``--config`` names the config file and its size tokens (``full``/``tiny``); the group mode
comes from ``--modes`` (each mode uses the file's ``:<mode>`` variant, e.g. ``:sampled`` is
G=4); ``--config.x=y`` overrides apply to every mode.
"""

import json
import os
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from ml_collections import config_dict, config_flags

from grpo_jax import config_blocks, groups, plots, sharding, trainer
from grpo_jax import data as data_lib
from grpo_jax import rollout as ro
from grpo_jax import task as task_lib
from grpo_jax.metric_writers import read_metrics
from grpo_jax.model import make_model

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
    "config", "configs/shakespeare.py", "Config file (path[:size]); the mode comes from --modes."
)
flags.DEFINE_integer("seeds", 3, "Seeds per mode: config.seed, config.seed + 1, ...", lower_bound=1)
flags.DEFINE_list("modes", ["sampled", "exhaustive", "guided"], "Group modes to compare.")
flags.DEFINE_integer("steps", 0, "Optimizer steps per run (0 = the config's train.num_steps).")
flags.DEFINE_string("out_dir", "experiments/results", "Where the table, JSON and PNGs go.")
flags.DEFINE_string("workdir_root", "/tmp/exhaustive_vs_sampled", "One workdir per run below.")
flags.DEFINE_string("name", "exhaustive_vs_sampled", "Basename of the output files.")
flags.DEFINE_bool(
    "report_only", False, "Only re-render the .md and PNGs from <out_dir>/<name>.json."
)
flags.DEFINE_string("note", "", "Text for an 'Observations' section of the markdown.")
flags.DEFINE_bool("fresh", True, "Delete an existing run workdir first (else the trainer resumes).")
flags.DEFINE_bool(
    "vmap_seeds", False, "Train a mode's seeds as one vmapped program (fits on one accelerator)."
)

EVAL_METRICS = ("eval/rollout_accuracy", "eval/next_char_accuracy")
REFERENCE_POINTS = {"unigram": 0.149, "bigram": 0.270, "trigram": 0.381}
GUIDE_CLAIMS = {  # the guide's "Final Accuracy" (metric unspecified) and training time
    "sampled": ("5.2%", "2 hours", "Space (degenerate)"),
    "exhaustive": ("35.7%", "8 hours", "Context-dependent"),
    "guided": ("42.3%", "4 hours", "Context-dependent"),
}


def load_config(flag, mode: str):
    """The config file's ``<mode>[,size]`` variant with the command line's overrides applied."""
    path, _, arg = flag.config_filename.partition(":")
    sizes = [t.strip() for t in arg.split(",") if t.strip()]
    if any(t in groups.MODES for t in sizes):
        raise app.UsageError(f"--config={flag.config_filename}: give the group mode via --modes")
    config = config_blocks.load_config(path, ",".join([mode] + sizes))
    overrides = dict(config_flags.get_override_values(flag))
    if "group.mode" in overrides:
        raise app.UsageError("--config.group.mode is set by --modes, not overridden")
    config.update_from_flattened_dict(overrides)
    return config


def spread(values):
    """(mean, std (ddof=1; 0 for one seed), min, max)."""
    v = [float(x) for x in values]
    std = statistics.stdev(v) if len(v) > 1 else 0.0
    return statistics.fmean(v), std, min(v), max(v)


def held_out_entropy(config, params, vocab_size: int):
    """Mean policy entropy (nats, temperature 1) of the first char on the eval windows."""
    c, h = config.data.context_len, config.data.horizon
    max_len = config.model.max_len or c + h
    model = make_model(config.model, vocab_size, max_len)
    corpus = data_lib.load_corpus(config.data)
    ctx, _ = data_lib.eval_windows(corpus.val, config.eval.num_windows, c, h)
    first_logits, _ = jax.jit(lambda p, x: ro.prefill(model, p, x))(params, jnp.asarray(ctx))
    return float(ro.entropy_of_logp(jax.nn.log_softmax(first_logits.astype(jnp.float32))).mean())


def run_one(config, workdir: Path):
    if FLAGS.fresh and workdir.exists():
        shutil.rmtree(workdir)
    t0 = time.perf_counter()
    state, last = trainer.train_and_evaluate(config, str(workdir), "train")
    jax.block_until_ready(state.params)
    wall = time.perf_counter() - t0
    rows = read_metrics(workdir)
    return state, last, rows, wall


def run_vmapped(config, seeds, task):
    """Every seed of one mode in one program: the step vmapped over a seed axis of the state.

    Returns, per seed, (params, last metrics, metrics rows like metrics.jsonl's) and the wall
    time of the whole set. ``config`` is the first seed's; each seed gets its own rng and its
    own init (or all load ``init_from``), exactly as separate runs would."""
    if config.reference.kind == "policy" and not config.init_from:
        raise app.UsageError(
            "--vmap_seeds with reference.kind=policy needs --config.init_from: the frozen "
            "reference is one params set shared by the seeds, not each seed's own init"
        )
    t0 = time.perf_counter()
    params0 = trainer.initial_params(config, task)
    step_fn, inputs = task.build(params0)
    per_seed_init = None if config.init_from else task.init_params
    states = sharding.seed_states(task.make_state, params0, seeds, init_params=per_seed_init)
    multi = jax.jit(sharding.make_multi_seed_step(step_fn), donate_argnums=0)
    tc, n = config.train, len(seeds)
    rows = [[] for _ in seeds]
    last = [{} for _ in seeds]
    t_last, since = time.perf_counter(), 0
    for step in range(tc.num_steps):
        states, metrics = multi(states, inputs)
        since += 1
        done = step + 1
        if done % tc.log_every == 0 or done == tc.num_steps:
            host = jax.device_get({k: v for k, v in metrics.items() if v.ndim == 1})
            dt = (time.perf_counter() - t_last) / since  # one step of all seeds together
            for i in range(n):
                row = {k: float(v[i]) for k, v in host.items()}
                row.update(step=done, step_time_s=dt)
                rows[i].append(row)
                last[i].update(row)
            t_last, since = time.perf_counter(), 0
        if done % tc.eval_every == 0 or done == tc.num_steps:
            for i in range(n):
                scalars, _ = task.evaluate(sharding.unstack_state(states, i).params)
                rows[i].append({"step": done, **scalars})
                last[i].update(scalars)
            t_last = time.perf_counter()
    params = [sharding.unstack_state(states, i).params for i in range(n)]
    jax.block_until_ready(params)
    return params, last, rows, time.perf_counter() - t0


def curve(rows, key, init_value):
    pts = [(0, init_value)] + [(int(r["step"]), r[key]) for r in rows if key in r]
    return [p[0] for p in pts], [float(p[1]) for p in pts]


def pct(x):
    return f"{100 * x:.1f}"


def fmt_pct(s):
    mean, std, lo, hi = s
    return f"{pct(mean)} ± {pct(std)} [{pct(lo)}–{pct(hi)}]"


def fmt(s, digits=2):
    mean, std, lo, hi = s
    return f"{mean:.{digits}f} ± {std:.{digits}f} [{lo:.{digits}f}–{hi:.{digits}f}]"


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)
    out_dir, root = Path(FLAGS.out_dir), Path(FLAGS.workdir_root)
    out_dir.mkdir(parents=True, exist_ok=True)
    if FLAGS.report_only:
        raw = json.loads((out_dir / f"{FLAGS.name}.json").read_text())
        configs = {m: config_dict.ConfigDict(c) for m, c in raw["configs"].items()}
        pngs = write_plots(raw["runs"], out_dir, raw["device"])
        md = write_markdown(raw, configs, pngs)
        (out_dir / f"{FLAGS.name}.md").write_text(md)
        print(md)
        return
    dev = jax.devices()[0]
    device = f"{dev.device_kind} ({dev.platform}, {jax.device_count()} device(s))"
    seed0 = int(FLAGS.config.seed)
    seeds = [seed0 + i for i in range(FLAGS.seeds)]
    runs = {}  # mode -> list of per-seed dicts
    init_evals, eval_task = {}, None
    configs = {}
    for mode in FLAGS.modes:
        cfgs = []
        for seed in seeds:
            config = load_config(FLAGS["config"], mode)
            config.seed = seed
            if FLAGS.steps:
                config.train.num_steps = FLAGS.steps
            config.logging.progress = False
            config.logging.tensorboard = False
            cfgs.append(config)
            # the initial policy's held-out figures (the same for every mode at a seed);
            # one task's compiled eval serves every seed
            if seed not in init_evals:
                eval_task = eval_task or task_lib.build_task(config, "train")
                init_evals[seed] = eval_task.evaluate(trainer.initial_params(config, eval_task))[0]
        configs[mode] = cfgs[0]
        if FLAGS.vmap_seeds:
            print(f"[{mode} seeds {seeds}] {cfgs[0].train.num_steps} steps, vmapped", flush=True)
            task = task_lib.build_task(cfgs[0], "train")
            params, lasts, rowss, wall = run_vmapped(cfgs[0], seeds, task)
            workdirs = [None] * len(seeds)
            walls = [wall / len(seeds)] * len(seeds)  # the set's wall time, shared out
        else:
            params, lasts, rowss, walls, workdirs = [], [], [], [], []
            for config in cfgs:
                workdir = root / mode / f"seed_{config.seed}"
                print(f"[{mode} seed {config.seed}] -> {workdir}", flush=True)
                state, last, rows, wall = run_one(config, workdir)
                for lst, x in zip(
                    (params, lasts, rowss, walls, workdirs),
                    (state.params, last, rows, wall, workdir),
                    strict=True,
                ):
                    lst.append(x)
        for config, p, last, rows, wall, workdir in zip(
            cfgs, params, lasts, rowss, walls, workdirs, strict=True
        ):
            seed, init_scalars = config.seed, init_evals[config.seed]
            # the first logged interval includes the step's compilation: left out
            step_times = [r["step_time_s"] for r in rows if "step_time_s" in r]
            step_times = step_times[1:] or step_times
            best_id = int(last["eval/best_char_id"])
            rec = {
                "seed": seed,
                "workdir": str(workdir) if workdir else None,
                "wall_s": wall,
                "median_step_time_s": statistics.median(step_times) if step_times else None,
                "steps": int(config.train.num_steps),
                "best_char": eval_task.vocab.decode([best_id]),
                "best_char_frac": last.get("eval/best_char_frac"),
                "train_entropy": last.get("entropy"),
                "entropy_decision": last.get("entropy_decision"),
                "heldout_first_char_entropy": held_out_entropy(config, p, eval_task.vocab.size),
                "final": {k: v for k, v in last.items() if k.startswith("eval/")},
                "train_final": {
                    k: last[k] for k in ("reward_mean", "reward_spread", "kl", "loss") if k in last
                },
                "init": init_scalars,
                "curves": {k: curve(rows, k, init_scalars[k]) for k in EVAL_METRICS},
                "train_curves": {
                    k: [(int(r["step"]), float(r[k])) for r in rows if k in r]
                    for k in ("reward_mean", "entropy")
                },
            }
            runs.setdefault(mode, []).append(rec)
            print(
                f"  seed {seed}: wall {wall:.1f}s  "
                f"rollout_acc {rec['final']['eval/rollout_accuracy']:.4f}  "
                f"next_char_acc {rec['final']['eval/next_char_accuracy']:.4f}  "
                f"best_char {rec['best_char']!r}",
                flush=True,
            )
            heat = workdir / "char_heatmap.png" if workdir else None
            if mode in ("exhaustive", "adaptive") and seed == seeds[0] and heat and heat.exists():
                shutil.copy(heat, out_dir / f"{FLAGS.name}_{mode}_char_heatmap.png")

    summary = summarize(runs)
    pngs = write_plots(runs, out_dir, device)
    raw = {
        "device": device,
        "command": command_line(),
        "overrides": dict(config_flags.get_override_values(FLAGS["config"])),
        "seeds": seeds,
        "seeds_parallel": bool(FLAGS.vmap_seeds),
        "modes": FLAGS.modes,
        "configs": {m: c.to_dict() for m, c in configs.items()},
        "summary": summary,
        "runs": runs,
    }
    (out_dir / f"{FLAGS.name}.json").write_text(json.dumps(raw, indent=1, default=str))
    md = write_markdown(raw, configs, pngs)
    (out_dir / f"{FLAGS.name}.md").write_text(md)
    print(md)


def command_line():
    args = [a for a in sys.argv[1:]]
    env = f"GRPO_JAX_DATA={os.environ['GRPO_JAX_DATA']} " if "GRPO_JAX_DATA" in os.environ else ""
    return env + "python experiments/exhaustive_vs_sampled.py " + " ".join(map(shlex.quote, args))


def summarize(runs):
    out = {}
    for mode, recs in runs.items():
        s = {k: spread([r["final"][k] for r in recs]) for k in EVAL_METRICS}
        s["init"] = {k: spread([r["init"][k] for r in recs]) for k in EVAL_METRICS}
        s["wall_s"] = spread([r["wall_s"] for r in recs])
        s["median_step_time_s"] = spread([r["median_step_time_s"] or 0.0 for r in recs])
        s["heldout_first_char_entropy"] = spread([r["heldout_first_char_entropy"] for r in recs])
        s["train_entropy"] = spread([r["train_entropy"] for r in recs])
        s["best_char"] = [r["best_char"] for r in recs]
        s["best_char_frac"] = [r["best_char_frac"] for r in recs]
        out[mode] = s
    return out


def write_plots(runs, out_dir, device):
    pngs = []
    for key in EVAL_METRICS:
        series = {}
        for mode, recs in runs.items():
            steps = recs[0]["curves"][key][0]
            vals = np.array([r["curves"][key][1] for r in recs])  # [seeds, points]
            std = vals.std(0, ddof=1) if len(recs) > 1 else np.zeros(vals.shape[1])
            series[f"{mode} (n={len(recs)})"] = (steps, vals.mean(0), std)
        if key == "eval/next_char_accuracy":
            steps = next(iter(series.values()))[0]
            for name, val in REFERENCE_POINTS.items():
                series[f"{name} ref ({pct(val)}%)"] = (steps, [val] * len(steps))
        name = f"{FLAGS.name}_{key.split('/')[-1]}.png"
        plots.learning_curves(
            series,
            out_dir / name,
            key,
            title=f"{key}: mean ± std over seeds ({device.split(' ')[0]})",
        )
        pngs.append(name)
    return pngs


def versus_references(m):
    """Where a mode's mean next-char accuracy sits among the n-gram reference points."""
    acc = m["eval/next_char_accuracy"][0]
    above = [n for n, v in REFERENCE_POINTS.items() if acc > v]
    below = [n for n, v in REFERENCE_POINTS.items() if acc <= v]
    if not above:
        return "below the unigram"
    if not below:
        return "above the trigram"
    return f"above the {above[-1]}, below the {below[0]}"


def write_markdown(raw, configs, pngs):
    s = raw["summary"]
    any_cfg = next(iter(configs.values()))
    n_seeds = len(raw["seeds"])
    lines = [
        "# Exhaustive vs sampled vs guided GRPO (held-out, char-level tiny Shakespeare)",
        "",
        f"- Device: **{raw['device']}** (jax {jax.__version__}). Seeds {raw['seeds']} "
        + (
            "ran **in parallel**: one program per mode, the train step vmapped over the "
            "seeds (`--vmap_seeds`, `sharding.make_multi_seed_step`); the wall time per run "
            "is the set's divided by the seeds, the step time one step of the whole set."
            if raw.get("seeds_parallel")
            else "ran **sequentially** through `trainer.train_and_evaluate`, one workdir per "
            "run (`--vmap_seeds` runs them as one vmapped program instead)."
        ),
        f"- Command: `{raw['command']}`",
        f"- Config overrides (all modes): `{json.dumps(raw['overrides'])}`",
        f"- Steps per run: {any_cfg.train.num_steps} GRPO steps, each "
        f"{any_cfg.grpo.num_iterations} optimizer update(s) (grpo.num_iterations) on one "
        f"batch of rollouts, batch {any_cfg.train.batch_size} prompts, context "
        f"{any_cfg.data.context_len}, horizon {any_cfg.data.horizon}; model "
        f"{any_cfg.model.num_layers} layers × {any_cfg.model.num_heads} heads × "
        f"{any_cfg.model.d_model}; lr {any_cfg.optim.learning_rate}, β {any_cfg.grpo.beta}, "
        f"reference {any_cfg.reference.kind} (n={any_cfg.reference.ngram_order}, KL "
        f"`{any_cfg.grpo.kl_estimator}`), reward "
        f"`{any_cfg.reward.terms}`, exhaustive estimator `{any_cfg.grpo.exhaustive_estimator}`; "
        f"eval on {any_cfg.eval.num_windows} held-out val windows every "
        f"{any_cfg.train.eval_every} steps.",
        f"- Init: {'`' + any_cfg.init_from + '`' if any_cfg.init_from else 'random, from the seed'}"
        " — the same initial params for every mode at a given seed.",
        "- Members per prompt: "
        + ", ".join(f"{m} {task_lib.members_per_prompt(c, 65):g}" for m, c in configs.items())
        + " (for V=65).",
        f"- Figures: mean ± std (sample std, ddof=1) over {n_seeds} seeds, [min–max] in "
        "brackets; accuracies in %.",
        "",
        "| mode | eval/rollout_accuracy % | eval/next_char_accuracy % | wall time / run (s) "
        "| step time (s, median) | eval/best_char per seed (share of windows) "
        "| held-out first-char entropy (nats) | final train entropy (nats/token) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    init = next(iter(s.values()))["init"]
    lines.append(
        f"| init (step 0) | {fmt_pct(init['eval/rollout_accuracy'])} | "
        f"{fmt_pct(init['eval/next_char_accuracy'])} | – | – | – | – | – |"
    )
    for mode, m in s.items():
        chars = ", ".join(
            f"{c!r} ({f:.0%})" for c, f in zip(m["best_char"], m["best_char_frac"], strict=True)
        )
        lines.append(
            f"| {mode} | {fmt_pct(m['eval/rollout_accuracy'])} | "
            f"{fmt_pct(m['eval/next_char_accuracy'])} | {fmt(m['wall_s'], 0)} | "
            f"{fmt(m['median_step_time_s'], 3)} | {chars} | "
            f"{fmt(m['heldout_first_char_entropy'])} | {fmt(m['train_entropy'])} |"
        )
    lines += [
        "",
        "Reference points (val split, next-char accuracy): unigram 14.9%, bigram 27.0%, "
        "trigram 38.1%. Here (mean over seeds): "
        + "; ".join(
            f"{mode} {pct(m['eval/next_char_accuracy'][0])}% ({versus_references(m)})"
            for mode, m in s.items()
        )
        + ".",
        "",
        "Wall time / run includes compilation and the evaluations; step time is the trainer's "
        "`step_time_s` (no eval; the first logged interval, which holds the compilation, is "
        "left out). Held-out first-char entropy: the final policy's entropy at "
        "temperature 1 over the first generated char of the eval windows (the same measure "
        "for every mode); train entropy: the last logged `entropy` (per-token mean over the "
        "training rollouts, decision point exact over V in forced modes; guided groups "
        "average over the candidate slots that count, see loss.py).",
        "",
        "## The guide's claims, for comparison",
        "",
        "| mode | guide: final accuracy | guide: training time | guide: best char "
        "| here: rollout / next-char accuracy % | here: wall time / run |",
        "|---|---|---|---|---|---|",
    ]
    for mode, m in s.items():
        claim = GUIDE_CLAIMS.get(mode, ("–", "–", "–"))
        lines.append(
            f"| {mode} | {claim[0]} | {claim[1]} | {claim[2]} | "
            f"{pct(m['eval/rollout_accuracy'][0])} / {pct(m['eval/next_char_accuracy'][0])} | "
            f"{m['wall_s'][0]:.0f} s |"
        )
    lines += [
        "",
        "The guide gives no metric, model size, step count, hardware or seed count for its "
        "figures (5.2% / 35.7% / 42.3% after 2 h / 8 h / 4 h), so they are claims, not "
        "targets; the runs above are CPU-sized (a small model, a few optimizer steps) and "
        "are not a reproduction of hours-long runs.",
        "",
        *(["## Observations", "", FLAGS.note, ""] if FLAGS.note else []),
        "## Learning curves",
        "",
    ]
    lines += [f"![{p}]({p})" for p in pngs]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    app.run(main)
