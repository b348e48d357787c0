"""Fill-in with a judge: refusal checks, judge training, frozen judge/reference, metrics."""

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax import checkpoint as ckpt_lib
from grpo_jax import judge as judge_lib
from grpo_jax import sharding, trainer
from grpo_jax.encoder import Encoder
from grpo_jax.metric_writers import read_metrics
from grpo_jax.task import build_task
from grpo_jax.train_step import STEP_METRICS as TRAIN_STEP_METRICS
from grpo_jax.train_step import TrainState

ROOT = Path(__file__).resolve().parents[1]
STEP_METRICS = TRAIN_STEP_METRICS + ("sample_fill_accuracy",)


def get_config(arg="tiny"):
    spec = importlib.util.spec_from_file_location("fill_cfg", ROOT / "configs/fill_in.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config(arg)


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory, shakespeare_path):
    """A tiny judge trained by --mode=train_judge (through the common trainer)."""
    cfg = get_config()
    cfg.data.path = str(shakespeare_path)
    workdir = tmp_path_factory.mktemp("judge")
    _, last = trainer.train_and_evaluate(cfg, str(workdir), "train_judge")
    assert 0.0 <= last["eval/judge_accuracy"] <= 1.0
    assert 0.0 <= last["eval/judge_pair_accuracy"] <= 1.0
    return workdir


def fill_config(shakespeare_path, judge_dir):
    cfg = get_config()
    cfg.data.path = str(shakespeare_path)
    cfg.judge.checkpoint = str(judge_dir)
    return cfg


def test_spans_are_one_contiguous_run():
    span = np.asarray(judge_lib.random_spans(jax.random.PRNGKey(0), 256, 12, 1, 3))
    lengths = span.sum(1)
    assert lengths.min() >= 1 and lengths.max() <= 3
    edges = np.abs(np.diff(np.pad(span, ((0, 0), (1, 1))), axis=1)).sum(1)
    np.testing.assert_array_equal(edges, 2)  # exactly one run of ones per row


def test_corruptions_stay_inside_the_span():
    tokens = jnp.arange(200, dtype=jnp.int32) % 20
    real = judge_lib.random_windows(jax.random.PRNGKey(1), tokens, 64, 12)
    span = judge_lib.random_spans(jax.random.PRNGKey(2), 64, 12, 1, 3)
    log_uni = judge_lib.log_unigram_of(np.asarray(tokens), 20)
    fake, _, changed = judge_lib.corrupt(
        jax.random.PRNGKey(3), real, span, tokens, log_uni, judge_lib.CORRUPTIONS
    )
    diff = np.asarray(fake != real)
    assert not diff[np.asarray(span) == 0].any()
    np.testing.assert_array_equal(diff.any(1), np.asarray(changed))


def test_refuses_data_without_mask_token(shakespeare_path, tmp_path):
    cfg = get_config()
    cfg.data.path = str(shakespeare_path)
    cfg.judge.checkpoint = str(tmp_path)
    cfg.data.mask_char = ""
    with pytest.raises(ValueError, match="no mask token"):
        build_task(cfg, "train")
    cfg.data.mask_char = "e"  # a corpus char cannot be the mask
    with pytest.raises(ValueError, match="mask_char"):
        build_task(cfg, "train")


def test_refuses_a_judge_that_is_not_a_sequence_scorer(shakespeare_path, tmp_path):
    cfg = get_config()
    cfg.data.path = str(shakespeare_path)
    with pytest.raises(ValueError, match="judge.checkpoint is empty"):
        build_task(cfg, "train")
    # a generator (token-head) checkpoint where the judge should be
    gen = Encoder(vocab_size=66, out_size=65, num_layers=1, d_model=16, max_len=12)
    params = gen.init(jax.random.PRNGKey(0), jnp.zeros((1, 12), jnp.int32))["params"]
    state = TrainState(jnp.zeros((), jnp.int32), params, (), jax.random.PRNGKey(0))
    with ckpt_lib.Checkpointer(tmp_path / "gen" / "checkpoints") as ck:
        ck.save(1, state, force=True)
    cfg.judge.checkpoint = str(tmp_path / "gen")
    with pytest.raises(ValueError, match="not a sequence scorer") as err:
        build_task(cfg, "train")
    assert "\n" not in str(err.value)


def test_fill_in_run_keeps_judge_and_reference_frozen(
    shakespeare_path, judge_dir, tmp_path, monkeypatch
):
    """Through the real trainer: capture the step's inputs (the frozen reference and judge
    params, exactly the arrays the jitted step receives every step) and check them after."""
    captured = {}
    real_jit_step = sharding.jit_step

    def spy(step_fn, mesh, state, inputs, *args, **kwargs):
        out = real_jit_step(step_fn, mesh, state, inputs, *args, **kwargs)
        captured["inputs"] = out[2]
        captured["frozen"] = jax.device_get((out[2].ref_params, out[2].reward_params))
        captured["params0"] = jax.device_get(out[1].params)
        return out

    monkeypatch.setattr(sharding, "jit_step", spy)
    cfg = fill_config(shakespeare_path, judge_dir)
    judge_before = jax.device_get(ckpt_lib.load_params(judge_dir, captured_template(cfg)))
    state, last = trainer.train_and_evaluate(cfg, str(tmp_path))

    ref0, judge0 = captured["frozen"]
    inputs = captured["inputs"]
    after = jax.device_get((inputs.ref_params, inputs.reward_params))
    for a, b in zip(jax.tree.leaves((ref0, judge0)), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(a, b)  # never changed by the donated, jitted steps
    for a, b in zip(jax.tree.leaves(ref0), jax.tree.leaves(captured["params0"]), strict=True):
        np.testing.assert_array_equal(a, b)  # the reference is the initial generator
    for a, b in zip(jax.tree.leaves(judge0), jax.tree.leaves(judge_before), strict=True):
        np.testing.assert_array_equal(a, b)  # the judge is the checkpoint's
    judge_after = ckpt_lib.load_params(judge_dir, judge_before)
    for a, b in zip(jax.tree.leaves(judge_before), jax.tree.leaves(judge_after), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))  # and its checkpoint is untouched
    moved = [
        not np.array_equal(a, np.asarray(b))
        for a, b in zip(
            jax.tree.leaves(captured["params0"]), jax.tree.leaves(state.params), strict=True
        )
    ]
    assert any(moved)  # while the generator does train

    rows = read_metrics(tmp_path)
    train_row = [r for r in rows if "loss" in r][-1]
    for key in STEP_METRICS:
        assert key in train_row and np.isfinite(train_row[key]), key
    for key in ("eval/fill_accuracy", "eval/sampled_fill_accuracy", "eval/judge_reward"):
        assert 0.0 <= last[key] <= 1.0, key
    assert "eval/pass@4" in last
    assert (tmp_path / "checkpoints").is_dir()
    samples = (tmp_path / "samples.txt").read_text()
    assert cfg.data.mask_char in samples  # the masked windows are shown with the mask token


def captured_template(cfg):
    model = judge_lib.make_judge_model(cfg.judge, 65, cfg.data.window_len)
    return model.init(jax.random.PRNGKey(0), jnp.zeros((1, cfg.data.window_len), jnp.int32))[
        "params"
    ]
