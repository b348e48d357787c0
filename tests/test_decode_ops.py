"""experiments/decode_ops.py at smoke size: every way of writing one decode step's attention
gives the model's output, and a variant the device cannot run is recorded, not fatal."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_decode_attention_variant_equals_the_models():
    proc = subprocess.run(
        [sys.executable, "experiments/decode_ops.py", "--smoke"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    rec = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rec["shapes"] == dict(B=2, G=3, h=2, d=8, P=8, S=6, steps=6)
    variants = rec["variants"]
    assert set(variants) == {"model", "values_s_minor", "one_softmax", "one_softmax_s_minor",
                             "dpa_xla", "dpa_cudnn"}  # fmt: skip
    assert variants["model"]["max_rel_deviation"] is None and variants["model"]["us_per_step"] > 0
    for name, res in variants.items():
        if name == "model" or (name == "dpa_cudnn" and "error" in res):  # no cuDNN on a CPU
            continue
        assert res["max_rel_deviation"] < 1e-5, (name, res)
        assert res["read_gb_per_s"] > 0
