"""experiments/grad_variance.py's smoke run, through the command line as a user runs it."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# G = 32 keeps a sampled group of a random tiny policy from scoring all-zero (a zero gradient
# has no direction); the other modes at the config's settings
MODES = ("sampled:group.size=32", "exhaustive", "guided")


def test_smoke_rows_and_exhaustive_horizon_one_is_deterministic(tmp_path, shakespeare_path):
    """Horizon 1 and a deterministic reward (match_partial against the fixed prompts' true
    next char): an exhaustive group rolls out every first char and nothing else, so no
    sampling is left and its repeat gradients are identical; sampled repeats are not."""
    cmd = [
        sys.executable,
        "experiments/grad_variance.py",
        "--smoke",
        "--config=shakespeare:tiny",
        "--config.data.horizon=1",
        f"--modes={','.join(MODES)}",
        f"--out_dir={tmp_path}",
        "--label=smoke",
    ]
    env = {**os.environ, "GRPO_JAX_DATA": str(shakespeare_path), "JAX_PLATFORMS": "cpu"}
    env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "true"  # cheap compiles: they are most of the run
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rec = json.loads((tmp_path / "grad_variance.json").read_text())["sections"]["smoke"]
    md = (tmp_path / "grad_variance.md").read_text()
    assert rec["meta"]["same_prompts"]
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
