"""experiments/measure.py's FLOP counter: loops counted by their trip count, and equal to XLA's
own cost analysis where XLA can see every iteration (the loop unrolled)."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
from measure import step_flops


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
