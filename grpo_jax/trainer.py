"""The host loop: restore-or-init, the jitted step, and the log / eval / checkpoint cadences.

Everything inside a step stays on device. The host reads one scalar (the loss) per step to
stop on a non-finite loss before anything is saved, and pulls the other metrics only at log
steps. Rerunning on the same workdir resumes from the latest checkpoint; because every step's
key is fold_in(rng, step), the resumed run ends with exactly the parameters an uninterrupted
run would.
"""

import contextlib
import functools
import json
import math
import time
from pathlib import Path

import jax
from absl import logging

from grpo_jax import checkpoint as ckpt_lib
from grpo_jax import diagnostics, integrity, interrupts, run_config, sharding
from grpo_jax.distributed import HeldError, is_main_process, training_loop
from grpo_jax.metric_writers import MetricWriter, ProgressBar
from grpo_jax.specs import TrainSpec
from grpo_jax.tasks import build_task


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


def run_identity(task):
    """What this run's checkpoints record and a resume checks: the vocabulary and data file."""
    return integrity.run_identity(task.vocab, task.data_sha256)


def initial_params(config, task):
    """Deterministic initial policy: random init from the seed, or ``init_from``'s params."""
    params = task.init_params(jax.random.PRNGKey(config.seed))
    if config.init_from:
        params = ckpt_lib.load_params(config.init_from, params, run_identity(task))
        logging.info("initialised params from %s", config.init_from)
    return params


def _warm_up_dir(config, workdir):
    """Where ``pretrain.before_train``'s warm-up runs (None when there is none)."""
    if not config.get("pretrain", {}).get("before_train", False) or config.init_from:
        return None
    return Path(workdir) / "pretrain"


def _with_init_from(config, target):
    config = config.copy_and_resolve_references()
    config.init_from = str(target)
    return config


def warm_up(config, workdir):
    """``pretrain.before_train``: the task's supervised warm-up runs first in
    ``workdir/pretrain`` (resumable like any run; a finished one is only reloaded) and GRPO
    starts from it. Returns the config GRPO runs with."""
    target = _warm_up_dir(config, workdir)
    if target is None:
        return config
    done = ckpt_lib.latest_step_of(target / "checkpoints")
    if done is None or done < int(config.pretrain.num_steps):
        if run_config.has_checkpoint(workdir):
            # GRPO started from the warm-up's last step, its initial params and reference:
            # training the warm-up on would change both under the run's checkpoints
            logging.info(
                "warm-up: GRPO in %s started from its step %s; pretrain.num_steps=%s changes "
                "nothing now",
                workdir, done, config.pretrain.num_steps,
            )  # fmt: skip
        else:
            logging.info("warm-up: supervised pretraining in %s", target)
            train_and_evaluate(config, str(target), "pretrain")
            signum = interrupts.agreed()
            if signum is not None:  # in its last step: stop before GRPO
                raise interrupts.Interrupted(signum, int(config.pretrain.num_steps))
    return _with_init_from(config, target)


def check_task_batch(config, task, mesh) -> None:
    """The setting whose rows the task's step splits over ``data`` must divide it."""
    batch = task.batch_setting
    sharding.check_batch(int(run_config.flat(config)[batch]), mesh, batch)


def _check_run(config, workdir, mode, task):
    """Everything that can refuse the run, before any file is written: the mesh (and the
    task's batch on it), the workdir (a file, "" or read-only), and the workdir's recorded
    config (run_config.py). Returns (TrainSpec, mesh, workdir Path, the config GRPO runs
    with, the recordable changes)."""
    tc = TrainSpec.from_config(config.train)
    mesh = sharding.make_mesh(config.get("mesh"))  # once per run; see sharding.py
    check_task_batch(config, task, mesh)
    workdir = run_config.check_workdir(workdir)
    target = _warm_up_dir(config, workdir) if mode == "train" else None
    resolved = config if target is None else _with_init_from(config, target)
    return tc, mesh, workdir, resolved, run_config.check_resume(workdir, resolved, mode)


def train_and_evaluate(config, workdir: str, mode: str = "train"):
    """Runs GRPO (mode=train) or a supervised mode (pretrain, train_judge) in ``workdir``.

    Returns the final TrainState and the last logged metrics. SIGINT/SIGTERM during the run
    finish the current step, save it and raise interrupts.Interrupted (interrupts.py)."""
    with interrupts.deferred():
        return _train_and_evaluate(config, workdir, mode)


