"""experiments/aot_compile.py: its report of a decode loop's kernels (aot_targets.py, its
flag-free half), its TPU slices, and its one error line where the interpreter has no plugin
to compile for the target with (as in CI: neither jax's CUDA plugin nor libtpu; a machine
with them compiles instead, see the script's docstring); the committed records."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_profile_step import LOOPS_HLO

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import aot_targets as G
import hlo_collectives as C
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
               mesh={"data": 2, "member": 4}, xla_flags="", collectives=C.collectives(
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
    # a record that names its device's memory says whether the plan fits it
    assert G.fits_words(res) == ""
    assert G.fits_words({**res, "device_memory_bytes": 2**31}) == (
        " of the device's 2 GiB: does not fit"
    )
    assert G.fits_words({**res, "device_memory_bytes": 80 * 2**30}).endswith("80 GiB: fits")


def test_the_targets_name_their_gpus():
    """Each target's text names its device and Hopper's compute capability (what XLA reads to
    pick its kernels), and its memory."""
    assert 'device_description_str: "NVIDIA H100 80GB HBM3"' in G.TARGETS["h100"]
    assert 'device_description_str: "NVIDIA H200"' in G.TARGETS["h200"]
    for text in G.TARGETS.values():
        assert "cuda_compute_capability { major: 9 minor: 0 }" in text
    assert "device_memory_size: 84929347584" in G.TARGETS["h100"]


def test_tpu_slices_are_named_as_libtpu_names_them():
    """--devices picks a slice of the TPU table: its topology name; one not there is a
    ValueError listing those there are. Each device's memory: the table's. Each slice's
    devices are its chips (the product of the topology's sides), two a chip on a v2 or v3
    (libtpu 0.0.42.1 built every one of these with as many devices, 2026-11-28)."""
    assert G.tpu_topology("v5e", 1) == "v5e:1x1" and G.tpu_topology("v2", 8) == "v2:2x2"
    assert G.tpu_topology("v5p", 8) == "v5p:2x2x2"
    with pytest.raises(ValueError, match=r"--devices=3: a v5e slice here has 1, 4, 8, 16 devices"):
        G.tpu_topology("v5e", 3)
    assert G.device_memory("v5e") == 16 * 2**30 and G.device_memory("h100") == 84929347584
    for target, (kind, memory, sizes) in G.TPUS.items():
        assert kind.startswith("TPU v") and memory >= 8 * 2**30
        per_chip = 2 if target in ("v2", "v3") else 1
        for devices, name in sizes.items():
            assert devices == per_chip * math.prod(int(d) for d in name.split("x")), name


def run_script(*args):
    """aot_compile.py in a subprocess: (return code, its error lines)."""
    proc = subprocess.run(
        [sys.executable, "experiments/aot_compile.py", "--config=configs/shakespeare.py:tiny",
         "--out_dir=/nonexistent", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "JAX_PLATFORMS": ""},
    )  # fmt: skip
    return proc.returncode, [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]


@pytest.mark.skipif(
    importlib.util.find_spec("jax_plugins") is not None, reason="a jax GPU plugin is installed"
)
def test_without_the_cuda_plugin_it_names_the_install():
    code, errors = run_script()
    assert code == 1 and len(errors) == 1, errors
    assert "--target=h100 needs jax's CUDA plugin" in errors[0]
    assert "pip install 'jax[cuda13]==" in errors[0]


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is not None, reason="libtpu is installed")
def test_a_tpu_target_names_its_own_fix():
    """Without libtpu: the install; a GPU flag with a TPU target, or a slice the table lacks:
    one line each, before any compile."""
    code, errors = run_script("--target=v5e")
    assert code == 1 and len(errors) == 1, errors
    assert "--target=v5e needs libtpu" in errors[0] and "pip install 'jax[tpu]==" in errors[0]
    assert run_script("--target=v6e", "--notriton_gemm")[1] == [
        "error: --notriton_gemm chooses a GPU's GEMMs; drop it for --target=v6e"
    ]
    assert run_script("--target=v2", "--devices=4")[1] == [
        "error: --devices=4: a v2 slice here has 2, 8, 32 devices; name one of them"
    ]


def test_the_committed_records_render_as_committed():
    """experiments/results/gpu_compile_h100: each markdown is its JSON's report; the large
    model's Triton kernels are two per layer and cache segment with ``flash``, one with
    ``pallas``."""
    records = sorted((ROOT / "experiments/results/gpu_compile_h100").glob("*.json"))
    assert len(records) == 10
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
    # and the update's params gathered too: under an eighth of the bytes of gathering only
    # the rollout's (0.73 of 6.4 GB; its update exchanged activations all-to-all), no
    # all-to-all; the gradient reduce-scattered (its all-reduces were 342 MB, a whole copy)
    moved = lambda r: sum(c["bytes"] for c in r["collectives"].values())
    assert moved(fsdp) < moved(by_name["large_8gpu_fsdp_rollout_only"]) / 8
    assert "all-to-all" not in fsdp["collectives"] and fsdp["decode_loop_collectives"] == {}
    _scatters(fsdp, 0.01)
    _sums_once(by_name, "exhaustive_full_8gpu_data2_member4")


def _scatters(fsdp, reduced):
    """FSDP's gradient is reduce-scattered onto the shards (sharding.make_member_sum); what
    is all-reduced moves under ``reduced`` of a float32 copy of the params (one update)."""
    assert fsdp["collectives"]["reduce-scatter"]["count"] > 0
    assert fsdp["collectives"]["all-reduce"]["bytes"] < reduced * 4 * fsdp["params"]


def _sums_once(by_name, name):
    """exhaustive,full (μ = 2 updates) on (data=2, member=4): its all-reduces move one copy
    of the float32 params per update, in one sum: the decision point's prefill runs in the
    loss's shard_map with its members (loss.continuation_terms). Outside it, 1.84 copies."""
    after, before = by_name[name], by_name[name + "_before"]
    assert after["mesh"] == before["mesh"] == {"data": 2, "member": 4}
    reduced = lambda r: r["collectives"]["all-reduce"]["bytes"] / (2 * 4 * r["params"])
    assert 1.0 <= reduced(after) < 1.01 and reduced(before) > 1.8


def test_the_committed_tpu_records_render_as_committed():
    """experiments/results/aot_compile_tpu: each markdown is its JSON's report, with the
    device's memory and no kernel counts. Colab's single v5e chip holds the large model's
    step and the exhaustive ``full`` config's within its 16 GiB; with FSDP on a v5e-8 the
    decode loops run no collective (the params gathered for the rollout and the update, as on
    the GPUs); on four v5e hosts at (data=4, member=4) no all-gather is left (7,774 a step
    before the position table's gradient became a matmul, 7,747 in the decode loops), and
    the gradient is summed once (the large model's step, and exhaustive ``full``'s on a
    v5e-8 at (data=2, member=4))."""
    records = sorted((ROOT / "experiments/results/aot_compile_tpu").glob("*.json"))
    assert len(records) == 13
    by_name = {}
    for path in records:
        res = json.loads(path.read_text())
        md = G.markdown(res)
        assert md == path.with_suffix(".md").read_text(), path.name
        assert res["platform"] == "tpu" and G.NO_KERNELS in md and "Triton" not in md
        by_name[path.stem] = res
    for name in ("large_v5e", "exhaustive_full_v5e"):
        assert by_name[name]["memory"]["executable_bytes"] < 16 * 2**30
        assert ": fits" in G.markdown(by_name[name])
    fsdp = by_name["large_v5e_8_fsdp"]
    assert fsdp["devices"] == 8 and fsdp["mesh"] == {"data": 8, "member": 1}
    assert fsdp["decode_loop_collectives"] == {} and fsdp["collectives"]["all-gather"]["count"]
    _scatters(fsdp, 0.3)  # XLA:TPU all-reduces some leaves' gradients (86.8 of 342 MB)
    # as the engine had it before: collectives at every decode step; then gathering only the
    # rollout's params: the update's activations gathered and exchanged (20x the bytes)
    assert by_name["large_v5e_8_fsdp_before"]["decode_loop_collectives"]["all-gather"]["count"]
    moved = lambda r: sum(c["bytes"] for c in r["collectives"].values())
    assert moved(fsdp) < moved(by_name["large_v5e_8_fsdp_rollout_only"]) / 20
    hosts, before = by_name["large_v5e_16_4hosts"], by_name["large_v5e_16_4hosts_before"]
    assert hosts["mesh"] == before["mesh"] == {"data": 4, "member": 4}
    assert "all-gather" not in hosts["collectives"] and hosts["decode_loop_collectives"] == {}
    assert before["decode_loop_collectives"]["all-gather"]["count"] == 7747
    # and the step (one update) sums its float32 gradient once over the 16 chips: its
    # all-reduces move one copy of the params; with ``data`` left automatic in the loss's
    # member loop they moved 2.1 (the loop's sum over ``member``, then GSPMD's over ``data``)
    reduced = lambda r: r["collectives"]["all-reduce"]["bytes"] / (4 * r["params"])
    assert 1.0 <= reduced(hosts) < 1.01 and reduced(before) > 2
    _sums_once(by_name, "exhaustive_full_v5e_8_data2_member4")
