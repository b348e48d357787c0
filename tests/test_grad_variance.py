"""experiments/grad_variance.py through the command line as a user runs it (the module defines
absl flags that other experiments' modules also define, so it is not imported here)."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# G = 32 keeps a sampled group of a random tiny policy from scoring all-zero (a zero gradient
# has no direction); the other modes at the config's settings
MODES = ("sampled:group.size=32", "exhaustive", "guided")
RESULTS = ROOT / "experiments/results"


def ceiling_fits(cases):
    """grad_variance.ceiling_fit(*case) per case, in a fresh interpreter."""
    code = (
        "import json, sys; sys.path.insert(0, 'experiments'); import grad_variance as gv; "
        f"print(json.dumps([gv.ceiling_fit(*c) for c in json.loads({json.dumps(cases)!r})]))"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_ceiling_above_one_beyond_its_error_or_with_large_rho_per_repeat_is_not_estimated():
    """(c_1, se, ρ, R, s/grad) by hand: a cosine cannot exceed 1. 1.003 ± 0.010 is noise
    around 1; 1.64 ± 0.56 with ρ/R = 24.6 (the committed Shakespeare hierarchical return-credit
    row) and 1.08 ± 0.012 are not, nor is any ceiling once ρ/R > 10."""
    inf = float("inf")
    arith, shakes, above, noisy, plain, hidden = ceiling_fits(
        [
            (0.8462, 0.0087, 0.406, 40, 0.134),
            (0.0523, 0.0178, 982.584, 40, 0.0923),
            (0.9, 0.01, 0.44, 40, 1.0),
            (0.02, 0.001, 440.0, 40, 1.0),
            (0.3, 0.01, 0.21, 40, 2.0),
            (0.3, 0.01, inf, 40, 2.0),
        ]
    )
    assert arith["ceiling"] == 1.0 and arith["ceiling_note"] == ""
    assert math.isclose(arith["ceiling_raw"], 0.8462 * math.sqrt(1.406))
    assert math.isclose(arith["ceiling_se"], 0.0087 * math.sqrt(1.406))
    assert math.isclose(arith["n_to_target"], 0.406 / (1 / 0.81 - 1))  # 1.731
    assert math.isclose(arith["s_to_target"], arith["n_to_target"] * 0.134)
    assert math.isclose(arith["cos_of_mean_model"], 1 / math.sqrt(1 + 0.406 / 40))
    assert "1.64 ± 0.56 exceeds 1" in shakes["ceiling_note"]
    assert "ρ/R = 24.6 > 10" in shakes["ceiling_note"]
    for key in ("ceiling", "n_to_target", "s_to_target", "cos_of_mean_model"):
        assert math.isnan(shakes[key]) and math.isnan(above[key]) and math.isnan(noisy[key])
    assert "1.08 ± 0.012 exceeds 1" in above["ceiling_note"] and "ρ/R" not in above["ceiling_note"]
    assert noisy["ceiling_note"] == "ρ/R = 11 > 10: ρ is poorly measured"
    assert math.isclose(plain["ceiling"], 0.33) and plain["ceiling_note"] == ""
    assert math.isclose(plain["ceiling_se"], 0.011)
    assert plain["n_to_target"] == inf and plain["s_to_target"] == inf
    # noise hiding the mean (ρ = ∞): no ceiling, and averaging never reaches 0.9, as before
    assert math.isnan(hidden["ceiling"]) and hidden["n_to_target"] == inf
    assert hidden["ceiling_note"] == ""


def test_committed_record_renders_to_its_markdown(tmp_path):
    """--report_only re-renders the committed JSON (ceilings refitted) to the committed .md; the
    Shakespeare hierarchical return-credit row gives no ceiling, n or s to 0.9."""
    shutil.copy(RESULTS / "grad_variance.json", tmp_path)
    cmd = [sys.executable, "experiments/grad_variance.py", "--report_only", f"--out_dir={tmp_path}"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    md = (tmp_path / "grad_variance.md").read_text()
    assert md == (RESULTS / "grad_variance.md").read_text()
    row = next(x for x in md.split("## shakespeare_return_credit")[1].splitlines() if "| hier" in x)
    assert "| 0.319 (–), R = 40 |" in row and "| – (1.64 ± 0.56) | – (1.55e+03) | – |" in row
    assert "4.19e+03" not in md
    assert "| 1 ± 0.01 | 1.73 (1.69) | 0.232 |" in md.split("## arithmetic")[1]


def test_smoke_rows_and_exhaustive_horizon_one_is_deterministic(tmp_path, shakespeare_path):
    """Horizon 1 and a deterministic reward (match_partial against the fixed prompts' true
    next char): an exhaustive group rolls out every first char and nothing else, so no
    sampling is left and its repeat gradients are identical; sampled repeats are not. The
    true gradient's groups take --true_advantage_scale, the modes keep the config's."""
    cmd = [
        sys.executable,
        "experiments/grad_variance.py",
        "--smoke",
        "--config=shakespeare:tiny",
        "--config.data.horizon=1",
        f"--modes={','.join(MODES)}",
        f"--out_dir={tmp_path}",
        "--label=smoke",
        "--true_advantage_scale=group",  # the config's objective has none
    ]
    env = {**os.environ, "GRPO_JAX_DATA": str(shakespeare_path), "JAX_PLATFORMS": "cpu"}
    env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "true"  # cheap compiles: they are most of the run
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rec = json.loads((tmp_path / "grad_variance.json").read_text())["sections"]["smoke"]
    md = (tmp_path / "grad_variance.md").read_text()
    assert rec["meta"]["same_prompts"]
    assert rec["truth"]["advantage_scale"] == "group"
    assert "advantage_scale none" in rec["meta"]["objective"]  # the modes' objective
    assert "G = 8, advantage_scale group (" in md
    assert 0 < rec["truth"]["split_half_cos"] <= 1
    for mode in MODES:
        row = rec["modes"][mode]
        assert f"| {mode} | " in md
        for key in ("cos", "cos_of_mean", "repeat_cos"):
            assert -1 - 1e-9 <= row[key] <= 1 + 1e-9, (mode, key, row[key])
        assert row["s_per_grad"] > 0 and row["tokens_per_grad"] > 0
    exhaustive, sampled = rec["modes"]["exhaustive"], rec["modes"][MODES[0]]
    assert abs(exhaustive["repeat_cos"] - 1.0) < 1e-5
    assert exhaustive["rho"] < 1e-6  # no covariance left across repeats
    assert sampled["repeat_cos"] < 0.99