def _build_in(config, workdir, mode):
    """The task, built in ``workdir`` (it may load what an earlier run kept there: a
    tokenizer) once the workdir has checkpoints: a run that failed before its first save
    binds nothing (run_config.check_resume), its kept files included. Every setting is
    checked before the workdir is touched."""
    kept = Path(str(workdir)).expanduser()
    return build_task(config, mode, workdir if run_config.has_checkpoint(kept) else None)


def _train_and_evaluate(config, workdir: str, mode: str = "train"):
    quiet_orbax()
    task = _build_in(config, workdir, mode)
    tc, mesh, workdir, resolved, changes = _check_run(config, workdir, mode, task)
    if mode == "train":
        config = warm_up(config, workdir)  # = resolved, once the warm-up's checkpoint exists
    params0 = initial_params(config, task)
    # what the run started from too: a resume whose init_from changed is refused on restore
    identity = {**run_identity(task), **integrity.init_identity(config.init_from, params0)}
    step_fn, inputs = task.build(params0, mesh=mesh)
    # state replicated (or FSDP over data), inputs replicated; compiled once for this mesh
    jstep, state, inputs, _ = sharding.jit_step(
        step_fn,
        mesh,
        task.make_state(params0),
        inputs,
        sharding.shards_params(config),
        wrap=trace_once,
    )
    ckpt = ckpt_lib.Checkpointer(
        workdir / "checkpoints", keep=tc.keep_checkpoints, identity=identity
    )
    if ckpt.latest_step() is not None:
        try:
            state = ckpt.restore(state)  # onto the template's shardings: this run's mesh
        except Exception:
            ckpt.close()  # no orbax threads left behind; the checkpoint itself is untouched
            raise
        if is_main_process():
            logging.info("resumed from %s at step %d", ckpt.directory, int(state.step))
    if int(state.step) >= task.num_steps:  # a finished run: nothing to add, not even a log
        ckpt.close()
        if is_main_process():
            logging.info(
                "%s is at step %d of %d: nothing to do", workdir, state.step, task.num_steps
            )
        return state, {}
    if is_main_process():
        logging.info("%s over %d devices", sharding.describe(mesh), mesh.size)
    run_config.record(workdir, resolved, changes, int(state.step), mode)  # the run goes ahead
    run_config.keep_files(workdir, task.files)
    writer = MetricWriter(
        workdir,
        tensorboard=config.logging.tensorboard,
        wandb=config.logging.wandb,
        wandb_project=config.logging.wandb_project,
        config=config,
        start_step=_logged_from(int(state.step), config),
    )
    try:
        return _loop(config, task, tc, jstep, state, inputs, workdir, ckpt, writer)
    finally:
        ckpt.close()
        writer.close()


def _loop(config, task, tc, jstep, state, inputs, workdir, ckpt, writer):
    """The host loop: one scalar read per step, metrics at log steps, the cadences."""
    monitor = diagnostics.Monitor(config.diagnostics, task.heldout_key)
    start = int(state.step)
    bar = ProgressBar(task.num_steps, start, config.logging.progress, tc.log_every)
    main_process = is_main_process()  # hooks' files and console lines: once, not per process
    last = {}
    if start == 0 and _eval_at_start(config):
        last.update(_evaluate(task, state.params, 0, writer, monitor))
    t_last, steps_since = time.perf_counter(), 0
    held = HeldError()  # an error in process 0's own work: all processes stop on it together
    # an error in the loop may be one process's alone: distributed.leave_on_error
    with training_loop(), contextlib.closing(bar):
        for step in range(start, task.num_steps):
            state, metrics = jstep(state, inputs)
            steps_since += 1
            loss = float(metrics["loss"])  # the one per-step host read
            done = step + 1  # steps are counted from 1, as metrics.jsonl and the checkpoints
            if not math.isfinite(loss):
                raise NonFiniteLossError(_non_finite(loss, done, ckpt.latest_step()))
            if task.hooks.on_step is not None:
                with held.hold():  # on every process, so that every process checks this step
                    if main_process:
                        task.hooks.on_step(workdir, done, metrics)
            if done % tc.log_every == 0 or done == task.num_steps:
                jax.block_until_ready(state.params)
                dt = time.perf_counter() - t_last
                host = {k: float(v) for k, v in jax.device_get(metrics).items() if v.ndim == 0}
                host["tokens_per_s"] = task.tokens_per_step * steps_since / max(dt, 1e-9)
                host["step_time_s"] = dt / steps_since
                with held.hold():
                    writer.write_scalars(done, host)
                last.update(host)
                for warning in monitor.update(done, host):
                    if main_process:
                        logging.warning(warning)
                t_last, steps_since = time.perf_counter(), 0
            if done % tc.eval_every == 0 or done == task.num_steps:
                t_eval = time.perf_counter()
                last.update(_evaluate(task, state.params, done, writer, monitor, held.hold))
                t_last += time.perf_counter() - t_eval  # keep eval time out of tokens_per_s
            held.check(done)  # before the checkpoint: a rerun redoes the step, as on one process
            # (a gather on several processes, after a step that held work only)
            if done % tc.checkpoint_every == 0 or done == task.num_steps:
                ckpt.save(done, state, force=True)
            bar.update(done, **{k: last[k] for k in task.log_keys if k in last})
            # The last step gathers too: a process failing alone after its checkpoint then finds
            # the others waiting here (distributed.training_loop), not finished.
            signum = interrupts.agreed()
            if signum is not None and done < task.num_steps:  # a finished run ends as one
                _stop(ckpt, writer, done, state, signum, held)
    if task.hooks.on_end is not None and main_process:
        task.hooks.on_end(workdir)
    return state, last


