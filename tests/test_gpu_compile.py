"""experiments/gpu_compile.py: its report of a decode loop's kernels (gpu_compile_parts.py,
its flag-free half), and its one error line where the interpreter has no jax CUDA plugin to
compile for a GPU with (as in CI; a machine with the plugin compiles instead, see the
script's docstring)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_profile_step import LOOPS_HLO

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import gpu_compile_parts as G
import xla_profile as P

ROOT = Path(__file__).resolve().parents[1]


def test_the_report_counts_each_decode_steps_kernels_per_layer():
    loops = P.decode_loops(P.parse_hlo(LOOPS_HLO))
    (row,) = G.loop_summary(loops)
    assert row == dict(loop="while.11", trip=31, kernels=4, layers=2, per_layer=(1, 2),
                       outside_layers=1)  # fmt: skip
    listed = [k[0] for k in G.layer_kernels(loops, layer=1)]
    assert listed == ["pallas_call.4", "triton_softmax.7"]
    # a layer the loop lacks: its first layer's
    assert [k[0] for k in G.layer_kernels(loops, layer=5)] == [
        "loop_convert_fusion.2", "gemm_fusion_dot.3", "triton_softmax.7"
    ]  # fmt: skip
    res = dict(name="t", device="NVIDIA H100 80GB HBM3", when="now", jax="0", dtype="bfloat16",
               params=1000, command="c", compile_s=2.0, triton_kernels=1, devices=8,
               mesh={"data": 2, "member": 4}, xla_flags="", collectives=P.collectives(
                   P.parse_hlo(LOOPS_HLO)),
               memory={"executable_bytes": 3 * 2**30,
                       "executable_memory": {"argument": 2**30, "temp": 2**31}},
               decode_loops=[row], layer_kernels=G.layer_kernels(loops))  # fmt: skip
    md = G.markdown(res)
    assert "| while.11 | 31 | 4 | 1-2 (2 layers) | 1 |" in md
    assert "XLA's buffer plan per device: 3.00 GiB (arguments 1.00 GiB, temporaries 2.00 GiB)" in md
    assert "compiled for 8 x NVIDIA H100 80GB HBM3" in md and "mesh data 2 x member 4" in md
    assert "collectives per step (each device): all-gather 1 (0.0 MB), all-reduce 4 (0.0 MB)" in md
    assert "| pallas_call.4 | elementwise | 1 |" in md
    assert "kernels of layer 1, and those outside the layers" in md


def test_the_targets_name_their_gpus():
    """Each target's text names its device and Hopper's compute capability (what XLA reads to
    pick its kernels), and its memory."""
    assert 'device_description_str: "NVIDIA H100 80GB HBM3"' in G.TARGETS["h100"]
    assert 'device_description_str: "NVIDIA H200"' in G.TARGETS["h200"]
    for text in G.TARGETS.values():
        assert "cuda_compute_capability { major: 9 minor: 0 }" in text
    assert "device_memory_size: 84929347584" in G.TARGETS["h100"]


@pytest.mark.skipif(
    importlib.util.find_spec("jax_plugins") is not None, reason="a jax GPU plugin is installed"
)
def test_without_the_cuda_plugin_it_names_the_install():
    proc = subprocess.run(
        [sys.executable, "experiments/gpu_compile.py", "--config=configs/shakespeare.py:tiny",
         "--out_dir=/nonexistent"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "JAX_PLATFORMS": ""},
    )  # fmt: skip
    assert proc.returncode == 1
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    assert "--gpu=h100 needs jax's CUDA plugin" in errors[0]
    assert "pip install 'jax[cuda13]==" in errors[0]


def test_the_committed_records_render_as_committed():
    """experiments/results/gpu_compile_h100: each markdown is its JSON's report; the large
    model's Triton kernels are two per layer and cache segment with ``flash``, one with
    ``pallas``."""
    records = sorted((ROOT / "experiments/results/gpu_compile_h100").glob("*.json"))
    assert len(records) == 7
    for path in records:
        res = json.loads(path.read_text())
        assert G.markdown(res) == path.with_suffix(".md").read_text(), path.name
    by_name = {p.stem: json.loads(p.read_text()) for p in records}
    assert by_name["large_flash"]["triton_kernels"] == 2 * 12 * 3
    assert by_name["large_pallas"]["triton_kernels"] == 12 * 3
    assert [r["layers"] for r in by_name["large_xla"]["decode_loops"]] == [12, 12, 12]
    # FSDP on 8 GPUs: the rollout's params gathered once (sharding.step_hooks) instead of at
    # every decode step, as the engine did before
    fsdp, before = by_name["large_8gpu_fsdp"], by_name["large_8gpu_fsdp_before"]
    assert fsdp["mesh"] == before["mesh"] == {"data": 8, "member": 1}
    gathers = lambda r: r["collectives"]["all-gather"]["count"]
    assert gathers(before) > 10 * gathers(fsdp)
    steps = lambda r: [loop["kernels"] for loop in r["decode_loops"]]
    assert max(steps(fsdp)) < min(steps(before)) / 2
