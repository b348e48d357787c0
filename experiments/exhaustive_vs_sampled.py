"""The exhaustive-GRPO guide's comparison: sampled (G=4) vs exhaustive (V) vs guided groups.

Every mode starts from the same init per seed (``config.seed`` = the run's seed drives both
the init and the step keys, or every run loads ``--config.init_from``) and takes the same
number of optimizer steps through the library's trainer (``trainer.train_and_evaluate``, one
workdir per run), seeds one after another; or, with ``--vmap_seeds``, all seeds of a mode
as one program (``sharding.make_multi_seed_step``: the train step vmapped over a leading seed
axis of the state, purejaxrl-style; the same figures as separate runs, tested to 1e-5 in
tests/test_sharding.py) with a lean loop: no checkpoints, no char heatmap. Writes,
under ``--out_dir``:

  exhaustive_vs_sampled.md        the table (mean ± std over seeds, and min–max), device, command
  exhaustive_vs_sampled.json      every run's raw figures and eval curves
  exhaustive_vs_sampled_<metric>.png   learning curves, mean ± std band over seeds vs step
  exhaustive_vs_sampled_<mode>_char_heatmap.png   exhaustive/adaptive modes: the first seed's
                                       per-first-char heatmap (not with --vmap_seeds)

The committed CPU-sized run (2 cores, ~7 min for all nine runs):

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

Equal compute (``--budget``, experiments/equal_compute.py): every mode gets the same training
wall time (``wall:<seconds>``, its vmapped set of seeds together; compilation and evaluations
excluded) or the same generated tokens per seed (``tokens:<n>``) instead of the same steps,
seeds vmapped, evaluated at ``--eval_points`` fractions of the budget. Writes <name>.md (the
budget spent and the final metrics: mean ± std, SE, the difference to the sampled mode with
its paired t test over the seeds (t = Δ / SE_Δ, two-sided p; Welch where the seeds differ),
equal_compute_report.py), <name>.json and <name>_<metric>_{seconds,tokens}.png (mean ± std
over seeds against training seconds and generated tokens). ``--metrics`` defaults to the
task's (equal_compute.DEFAULT_METRICS). A config with a supervised warm-up (arithmetic) runs
it once under --workdir_root for every mode and seed, unless ``--config.init_from`` is
given. The real runs, 2-core CPU sizes (tokens:1820000 = the 100 exhaustive steps of
exhaustive_vs_sampled.md; a wall budget costs each mode two compilations on top, one to time
the steps its lr schedule spans):

  export GRPO_JAX_DATA=/work/shared/data/tinyshakespeare.txt
  CHAR="--config.model.num_layers=2 --config.model.d_model=64 --config.model.num_heads=2 \
      --config.train.batch_size=4 --config.eval.num_windows=128"
  # char Shakespeare at the plain config's β (1.0), then at β = 0
  python experiments/exhaustive_vs_sampled.py --config=configs/shakespeare.py --seeds=3 \
      --modes=sampled,exhaustive,guided $CHAR --budget=wall:600 --name=equal_compute_wall
  python experiments/exhaustive_vs_sampled.py --config=configs/shakespeare.py --seeds=3 \
      --modes=sampled,exhaustive,guided $CHAR --budget=tokens:1820000 --name=equal_compute_tokens
  python experiments/exhaustive_vs_sampled.py --config=configs/shakespeare.py --seeds=3 \
      --modes=sampled,exhaustive,guided $CHAR --config.grpo.beta=0 --budget=wall:600 \
      --name=equal_compute_beta0_wall
  python experiments/exhaustive_vs_sampled.py --config=configs/shakespeare.py --seeds=3 \
      --modes=sampled,exhaustive,guided $CHAR --config.grpo.beta=0 --budget=tokens:1820000 \
      --name=equal_compute_beta0_tokens
  # BPE Shakespeare, V = 1024 (exhaustive: 286,720 tokens a step; 5,734,400 = 20 such steps)
  python experiments/exhaustive_vs_sampled.py --config=configs/shakespeare.py:bpe1024 --seeds=3 \
      --modes=sampled,exhaustive,guided $CHAR --budget=wall:600 --name=equal_compute_bpe1024_wall
  python experiments/exhaustive_vs_sampled.py --config=configs/shakespeare.py:bpe1024 --seeds=3 \
      --modes=sampled,exhaustive,guided $CHAR --budget=tokens:5734400 \
      --name=equal_compute_bpe1024_tokens
  # arithmetic (:jax = jittable rewards, one program); one warm-up (seed 0) is every run's
  # start, where experiments/arithmetic.py warms up each seed; 4096 tokens a step either mode
  grpo-jax --config=arithmetic:jax --mode=pretrain --workdir=/tmp/arith_warm
  python experiments/exhaustive_vs_sampled.py --config=configs/arithmetic.py:jax --seeds=3 \
      --modes=sampled,exhaustive --config.init_from=/tmp/arith_warm --budget=wall:300 \
      --name=equal_compute_arithmetic_wall
  python experiments/exhaustive_vs_sampled.py --config=configs/arithmetic.py:jax --seeds=3 \
      --modes=sampled,exhaustive --config.init_from=/tmp/arith_warm --budget=tokens:4096000 \
      --name=equal_compute_arithmetic_tokens

``--report_only`` re-renders the markdown and PNGs from the JSON without running anything;
``--note="..."`` adds an Observations section, stored in the JSON so that a later
``--report_only`` without ``--note`` keeps it.

``--config`` names the config file and its size tokens (``full``/``tiny``); the group mode
comes from ``--modes`` (each mode uses the file's ``:<mode>`` variant, e.g. ``:sampled`` is
G=4); ``--config.x=y`` overrides apply to every mode. This script parses the flags, runs
and records: the equal-step runs are experiments/equal_steps.py's, the equal-compute ones
experiments/equal_compute.py's; the summary, table and plots are rendered by
experiments/comparison_report.py (equal steps) and experiments/equal_compute_report.py
(equal compute).
"""

