"""experiments/flop_count.py's FLOP counter (and measure.py's matmul floor): loops counted by
their trip count, and equal to XLA's own cost analysis where XLA can see every iteration (the
loop unrolled); the matmul peak's program: its matmuls and nothing else."""

import json
import os
import subprocess
import sys
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import measure
from flop_count import step_flops
from measure import matmul_floor, matmul_program


def _net(x, w, unroll):
    """A 10-step recurrence x <- tanh(x @ w) and its gradient in w: 10 forward matmuls, and
    20 backward ones (the gradient in x and in w at every step)."""

    def loss(x, w):
        body = lambda c, _: (jnp.tanh(c @ w), None)
        return jnp.sum(jax.lax.scan(body, x, None, length=10, unroll=unroll)[0])

    return jax.grad(loss, argnums=(0, 1))(x, w)


def test_scan_bodies_count_their_trip_count_and_match_xla_unrolled():
    x, w = jnp.ones((16, 32)), jnp.full((32, 32), 0.01)
    one = 2 * 16 * 32 * 32  # one [16, 32] x [32, 32] matmul
    rolled = lambda x, w: _net(x, w, 1)
    unrolled = lambda x, w: _net(x, w, True)
    got = step_flops(rolled, x, w, compiled=jax.jit(rolled).lower(x, w).compile())
    want = step_flops(unrolled, x, w, compiled=jax.jit(unrolled).lower(x, w).compile())
    assert got["matmul_flops"] == want["matmul_flops"] == 30 * one
    # XLA sees all 30 matmuls only unrolled (plus the elementwise ops it also counts)...
    assert 30 * one <= want["xla_flops"] < 31 * one
    # ...and rolled, the loop bodies once: the undercount benchmark.py reports beside ours
    assert got["xla_flops"] < 4 * one


def test_batched_and_dense_matmuls_are_counted_apart():
    """Attention's batched dots and the dense layers' dots, split as profile_step reports them."""
    from flop_count import matmul_flops_of

    def f(x, w, q, k):
        return jnp.sum(x @ w) + jnp.sum(jnp.einsum("bqd,bkd->bqk", q, k))

    args = jnp.ones((16, 32)), jnp.ones((32, 8)), jnp.ones((4, 5, 6)), jnp.ones((4, 7, 6))
    jaxpr = jax.make_jaxpr(f)(*args).jaxpr
    dense, batched = 2 * 16 * 32 * 8, 2 * 4 * 5 * 7 * 6
    assert matmul_flops_of(jaxpr, batched=False) == dense
    assert matmul_flops_of(jaxpr, batched=True) == batched
    assert matmul_flops_of(jaxpr) == dense + batched


def test_loop_flops_are_the_matmuls_inside_scans_at_any_depth():
    """loop_matmul_flops counts the dots a scan runs (its length times, inside a jit too) and
    leaves the ones before and after it out: the rollout floor's decode loop."""
    from flop_count import loop_matmul_flops, matmul_flops_of

    @jax.jit
    def inner(x, w):
        return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=5)[0]

    f = lambda x, w: inner(x @ w, w) @ w
    jaxpr = jax.make_jaxpr(f)(jnp.ones((16, 32)), jnp.ones((32, 32))).jaxpr
    one = 2 * 16 * 32 * 32
    assert (loop_matmul_flops(jaxpr), matmul_flops_of(jaxpr)) == (5 * one, 7 * one)


