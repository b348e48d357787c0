"""The host loop end to end on the tiny config: resume, metrics, pretrain/init_from, NaN stop,
every group mode.

Each distinct step program is compiled once per module: runs are module-scoped fixtures that
several tests read, XLA runs with most optimisations off, and a persistent compilation cache
(shared with tests/test_cli.py) turns recompiles of an identical program into loads.
"""

import functools
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax import checkpoint as ckpt_lib
from grpo_jax import trainer
from grpo_jax.config_blocks import load_config
from grpo_jax.engine import STEP_METRICS
from grpo_jax.metric_writers import read_metrics

ROOT = Path(__file__).resolve().parents[1]
TRAIN_KEYS = STEP_METRICS + ("tokens_per_s",)
EVAL_KEYS = ("eval/next_char_accuracy", "eval/rollout_accuracy", "eval/val_loss", "eval/pass_at_1")
TIMING_KEYS = ("tokens_per_s", "step_time_s")


def get_config(arg):
    return load_config("shakespeare", arg)


pytestmark = pytest.mark.usefixtures("fast_compiles")  # conftest.py


def tiny(data_path, mode="exhaustive", num_steps=4, **train):
    """The tiny config; evaluation and checkpoints every 2 steps and at the end."""
    c = get_config(f"{mode},tiny")
    c.data.path = str(data_path)
    c.train.num_steps = num_steps
    c.train.eval_every = 2
    c.train.checkpoint_every = 2
    c.train.update(train)
    return c


class Recorder:
    """Wraps trainer.build_task: counts traces of the step, optionally rewrites it or the task."""

    def __init__(self, monkeypatch, wrap_step=None, num_steps=None):
        self.traces = 0
        real_build_task = trainer.build_task

        def build_task(config, mode="train", workdir=None):
            task = real = real_build_task(config, mode, workdir)

            def build(params, **kwargs):
                step, inputs = real.build(params, **kwargs)
                step = getattr(step, "fused", step)  # an engine.Step as one function
                step = wrap_step(step) if wrap_step else step

                @functools.wraps(step)
                def counted(state, inputs):
                    self.traces += 1  # Python side effect: runs once per trace only
                    return step(state, inputs)

                return counted, inputs

            task = task._replace(build=build)
            if num_steps is not None:  # Stop early like a killed run (same lr schedule).
                task = task._replace(num_steps=num_steps)
            return task

        monkeypatch.setattr(trainer, "build_task", build_task)


def run(config, workdir, mode="train", **recorder):
    with pytest.MonkeyPatch.context() as mp:
        rec = Recorder(mp, **recorder)
        state, last = trainer.train_and_evaluate(config, str(workdir), mode)
    return jax.device_get(state), last, rec.traces


def leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def assert_trees_equal(a, b):
    la, lb = leaves(a), leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.array_equal(x, y)


def differs(a, b):
    """Whether two same-structured trees differ in at least one element."""
    return any(not np.array_equal(x, y) for x, y in zip(leaves(a), leaves(b), strict=True))


def without_timing(rows):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


# ---------------------------------------------------------------------------------------------
# 1 + 2: resume == uninterrupted; the metrics/artefacts contract (on the uninterrupted run).


@pytest.fixture(scope="module")
def resume_runs(tmp_path_factory, shakespeare_path):
    config = tiny(shakespeare_path)
    root = tmp_path_factory.mktemp("resume")
    a = run(config, root / "a")
    # "Killed" after step 2 (checkpointed), with the config unchanged: a run with
    # train.num_steps=2 would have another lr schedule, so it could not be resumed to 4.
    b1 = run(config, root / "b", num_steps=2)
    b1_ckpt_steps = sorted(int(p.name) for p in (root / "b/checkpoints").iterdir())
    b2 = run(config, root / "b")
    return {"root": root, "a": a, "b1": b1, "b2": b2, "b1_ckpt_steps": b1_ckpt_steps}


