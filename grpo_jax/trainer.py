"""The host loop: restore-or-init, the jitted step, and the log / eval / checkpoint cadences.

Everything inside a step stays on device. The host reads one scalar (the loss) per step to
stop on a non-finite loss before anything is saved, and pulls the other metrics only at log
steps. Rerunning on the same workdir resumes from the latest checkpoint; because every step's
key is fold_in(rng, step), the resumed run ends with exactly the parameters an uninterrupted
run would.
"""

import functools
import json
import math
import time

import jax
import numpy as np
from absl import logging

from grpo_jax import checkpoint as ckpt_lib
from grpo_jax import diagnostics, plots, sharding
from grpo_jax.metric_writers import MetricWriter, ProgressBar
from grpo_jax.task import build_task

KEY_FIGURES = ("loss", "reward_mean", "kl", "eval/next_char_accuracy")


class _QuietOrbax:
    """absl log filter: orbax narrates every save at INFO; keep its warnings only."""

    def filter(self, record):
        return record.levelno >= 30 or "/orbax/" not in record.pathname  # 30 = WARNING


def quiet_orbax():
    handler = logging.get_absl_handler()
    if not any(isinstance(f, _QuietOrbax) for f in handler.filters):
        handler.addFilter(_QuietOrbax())


def trace_once(fn):
    """Like ``chex.assert_max_traces(fn, n=1)``, but counting per call of this function.

    chex keys its counter by the call stack and source of ``fn``, so a second
    ``train_and_evaluate`` in the same process (a test, a notebook, a sweep) would
    wrongly count as a retrace of the first run's step."""
    traces = 0

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        nonlocal traces
        traces += 1
        if traces > 1:
            raise AssertionError(
                f"{fn.__name__} is traced {traces} times; the jitted step must compile once "
                "(an input changed shape, dtype or structure between steps)"
            )
        return fn(*args, **kwargs)

    return wrapped


class NonFiniteLossError(RuntimeError):
    """Raised when the loss is NaN/inf; the last good checkpoint is left in place."""


def initial_params(config, task):
    """Deterministic initial policy: random init from the seed, or ``init_from``'s params."""
    params = task.init_params(jax.random.PRNGKey(config.seed))
    if config.init_from:
        params = ckpt_lib.load_params(config.init_from, params)
        logging.info("initialised params from %s", config.init_from)
    return params