def test_a_rollouts_loop_flops_are_its_decode_steps_by_hand(shakespeare_path, monkeypatch):
    """The sampled rollout's loop FLOPs are its H - 1 decode steps, counted by hand: per step
    and member, 24·D² per layer (qkv, out, the 4·D MLP), the 2·D·V head, and per layer the
    scores and values against the P prompt positions and the S member-cache slots
    (4·(P + S)·D); the prefill and the reference's pass are outside the loop."""
    from flop_count import step_flops

    from grpo_jax import trainer
    from grpo_jax.configs.shakespeare import get_config
    from grpo_jax.tasks import build_task

    monkeypatch.setenv("GRPO_JAX_DATA", str(shakespeare_path))
    cfg = get_config("sampled")
    cfg.update_from_flattened_dict({"group.size": 4, "reference.kind": "policy",
        "train.batch_size": 2, "model.num_layers": 2, "model.num_heads": 2,
        "model.d_model": 32, "data.context_len": 20, "data.horizon": 9})  # fmt: skip
    task = build_task(cfg, "train")
    params = trainer.initial_params(cfg, task)
    step, inputs = task.build(params)
    got = step_flops(step.rollout, task.make_state(params), inputs)
    rows, n_l, d, v, p, s = 2 * 4, 2, 32, 65, 20, 8  # 8 decode steps fill one 8-slot segment
    per_step = rows * (n_l * 24 * d * d + 2 * d * v + n_l * 4 * (p + s) * d)
    assert got["loop_matmul_flops"] == 8 * per_step
    assert 0 < got["loop_matmul_flops"] < got["matmul_flops"]


def test_the_peak_program_is_its_matmuls_and_nothing_else():
    """XLA compiles every one of the repeats (none merged or hoisted: the rate would be
    inflated) and no other arithmetic (a shifted input or an accumulator, which the earlier
    scan spent a quarter of its time on, deflating the peak); each output is x @ w."""
    m, k, n, repeats = 48, 32, 40, 5
    program, args = matmul_program(m, k, n, "float32", repeats)
    compiled = program.lower(*args).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    assert cost["flops"] == repeats * 2 * m * k * n
    outs = program(*args)
    assert len(outs) == repeats
    for out in outs:
        chex.assert_shape(out, (m, n))
        np.testing.assert_allclose(np.asarray(out), np.full((m, n), 1e-4 * k), rtol=1e-5)


def test_the_matmul_floor_times_each_distinct_matmul_once_and_counts_its_runs(monkeypatch):
    """A scan's 10 [16, 32] @ [32, 32] matmuls are one distinct program run 10 times; the
    final [16, 32] @ [32, 8] another, run once; a batched [2, 16, 32] @ [2, 32, 4] a third,
    counted as batched. The timer is faked (seconds per call = the right operand's last
    width in ms) so the sums are exact, with 8 matmuls per timed call."""
    seen = []

    def fake_best_call_s(program, args, runs):
        xs, w = args
        seen.append((len(xs), xs[0].shape, w.shape))
        return w.shape[-1] * 1e-3

    monkeypatch.setattr(measure, "_best_call_s", fake_best_call_s)

    def f(x, w, v, xb, yb):
        body = lambda c, _: (jnp.tanh(c @ w), None)
        return jax.lax.scan(body, x, None, length=10)[0] @ v, jnp.einsum("bij,bjk->bik", xb, yb)

    x, w, v = jnp.ones((16, 32)), jnp.full((32, 32), 0.01), jnp.ones((32, 8))
    got = matmul_floor(f, x, w, v, jnp.ones((2, 16, 32)), jnp.ones((2, 32, 4)), repeats=8)
    assert got["distinct_matmuls"] == 3
    assert sorted(seen) == [(8, (2, 16, 32), (2, 32, 4)), (8, (16, 32), (32, 8)),
                            (8, (16, 32), (32, 32))]  # fmt: skip
    by_kind = got["matmul_floor_s_by_kind"]
    np.testing.assert_allclose(by_kind["dense"], (10 * 32e-3 + 8e-3) / 8, rtol=1e-12)
    np.testing.assert_allclose(by_kind["batched"], 4e-3 / 8, rtol=1e-12)
    assert got["matmul_floor_s"] == by_kind["dense"] + by_kind["batched"]
    top = [(r["kind"], r["lhs"], r["rhs"], r["runs"]) for r in got["matmul_floor_top"]]
    assert top == [("dense", [16, 32], [32, 32], 10), ("dense", [16, 32], [32, 8], 1),
                   ("batched", [2, 16, 32], [2, 32, 4], 1)]  # fmt: skip
    first = got["matmul_floor_top"][0]  # 32e-3 s per call of 8 matmuls, run 10 times
    np.testing.assert_allclose([first["us_per_run"], first["floor_ms"]], [4000, 40], rtol=1e-12)
    np.testing.assert_allclose(first["gflops_alone"], 2 * 16 * 32 * 32 / 4e-3 / 1e9, rtol=1e-12)


