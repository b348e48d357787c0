"""experiments/measure.py's FLOP counter: loops counted by their trip count, and equal to XLA's
own cost analysis where XLA can see every iteration (the loop unrolled); the matmul peak's
program: its matmuls and nothing else."""

import sys
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import measure
from measure import matmul_floor, matmul_program, step_flops


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
    from measure import matmul_flops_of

    def f(x, w, q, k):
        return jnp.sum(x @ w) + jnp.sum(jnp.einsum("bqd,bkd->bqk", q, k))

    args = jnp.ones((16, 32)), jnp.ones((32, 8)), jnp.ones((4, 5, 6)), jnp.ones((4, 7, 6))
    jaxpr = jax.make_jaxpr(f)(*args).jaxpr
    dense, batched = 2 * 16 * 32 * 8, 2 * 4 * 5 * 7 * 6
    assert matmul_flops_of(jaxpr, batched=False) == dense
    assert matmul_flops_of(jaxpr, batched=True) == batched
    assert matmul_flops_of(jaxpr) == dense + batched


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
    from jax.sharding import AbstractMesh, AxisType
    from jax.sharding import PartitionSpec as P
    from measure import matmul_flops_of

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
    """lax.platform_dependent (model.lookup's gradient) runs one branch per backend: a CPU
    counts its own (no matmul here), not the GPU's matmul; a data-dependent cond still
    counts its most expensive branch, as does a platform_dependent one with neither this
    backend's branch nor a default (it used to raise)."""
    from measure import matmul_flops_of

    x = jnp.ones((8, 8))
    square = lambda x: x @ x  # 2 * 8 * 8 * 8 FLOPs
    by_platform = lambda x: jax.lax.platform_dependent(x, cpu=jnp.tanh, default=square)
    by_value = lambda x: jax.lax.cond(x[0, 0] > 0, square, jnp.tanh, x)
    assert jax.default_backend() == "cpu"
    assert matmul_flops_of(jax.make_jaxpr(by_platform)(x).jaxpr) == 0
    assert matmul_flops_of(jax.make_jaxpr(by_value)(x).jaxpr) == 2 * 8 * 8 * 8
    elsewhere = lambda x: jax.lax.platform_dependent(x, cuda=square, tpu=jnp.tanh)
    assert matmul_flops_of(jax.make_jaxpr(elsewhere)(x).jaxpr) == 2 * 8 * 8 * 8
