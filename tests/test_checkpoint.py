"""Tests for grpo_jax.checkpoint: round trips, rotation and one-line failures."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from _damage import flip_bit

from grpo_jax.checkpoint import (
    Checkpointer,
    CheckpointError,
    load_params,
)
from grpo_jax.run_config import check_workdir, ensure_workdir, save_config  # the record


class TrainState(NamedTuple):
    step: jax.Array
    params: dict
    opt_state: Any


def make_state(hidden: int = 8, seed: int = 0, steps: int = 2) -> TrainState:
    """A small TrainState whose adam moments are non-trivial (after real updates)."""
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    params = {
        "dense": {
            "kernel": jax.random.normal(k1, (4, hidden)),
            "bias": jax.random.normal(k2, (hidden,), dtype=jnp.bfloat16),
        }
    }
    tx = optax.adam(1e-2)
    opt_state = tx.init(params)
    for _ in range(steps):
        grads = jax.tree.map(lambda p: jnp.ones_like(p) * 0.3, params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return TrainState(jnp.asarray(steps, jnp.int32), params, opt_state)


def assert_bitwise_equal(a: Any, b: Any) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file's bytes under ``directory``, to prove nothing was touched."""
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def test_latest_step_none_on_empty_dir(tmp_path: Path) -> None:
    with Checkpointer(tmp_path / "checkpoints") as ckpt:
        assert ckpt.latest_step() is None
        assert ckpt.restore_extra() is None
        with pytest.raises(CheckpointError, match="no checkpoint found"):
            ckpt.restore(make_state())
    assert (tmp_path / "checkpoints").is_dir()


def test_round_trip_bitwise_with_extra(tmp_path: Path) -> None:
    state = make_state()
    with Checkpointer(tmp_path / "checkpoints") as ckpt:
        assert ckpt.save(2, state, extra={"tokens_seen": 123, "note": "hi"})
        assert ckpt.save(3, state)  # no extra at this step
        ckpt.wait()
        assert ckpt.latest_step() == 3
        assert not ckpt.save(3, make_state(seed=1))  # never overwrites a step
    # A fresh Checkpointer (like a resumed process) reads what the first wrote.
    with Checkpointer(tmp_path / "checkpoints") as ckpt:
        restored = ckpt.restore(make_state(seed=5, steps=0))
        assert isinstance(restored, TrainState)
        assert isinstance(restored.params["dense"]["kernel"], jax.Array)
        assert_bitwise_equal(restored, state)
        assert_bitwise_equal(ckpt.restore(make_state(seed=5), step=2), state)
        assert ckpt.restore_extra(2) == {"tokens_seen": 123, "note": "hi"}
        assert ckpt.restore_extra() is None


def test_keep_and_interval(tmp_path: Path) -> None:
    state = make_state(steps=0)
    with Checkpointer(tmp_path / "ck", keep=2, save_interval_steps=2) as ckpt:
        saved = [ckpt.save(s, state) for s in range(7)]
        assert ckpt.save(7, state, force=True)
    assert saved == [True, False, True, False, True, False, True]
    steps = sorted(int(p.name) for p in (tmp_path / "ck").iterdir() if p.is_dir())
    assert steps == [6, 7]


def test_shape_mismatch_is_one_line_and_keeps_files(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints"
    with Checkpointer(directory) as ckpt:
        ckpt.save(4, make_state(hidden=8))
    before = snapshot(directory)
    with Checkpointer(directory) as ckpt:
        with pytest.raises(CheckpointError) as err:
            ckpt.restore(make_state(hidden=16))
        with pytest.raises(CheckpointError, match="different state structure"):
            ckpt.restore({"params": make_state().params})
    msg = str(err.value)
    assert "\n" not in msg
    assert f"checkpoint at {directory} step 4 has a different model shape" in msg
    assert "params/dense/bias: checkpoint (8,) vs config (16,)" in msg
    assert "--config.model.*" in msg
    assert snapshot(directory) == before


def test_dtype_mismatch(tmp_path: Path) -> None:
    state = make_state()
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state)
        wrong = state._replace(step=jnp.asarray(1.0, jnp.float32))
        with pytest.raises(CheckpointError, match=r"state dtype \(step: checkpoint int32"):
            ckpt.restore(wrong)