def test_a_shard_map_body_counts_once_per_block_of_its_manual_axes():
    """The member map's shard_map is manual over ``member`` only: its body's shapes are one
    member block's but the whole batch along ``data``, which the partitioner splits without
    repeating it. Its FLOPs are the body's times the member axis (3), not times the whole mesh
    (6): the plain computation's. Fully manual, the body sees a [4, 2] block and every one of
    the 6 devices runs it. Traced on an abstract mesh: no devices needed."""
    from flop_count import matmul_flops_of
    from jax.sharding import AbstractMesh, AxisType
    from jax.sharding import PartitionSpec as P

    mesh = AbstractMesh((2, 3), ("data", "member"), axis_types=(AxisType.Auto,) * 2)
    gram = lambda x: x @ x.T  # [rows, cols] -> [rows, rows], 2 * rows * rows * cols FLOPs
    x = jnp.ones((8, 6))

    def flops(spec, axes):
        f = jax.shard_map(
            gram, mesh=mesh, in_specs=spec, out_specs=spec, axis_names=axes, check_vma=False
        )
        return matmul_flops_of(jax.make_jaxpr(f)(x).jaxpr)

    assert flops(P(None, "member"), frozenset({"member"})) == 3 * (2 * 8 * 8 * 2)
    assert flops(P("data", "member"), frozenset({"data", "member"})) == 6 * (2 * 4 * 4 * 2)


def test_a_platform_dependent_branch_counts_as_this_backend_runs_it():
    """lax.platform_dependent (products.lookup's gradient) runs one branch per backend: a CPU
    counts its own (no matmul here), not the GPU's matmul; a data-dependent cond still
    counts its most expensive branch, as does a platform_dependent one with neither this
    backend's branch nor a default (it used to raise)."""
    from flop_count import matmul_flops_of

    x = jnp.ones((8, 8))
    square = lambda x: x @ x  # 2 * 8 * 8 * 8 FLOPs
    by_platform = lambda x: jax.lax.platform_dependent(x, cpu=jnp.tanh, default=square)
    by_value = lambda x: jax.lax.cond(x[0, 0] > 0, square, jnp.tanh, x)
    assert jax.default_backend() == "cpu"
    assert matmul_flops_of(jax.make_jaxpr(by_platform)(x).jaxpr) == 0
    assert matmul_flops_of(jax.make_jaxpr(by_value)(x).jaxpr) == 2 * 8 * 8 * 8
    elsewhere = lambda x: jax.lax.platform_dependent(x, cuda=square, tpu=jnp.tanh)
    assert matmul_flops_of(jax.make_jaxpr(elsewhere)(x).jaxpr) == 2 * 8 * 8 * 8


@pytest.fixture
def cudnn_traces(monkeypatch):
    """jax's cuDNN attention traced on a CPU: its version query stubbed, as
    tests/test_model_rollout.py does (tracing only: nothing lowers for a GPU)."""
    fa = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")
    if not hasattr(fa, "check_cudnn_version"):
        pytest.skip("this jax checks cuDNN elsewhere")
    monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91000)


def _attention_counts(impl, *shapes, **kw):
    """(forward, forward + backward) matmul FLOPs of jax.nn.dot_product_attention."""
    from flop_count import matmul_flops_of

    f = lambda q, k, v, m: jax.nn.dot_product_attention(q, k, v, mask=m, implementation=impl, **kw)
    loss = lambda *a: jnp.sum(f(*a).astype(jnp.float32))
    args = [jax.ShapeDtypeStruct(s, t) for s, t in shapes]
    fwd = matmul_flops_of(jax.make_jaxpr(f)(*args).jaxpr, batched=True)
    both = matmul_flops_of(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(*args).jaxpr)
    return fwd, both