def train_and_evaluate(config, workdir: str, mode: str = "train"):
    """Runs GRPO (mode=train) or supervised pretraining (mode=pretrain) in ``workdir``.

    Returns the final TrainState and the last logged metrics."""
    quiet_orbax()
    task = build_task(config, mode)
    params0 = initial_params(config, task)
    mesh = sharding.make_mesh(config.get("mesh"))  # once per run; see sharding.py
    if mode == "train":
        sharding.check_batch(config.train.batch_size, mesh)
        if "mode" in config.get("group", {}):
            sharding.check_group_mode(config.group.mode, mesh)
    step_fn, inputs = task.build(params0, mesh=mesh)
    # state replicated (or FSDP over data), inputs replicated; compiled once for this mesh
    jstep, state, inputs, _ = sharding.jit_step(
        step_fn,
        mesh,
        task.make_state(params0),
        inputs,
        bool(config.get("mesh", {}).get("shard_params", False)),
        wrap=trace_once,
    )
    workdir = ckpt_lib.ensure_workdir(workdir)  # after the config checks: bad input makes no dir
    ckpt = ckpt_lib.Checkpointer(workdir / "checkpoints", keep=config.train.keep_checkpoints)
    if ckpt.latest_step() is not None:
        try:
            state = ckpt.restore(state)  # onto the template's shardings: this run's mesh
        except Exception:
            ckpt.close()  # no orbax threads left behind; the checkpoint itself is untouched
            raise
        logging.info("resumed from %s at step %d", ckpt.directory, int(state.step))
    logging.info("%s over %d devices", sharding.describe(mesh), mesh.size)
    ckpt_lib.save_config(workdir, config)

    writer = MetricWriter(
        workdir,
        tensorboard=config.logging.tensorboard,
        wandb=config.logging.wandb,
        wandb_project=config.logging.wandb_project,
        config=config,
    )
    monitor = diagnostics.Monitor(config.diagnostics)
    tc = config.train
    start = int(state.step)
    bar = ProgressBar(task.num_steps, start, config.logging.progress)
    char_acc, char_n = None, 0
    last, t_last, steps_since = {}, time.perf_counter(), 0
    try:
        for step in range(start, task.num_steps):
            state, metrics = jstep(state, inputs)
            steps_since += 1
            loss = float(metrics["loss"])  # the one per-step host read
            if not math.isfinite(loss):
                raise NonFiniteLossError(
                    f"non-finite loss ({loss}) at step {step}: stopping; the last good "
                    f"checkpoint (step {ckpt.latest_step()}) is kept; lower optim.learning_rate"
                )
            if "char/reward" in metrics:
                cm = np.stack([metrics["char/reward"], metrics["char/best"]])
                char_acc = cm if char_acc is None else char_acc + cm
                char_n += 1
            done = step + 1
            if done % tc.log_every == 0 or done == task.num_steps:
                jax.block_until_ready(state.params)
                dt = time.perf_counter() - t_last
                host = {k: float(v) for k, v in jax.device_get(metrics).items() if v.ndim == 0}
                host["tokens_per_s"] = task.tokens_per_step * steps_since / max(dt, 1e-9)
                host["step_time_s"] = dt / steps_since
                writer.write_scalars(done, host)
                last.update(host)
                for warning in monitor.update(done, host):
                    logging.warning(warning)
                t_last, steps_since = time.perf_counter(), 0
            every = config.logging.char_stats_every
            if char_acc is not None and every and (done % every == 0 or done == task.num_steps):
                _write_char_stats(workdir, done, char_acc / char_n, task.vocab)
                char_acc, char_n = None, 0
            if done % tc.eval_every == 0 or done == task.num_steps:
                scalars, texts = task.evaluate(state.params)
                writer.write_scalars(done, scalars)
                writer.write_text(done, "samples", texts["samples"])
                last.update(scalars)
                for warning in monitor.update(done, scalars):
                    logging.warning(warning)
                logging.info(
                    "step %d eval: %s best_char=%r",
                    done,
                    json.dumps({k: round(v, 4) for k, v in scalars.items()}),
                    texts["best_char"],
                )
                t_last = time.perf_counter()  # keep eval time out of tokens_per_s
            if done % tc.checkpoint_every == 0 or done == task.num_steps:
                ckpt.save(done, state, force=True)
            bar.update(done, **{k: last[k] for k in KEY_FIGURES if k in last})
    finally:
        bar.close()
        ckpt.close()
        writer.close()
    if (workdir / "char_stats.jsonl").exists():
        plots.char_heatmap(workdir / "char_stats.jsonl", workdir / "char_heatmap.png")
    return state, last


def _write_char_stats(workdir, step, stats, vocab):
    row = {
        "step": step,
        "chars": vocab.chars,
        "reward": [round(float(x), 5) for x in stats[0]],
        "best": [round(float(x), 5) for x in stats[1]],
    }
    with open(workdir / "char_stats.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def restore_params(config, workdir: str, task=None):
    """The params of the latest checkpoint in workdir (else init_from / a fresh init)."""
    task = task or build_task(config, "eval")
    params = initial_params(config, task)
    workdir = ckpt_lib.ensure_workdir(workdir)
    ckpt = ckpt_lib.Checkpointer(workdir / "checkpoints", keep=config.train.keep_checkpoints)
    if ckpt.latest_step() is not None:
        params = ckpt.restore(task.make_state(params)).params
    ckpt.close()
    return params


def evaluate_only(config, workdir: str):
    """--mode=eval: evaluate the latest checkpoint in workdir (or init_from / a fresh init)."""
    task = build_task(config, "eval")
    return task.evaluate(restore_params(config, workdir, task))
