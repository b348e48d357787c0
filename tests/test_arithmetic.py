"""The arithmetic task through the engine and the trainer: Python rewards and their jittable
twins give the same step, every group mode compiles once with EOS masks, the one-command
pipeline (warm-up, then GRPO) resumes, and bad input is one line."""

import jax
import numpy as np
import pytest

from grpo_jax import sharding, trainer
from grpo_jax.config_blocks import load_config
from grpo_jax.metric_writers import read_metrics
from grpo_jax.model import Transformer
from grpo_jax.policy import transformer_policy
from grpo_jax.rollout import SamplingParams, Stop
from grpo_jax.tasks import build_task

pytestmark = pytest.mark.usefixtures("fast_compiles")  # conftest.py


def tiny(variant="tiny", **overrides):
    return load_config("arithmetic", variant, **overrides)


def one_step(config):
    """One GRPO step of the task from its seed's initial params, as the trainer runs it."""
    task = build_task(config, "train")
    params = task.init_params(jax.random.PRNGKey(config.seed))
    step, inputs = task.build(params)
    mesh = sharding.make_mesh(config.mesh)
    run, state, inputs, _ = sharding.jit_step(step, mesh, task.make_state(params), inputs)
    return step, jax.device_get(run(state, inputs))


def test_python_reward_and_its_jittable_twin_give_the_same_step():
    config = tiny(**{"reward.terms": "correct:1.0,format:0.5", "group.temperature": 3.0})
    host_step, (host_state, host_m) = one_step(config)
    config.reward.python = False
    dev_step, (dev_state, dev_m) = one_step(config)
    assert host_step.host is not None and dev_step.host is None  # the two paths really differ
    for a, b in zip(jax.tree.leaves(host_state), jax.tree.leaves(dev_state), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    for k in ("loss", "reward", "rewards/correct/mean", "rewards/format/mean", "num_tokens"):
        np.testing.assert_allclose(host_m[k], dev_m[k], rtol=1e-6, err_msg=k)
    # at temperature 3 the untrained policy ends some completions early and misses others
    assert 0.0 < host_m["rewards/format/mean"] < 1.0
    assert 0 < host_m["completions/clipped_ratio"] < 1
    assert host_m["completions/min_length"] < host_m["completions/max_length"]


@pytest.mark.parametrize("mode", ["sampled", "exhaustive", "guided", "adaptive"])
def test_every_group_mode_compiles_once_with_masks(mode, tmp_path):
    """trainer.trace_once fails the run on a second trace of a jitted function; the Python
    reward path jits the rollout and the update separately, each once."""
    config = tiny(
        "tiny,jax" if mode in ("guided", "adaptive") else "tiny",
        **{
            "group.mode": mode,
            "pretrain.before_train": False,
            "train.eval_every": 4,
            "train.checkpoint_every": 4,
        },
    )
    if mode == "guided":
        config.group.guide = "policy"
        config.group.guide_top_k = 3
        config.group.guide_top_k_confident = 2
        config.group.guide_random = 2
        config.group.entropy_threshold = 1.0
    state, last = trainer.train_and_evaluate(config, str(tmp_path))
    assert int(state.step) == 4
    assert np.isfinite(last["loss"]) and 1 <= last["completions/mean_length"] <= 4
    assert 0.0 <= last["eval/accuracy"] <= 1.0


def test_one_command_runs_warm_up_then_grpo_and_resumes(tmp_path):
    config = tiny()
    trainer.train_and_evaluate(config, str(tmp_path))
    assert sorted(int(p.name) for p in (tmp_path / "pretrain/checkpoints").iterdir())[-1] == 4
    rows = read_metrics(tmp_path)
    evals = [r["step"] for r in rows if "eval/accuracy" in r]
    assert evals == [0, 2, 4]  # step 0 is the warm-up's end, then the eval cadence
    for key in ("eval/pass_at_1", "eval/pass_at_8", "eval/mean_length"):
        assert key in rows[0]
    assert rows[0]["eval/pass_at_1"] <= rows[0]["eval/pass_at_8"]
    warm_rows = read_metrics(tmp_path / "pretrain")
    before = (tmp_path / "metrics.jsonl").read_text()
    state, _ = trainer.train_and_evaluate(config, str(tmp_path))  # a finished run: a no-op
    assert int(state.step) == 4
    assert read_metrics(tmp_path / "pretrain") == warm_rows  # the warm-up is not run again
    assert (tmp_path / "metrics.jsonl").read_text() == before


@pytest.mark.parametrize(
    "overrides, text",
    [
        ({"data.max_completion_length": 0}, "data.max_completion_length=0 must be an integer"),
        ({"data.max_completion_length": 3}, "data.max_completion_length=3 must be >= 4"),
        ({"model.max_len": 6}, "model.max_len=6 must hold prompts of up to 6 tokens"),
        ({"reward.terms": "correct,speed"}, "unknown reward 'speed'"),
        ({"group.top_k": 99}, "group.top_k=99 must be <= the vocabulary size 16"),
        ({"data.ops": "/"}, "data.ops='/' is unknown"),
    ],
)
def test_bad_input_is_one_line(overrides, text):
    with pytest.raises(ValueError, match=text) as err:
        build_task(tiny(**overrides), "train")
    assert "\n" not in str(err.value)


def test_model_max_len_sizes_the_positional_window():
    """model.max_len (0: the longest prompt plus max_completion_length) is the model's
    positional window; it was checked and then not passed on (the window stayed p + t)."""
    sizes = []
    for c in (tiny(), tiny(**{"model.max_len": 40})):
        params = build_task(c, "train").init_params(jax.random.PRNGKey(0))
        sizes.append(params["pos_embedding"].shape[0])
    assert sizes[0] < 40 and sizes[1] == 40


def test_an_eos_id_outside_the_vocabulary_is_refused():
    model = Transformer(vocab_size=16, num_layers=1, num_heads=2, d_model=8, max_len=10)
    with pytest.raises(ValueError, match="eos_id=16 is outside the 16-token vocabulary"):
        transformer_policy(model, SamplingParams(), 4, Stop(16, 0))
