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


def test_summary_tests_the_difference_paired_by_seed(raw):
    """Every mode's seed i starts from the same init: the summary's t is the paired one."""
    fin = {m: {r["seed"]: r["final"][METRICS[0]] for r in recs} for m, recs in raw["runs"].items()}
    a, ref = (np.array([fin[m][s] for s in SEEDS]) for m in ("exhaustive", "sampled"))
    d = a - ref
    se = d.std(ddof=1) / np.sqrt(len(d))
    got = raw["summary"]["exhaustive"][METRICS[0]]
    assert (got["test"], got["df"]) == ("paired", len(SEEDS) - 1)
    np.testing.assert_allclose(
        [got["se"], got["se_diff"], got["t"]],
        [a.std(ddof=1) / np.sqrt(len(a)), se, d.mean() / se],
        rtol=1e-9,
    )


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
    cells = equal_compute_report.versus_cells(METRICS[0], e)
    rows = [line for line in md.splitlines() if line.startswith("| exhaustive | ")]
    assert rows[1].endswith(cells) and "| paired, df 2 |" in cells  # the first metric's table
    per_step = raw["spent"]["sampled"]["tokens_per_step"]
    assert f"| sampled | {per_step:,} | {raw['spent']['sampled']['steps']} (" in md


@pytest.mark.parametrize(
    "text", ["wall", "wall:0", "tokens:-5", "tokens:0.5", "steps:10", "wall:nan", "tokens:inf"]
)
def test_bad_budget_is_refused(text):
    with pytest.raises(ValueError, match="wall:<seconds> or tokens:<n>"):
        equal_compute.parse_budget(text)


# Golden values by hand. d = a − ref = (1, 2, 3): mean 2, std 1, SE_Δ = 1/√3, t = 2√3 with 2 df,
# and t(2)'s two-sided p = 1 − |t|/√(t² + 2) = 1 − √(6/7). The modes' own SEs are 11/√3 and
# 10/√3: the unpaired SE √(SE_a² + SE_ref²) = √(221/3) would give Δ / SE = 0.23.
A, REF = [11.0, 22.0, 33.0], [10.0, 20.0, 30.0]


def records(values, seeds=(0, 1, 2)):
    return [{"seed": s, "final": {"m": v}} for s, v in zip(seeds, values, strict=True)]


def test_paired_difference_by_hand():
    got = equal_compute_report.versus(records(A), records(REF), "m")
    assert (got["test"], got["df"]) == ("paired", 2)
    np.testing.assert_allclose(
        [got["diff"], got["se_diff"], got["t"], got["p"]],
        [2.0, 1 / math.sqrt(3), 2 * math.sqrt(3), 1 - math.sqrt(6 / 7)],
        rtol=1e-12,
    )


def test_pairs_by_seed_not_by_position():
    shuffled = records([A[2], A[0], A[1]], seeds=(2, 0, 1))
    got = equal_compute_report.versus(shuffled, records(REF), "m")
    np.testing.assert_allclose([got["se_diff"], got["t"]], [1 / math.sqrt(3), 2 * math.sqrt(3)])


def test_unpaired_seeds_fall_back_to_welch_by_hand():
    """a = (1, 2, 3): var 1, n 3; ref = (2, 4, 6, 8, 10): var 10, n 5. SE_Δ² = 1/3 + 2 = 7/3;
    Welch-Satterthwaite df = (7/3)² / ((1/3)²/2 + 2²/4) = 98/19."""
    ref = records([2.0, 4.0, 6.0, 8.0, 10.0], seeds=range(5))
    got = equal_compute_report.versus(records([1.0, 2.0, 3.0]), ref, "m")
    assert got["test"] == "Welch"
    t = -4 / math.sqrt(7 / 3)
    np.testing.assert_allclose(
        [got["se_diff"], got["df"], got["t"]], [math.sqrt(7 / 3), 98 / 19, t]
    )
    assert 0.02 < got["p"] < 0.05  # t tables, 5.16 df: 5 % needs 2.57, 2 % needs 3.36; |t| 2.62
    cells = equal_compute_report.versus_cells("m", got)
    assert cells == "| -4 | -2.6 | Welch, df 5.16 | 0.046 | yes |"


@pytest.mark.parametrize("t, df", [(4.303, 2), (2.776, 4), (12.706, 1), (2.228, 10)])
def test_p_matches_the_t_table_at_5_percent(t, df):
    """Two-sided 5 % critical values of Student's t (the printed tables, 3 decimals)."""
    assert equal_compute_report.t_test(t, 1.0, df, "paired")["p"] == pytest.approx(0.05, abs=1e-4)


@pytest.mark.parametrize("t", [0.5, 1.0, 3.0, 4.0, 9.925])
def test_p_with_two_df_has_its_closed_form(t):
    got = equal_compute_report.t_test(-t, 1.0, 2, "paired")["p"]
    assert got == pytest.approx(1 - t / math.sqrt(t**2 + 2), rel=1e-12)


def test_three_se_with_three_seeds_is_not_significant():
    """|t| = 4 would have been 'beyond 3 SE'; under t(2) its p is 0.057."""
    m = equal_compute_report.t_test(0.04, 0.01, 2, "paired")
    assert m["p"] == pytest.approx(1 - 4 / math.sqrt(18))
    assert equal_compute_report.versus_cells("eval/x_accuracy", m) == (
        "| 4.0 | +4.0 | paired, df 2 | 0.057 | no |"
    )


def test_no_spread_or_one_seed_gives_no_test():
    same = equal_compute_report.versus(records(A), records(A), "m")
    one = equal_compute_report.versus(records([1.0], (0,)), records([2.0], (0,)), "m")
    assert same["t"] is None and same["p"] is None and one["t"] is None and one["df"] == 0
    assert equal_compute_report.versus_cells("m", one) == "| -1 | – | paired, df 0 | – | – |"
