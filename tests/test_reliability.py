"""Reliability (issue 16): checkpoints that prove their integrity, clean interrupts, and logs
that stay true across resumes.

The in-process runs share the session's persistent compilation cache (conftest.py
``fast_compiles``), so after the first compile each costs little more than its steps.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _damage import flip_bit
from conftest import compilation_cache_dir, signal_after
from test_cli import ABSL_LOG_LINE

from grpo_jax import checkpoint as ckpt_lib
from grpo_jax import trainer
from grpo_jax.config_blocks import load_config
from grpo_jax.metric_writers import read_metrics

pytestmark = pytest.mark.usefixtures("fast_compiles")  # conftest.py


def tiny(data_path, num_steps=4, **train):
    c = load_config("shakespeare", "tiny")
    c.data.path = str(data_path)
    c.train.num_steps = num_steps
    c.train.eval_every = 100  # evaluation only at the end: these tests are about the loop
    c.train.checkpoint_every = 2
    c.train.keep_checkpoints = 3
    c.train.update(train)
    return c


def host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def assert_bitwise(a, b):
    la, lb = host(a), host(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes()


def snapshot(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()
    }


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_bit_flip_is_named_and_the_run_falls_back(tmp_path, shakespeare_path, caplog):
    config = tiny(shakespeare_path)
    work = tmp_path / "run"
    final, _ = trainer.train_and_evaluate(config, str(work), "train")  # checkpoints 2 and 4
    flip_bit(work / "checkpoints" / "4")
    damaged = snapshot(work / "checkpoints" / "4")
    caplog.set_level(logging.WARNING)
    again, _ = trainer.train_and_evaluate(config, str(work), "train")
    lines = [w for w in warnings_of(caplog) if "damaged" in w]
    assert len(lines) >= 1 and "\n" not in lines[0], warnings_of(caplog)
    # The middle of the largest data file holds Adam's moments here; a flip in the params
    # file reads "params" (both are named by the same check).
    named = r"step 4 is damaged: (params|opt_state) bytes do not match the digest saved with them"
    assert re.search(
        named + r" \((params|opt_state): saved [0-9a-f]{12}…, read [0-9a-f]{12}…\)", lines[0]
    )
    assert lines[0].endswith("falling back to the previous checkpoint")
    # Resumed from step 2 and retrained steps 3-4: bitwise the uninterrupted run's state.
    assert int(again.step) == 4
    assert_bitwise(again, final)
    # The damaged folder was set aside, byte for byte, not deleted or rewritten.
    assert snapshot(work / "checkpoints" / "4.damaged") == damaged
    assert ckpt_lib.latest_step_of(work / "checkpoints") == 4


def test_same_size_corpus_with_other_characters_is_refused(tmp_path, shakespeare_path):
    corpus = tmp_path / "corpus.txt"
    text = shakespeare_path.read_text(encoding="utf-8")
    assert "Z" in text and "~" not in text
    corpus.write_text(text, encoding="utf-8")
    config = tiny(corpus, num_steps=2)
    trainer.train_and_evaluate(config, str(tmp_path / "run"), "train")
    before = snapshot(tmp_path / "run")
    corpus.write_text(text.replace("Z", "~"), encoding="utf-8")  # same size, same V = 65
    config.train.num_steps = 4
    with pytest.raises(ckpt_lib.CheckpointError) as err:
        trainer.train_and_evaluate(config, str(tmp_path / "run"), "train")
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("checkpoint step 2 was trained on a vocabulary with digest ")
    assert "same-size corpus with other characters?" in msg
    assert snapshot(tmp_path / "run") == before


# --- Checkpointer-level: damaged and uncommitted steps (no model, no compile) -------------


def state_of(seed: int):
    w = jax.random.normal(jax.random.PRNGKey(seed), (256,))
    return {"params": {"w": w}, "step": jnp.asarray(seed, jnp.int32)}


def saved(directory: Path, steps=(1, 2)) -> Path:
    with ckpt_lib.Checkpointer(directory) as ckpt:
        for s in steps:
            ckpt.save(s, state_of(s), force=True)
    return directory


def test_emptied_manifest_falls_back_then_refuses(tmp_path, caplog):
    directory = saved(tmp_path / "checkpoints")
    (directory / "2" / "state" / "manifest.ocdbt").write_bytes(b"")
    caplog.set_level(logging.WARNING)
    with ckpt_lib.Checkpointer(directory) as ckpt:
        assert_bitwise(ckpt.restore(state_of(0)), state_of(1))
    line = [w for w in warnings_of(caplog) if "unreadable" in w]
    assert len(line) == 1 and "\n" not in line[0]
    assert line[0].startswith(f"checkpoint at {directory} step 2 is unreadable (")
    (directory / "1" / "state" / "manifest.ocdbt").write_bytes(b"")
    before = snapshot(directory)
    with ckpt_lib.Checkpointer(directory) as ckpt:
        with pytest.raises(ckpt_lib.CheckpointError) as err:
            ckpt.restore(state_of(0))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"no intact checkpoint in {directory} (")
    assert "step 2 is unreadable" in msg and "step 1 is unreadable" in msg
    assert snapshot(directory) == before  # never deleted or rewritten


def test_uncommitted_step_folders_are_ignored_with_a_warning(tmp_path, caplog):
    directory = saved(tmp_path / "checkpoints")
    shutil.copytree(directory / "2", directory / "3")  # a save that never committed
    (directory / "3" / "commit_success.txt").unlink(missing_ok=True)
    (directory / "3" / "_CHECKPOINT_METADATA").unlink()
    (directory / "4.orbax-checkpoint-tmp-123").mkdir()  # orbax's own unfinished save
    caplog.set_level(logging.WARNING)
    with ckpt_lib.Checkpointer(directory) as ckpt:
        assert ckpt.latest_step() == 2
        assert_bitwise(ckpt.restore(state_of(0)), state_of(2))
        ignored = [w for w in warnings_of(caplog) if w.startswith("ignoring uncommitted")]
        assert sorted(w.split(" ")[4].rsplit("/", 1)[1] for w in ignored) == [
            "3",
            "4.orbax-checkpoint-tmp-123",
        ]
        # The run goes on: step 3 is saved, the stray folder set aside (not deleted).
        assert ckpt.save(3, state_of(3), force=True)
        ckpt.wait()
        assert_bitwise(ckpt.restore(state_of(0)), state_of(3))
    assert (directory / "3.damaged" / "state").is_dir()
    assert ckpt_lib.latest_step_of(directory) == 3


def test_a_signal_saves_its_step_over_the_damaged_one_a_resume_fell_back_past(tmp_path):
    """A resume fell back past step 2's damaged folder and a signal came at step 2: the step is
    saved (the damaged folder set aside) and said so, once. It was skipped because step 2
    existed, with "checkpoint saved" printed, and the rerun fell back past it again; where the
    folder cannot be set aside (several processes) the line says it was not saved."""
    from grpo_jax import interrupts
    from grpo_jax.distributed import HeldError

    directory = saved(tmp_path / "checkpoints")
    (directory / "2" / "state" / "manifest.ocdbt").write_bytes(b"")
    writer = types.SimpleNamespace(flush=lambda: None)
    stop = lambda ckpt, state: trainer._stop(ckpt, writer, 2, state, signal.SIGTERM, HeldError())
    with ckpt_lib.Checkpointer(directory) as ckpt:
        ckpt.restore(state_of(0))  # step 1's
        ckpt._set_aside = lambda step: False
        with pytest.raises(interrupts.Interrupted, match="at step 2: not saved .* move its"):
            stop(ckpt, state_of(7))
    with ckpt_lib.Checkpointer(directory) as ckpt:
        ckpt.restore(state_of(0))
        with pytest.raises(interrupts.Interrupted, match="at step 2: checkpoint saved, rerun"):
            stop(ckpt, state_of(7))
        with pytest.raises(interrupts.Interrupted, match="at step 2: checkpoint saved, rerun"):
            stop(ckpt, state_of(8))  # saved already: kept, not set aside again
    with ckpt_lib.Checkpointer(directory) as ckpt:
        assert_bitwise(ckpt.restore(state_of(0)), state_of(7))
    assert sorted(p.name for p in directory.iterdir()) == ["1", "2", "2.damaged"]


# --- Through the entry point: SIGTERM, SIGKILL and the logs after a resume ----------------

ROOT = Path(__file__).resolve().parents[1]
TOY = [
    "--config=toy_bandit:tiny",
    "--config.train.num_steps=400",
    "--config.train.log_every=1",
    "--config.train.eval_every=200",
]
TIMING = ("tokens_per_s", "step_time_s")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    env = dict(os.environ)
    env.update(
        JAX_COMPILATION_CACHE_DIR=str(compilation_cache_dir(tmp_path_factory)),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_DISABLE_MOST_OPTIMIZATIONS="1",
    )
    return env


def start(workdir, env, *extra):
    args = [sys.executable, "-m", "grpo_jax.main", *TOY, *extra, f"--workdir={workdir}"]
    return subprocess.Popen(args, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)


def finish(proc):
    _, err = proc.communicate(timeout=300)
    return proc.returncode, err


def rows_without_timing(workdir):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in read_metrics(workdir)]


def state_digest(workdir, step):
    """The saved state's digests (integrity.py): equal digests = bitwise equal states."""
    path = Path(workdir) / "checkpoints" / str(step) / "integrity" / "metadata"
    return json.loads(path.read_text())["state_sha256"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, env):
    workdir = tmp_path_factory.mktemp("uninterrupted")
    rc, err = finish(start(workdir, env))
    assert rc == 0, err
    return workdir


