"""experiments/decode_ops.py at smoke size: every way of writing one decode step's attention
gives the model's output (the Pallas kernel interpreted), and a variant the device cannot run
is recorded, not fatal."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_decode_attention_variant_equals_the_models(tmp_path):
    proc = subprocess.run(
        [sys.executable, "experiments/decode_ops.py", "--smoke", "--members=1,4",
         f"--out_dir={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    rec = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rec["shapes"] == dict(B=2, G=4, h=2, d=8, P=128, S=64, steps=40)
    variants = rec["variants"]
    assert set(variants) == {"model", "values_s_minor", "one_softmax", "one_softmax_s_minor",
                             "dpa_xla", "dpa_cudnn", "rows2", "rows16", "pallas_m1",
                             "pallas_m4", "flash_s1", "flash_s2"}  # fmt: skip
    assert rec["pallas"] == dict(members=[1, 4], warps=4)
    assert rec["flash"] == dict(own_splits=[1, 2], prompt_splits=4, block=32)
    assert variants["model"]["max_rel_deviation"] is None and variants["model"]["us_per_step"] > 0
    for name, res in variants.items():
        if name == "model" or (name == "dpa_cudnn" and "error" in res):  # no cuDNN on a CPU
            continue
        assert res["max_rel_deviation"] < 1e-5, (name, res)
        assert res["read_gb_per_s"] > 0
    assert json.loads((tmp_path / "decode_ops_cpu.json").read_text()) == rec
    md = (tmp_path / "decode_ops_cpu.md").read_text()
    assert "(the Pallas kernel interpreted)" in md
    assert all(f"| {name} |" in md for name in variants)


def test_the_kernel_serves_several_members_per_program():
    """grpo_jax/decode_kernel.py, interpreted: 1, 4 or 16 members per program (16 x 64-wide
    heads read their own keys 8 at a time) give the model's attention, with a fully padded
    prompt chunk and the own cache written up to several indices."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from grpo_jax import decode_kernel
    from grpo_jax.model import _attention

    b, g, h, d, p, s = 1, 16, 2, 64, 70, 64  # the prompt pads to 96: 32 masked slots first
    ks = jax.random.split(jax.random.PRNGKey(0), 5)
    q = jax.random.normal(ks[0], (b, g, h, d))
    pk, pv = (jax.random.normal(k, (b, h, p, d)) for k in ks[1:3])
    ck, cv = (jax.random.normal(k, (b, g, h, s, d)) for k in ks[3:5])
    pmask = jnp.broadcast_to(jnp.arange(p) >= 6, (b, p))
    for index in (0, 31, 40):
        own = (jnp.arange(s) <= index)[None, :]
        want = _attention(q[:, :, None], pk, pv, pmask, ck, cv, own, jnp.float32)[:, :, 0]
        for members in (1, 4, 16):
            got = decode_kernel.attention(q, pk, pv, pmask, ck, cv, index, members, interpret=True)
            np.testing.assert_allclose(got, want, atol=2e-5, err_msg=f"{members}, {index}")


TRITON = "__gpu$xla.gpu.triton"
# the large model's shapes (b, g, h, d, p, s), and the TRL-comparable step's: a 100-key prompt,
# a 96-slot cache segment (horizon 70's last), neither a power of two
LARGE, TRL_STEP = (16, 16, 12, 64, 256, 128), (8, 8, 4, 32, 100, 96)


def lowered_for_h100(kernel, shapes) -> str:
    """The StableHLO of ``kernel(q, pk, pv, pmask, ck, cv, index)`` (bfloat16) exported for a
    CUDA GPU named as an H100 (jax >= 0.11 asks the device for its compute capability): the
    Triton lowering rules run, only compiling it needs the GPU."""
    import jax
    import jax.numpy as jnp

    b, g, h, d, p, s = shapes
    bf16 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    args = [bf16(b, g, h, d), bf16(b, h, p, d), bf16(b, h, p, d)]
    args += [jax.ShapeDtypeStruct((b, p), jnp.bool_), bf16(b, g, h, s, d), bf16(b, g, h, s, d)]
    args += [jax.ShapeDtypeStruct((), jnp.int32)]
    h100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=None,
                                       platform="gpu")  # fmt: skip
    mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=h100)
    with jax.sharding.use_abstract_mesh(mesh):
        exported = jax.export.export(
            jax.jit(kernel), platforms=["cuda"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)],
        )(*args)  # fmt: skip
    return exported.mlir_module()


def test_the_pallas_kernel_lowers_to_triton_for_a_cuda_gpu():
    """Without a GPU: grpo_jax/decode_kernel.py in bfloat16, for an H100, passes JAX's Triton
    lowering rules (block shapes, the dynamic own-cache loop) into one Triton custom call, at
    the large model's shapes and at the TRL-comparable step's (the prompt padded to 128)."""
    from grpo_jax import decode_kernel
    from grpo_jax.rollout import cache_segments

    assert cache_segments(69, decode_kernel.BLOCK)[-1] == TRL_STEP[-1]
    cases = [(LARGE, m) for m in (1, 4, 16)] + [(TRL_STEP, 1)]  # own keys 32, 32, 8, 32 a time
    for (b, g, h, d, p, s), members in cases:
        kernel = lambda *a, m=members: decode_kernel.attention(*a, m, interpret=False)
        text = lowered_for_h100(kernel, (b, g, h, d, p, s))
        assert text.count(f"stablehlo.custom_call @{TRITON}") == 1
        assert f"grid_x = {b} : i32, grid_y = {g // members} : i32, grid_z = {h}" in text


def test_the_flash_kernel_lowers_to_two_triton_kernels_for_a_cuda_gpu():
    """Without a GPU: decode_kernel.flash_attention (jax's flash-decoding kernel) in bfloat16,
    for an H100, passes JAX's Triton lowering as two kernels: the prompt's, a program per key
    split (4) and (prompt, head) row, all the prompt's members' queries in one program, and
    the own caches', a program per cache split and (prompt, member, head). At the large
    model's shapes with 1 and 4 cache splits (decode_ops.py's flash_s1 and flash_s4), and at
    the TRL-comparable step's (the prompt padded in front to 128)."""
    from grpo_jax import decode_kernel

    grid = "grid_x = 1 : i32, grid_y = {} : i32, grid_z = {} : i32"
    for (b, g, h, d, p, s), splits in [(LARGE, 1), (LARGE, 4), (TRL_STEP, 1)]:
        kernel = lambda *a, k=splits: decode_kernel.flash_attention(*a, k, interpret=False)
        text = lowered_for_h100(kernel, (b, g, h, d, p, s))
        assert text.count(f"stablehlo.custom_call @{TRITON}") == 2
        assert grid.format(4, b * h) in text and grid.format(splits, b * g * h) in text
