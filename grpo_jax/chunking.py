"""A group's members a chunk at a time, so that peak memory follows the chunk, not the group.

The member axis (axis 1 of [B, K, ...] arrays) is cut into slices of at most ``chunk``
members (``member_chunks``). The rollout and the reference's log-probs run the slices one
after another with ``lax.map`` (``chunked``: forward only). The loss's training forward
runs them in a ``lax.scan`` that takes each slice's gradient right after its forward and
sums it (``accumulated``), so one slice's activations exist at a time and nothing is
recomputed. ``group.vocab_chunk`` sizes the rollout's slices, ``group.loss_chunk`` the
loss's.
"""

import jax
import jax.numpy as jnp


def member_chunks(k: int, chunk: int):
    """(split, merge) for slices of at most ``chunk`` members of a K-member axis (axis 1):
    ``split`` pads K up to a multiple of the slice and stacks the slices on a new leading
    axis, ``merge`` undoes it on a loop's stacked outputs. The slices are as even as their
    number allows (K = 17, chunk 13: two slices of 9, not 13 and 4 padded to 13), so padding
    costs under one member per slice."""
    n = -(-k // chunk)
    chunk = -(-k // n)
    pad = n * chunk - k

    def split(x):
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(x.shape[0], n, chunk, *x.shape[2:]), 1, 0)

    def merge(y):
        y = jnp.moveaxis(y, 0, 1)
        return y.reshape(y.shape[0], n * chunk, *y.shape[3:])[:, :k]

    return split, merge


def chunked(fn, chunk: int, *member_args):
    """Apply ``fn`` to member-axis (axis 1) slices of at most ``chunk`` members with
    ``lax.map``, as even as their number allows (member_chunks).

    Bounds peak memory by the chunk instead of the group."""
    k = member_args[0].shape[1]
    if chunk <= 0 or chunk >= k:
        return fn(*member_args)
    split, merge = member_chunks(k, chunk)
    outs = jax.lax.map(lambda a: fn(*a), tuple(split(a) for a in member_args))
    return jax.tree.map(merge, outs)


def accumulated(fn, chunk: int, diff, *member_args):
    """(Σ over members of j, aux) for ``fn(diff, *member_slices) -> (j [B, c], aux)`` run
    ``chunk`` members at a time (member axis 1 of ``member_args``), with the gradient of Σ j
    in ``diff`` and nothing recomputed.

    Each chunk's gradient is taken in the forward pass, right after its own forward
    (``jax.vjp``), and added to a float32 running sum; the backward pass only scales that sum
    by the cotangent of Σ j, which is exact because Σ j is linear in the chunks' j (the
    loss's coefficients live in ``fn``). So one chunk's activations exist at a time, as
    with ``jax.checkpoint``, but the forward runs once per chunk, not twice. ``aux`` (the
    metrics, the log-probs) carries no gradient. ``fn`` must read the differentiated values
    through ``diff`` only. The last slice's padding members (member_chunks) run, but their j
    enters neither the sum nor the gradient, so ``fn`` need not vanish on an all-zero
    member. Unchunked (chunk 0 or >= K), ``fn`` runs once under plain autodiff."""
    k = member_args[0].shape[1]
    if chunk <= 0 or chunk >= k:
        j, aux = fn(diff, *member_args)
        return jnp.sum(j), jax.lax.stop_gradient(aux)
    leaves, tree = jax.tree.flatten(diff)
    inexact = [jnp.issubdtype(x.dtype, jnp.inexact) for x in leaves]
    fixed = [None if d else x for x, d in zip(leaves, inexact, strict=True)]
    live = [x for x, d in zip(leaves, inexact, strict=True) if d]  # what gets a gradient
    dtypes = [x.dtype for x in live]
    split, merge = member_chunks(k, chunk)
    slices = tuple(split(a) for a in member_args)
    real = split(jnp.ones((1, k), jnp.float32))  # [n, 1, c]: 0 on the padding members

    def rebuild(live):  # the differentiated leaves back among the fixed (integer) ones
        it = iter(live)
        return tree.unflatten([next(it) if x is None else x for x in fixed])

    def run(live, with_grad: bool):
        def body(acc, xs):
            xs, real = xs
            f = lambda live: fn(rebuild(live), *xs)
            if not with_grad:
                j, aux = f(live)
                return acc, (jnp.sum(j * real), aux)
            j, vjp, aux = jax.vjp(f, live, has_aux=True)
            # the gradient of Σ over the slice's real members of j
            (g,) = vjp(jnp.broadcast_to(real, j.shape).astype(j.dtype))
            acc = [a + x.astype(a.dtype) for a, x in zip(acc, g, strict=True)]
            return acc, (jnp.sum(j * real), aux)

        acc0 = [jnp.zeros(x.shape, jnp.promote_types(x.dtype, jnp.float32)) for x in live]
        grads, (js, aux) = jax.lax.scan(body, acc0, (slices, real))
        return (jnp.sum(js), jax.tree.map(merge, aux)), grads

    @jax.custom_vjp
    def total(live):
        return run(live, False)[0]

    def bwd(grads, ct):
        return ([(ct[0] * g).astype(dt) for g, dt in zip(grads, dtypes, strict=True)],)

    total.defvjp(lambda live: run(live, True), bwd)
    j, aux = total(live)
    return j, jax.lax.stop_gradient(aux)
