"""Equal-step runs for experiments/exhaustive_vs_sampled.py (the default, without --budget).

Every seed of a mode takes the same number of optimizer steps: one after another through the
library's trainer (``trainer.train_and_evaluate``, one workdir per run), or all seeds as one
program (``run_vmapped``: the train step vmapped over a leading seed axis of the state) with
a lean loop here: no checkpoints, no char heatmap. ``step_record`` turns one run into its
record in the comparison's JSON, adding the held-out first-char entropy of its final policy.
"""

import functools
import shutil
import statistics
import time
from pathlib import Path

import equal_compute
import jax
import jax.numpy as jnp
from absl import app
from comparison_report import EVAL_METRICS

from grpo_jax import data as data_lib
from grpo_jax import rollout as ro
from grpo_jax import sharding, trainer
from grpo_jax.metric_writers import read_metrics
from grpo_jax.model import make_model
from grpo_jax.objective import entropy_from_logits
from grpo_jax.policy import TokenPrompts, transformer_policy
from grpo_jax.tasks import build_task, shakespeare


@functools.cache
def _first_logits(model, horizon: int):
    """The policy's first-token logits on a context batch, jitted once per model (a hashable
    flax module): the Shakespeare task's own policy (policy.transformer_policy) at
    temperature 1. The task does not hand out its model, so only the module is rebuilt here
    from the config, as the task builds it."""
    policy = transformer_policy(
        model, ro.SamplingParams(temperature=1.0, top_k=0, top_p=1.0), horizon
    )
    return jax.jit(lambda params, ctx: policy.prefill(params, TokenPrompts(ctx, None, {}))[0])


def held_out_entropy(config, params, vocab_size: int):
    """Mean policy entropy (nats, temperature 1) of the first char on the eval windows."""
    c, h = config.data.context_len, config.data.horizon
    max_len = config.model.max_len or c + h
    model = make_model(config.model, vocab_size, max_len)
    corpus = shakespeare.load_corpus(config.data)  # chars or BPE, as the task's
    ctx, _ = data_lib.eval_windows(corpus.val, config.eval.num_windows, c, h)
    first_logits = _first_logits(model, h)(params, jnp.asarray(ctx))
    return float(entropy_from_logits(first_logits.astype(jnp.float32)).mean())


def run_one(config, workdir: Path, fresh: bool):
    if fresh and workdir.exists():
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
    t0 = time.perf_counter()
    try:
        step, inputs, states = equal_compute.vmapped_setup(config, seeds, task)
    except ValueError as e:
        raise app.UsageError(f"--vmap_seeds: {e}") from e
    multi = jax.jit(sharding.make_multi_seed_step(step.fused), donate_argnums=0)
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
            for i, scalars in enumerate(equal_compute.evaluate_seeds(task, states)):
                rows[i].append({"step": done, **scalars})
                last[i].update(scalars)
            t_last = time.perf_counter()
    params = [sharding.unstack_state(states, i).params for i in range(n)]
    jax.block_until_ready(params)
    return params, last, rows, time.perf_counter() - t0


def train_mode(mode, cfgs, seeds, vmapped: bool, workdir_root: Path, fresh: bool):
    """Per seed (params, last metrics, metrics rows, wall time, workdir or None)."""
    if vmapped:
        print(f"[{mode} seeds {seeds}] {cfgs[0].train.num_steps} steps, vmapped", flush=True)
        task = build_task(cfgs[0], "train")
        params, lasts, rowss, wall = run_vmapped(cfgs[0], seeds, task)
        wall /= len(seeds)  # the set's wall time, shared out
        per_seed = zip(params, lasts, rowss, strict=True)
        return [(p, last, rows, wall, None) for p, last, rows in per_seed]
    per_seed = []
    for config in cfgs:
        workdir = workdir_root / mode / f"seed_{config.seed}"
        print(f"[{mode} seed {config.seed}] -> {workdir}", flush=True)
        state, last, rows, wall = run_one(config, workdir, fresh)
        per_seed.append((state.params, last, rows, wall, workdir))
    return per_seed


def curve(rows, key, init_value):
    pts = [(0, init_value)] + [(int(r["step"]), r[key]) for r in rows if key in r]
    return [p[0] for p in pts], [float(p[1]) for p in pts]


def step_record(config, result, init_scalars, eval_task) -> dict:
    """One run's record in the step-count JSON."""
    p, last, rows, wall, workdir = result
    # the first logged interval includes the step's compilation: left out
    step_times = [r["step_time_s"] for r in rows if "step_time_s" in r]
    step_times = step_times[1:] or step_times
    best_id = int(last["eval/best_char_id"])
    return {
        "seed": config.seed,
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
        # step metrics under the trainer's (TRL's) names; records written before the
        # engine refactor say reward_mean for reward (nothing in the report reads these)
        "train_final": {k: last[k] for k in ("reward", "reward_spread", "kl", "loss") if k in last},
        "init": init_scalars,
        "curves": {k: curve(rows, k, init_scalars[k]) for k in EVAL_METRICS},
        "train_curves": {
            k: [(int(r["step"]), float(r[k])) for r in rows if k in r]
            for k in ("reward", "entropy")
        },
    }