def test_resume_is_bitwise_equal_to_uninterrupted(resume_runs):
    root = resume_runs["root"]
    (state_a, _, traces_a), (state_b1, _, _), (state_b2, _, traces_b2) = (
        resume_runs[k] for k in ("a", "b1", "b2")
    )
    assert int(state_b1.step) == 2 and resume_runs["b1_ckpt_steps"] == [2]
    assert int(state_a.step) == int(state_b2.step) == 4
    assert traces_a == traces_b2 == 1  # one compile per run, also when resuming
    assert_trees_equal(state_a.params, state_b2.params)
    assert_trees_equal(state_a.opt_state, state_b2.opt_state)
    assert_trees_equal(state_a.rng, state_b2.rng)
    # The test can fail: training moved the params between step 2 and step 4.
    assert differs(state_b1.params, state_a.params)

    # B's second run really resumed from step 2: it logged steps 3 and 4 only ...
    rows_b = read_metrics(root / "b")
    train_steps = [r["step"] for r in rows_b if "loss" in r]
    assert train_steps == [1, 2, 3, 4]
    assert sorted(int(p.name) for p in (root / "b/checkpoints").iterdir()) == [2, 4]
    # ... and B's history (first + second run) is A's, row for row (timings aside).
    assert without_timing(rows_b) == without_timing(read_metrics(root / "a"))
    restored = ckpt_lib.Checkpointer(root / "b/checkpoints")
    try:
        assert_trees_equal(restored.restore(state_a, step=4).params, state_a.params)
    finally:
        restored.close()


