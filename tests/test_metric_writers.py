"""Tests for grpo_jax.metric_writers: JSONL round trip, TensorBoard, text, progress bar."""

from __future__ import annotations

import json
import logging
import math
import struct
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax import metric_writers
from grpo_jax.engine import STEP_METRICS
from grpo_jax.metric_writers import MetricWriter, ProgressBar, current_names, read_metrics


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


def test_a_resumed_writer_cuts_text_sections_past_its_start(tmp_path: Path) -> None:
    """samples.txt sections of steps a killed run logged after its last checkpoint are
    dropped at the resumed run's first write (as metrics.jsonl's rows); start_step=-1 (a
    rerun that evaluates step 0 again) drops step 0's too. Other text files are untouched."""
    (tmp_path / "config.txt").write_text("=== step 9 ===\nnot a log\n")
    with MetricWriter(tmp_path) as writer:
        for step in (0, 2, 4, 6):
            writer.write_text(step, "samples", f"s{step}")
    with MetricWriter(tmp_path, start_step=4) as writer:
        writer.write_text(6, "samples", "again")
        writer.write_text(8, "samples", "s8")
    text = (tmp_path / "samples.txt").read_text()
    assert text == "".join(f"=== step {s} ===\n{t}\n\n" for s, t in
                           [(0, "s0"), (2, "s2"), (4, "s4"), (6, "again"), (8, "s8")])  # fmt: skip
    with MetricWriter(tmp_path, start_step=-1) as writer:
        writer.write_text(0, "samples", "fresh")
    assert (tmp_path / "samples.txt").read_text() == "=== step 0 ===\nfresh\n\n"
    assert (tmp_path / "config.txt").read_text() == "=== step 9 ===\nnot a log\n"


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


def _event_scalars(tb_dir: Path) -> dict[str, float]:
    """The scalars of an event file, read back with tensorboardX's own protos: TFRecord
    framing (u64 length, u32 crc, data, u32 crc), no TensorFlow or tensorboard needed."""
    from tensorboardX.proto import event_pb2

    (path,) = tb_dir.glob("events.out.tfevents.*")
    data, pos, out = path.read_bytes(), 0, {}
    while pos < len(data):
        (length,) = struct.unpack("<Q", data[pos : pos + 8])
        event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
        pos += 12 + length + 4
        for value in event.summary.value:
            out[value.tag] = value.simple_value
    return out


def test_tensorboard_tags_equal_jsonl_keys(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The names the engine, the evaluators and the trainer really log.
    names = [*STEP_METRICS, "rewards/first_char/mean", "rewards/first_char/std"]
    names += ["tokens_per_s", "step_time_s", "eval/pass_at_1", "eval/pass_at_8"]
    names += ["eval/next_char_accuracy", "eval/fill_accuracy/len1", "eval/true_reward/ctx0"]
    caplog.set_level(logging.INFO)
    with MetricWriter(tmp_path) as writer:
        writer.write_scalars(7, {name: i / 8 for i, name in enumerate(names)})
    (row,) = read_metrics(tmp_path)
    assert _event_scalars(tmp_path / "tb") == {k: v for k, v in row.items() if k != "step"}
    assert not [r for r in caplog.records if "illegal" in r.getMessage()]


@pytest.mark.parametrize("name", ["eval/pass@1", "/loss", "a b", "x:y", ""])
def test_names_tensorboard_would_rename_are_refused(tmp_path: Path, name: str) -> None:
    with MetricWriter(tmp_path) as writer:
        with pytest.raises(ValueError, match="not a legal TensorBoard tag"):
            writer.write_scalars(0, {"loss": 1.0, name: 1.0})
        with pytest.raises(ValueError, match="not a legal TensorBoard tag"):
            writer.write_image(0, name, np.zeros((2, 2), np.uint8))
    assert read_metrics(tmp_path) == []  # refused whole: no row without the bad name


def test_old_pass_at_names_read_as_new(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 3, "eval/pass@1": 0.5, "loss": 1}\n')
    assert read_metrics(tmp_path) == [{"step": 3, "eval/pass_at_1": 0.5, "loss": 1}]
    prose = "pass@1 in prose stays"
    old = {"runs": [{"curve": [{"eval/pass@8": 1.0}]}], "note": prose}
    assert current_names(old) == {"runs": [{"curve": [{"eval/pass_at_8": 1.0}]}], "note": prose}


def test_progress_bar_on_a_tty(capsys: pytest.CaptureFixture[str]) -> None:
    bar = ProgressBar(total=10, initial=0, enabled=False)
    bar.update(5, loss=0.5)
    bar.close()
    assert capsys.readouterr().err == ""
    bar = ProgressBar(total=10, initial=2, enabled=True, tty=True)
    bar.update(4, loss=jnp.asarray(0.123456), phase="train")
    assert bar._bar.n == 4
    bar.update(10, loss=0.1)
    bar.close()
    err = capsys.readouterr().err
    assert "loss=0.1" in err and "10/10" in err


def test_progress_lines_without_a_tty(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    assert not sys.stderr.isatty()  # pytest captures stderr: the log-file case
    bar = ProgressBar(total=10, initial=0, enabled=True, log_every=3)
    for step in range(1, 11):
        bar.update(step, loss=jnp.asarray(0.123456), reward=0.5)
        bar.update(step, loss=0.1)  # a second call at a step (after an eval) adds no line
    bar.close()
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split(" | ")[0] for line in lines] == [f"step {s}/10" for s in (3, 6, 9, 10)]
    assert lines[0].startswith("step 3/10 | loss 0.1235 | reward 0.5 | ")
    assert " steps/s | eta " in lines[0] and lines[-1].endswith("eta 0:00")
    assert not any("\r" in line or "\n" in line for line in lines)
    assert "\r" not in capsys.readouterr().err  # and no tqdm bar drawn alongside