def test_cudnn_attention_counts_as_the_products_its_flash_kernel_runs(cudnn_traces):
    """q [B, T, N, H] = [2, 8, 3, 8] against S = 16 keys: each product is 2·B·N·T·S·H = 12288
    FLOPs. Forward, QKᵀ and PV, as the xla implementation's einsums (2 products, batched); the
    gradient's four (dP, dV, dQ, dK), and for cuDNN's flash backward a fifth, QKᵀ recomputed.
    The old counter saw only dot_generals: cuDNN's fused calls counted 0."""
    bf16 = jnp.bfloat16
    shapes = ((2, 8, 3, 8), bf16), ((2, 16, 3, 8), bf16), ((2, 16, 3, 8), bf16)
    shapes += (((2, 1, 8, 16), jnp.bool_),)
    one = 2 * 2 * 3 * 8 * 16 * 8
    assert _attention_counts("xla", *shapes) == (2 * one, 6 * one)
    assert _attention_counts("cudnn", *shapes) == (2 * one, 7 * one)


def test_cudnn_attention_that_skips_tiles_is_reported_not_counted(cudnn_traces):
    """A causal mask lets cuDNN skip tiles (its tiling decides how many): the counter raises
    by default, naming the primitive, and with a list it records the call and counts 0."""
    from flop_count import UncountedMatmulError, matmul_flops_of

    q = jax.ShapeDtypeStruct((2, 8, 3, 8), jnp.bfloat16)
    f = lambda q: jax.nn.dot_product_attention(q, q, q, is_causal=True, implementation="cudnn")
    jaxpr = jax.make_jaxpr(f)(q).jaxpr
    with pytest.raises(UncountedMatmulError, match="dot_product_attention_fwd_wrapper"):
        matmul_flops_of(jaxpr)
    uncounted = []
    assert matmul_flops_of(jaxpr, uncounted=uncounted) == 0
    assert [(e["primitive"], e["runs"]) for e in uncounted] == [
        ("dot_product_attention_fwd_wrapper", 1)
    ]
    assert "CAUSAL" in uncounted[0]["why"]


def test_a_model_on_cudnn_counts_the_xla_paths_forward_and_one_more_product_backward(
    cudnn_traces,
):
    """The same small model (2 layers, 2 heads of 16) on model.attention=xla and =cudnn, one
    group's logits (group_logits: a prefill and an extend per layer): the forward counts are
    equal (the same products), and the gradient's differ by the flash backward's recomputed
    QKᵀ, 2·B·N·T·S·H per attention call: the prefill's 2 prompts over their 6 tokens, the
    extend's 2 x 3 members over 7 tokens (padded to 8) against 6 + 7 keys (padded to 14)."""
    from flop_count import matmul_flops_of

    from grpo_jax.model import Transformer, group_logits, init_params

    kw = dict(vocab_size=11, num_layers=2, num_heads=2, d_model=32, max_len=14)
    p = init_params(Transformer(**kw), jax.random.PRNGKey(0))  # init runs eagerly, on the CPU
    ctx, gen, mask = jnp.zeros((2, 6), jnp.int32), jnp.zeros((2, 3, 8), jnp.int32), jnp.ones((2, 6))

    def counts(attention, grad):
        m = Transformer(**kw, dtype=jnp.bfloat16, attention=attention)
        f = lambda params: jnp.sum(group_logits(m, params, ctx, gen, mask)[1].astype(jnp.float32))
        jaxpr = jax.make_jaxpr(jax.grad(f) if grad else f)(p).jaxpr
        return [matmul_flops_of(jaxpr, batched=b) for b in (False, True)]

    qk = lambda b, t, s: 2 * b * 2 * t * s * 16  # QKᵀ over b query batches, 2 heads of 16
    recomputed = 2 * (qk(2, 6, 6) + qk(2 * 3, 8, 14))  # 2 layers: a prefill, an extend
    assert counts("cudnn", grad=False) == counts("xla", grad=False)
    (dense, batched), (xla_dense, xla_batched) = counts("cudnn", True), counts("xla", True)
    assert dense == xla_dense and batched - xla_batched == recomputed == 95232