def test_metrics_and_artefacts(resume_runs):
    wd = resume_runs["root"] / "a"
    _, last, _ = resume_runs["a"]
    rows = read_metrics(wd)
    train_rows = [r for r in rows if "loss" in r]
    eval_rows = [r for r in rows if "eval/val_loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4]
    assert [r["step"] for r in eval_rows] == [2, 4]
    for row in train_rows:
        assert set(TRAIN_KEYS) <= set(row), sorted(set(TRAIN_KEYS) - set(row))
    for row in eval_rows:
        assert set(EVAL_KEYS) <= set(row), sorted(set(EVAL_KEYS) - set(row))
    for row in rows:
        for key, value in row.items():
            assert isinstance(value, int | float) and math.isfinite(value), (row["step"], key)
    assert set(TRAIN_KEYS + EVAL_KEYS) <= set(last)
    assert 0.0 <= last["eval/next_char_accuracy"] <= 1.0

    samples = (wd / "samples.txt").read_text()
    assert "=== step 2 ===" in samples and "=== step 4 ===" in samples
    assert list((wd / "tb").glob("events.out.tfevents.*"))
    config = json.loads((wd / "config.json").read_text())
    assert config["train"]["num_steps"] == 4 and config["group"]["mode"] == "exhaustive"
    stats = [json.loads(line) for line in (wd / "char_stats.jsonl").read_text().splitlines()]
    assert [s["step"] for s in stats] == [1, 2, 3, 4]  # tiny: char_stats_every=1
    for s in stats:
        assert len(s["chars"]) == len(s["reward"]) == len(s["best"])
        assert all(math.isfinite(x) for x in s["reward"] + s["best"])


# ---------------------------------------------------------------------------------------------
# 3: pretrain, then GRPO initialised from it.


def test_pretrain_then_init_from(tmp_path, shakespeare_path):
    config = tiny(shakespeare_path)
    pre_state, pre_last, traces = run(config, tmp_path / "pre", mode="pretrain")
    assert traces == 1
    assert int(pre_state.step) == config.pretrain.num_steps == 3
    assert math.isfinite(pre_last["loss"]) and "train_accuracy" in pre_last
    assert "eval/val_loss" in pre_last
    assert (tmp_path / "pre/checkpoints/3").is_dir()

    grpo = tiny(shakespeare_path, num_steps=0)  # build and restore only; no step runs
    grpo.init_from = str(tmp_path / "pre")
    task = trainer.build_task(grpo)
    loaded = ckpt_lib.load_params(tmp_path / "pre", task.init_params(jax.random.PRNGKey(0)))
    assert_trees_equal(loaded, pre_state.params)
    assert_trees_equal(trainer.initial_params(grpo, task), pre_state.params)
    state, _, _ = run(grpo, tmp_path / "grpo")
    assert int(state.step) == 0
    assert_trees_equal(state.params, pre_state.params)  # GRPO starts from the pretrained params
    grpo.init_from = ""
    fresh = trainer.initial_params(grpo, task)
    assert differs(fresh, pre_state.params)


def test_a_resume_whose_init_from_moved_on_is_refused(tmp_path, shakespeare_path):
    """Every resume reads its initial params and KL reference from init_from again: a resume
    goes ahead while init_from holds the params the run started from, and once pretraining
    went on there it is refused in one line (it trained on against another reference, kl
    7.4e-4 instead of 1e-15 on arithmetic:tiny), the run's checkpoints untouched."""
    pre = tiny(shakespeare_path)
    run(pre, tmp_path / "pre", mode="pretrain")
    grpo = tiny(shakespeare_path)
    grpo.init_from = str(tmp_path / "pre")
    run(grpo, tmp_path / "grpo", num_steps=2)  # stopped after step 2
    assert int(run(grpo, tmp_path / "grpo", num_steps=3)[0].step) == 3  # the same init_from
    pre.pretrain.num_steps += 1
    run(pre, tmp_path / "pre", mode="pretrain")  # pretraining goes on into init_from
    saved = {p: p.read_bytes() for p in (tmp_path / "grpo").rglob("*") if p.is_file()}
    with pytest.raises(ckpt_lib.CheckpointError, match=r"init_from \S*pre's latest checkpoint"):
        run(grpo, tmp_path / "grpo")
    assert {p: p.read_bytes() for p in (tmp_path / "grpo").rglob("*") if p.is_file()} == saved


def test_a_signal_in_the_last_step_finishes_the_run(tmp_path, shakespeare_path, monkeypatch):
    """SIGTERM during the final step: the run is complete, so it ends as one (on_end draws
    the heatmap) instead of reporting an interruption a rerun could not resume from."""
    import signal

    from grpo_jax import interrupts

    monkeypatch.setattr(interrupts, "requested", lambda: signal.SIGTERM)
    state, _, _ = run(tiny(shakespeare_path), tmp_path, num_steps=1)  # the resume run's program
    assert int(state.step) == 1 and (tmp_path / "char_heatmap.png").is_file()


def test_step_time_counts_every_step_and_no_evaluation(tmp_path, shakespeare_path, monkeypatch):
    """On a clock where a step takes 1 s and an evaluation 100 s, with an evaluation every
    step and a log every 2: step_time_s is 1 s (eval time out, both steps in)."""
    clock = [0.0]
    monkeypatch.setattr(trainer.time, "perf_counter", lambda: clock[0])
    real_jit_step = trainer.sharding.jit_step

    def jit_step(*args, **kwargs):
        jstep, *rest = real_jit_step(*args, **kwargs)

        def timed(state, inputs):
            clock[0] += 1.0
            return jstep(state, inputs)

        return (timed, *rest)

    def evaluate(task, params, step, writer, monitor, hold=None):
        clock[0] += 100.0
        return {}

    monkeypatch.setattr(trainer.sharding, "jit_step", jit_step)
    monkeypatch.setattr(trainer, "_evaluate", evaluate)
    config = tiny(shakespeare_path, log_every=2, eval_every=1, checkpoint_every=4)
    run(config, tmp_path)
    times = [r["step_time_s"] for r in read_metrics(tmp_path) if "step_time_s" in r]
    assert times == [1.0, 1.0]


def test_a_resumed_runs_char_stats_drop_the_rows_it_logs_again(tmp_path):
    """char_stats.jsonl rows of steps past a resume's start (a run killed after its last
    checkpoint) are dropped at the resumed run's first step, as metrics.jsonl's rows."""
    from grpo_jax.tasks.shakespeare import char_stats_hooks

    path = tmp_path / "char_stats.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3, 4)))
    hooks = char_stats_hooks(1, ["a", "b"])
    metrics = {"first_token/reward": np.array([1.0, 0.0]), "first_token/best": np.array([1, 0])}
    hooks.on_step(tmp_path, 3, metrics)  # resumed from checkpoint 2
    hooks.on_step(tmp_path, 4, metrics)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3, 4]