import json
import os
import shlex
import shutil
import sys
from pathlib import Path

import equal_compute
import equal_steps
import jax
from absl import app, flags, logging
from comparison_report import summarize, write_markdown, write_plots
from equal_compute_report import budget_summary, render_budget
from ml_collections import config_dict, config_flags

from grpo_jax import config_blocks
from grpo_jax.specs import GROUP_MODES
from grpo_jax.tasks import build_task

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
flags.DEFINE_string(
    "budget",
    "",
    "Equal compute instead of equal steps: wall:<seconds> (training time per mode) or "
    "tokens:<n> (generated tokens per seed); seeds are vmapped (equal_compute.py).",
)
flags.DEFINE_integer(
    "eval_points", 10, "--budget: evaluations at fractions 1/n, ..., 1 of it.", lower_bound=1
)
flags.DEFINE_list(
    "metrics", [], "--budget: eval metrics to report (default: the task's, equal_compute.py)."
)


def load_config(flag, entry: str):
    """The config file's ``<mode>[,size]`` variant with the command line's overrides applied,
    then the entry's own settings: ``--modes=sampled,pruned:group.value_horizon=8`` runs the
    ``pruned`` variant with that field set (the entry is the mode's name in the report)."""
    mode, *settings = entry.split(":")
    path, _, arg = flag.config_filename.partition(":")
    sizes = [t.strip() for t in arg.split(",") if t.strip()]
    if any(t in GROUP_MODES for t in sizes):
        raise app.UsageError(f"--config={flag.config_filename}: give the group mode via --modes")
    config = config_blocks.load_config(path, ",".join([mode] + sizes))
    overrides = dict(config_flags.get_override_values(flag))
    if "group.mode" in overrides:
        raise app.UsageError("--config.group.mode is set by --modes, not overridden")
    config.update_from_flattened_dict(overrides)
    for item in settings:
        config_blocks.set_field(config, *item.split("=", 1))
    return config


