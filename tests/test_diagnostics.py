"""Diagnostics warnings fire on the right conditions, and only then."""

from ml_collections import ConfigDict

from grpo_jax.diagnostics import Monitor


def _cfg(patience=3, heldout_min_drop=0.01):
    return ConfigDict(
        {
            "kl_bound": 0.1,
            "reward_std_low": 0.3,
            "reward_std_high": 2.0,
            "patience": patience,
            "heldout_min_drop": heldout_min_drop,
        }
    )


def test_kl_warning_first_crossing_then_every_patience_steps():
    m = Monitor(_cfg(patience=3))
    fired = [bool(m.update(s, {"kl": kl})) for s, kl in enumerate([0.05, 0.2, 0.3, 0.4, 0.5, 0.01])]
    assert fired == [False, True, False, False, True, False]


def test_reward_std_low_and_high_after_patience():
    m = Monitor(_cfg(patience=2))
    out = [m.update(s, {"reward_std": 0.1, "reward": 0.5}) for s in range(3)]
    assert [len(o) for o in out] == [0, 1, 0]
    assert "temperature too low" in out[1][0] and "groups too small" in out[1][0]
    m = Monitor(_cfg(patience=2))
    out = [m.update(s, {"reward_std": 3.0}) for s in range(2)]
    assert len(out[1]) == 1 and "> 2.0" in out[1][0]


def test_reward_hacking_signal():
    m = Monitor(_cfg(), heldout_key="eval/rollout_accuracy")  # the task names its metric
    m.update(1, {"reward_std": 1.0, "reward": 0.2})
    assert m.update(1, {"eval/rollout_accuracy": 0.30}) == []
    m.update(2, {"reward_std": 1.0, "reward": 0.4})  # reward up ...
    (warning,) = m.update(2, {"eval/rollout_accuracy": 0.25})  # ... held-out down
    assert "reward hacking" in warning
    m.update(3, {"reward_std": 1.0, "reward": 0.5})
    assert m.update(3, {"eval/rollout_accuracy": 0.35}) == []  # both up: fine
    m.update(4, {"reward_std": 1.0, "reward": 0.6})
    assert m.update(4, {"eval/rollout_accuracy": 0.345}) == []  # a fall within the tolerance
    m.update(5, {"reward_std": 1.0, "reward": 0.7})
    assert len(m.update(5, {"eval/rollout_accuracy": 0.33})) == 1  # 0.015 > 0.01