def test_a_char_stats_row_names_the_steps_it_averages(tmp_path):
    """char_stats_every=2: a row averages its window's steps (1-2), and a run resumed inside a
    window (checkpoint 3, resumed at 4) writes a row of step 4 alone, saying so."""
    from grpo_jax.tasks.shakespeare import char_stats_hooks

    m = lambda r: {"first_token/reward": np.array([r, 0.0]), "first_token/best": np.array([1, 0])}
    hooks = char_stats_hooks(2, ["a", "b"])
    for step, r in ((1, 1.0), (2, 3.0), (3, 5.0)):
        hooks.on_step(tmp_path, step, m(r))
    char_stats_hooks(2, ["a", "b"]).on_step(tmp_path, 4, m(8.0))  # the resumed run
    rows = [json.loads(line) for line in (tmp_path / "char_stats.jsonl").read_text().splitlines()]
    got = [(r["step"], r["first_step"], r["reward"][0]) for r in rows]
    assert got == [(2, 1, 2.0), (4, 4, 8.0)]


# ---------------------------------------------------------------------------------------------
# 4: a non-finite loss stops the run before anything is saved; the last checkpoint survives.


def nan_loss_at(step_index):
    """Wraps a step so that its reported loss is NaN when state.step == step_index (pure)."""

    def wrap(step):
        @functools.wraps(step)
        def nan_step(state, inputs):
            new_state, metrics = step(state, inputs)
            loss = jnp.where(state.step == step_index, jnp.nan, metrics["loss"])
            return new_state, {**metrics, "loss": loss}

        return nan_step

    return wrap


def test_non_finite_loss_stops_and_keeps_checkpoint(tmp_path, shakespeare_path):
    # The host loop is the same for both modes; pretraining's step is the cheaper compile.
    config = tiny(shakespeare_path)
    config.pretrain.num_steps = 4
    with pytest.raises(trainer.NonFiniteLossError) as err:
        run(config, tmp_path, mode="pretrain", wrap_step=nan_loss_at(2))
    message = str(err.value)
    assert "\n" not in message and "nan" in message and "at step 3:" in message
    assert "checkpoint 2 is kept" in message
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()) == [2]
    assert max(r["step"] for r in read_metrics(tmp_path)) == 2  # step 3 was never logged
    task = trainer.build_task(config, "pretrain")
    template = task.make_state(task.init_params(jax.random.PRNGKey(0)))
    ckpt = ckpt_lib.Checkpointer(tmp_path / "checkpoints")
    try:
        restored = jax.device_get(ckpt.restore(template))
    finally:
        ckpt.close()
    assert int(restored.step) == 2
    assert all(np.isfinite(x).all() for x in leaves(restored.params))
    assert differs(restored.params, template.params)  # it trained before the NaN


# ---------------------------------------------------------------------------------------------
# 5: every group mode trains, with a finite loss and a step traced (compiled) exactly once.


@pytest.mark.parametrize("mode", ["exhaustive", "sampled", "guided", "adaptive"])
def test_group_modes_train_and_compile_once(mode, resume_runs, tmp_path, shakespeare_path):
    if mode == "exhaustive":  # already trained above; don't compile it again
        state, last, traces = resume_runs["a"]
    else:
        state, last, traces = run(tiny(shakespeare_path, mode, num_steps=2), tmp_path)
        assert (tmp_path / "checkpoints/2").is_dir()
    assert traces == 1
    assert int(state.step) >= 2
    assert math.isfinite(last["loss"]) and math.isfinite(last["grad_norm"])
    assert math.isfinite(last["eval/val_loss"])


def test_trace_once_rejects_a_retrace_per_run():
    def f(x):
        return x * 2

    first = jax.jit(trainer.trace_once(f))
    first(jnp.zeros(2))
    first(jnp.ones(2))  # same shapes: cached, no retrace
    with pytest.raises(AssertionError, match="traced 2 times"):
        first(jnp.zeros(3))
    # A new run (a new wrapper of the same function) starts its own count.
    jax.jit(trainer.trace_once(f))(jnp.zeros(2))