def test_sigterm_saves_the_step_and_the_rerun_is_bitwise_uninterrupted(
    tmp_path, env, uninterrupted
):
    proc = start(tmp_path, env)
    signal_after([proc], tmp_path, 30, signal.SIGTERM)
    rc, err = finish(proc)
    assert rc == 143, err
    assert "Traceback" not in err and "Segmentation" not in err
    lines = [line for line in err.splitlines() if not ABSL_LOG_LINE.match(line)]
    assert len(lines) == 1, err
    match = re.fullmatch(
        r"interrupted by SIGTERM at step (\d+): checkpoint saved, rerun the same command to "
        r"resume",
        lines[0],
    )
    assert match, lines[0]
    step = int(match.group(1))
    assert 30 <= step < 400
    assert ckpt_lib.latest_step_of(tmp_path / "checkpoints") == step  # the step itself
    assert read_metrics(tmp_path)[-1]["step"] == step  # the writers were flushed
    rc, err = finish(start(tmp_path, env))
    assert rc == 0, err
    assert state_digest(tmp_path, 400) == state_digest(uninterrupted, 400)
    assert rows_without_timing(tmp_path) == rows_without_timing(uninterrupted)


def test_after_sigkill_the_resumed_logs_hold_each_step_once(tmp_path, env, uninterrupted):
    proc = start(tmp_path, env, "--config.train.checkpoint_every=50")
    signal_after([proc], tmp_path, 120, signal.SIGKILL)
    finish(proc)
    saved = ckpt_lib.latest_step_of(tmp_path / "checkpoints")
    killed_at = read_metrics(tmp_path)[-1]["step"]
    assert saved is not None and killed_at > saved  # rows past the checkpoint to drop
    rc, err = finish(start(tmp_path, env, "--config.train.checkpoint_every=50"))
    assert rc == 0, err
    steps = [r["step"] for r in read_metrics(tmp_path) if "loss" in r]  # the step rows
    assert steps == list(range(1, 401))  # each step once, in order
    assert rows_without_timing(tmp_path) == rows_without_timing(uninterrupted)