def test_corrupt_checkpoint_is_one_line_and_untouched(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints"
    state = make_state()
    with Checkpointer(directory) as ckpt:
        ckpt.save(1, state)
    data_files = [p for p in (directory / "1" / "state").rglob("d/*") if p.is_file()]
    assert data_files, "expected OCDBT data files in the step folder"
    for path in data_files:
        path.write_bytes(path.read_bytes()[:3])  # truncate: a half-copied checkpoint
    before = snapshot(directory)
    with Checkpointer(directory) as ckpt:
        with pytest.raises(CheckpointError) as err:
            ckpt.restore(state)
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(f"checkpoint at {directory} step 1 is unreadable (")
    assert msg.endswith("delete that step's folder or restore an earlier one")
    assert snapshot(directory) == before


def test_corrupt_metadata_is_unreadable(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints"
    with Checkpointer(directory) as ckpt:
        ckpt.save(1, make_state())
    (directory / "1" / "state" / "_METADATA").write_text("{not json")
    with Checkpointer(directory) as ckpt:
        with pytest.raises(CheckpointError, match="step 1 is unreadable") as err:
            ckpt.restore(make_state())
    assert "\n" not in str(err.value)
    assert (directory / "1" / "state" / "_METADATA").read_text() == "{not json"


def test_load_params_from_workdir_and_dir(tmp_path: Path) -> None:
    state = make_state()
    with Checkpointer(tmp_path / "checkpoints") as ckpt:
        ckpt.save(1, make_state(seed=3))
        ckpt.save(2, state)
    template = make_state(seed=9, steps=0).params
    for where in (tmp_path, tmp_path / "checkpoints"):
        assert_bitwise_equal(load_params(where, template), state.params)
    with pytest.raises(CheckpointError, match=r"model shape \(params/dense/bias"):
        load_params(tmp_path, make_state(hidden=4).params)


def test_load_params_checks_the_digest_and_the_vocabulary(tmp_path: Path) -> None:
    """init_from reads params as a resume does: a flipped bit is refused (orbax reads it
    back silently), and so is a checkpoint of another vocabulary; another data file is not."""
    saved = {"vocab_sha256": "a" * 64, "data_sha256": "c" * 64}
    with Checkpointer(tmp_path / "checkpoints", identity=saved) as ckpt:
        ckpt.save(2, make_state(hidden=512))
    template = make_state(hidden=512, steps=0).params
    load_params(tmp_path, template, {"vocab_sha256": "a" * 64, "data_sha256": "d" * 64})
    with pytest.raises(CheckpointError, match=r"step 2 was trained on another vocabulary.*aaaa"):
        load_params(tmp_path, template, {"vocab_sha256": "b" * 64})
    flip_bit(tmp_path / "checkpoints" / "2")
    with pytest.raises(CheckpointError, match=r"step 2 is damaged: params bytes do not match"):
        load_params(tmp_path, template)


def test_load_params_missing(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no checkpoint directory at"):
        load_params(tmp_path / "nope", {})
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(CheckpointError, match="no checkpoint found in"):
        load_params(tmp_path, {})


def test_ensure_workdir(tmp_path: Path) -> None:
    assert ensure_workdir(tmp_path / "a" / "b").is_dir()
    assert ensure_workdir(tmp_path / "a" / "b") == tmp_path / "a" / "b"
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file; pass a directory") as err:
        ensure_workdir(tmp_path / "file")
    assert "\n" not in str(err.value)


def test_a_workdir_under_a_file_is_refused_naming_the_file(tmp_path: Path) -> None:
    """A workdir whose nearest existing parent is a file: one line naming the file, before
    anything runs (was: NotADirectoryError after the compile, the file executable, or
    "is read-only" otherwise)."""
    for mode in (0o755, 0o644):
        parent = tmp_path / f"file_{mode:o}"
        parent.write_text("x")
        parent.chmod(mode)
        with pytest.raises(ValueError) as err:
            check_workdir(parent / "run" / "sub")
        assert str(err.value) == (
            f"--workdir {parent}/run/sub is under {parent}, which is a file, not a directory; "
            "pass another --workdir (or move the file)"
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file_644", "file_755"]


def test_the_record_takes_the_umasks_mode(tmp_path: Path) -> None:
    """config.json and config.txt are created as open() creates the workdir's other files,
    0o666 less the umask (they were 0o600, written through tempfile.mkstemp)."""
    config = ml_collections.ConfigDict({"lr": 0.1})
    for umask, mode in ((0o022, 0o644), (0o077, 0o600)):
        previous = os.umask(umask)
        try:
            save_config(tmp_path / f"{umask:o}", config)
        finally:
            os.umask(previous)
        for name in ("config.json", "config.txt"):
            assert stat.S_IMODE((tmp_path / f"{umask:o}" / name).stat().st_mode) == mode


def test_save_config(tmp_path: Path) -> None:
    config = ml_collections.ConfigDict({"model": {"hidden": 8}, "lr": 0.1})
    save_config(tmp_path / "wd", config)
    save_config(tmp_path / "wd", config)  # overwriting is fine
    assert json.loads((tmp_path / "wd" / "config.json").read_text()) == {
        "lr": 0.1,
        "model": {"hidden": 8},
    }
    assert "hidden: 8" in (tmp_path / "wd" / "config.txt").read_text()
    assert sorted(p.name for p in (tmp_path / "wd").iterdir()) == [
        "config.json",
        "config.txt",
    ]