def _pallas_matmul(x, w, block: int):
    """x @ w as a Pallas kernel, one program per ``block`` rows of x (interpreted on a CPU)."""
    from jax.experimental import pallas as pl

    def kernel(x_ref, w_ref, o_ref):
        o_ref[...] = jnp.dot(x_ref[...], w_ref[...])

    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), x.dtype),
        grid=(x.shape[0] // block,),
        in_specs=[pl.BlockSpec((block, x.shape[1]), lambda i: (i, 0)), pl.BlockSpec(w.shape)],
        out_specs=pl.BlockSpec((block, w.shape[1]), lambda i: (i, 0)),
        interpret=True,
    )(x, w)


def test_a_pallas_kernel_counts_its_dot_generals_once_per_program_of_its_grid():
    """[32, 16] @ [16, 8] in 4 programs of [8, 16] @ [16, 8]: 4 x 2·8·16·8 = 2·32·16·8, as the
    plain matmul. The old counter walked the kernel once: a quarter of it."""
    from flop_count import matmul_flops_of

    x, w = jnp.ones((32, 16)), jnp.ones((16, 8))
    jaxpr = jax.make_jaxpr(lambda x, w: _pallas_matmul(x, w, 8))(x, w).jaxpr
    assert matmul_flops_of(jaxpr) == matmul_flops_of(jax.make_jaxpr(jnp.matmul)(x, w).jaxpr)
    assert matmul_flops_of(jaxpr) == 4 * 2 * 8 * 16 * 8


def test_the_pallas_decode_kernel_is_reported_not_counted_as_zero():
    """decode_kernel.py's attention multiplies and sums (no dot_general): the counter cannot
    size its products from the kernel, so it raises by default and step_flops reports it
    (matmul_uncounted: the kernel, its op, how often it runs) beside the rest's count."""
    from flop_count import UncountedMatmulError, matmul_flops_of

    from grpo_jax.decode_kernel import attention

    b, g, h, d, p, s = 1, 2, 2, 8, 32, 32
    args = (
        jnp.ones((b, g, h, d)),
        jnp.ones((b, h, p, d)),
        jnp.ones((b, h, p, d)),
        jnp.ones((b, p), bool),
        jnp.ones((b, g, h, s, d)),
        jnp.ones((b, g, h, s, d)),
    )
    dense = jnp.ones((d, d))
    f = lambda w, *a: attention(*a, 3) @ w  # then a [b·g·h, d] @ [d, d] matmul: counted
    with pytest.raises(UncountedMatmulError, match="pallas_call.*decode_kernel.py"):
        matmul_flops_of(jax.make_jaxpr(f)(dense, *args).jaxpr)
    got = step_flops(f, dense, *args)
    assert got["matmul_flops"] == 2 * b * g * h * d * d
    (entry,) = got["matmul_uncounted"]
    assert (entry["primitive"], entry["runs"]) == ("pallas_call", 1)
    assert "no dot_general" in entry["why"]


def test_known_matmul_primitives_the_counter_cannot_size_are_never_counted_as_zero():
    """A grouped matmul (lax.ragged_dot: its groups' sizes are data) inside a 5-step scan:
    raised by default, else reported with its runs, one entry per op."""
    from flop_count import UncountedMatmulError, matmul_flops_of

    def f(x, w, sizes):
        body = lambda c, _: (jax.lax.ragged_dot(c, w, sizes)[:, :4], None)
        return jax.lax.scan(body, x, None, length=5)[0]

    args = jnp.ones((8, 4)), jnp.ones((2, 4, 4)), jnp.array([3, 5])
    with pytest.raises(UncountedMatmulError, match="ragged_dot_general"):
        matmul_flops_of(jax.make_jaxpr(f)(*args).jaxpr)
    got = step_flops(f, *args)
    assert got["matmul_flops"] == 0
    assert [(e["primitive"], e["runs"]) for e in got["matmul_uncounted"]] == [
        ("ragged_dot_general", 5)
    ]