def _non_finite(loss, step, saved):
    kept = "no checkpoint was saved yet" if saved is None else f"checkpoint {saved} is kept"
    return f"non-finite loss ({loss}) at step {step}: stopping; {kept}; lower optim.learning_rate"


def _eval_at_start(config) -> bool:
    return bool(config.train.get("eval_at_start", False))


def _logged_from(start: int, config) -> int:
    """The last step whose logs a run starting at ``start`` keeps (MetricWriter's start_step):
    a resume logs the steps after it again; a run that evaluates its step 0 logs that too."""
    return -1 if start == 0 and _eval_at_start(config) else start


def _stop(ckpt, writer, done, state, signum, held):
    """On a signal: save this step (unless the cadence just did), make it durable, flush the
    logs, and raise Interrupted for the CLI's one line and exit status (or, when process 0's
    flush failed, its error on every process: ``held``, as in the loop)."""
    ckpt.wait()  # the cadence may have just saved this step (asynchronously)
    # not merely "exists": a resume may have fallen back past this step's damaged folder
    saved = ckpt.has_intact(done) or ckpt.save(done, state, force=True)
    ckpt.wait()
    with held.hold():
        writer.flush()
    held.check(done)
    raise interrupts.Interrupted(signum, done, saved)


def _evaluate(task, params, step, writer, monitor, hold=contextlib.nullcontext):
    scalars, texts = task.evaluate(params)  # on every process: one program over the mesh
    with hold():  # the writer is a no-op outside process 0
        writer.write_scalars(step, scalars)
        writer.write_text(step, "samples", texts["samples"])
    warnings = monitor.update(step, scalars)
    if not is_main_process():
        return scalars
    for warning in warnings:
        logging.warning(warning)
    summary = json.dumps({k: round(v, 4) for k, v in scalars.items()})
    logging.info("step %d eval: %s %s", step, summary, texts.get("summary", ""))
    return scalars


def restore_params(config, workdir: str):
    """The params of the latest checkpoint in workdir; a workdir without one is refused
    (nothing is created: an evaluation of a random init would pass for the run's)."""
    return _restore(config, workdir)[1]


def _restore(config, workdir: str):
    """(the task, the latest checkpoint's params). The workdir is checked before the task
    is built: building may read the corpus or train a BPE tokenizer, minutes spent on a
    workdir that is then refused."""
    path = Path(workdir).expanduser()
    if path.is_file():
        raise ValueError(f"--workdir {workdir} is a file; pass the directory of a run")
    run_config.check_evaluation(path, config)
    directory = path / "checkpoints"
    if ckpt_lib.latest_step_of(directory) is None:
        raise ValueError(
            f"--workdir {workdir} has no checkpoint to evaluate or sample; train there first "
            "(--mode=train) or pass the workdir of a run"
        )
    task = build_task(config, "eval", workdir)  # it has a checkpoint: its kept files bind
    quiet_orbax()
    template = task.make_state(task.init_params(jax.random.PRNGKey(config.seed)))
    ckpt = ckpt_lib.Checkpointer(
        directory, keep=config.train.keep_checkpoints, identity=run_identity(task)
    )
    try:
        return task, ckpt.restore(template).params
    finally:
        ckpt.close()


def evaluate_only(config, workdir: str):
    """--mode=eval / --mode=sample: evaluate the latest checkpoint in workdir."""
    task, params = _restore(config, workdir)
    return task.evaluate(params)
