"""The model's two products whose gradients a backend runs faster in another form than
autodiff's: the token embedding's lookup and the dense layers' matmuls over rows.

Both keep their forward and their gradients' values (tests); only the form of the backward's
contraction over the rows changes, and only where it was measured to pay: ``lookup`` off a
CPU, ``dense_dot`` on a CPU. Each backend's branch is chosen at lowering
(``lax.platform_dependent``): the other backends lower autodiff's products, inside a
constant-index case for XLA to drop.
"""

import functools

import jax
import jax.numpy as jnp

ONE_HOT_GRAD_ROWS = 256  # lookup: tables up to this many rows, off a CPU, sum as a matmul


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _one_hot_grad_take(table, ids, rows: int, mode=None):
    return jnp.take(table, ids, axis=0, mode=mode)


def _one_hot_bwd(rows, mode, ids, g):
    ids = jnp.clip(ids, 0, rows - 1) if mode == "clip" else ids  # where the forward read
    onehot = jax.nn.one_hot(ids.reshape(-1), rows, dtype=g.dtype)
    hi = jax.lax.Precision.HIGHEST  # no TF32 rounding of the cotangents on a GPU
    return jnp.einsum("nv,nd->vd", onehot, g.reshape(-1, g.shape[-1]), precision=hi), None


# forward: the plain take, keeping the ids for the backward
_one_hot_grad_take.defvjp(
    lambda t, ids, rows, mode: (jnp.take(t, ids, axis=0, mode=mode), ids), _one_hot_bwd
)


def lookup(table, ids, one_hot_rows: int = ONE_HOT_GRAD_ROWS, mode=None):
    """``table[ids]``, as ``jnp.take(table, ids, axis=0, mode=mode)``. Its gradient sums each
    token's cotangent into its row: a scatter-add, whose writes collide when a small table meets
    many tokens (on one H100 the 12 x 768 model's in bfloat16, 32,768 tokens into 65 rows, took
    19.9 ms of its step), summed by a GPU's atomics in no fixed order. Off a CPU, tables of up
    to ONE_HOT_GRAD_ROWS rows take it as one matmul, one_hot(ids)ᵀ · cotangent at HIGHEST
    precision: the tied logits' FLOPs, in a fixed order, equal to the scatter's (test); the
    forward stays a gather (T5X's ``Embed(one_hot=True)`` contracts with a one-hot in the
    forward too, for SPMD partitioning). A CPU keeps the scatter (nearly free there: the matmul
    was no faster in 7 alternating runs of the TRL-comparable step), as do tables of over
    ``one_hot_rows`` rows, whose one-hot operand grows with them.

    The matmul also partitions where the scatter did not: on a mesh, with the ids split over
    ``data``, each device sums its own rows and the partial tables are all-reduced, while XLA
    gathered a scatter's ids and updates from every data device first (a v5e-16 at data=4 x
    member=4: 7,747 all-gathers a step of the position table's ids and cotangents)."""
    if table.shape[0] > one_hot_rows:
        return jnp.take(table, ids, axis=0, mode=mode)
    return jax.lax.platform_dependent(
        table,
        ids,
        cpu=lambda t, i: jnp.take(t, i, axis=0, mode=mode),
        default=lambda t, i: _one_hot_grad_take(t, i, t.shape[0], mode),
    )


@jax.custom_vjp
def _rows_matmul(x, w):
    return x @ w


def _rows_matmul_bwd(res, g):
    x, w = res
    # the barrier keeps XLA from folding the transpose back into the product's dimensions
    return g @ w.T, jax.lax.optimization_barrier(x.T) @ g


_rows_matmul.defvjp(lambda x, w: (x @ w, (x, w)), _rows_matmul_bwd)


def dense_dot(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    """``lax.dot_general`` for ``nn.Dense(dot_general=...)``. On a CPU, a 2-D product x [N, K]
    · w [K, F] (the model's dense layers see [rows, features]) takes its weight gradient as
    copy(xᵀ) · g: XLA:CPU ran autodiff's xᵀ · g, a contraction over both operands' major
    axis, at 192 GFLOP/s for the ``out`` layer's x [4416, 512], g [4416, 128], and at 422 with
    xᵀ laid out in memory; with the copy (0.25 ms) the product took 2.07 ms against 3.00
    (experiments/benchmark.py's --matmul_floor names these products). The forward is the
    plain product. The gradients equal autodiff's to rounding, not bitwise: three float32
    steps on one device gave the same losses and params within 1.2e-7 of autodiff's, but for
    the keys' bias (6.4e-5: its true gradient is 0, as a shift of every key leaves the
    softmax as it was, and Adam scales the rounding up to a step); bfloat16 losses differ
    from step 2 on.

    Other backends, and any other product, take ``lax.dot_general``: ``platform_dependent``
    lowers autodiff's products there inside a constant-index case (tested on the lowering),
    which XLA's simplifier drops (checked on a CPU's compile: the rollout, without gradients,
    compiles to the same program as without dense_dot; no GPU compile checked). Every backend
    traces the CPU branch's custom VJP too: no forward-mode autodiff through it (``jax.jvp``,
    ``jacfwd``; nothing here uses them), and a ``lax.scan`` differentiated over stacked
    weights would keep both operands as residuals (the model's layers are a Python loop)."""
    plain = functools.partial(
        jax.lax.dot_general,
        dimension_numbers=dimension_numbers,
        precision=precision,
        preferred_element_type=preferred_element_type,
    )
    rows = lhs.ndim == 2 and dimension_numbers == (((1,), (0,)), ((), ()))
    if not rows or precision is not None or preferred_element_type is not None:
        return plain(lhs, rhs)
    return jax.lax.platform_dependent(lhs, rhs, cpu=_rows_matmul, default=plain)
