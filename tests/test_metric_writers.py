"""Tests for grpo_jax.metric_writers: JSONL round trip, TensorBoard, text, progress bar."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax import metric_writers
from grpo_jax.metric_writers import MetricWriter, ProgressBar, read_metrics


def test_scalars_round_trip_exactly(tmp_path: Path) -> None:
    with MetricWriter(tmp_path) as writer:
        writer.write_scalars(0, {"loss": 1.5, "reward": np.float32(0.25)})
        writer.write_scalars(1, {"loss": jnp.asarray(0.125), "kl": np.int64(3)})
        writer.write_scalars(2, {"loss": float("nan"), "up": math.inf, "dn": -math.inf})
        # Flushed per call: readable before close, as after a crash.
        assert len(read_metrics(tmp_path / "metrics.jsonl")) == 3
    rows = read_metrics(tmp_path)  # a workdir works too
    assert rows[:2] == [
        {"step": 0, "loss": 1.5, "reward": 0.25},
        {"step": 1, "loss": 0.125, "kl": 3.0},
    ]
    assert all(type(v) is float for row in rows for k, v in row.items() if k != "step")
    assert math.isnan(rows[2]["loss"])
    assert rows[2]["up"] == math.inf and rows[2]["dn"] == -math.inf
    # The file itself is strict JSON: non-finite values are strings.
    last = (tmp_path / "metrics.jsonl").read_text().splitlines()[-1]
    assert json.loads(last) == {"step": 2, "loss": "nan", "up": "inf", "dn": "-inf"}


def test_append_after_crash_and_reserved_step(tmp_path: Path) -> None:
    with MetricWriter(tmp_path, tensorboard=False) as writer:
        writer.write_scalars(0, {"loss": 1.0})
        with pytest.raises(ValueError, match="reserved"):
            writer.write_scalars(1, {"step": 1.0})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 1, "lo')  # a crash mid-write
    with MetricWriter(tmp_path, tensorboard=False) as writer:  # resumed run
        writer.write_scalars(2, {"loss": 0.5})
    assert read_metrics(tmp_path) == [
        {"step": 0, "loss": 1.0},
        {"step": 2, "loss": 0.5},
    ]


def test_tensorboard_event_file_and_image(tmp_path: Path) -> None:
    with MetricWriter(tmp_path) as writer:
        writer.write_scalars(3, {"loss": 2.0})
        writer.write_image(3, "figure", np.random.default_rng(0).random((8, 6, 3)))
        writer.write_image(3, "gray", np.zeros((4, 4), np.uint8))
        writer.flush()
    events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0


def test_text_log(tmp_path: Path) -> None:
    with MetricWriter(tmp_path) as writer:
        writer.write_text(5, "samples", "to be or not")
        writer.write_text(10, "samples", "that is\nthe question")
        writer.write_text(10, "eval/samples", "x")
    assert (tmp_path / "samples.txt").read_text() == (
        "=== step 5 ===\nto be or not\n\n=== step 10 ===\nthat is\nthe question\n\n"
    )
    assert (tmp_path / "eval_samples.txt").read_text() == "=== step 10 ===\nx\n\n"


def test_wandb_missing_warns_once_and_continues(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail
    monkeypatch.setattr(metric_writers, "_warned_no_wandb", False)
    for _ in range(2):
        with MetricWriter(tmp_path, tensorboard=False, wandb=True) as writer:
            writer.write_scalars(0, {"a": 1.0})
    assert read_metrics(tmp_path) == [{"step": 0, "a": 1.0}] * 2
    warnings = [r for r in caplog.records if "wandb is not installed" in r.message]
    assert len(warnings) == 1


def test_only_process_zero_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    with MetricWriter(tmp_path / "wd") as writer:
        writer.write_scalars(0, {"a": 1.0})
        writer.write_text(0, "samples", "x")
        writer.flush()
    assert not (tmp_path / "wd").exists()


def test_close_twice_and_write_after_close_are_noops(tmp_path: Path) -> None:
    writer = MetricWriter(tmp_path, tensorboard=False)
    writer.close()
    writer.close()
    writer.write_scalars(0, {"a": 1.0})
    assert read_metrics(tmp_path) == []


def test_progress_bar(capsys: pytest.CaptureFixture[str]) -> None:
    bar = ProgressBar(total=10, initial=0, enabled=False)
    bar.update(5, loss=0.5)
    bar.close()
    assert capsys.readouterr().err == ""
    bar = ProgressBar(total=10, initial=2, enabled=True)
    bar.update(4, loss=jnp.asarray(0.123456), phase="train")
    assert bar._bar.n == 4
    bar.update(10, loss=0.1)
    bar.close()
    err = capsys.readouterr().err
    assert "loss=0.1" in err and "10/10" in err