def test_alternate_calls_times_each_sides_own_program_after_one_untimed_call():
    """measure.alternate_calls: one untimed call of A then B, then rounds of ``calls`` calls
    of each side's own function on its own arguments, in alternate's order."""
    ran = []

    def prog(name):
        def fn(x):
            ran.append((name, x))
            return jnp.zeros(())

        return fn

    progs = {"A": (prog("A"), (1,)), "B": (prog("B"), (2,))}
    times = measure.alternate_calls(progs, rounds=2, calls=2)
    a, b = ("A", 1), ("B", 2)
    assert ran == [a, b, a, a, b, b, b, b, a, a]
    assert [len(times[side]) for side in "AB"] == [4, 4]
    assert all(t >= 0 for side in "AB" for t in times[side])


def run_script(name: str, *args: str, data, timeout=300, **env_vars):
    """experiments/<name> in a subprocess on the corpus at ``data``, compiling with most of
    XLA's optimisations off (the programs still differ where the code does), with
    ``env_vars`` set too; the finished process."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "GRPO_JAX_DATA": str(data), "JAX_DISABLE_MOST_OPTIMIZATIONS": "1"}
    env.update(env_vars)
    cmd = [sys.executable, f"experiments/{name}", *args]
    return subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)


def test_rollout_devices_ab_splits_the_step_and_trains_as_one_program(shakespeare_path):
    """experiments/rollout_devices_ab.py on the tiny sampled step: the rollout on two CPU
    devices and the update on one time alternately against the one-program step, and a step
    taken both ways from one state samples the same batch and trains to the same loss and
    params; too few host devices in the caller's XLA_FLAGS give one error line."""
    args = ["--config=configs/shakespeare.py:tiny,sampled", "--rounds=2", "--calls=2"]
    done = run_script("rollout_devices_ab.py", *args, data=shakespeare_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rec = json.loads(done.stdout.strip().splitlines()[-1])
    sides = rec["sides"]
    assert [len(sides[k]["times_s"]) for k in ("split", "fused")] == [4, 4]
    for side in sides.values():
        assert side["median_step_s"] == np.median(side["times_s"])
    assert rec["ratio"] == pytest.approx(
        sides["split"]["median_step_s"] / sides["fused"]["median_step_s"]
    )
    # the same samples, their log-probs to rounding, the same loss; the new params within 1 %
    # of the step's largest update (Adam can turn a near-zero gradient's rounding into a
    # visible part of an update: 1.6e-5 of 5.5e-3 after two warm-up steps)
    assert rec["batch_ints_differ"] == 0 and rec["batch_max_diff"] <= 1e-5
    assert rec["loss_split"] == pytest.approx(rec["loss_fused"], rel=1e-6)
    assert 0 < rec["max_update"] and rec["max_param_diff"] <= 0.01 * rec["max_update"]
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1"
    bad = run_script("rollout_devices_ab.py", *args, data=shakespeare_path, XLA_FLAGS=flags)
    assert bad.returncode == 1
    line = bad.stderr.strip().splitlines()[-1]
    assert line == "error: XLA_FLAGS asks for 1 CPU devices; --rollout_devices=2", line


def test_half_ab_times_what_the_swap_changed_and_names_what_it_did_not(shakespeare_path):
    """experiments/half_ab.py with the dense layers' CPU weight gradient (products.dense_dot)
    swapped for lax.dot_general: the update compiles to another program (the model uses
    dense_dot, and the swap reaches the second trace), timed in alternating calls; the
    rollout, which takes no gradient, to the same one up to names and metadata, not timed."""
    swap = "--swap=grpo_jax.model.dense_dot=jax.lax.dot_general"
    args = ["--config=configs/shakespeare.py:tiny,sampled", "--halves=rollout,update",
            "--rounds=2", "--calls=2", swap]  # fmt: skip
    done = run_script("half_ab.py", *args, data=shakespeare_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rollout: the swap left its compiled program as it was" in done.stdout
    halves = json.loads(done.stdout.strip().splitlines()[-1])["halves"]
    assert halves["rollout"] == {"same_program": True}
    update = halves["update"]
    assert update["same_program"] is False and update["ratio"] > 0
    assert [len(update["times_s"][side]) for side in "AB"] == [4, 4]
    for swap, line in (
        ("grpo_jax.model.nope=jax.lax.dot_general", "grpo_jax.model has no attribute 'nope'"),
        ("dense_dot=jax.lax.dot_general", "'dense_dot' is not module.attr"),
        ("grpo_jax.model.dense_dot=jax.lax", "jax.lax is not callable"),
    ):
        bad = run_script("half_ab.py", args[0], f"--swap={swap}", data=shakespeare_path)
        assert bad.returncode == 1
        assert bad.stderr.strip().splitlines()[-1] == f"error: --swap: {line}", bad.stderr


def test_canonical_hlo_drops_names_and_metadata_but_keeps_which_operand_is_which():
    """Two traces of one function compare equal; programs that differ only in the order of
    their operands (the same instructions, renumbered) do not."""
    a, b = jnp.ones((8, 8)), jnp.full((8, 8), 2.0)
    hlo = lambda f: measure.canonical_hlo(jax.jit(f).lower(a, b).compile().as_text())
    first = hlo(lambda x, y: (x @ x) @ (y @ y))
    jax.clear_caches()
    assert hlo(lambda x, y: (x @ x) @ (y @ y)) == first
    assert hlo(lambda x, y: (y @ y) @ (x @ x)) != first
    assert hlo(lambda x, y: x + y) != hlo(lambda x, y: x * y)


def test_alternate_puts_each_side_first_in_every_other_round():
    """measure.alternate: A B, B A, A B ...; each side's seconds in its own rounds' order."""
    order = []

    def side(name, seconds):
        def run():
            order.append(name)
            return [seconds + len(order)]

        return run

    times = measure.alternate({"A": side("A", 0.0), "B": side("B", 100.0)}, rounds=4)
    assert order == ["A", "B", "B", "A", "A", "B", "B", "A"]
    assert times == {"A": [1.0, 4.0, 5.0, 8.0], "B": [102.0, 103.0, 106.0, 107.0]}


def test_modes_ab_times_two_configs_steps_alternately(shakespeare_path):
    """experiments/modes_ab.py on the tiny config's exhaustive (A) and sampled (B) modes: each
    side's steps timed in alternating rounds, tokens/s from the task's tokens per step, the
    ratio of the two; configs whose host memory settings differ give one error line."""
    args = ["--config=configs/shakespeare.py:tiny", "--other=configs/shakespeare.py:tiny,sampled",
            "--rounds=2", "--calls=2", "--warmup=0"]  # fmt: skip
    done = run_script("modes_ab.py", *args, data=shakespeare_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rec = json.loads(done.stdout.strip().splitlines()[-1])
    a, b = rec["sides"]["A"], rec["sides"]["B"]
    # tiny: B = 2 prompts, horizon 8; exhaustive forces all V = 65 first tokens, sampled G = 4
    assert (a["tokens_per_step"], b["tokens_per_step"]) == (2 * 65 * 8, 2 * 4 * 8)
    for s in (a, b):
        assert len(s["times_s"]) == 4 and s["median_step_s"] == np.median(s["times_s"])
        assert s["tokens_per_s"] == pytest.approx(s["tokens_per_step"] / s["median_step_s"])
    assert rec["ratio"] == pytest.approx(a["tokens_per_s"] / b["tokens_per_s"])
    # each side stepped its own state: no warm-up, 2 rounds of 2 steps
    assert a["state_steps"] == b["state_steps"] == 4
    tps = lambda s, r: s["tokens_per_step"] / np.median(s["times_s"][2 * r : 2 * r + 2])
    want = [tps(a, r) / tps(b, r) for r in range(2)]
    np.testing.assert_allclose(rec["round_ratios"], want, rtol=1e-12)
    bad = run_script("modes_ab.py", *args[:2], "--other.cpu_buffers=release", data=shakespeare_path)
    assert bad.returncode == 1
    line = bad.stderr.strip().splitlines()[-1]
    assert line.startswith("error: cpu_buffers differ") and "--other.cpu_buffers=" in line, line