def device_text() -> str:
    dev = jax.devices()[0]
    return f"{dev.device_kind} ({dev.platform}, {jax.device_count()} device(s))"


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.set_verbosity(logging.WARNING)
    out_dir = Path(FLAGS.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    seeds = [int(FLAGS.config.seed) + i for i in range(FLAGS.seeds)]
    if FLAGS.report_only:
        md = report_only(out_dir)
    elif FLAGS.budget:
        md = run_budget(out_dir, seeds)
    else:
        md = run_steps(out_dir, seeds)
    print(md)


def report_only(out_dir: Path) -> str:
    """Re-renders <name>.md and the PNGs from <name>.json (either kind of run); an
    equal-compute run's stored summary is recomputed with today's statistics too."""
    path = out_dir / f"{FLAGS.name}.json"
    raw = json.loads(path.read_text())
    stored = json.dumps(raw, indent=1, default=str)
    if FLAGS.note:  # a new note replaces the stored one; without one the stored note stays
        raw["note"] = FLAGS.note
    if "budget" in raw:
        raw["summary"] = budget_summary(raw["runs"], raw["metrics"], raw["reference_mode"])
    if json.dumps(raw, indent=1, default=str) != stored:
        path.write_text(json.dumps(raw, indent=1, default=str))
    if "budget" in raw:
        return render_budget(raw, out_dir, FLAGS.name)
    configs = {m: config_dict.ConfigDict(c) for m, c in raw["configs"].items()}
    pngs = write_plots(raw["runs"], out_dir, raw["device"], FLAGS.name)
    md = write_markdown(raw, configs, pngs, raw.get("note", ""))
    (out_dir / f"{FLAGS.name}.md").write_text(md)
    return md


def run_config(mode: str, seed: int):
    """A mode's config for one seed, as this script runs it (no progress bar, no TensorBoard)."""
    config = load_config(FLAGS["config"], mode)
    config.seed = seed
    if FLAGS.steps:
        config.train.num_steps = FLAGS.steps
    config.logging.progress = False
    config.logging.tensorboard = False
    return config


def run_budget(out_dir: Path, seeds) -> str:
    """--budget: every mode trained to the same wall time or generated tokens (seeds vmapped)."""
    try:
        budget = equal_compute.parse_budget(FLAGS.budget)
    except ValueError as e:
        raise app.UsageError(str(e)) from e
    if FLAGS.steps:
        raise app.UsageError("--budget replaces --steps: give one of them")
    configs = {mode: run_config(mode, seeds[0]) for mode in FLAGS.modes}
    init_from = equal_compute.warm_start(
        next(iter(configs.values())), Path(FLAGS.workdir_root), FLAGS.fresh
    )
    for config in configs.values():
        config.init_from = init_from  # every mode starts from the same checkpoint
    try:
        results = equal_compute.run_comparison(
            configs, seeds, budget, FLAGS.eval_points, FLAGS.metrics
        )
    except ValueError as e:  # a setting the vmapped program cannot run: one line
        raise app.UsageError(str(e)) from e
    meta = {"device": device_text(), "command": command_line(), "note": FLAGS.note}
    meta["overrides"] = dict(config_flags.get_override_values(FLAGS["config"]))
    raw = equal_compute.comparison_record(results, seeds, budget, FLAGS.eval_points, meta)
    text = json.dumps(raw, indent=1, default=str)
    (out_dir / f"{FLAGS.name}.json").write_text(text)
    return render_budget(json.loads(text), out_dir, FLAGS.name)


def run_steps(out_dir: Path, seeds) -> str:
    """The step-count comparison: every mode takes the same number of optimizer steps."""
    runs, configs = {}, {}  # mode -> list of per-seed dicts; mode -> the first seed's config
    first = run_config(FLAGS.modes[0], seeds[0])
    eval_task = build_task(first, "train")  # one task's compiled eval serves every run
    # the initial policy's held-out figures, the same for every mode at a seed
    init_evals = equal_compute.initial_evals(first, seeds, eval_task)
    root, vmapped = Path(FLAGS.workdir_root), FLAGS.vmap_seeds
    for mode in FLAGS.modes:
        cfgs = [run_config(mode, seed) for seed in seeds]
        configs[mode] = cfgs[0]
        per_seed = equal_steps.train_mode(mode, cfgs, seeds, vmapped, root, FLAGS.fresh)
        for config, result in zip(cfgs, per_seed, strict=True):
            rec = equal_steps.step_record(config, result, init_evals[config.seed], eval_task)
            runs.setdefault(mode, []).append(rec)
            print(
                f"  seed {rec['seed']}: wall {rec['wall_s']:.1f}s  "
                f"rollout_acc {rec['final']['eval/rollout_accuracy']:.4f}  "
                f"next_char_acc {rec['final']['eval/next_char_accuracy']:.4f}  "
                f"best_char {rec['best_char']!r}",
                flush=True,
            )
            heat = result[4] / "char_heatmap.png" if result[4] else None
            if mode in ("exhaustive", "adaptive") and rec["seed"] == seeds[0] and heat:
                if heat.exists():
                    shutil.copy(heat, out_dir / f"{FLAGS.name}_{mode}_char_heatmap.png")
    device = device_text()
    summary = summarize(runs)
    pngs = write_plots(runs, out_dir, device, FLAGS.name)
    raw = {
        "device": device,
        "jax": jax.__version__,  # the measuring process's: a re-render names it, not its own
        "command": command_line(),
        "overrides": dict(config_flags.get_override_values(FLAGS["config"])),
        "seeds": seeds,
        "seeds_parallel": bool(FLAGS.vmap_seeds),
        "modes": FLAGS.modes,
        "configs": {m: c.to_dict() for m, c in configs.items()},
        "summary": summary,
        "runs": runs,
        "note": FLAGS.note,
    }
    (out_dir / f"{FLAGS.name}.json").write_text(json.dumps(raw, indent=1, default=str))
    md = write_markdown(raw, configs, pngs, FLAGS.note)
    (out_dir / f"{FLAGS.name}.md").write_text(md)
    return md


def command_line():
    env = f"GRPO_JAX_DATA={os.environ['GRPO_JAX_DATA']} " if "GRPO_JAX_DATA" in os.environ else ""
    args = " ".join(map(shlex.quote, sys.argv[1:]))
    return env + "python experiments/exhaustive_vs_sampled.py " + args


if __name__ == "__main__":
    app.run(main)
