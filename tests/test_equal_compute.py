"""experiments/exhaustive_vs_sampled.py --budget=tokens:N end to end, in-process, on the tiny
config: every mode stops at the first step whose generated tokens reach the budget, its eval
points sit at the same budget fractions, and the report renders from the stored JSON.

The token counts are computed here from B, G or V and the horizon, not read from the code
under test. One step compile per mode (a tokens budget needs no calibration run).
"""

import json
import math
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from grpo_jax.config_blocks import load_config

pytestmark = pytest.mark.usefixtures("fast_compiles")  # conftest.py

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import equal_compute  # noqa: E402
import equal_compute_report  # noqa: E402

BUDGET, POINTS, SEEDS = 1200, 4, (0, 1, 2)
METRICS = ["eval/next_char_accuracy", "eval/rollout_accuracy"]


@pytest.fixture(scope="module")
def raw(shakespeare_path):
    configs = {}
    for mode in ("sampled", "exhaustive"):
        configs[mode] = load_config("shakespeare", f"{mode},tiny")
        configs[mode].data.path = str(shakespeare_path)
    budget = equal_compute.parse_budget(f"tokens:{BUDGET}")
    results = equal_compute.run_comparison(configs, SEEDS, budget, POINTS)
    meta = {"device": "cpu", "command": "test", "overrides": {}, "note": ""}
    record = equal_compute.comparison_record(results, SEEDS, budget, POINTS, meta)
    return json.loads(json.dumps(record, default=str))  # as --report_only reads it back


def tokens_per_step(config, data_path) -> int:
    """B x members x horizon, members = G (sampled) or V, the corpus's distinct chars."""
    vocab = len(set(Path(data_path).read_text()))
    members = config.group.size if config.group.mode == "sampled" else vocab
    return config.train.batch_size * members * config.data.horizon


def test_modes_stop_at_the_budget_with_evals_at_its_fractions(raw, shakespeare_path):
    assert raw["metrics"] == METRICS and raw["reference_mode"] == "sampled"
    fractions = [i / POINTS for i in range(POINTS + 1)]
    for mode, recs in raw["runs"].items():
        per_step = tokens_per_step(load_config("shakespeare", f"{mode},tiny"), shakespeare_path)
        steps = math.ceil(BUDGET / per_step)  # the first step reaching the budget
        assert (steps - 1) * per_step < BUDGET <= steps * per_step
        info = raw["spent"][mode]
        assert (info["tokens_per_step"], info["steps"], info["tokens"]) == (
            per_step, steps, steps * per_step)  # fmt: skip
        assert info["schedule_steps"] == steps and info["schedule"] == "exact"
        assert len(recs) == len(SEEDS)
        for rec in recs:
            pts = rec["points"]
            assert [p["fraction"] for p in pts] == fractions  # the same for every mode
            for p, f in zip(pts, fractions, strict=True):
                assert p["step"] == math.ceil(f * BUDGET / per_step)
                assert p["tokens"] == p["step"] * per_step
                # no EOS and every member counts: the engine's count equals the budget's
                assert p["generated_tokens"] == p["tokens"]
                assert all(0.0 <= p["eval"][k] <= 1.0 for k in METRICS)
            assert np.all(np.diff([p["seconds"] for p in pts]) >= 0) and pts[-1]["seconds"] > 0
            assert rec["final"] == pts[-1]["eval"] and pts[0]["eval"] != pts[-1]["eval"]
    # the modes start from the same init per seed and really train apart
    s, e = raw["runs"]["sampled"], raw["runs"]["exhaustive"]
    assert [r["points"][0]["eval"] for r in s] == [r["points"][0]["eval"] for r in e]
    assert s[0]["final"] != e[0]["final"]


def test_summary_is_in_standard_errors_of_the_difference(raw):
    finals = {
        m: np.array([r["final"][METRICS[0]] for r in recs]) for m, recs in raw["runs"].items()
    }
    se = {m: v.std(ddof=1) / np.sqrt(len(v)) for m, v in finals.items()}
    z = (finals["exhaustive"].mean() - finals["sampled"].mean()) / np.hypot(*se.values())
    got = raw["summary"]["exhaustive"][METRICS[0]]
    np.testing.assert_allclose([got["se"], got["z"]], [se["exhaustive"], z], rtol=1e-9)


def test_report_renders(raw, tmp_path):
    md = equal_compute_report.render_budget(raw, tmp_path, "ec")
    assert (tmp_path / "ec.md").read_text() == md
    assert raw["jax"] == jax.__version__ and f"(jax {jax.__version__})" in md  # the run's
    for key in METRICS:
        for axis in ("seconds", "tokens"):
            png = tmp_path / f"ec_{key.split('/')[-1]}_{axis}.png"
            assert png.stat().st_size > 1000 and f"]({png.name})" in md
        assert f"### {key} (%), at the full budget" in md
    e = raw["summary"]["exhaustive"][METRICS[0]]
    beyond = "yes" if abs(e["z"]) > 3 else "no"
    assert f"| {e['z']:+.1f} | {beyond} |" in md
    per_step = raw["spent"]["sampled"]["tokens_per_step"]
    assert f"| sampled | {per_step:,} | {raw['spent']['sampled']['steps']} (" in md


@pytest.mark.parametrize(
    "text", ["wall", "wall:0", "tokens:-5", "tokens:0.5", "steps:10", "wall:nan", "tokens:inf"]
)
def test_bad_budget_is_refused(text):
    with pytest.raises(ValueError, match="wall:<seconds> or tokens:<n>"):
        equal_compute.parse_budget(text)
