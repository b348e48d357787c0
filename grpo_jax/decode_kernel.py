"""The decode step's attention as one Pallas kernel (``model.decode_kernel=pallas``).

A decode step has one query per member. XLA computes its attention as several small kernels
per layer (scores against the prompt and against the member's cache, their maxima, sums and
weighted values), each matrix-vector product a reduction over the whole static cache: on one
H100 the large model's decode loop spent 153.6 of its 244.5 kernel-ms per step in reductions
(experiments/results/gpu_suite_nvidia-h100-80gb-hbm3.md). Here one Triton program per
(prompt, member, head) reads the prompt's keys and values, then only the member's written
cache slots, ``BLOCK`` keys at a time under an online softmax, everything in registers.

Requirements (checked by specs.ModelSpec, or raised here): a CUDA GPU (elsewhere the kernel
runs interpreted: tests only), a power-of-two head dimension, and a member cache whose length
is a multiple of ``BLOCK`` (rollout.cache_segments aligns it). A prompt whose length is not a
multiple is padded here with masked keys. experiments/decode_ops.py times it beside XLA's
forms of the same attention.
"""

import functools

import jax
import jax.numpy as jnp

BLOCK = 32  # keys per chunk: the cache's alignment
_NEG = -1e30  # finite, as model._NEG_INF: a chunk of padding never makes inf - inf


def _kernel(idx_ref, q_ref, pk_ref, pv_ref, pbias_ref, ck_ref, cv_ref, o_ref, *, block):
    """One member's query against its prompt's keys, then its own slots <= index (only the
    chunks holding them are read), ``block`` keys at a time."""
    from jax.experimental import pallas as pl

    q = q_ref[...].astype(jnp.float32) * (q_ref.shape[-1] ** -0.5)

    def attend(k_ref, v_ref, start, bias, carry):
        m, total, acc = carry
        k = k_ref[pl.ds(start, block), :].astype(jnp.float32)
        s = jnp.sum(k * q[None, :], axis=1) + bias
        m_new = jnp.maximum(m, jnp.max(s))
        # a chunk of padding before any real key adds exp(0)s, which the first real key's
        # larger maximum then scales to zero
        e, rescale = jnp.exp(s - m_new), jnp.exp(m - m_new)
        v = v_ref[pl.ds(start, block), :].astype(jnp.float32)
        return m_new, total * rescale + jnp.sum(e), acc * rescale + jnp.sum(e[:, None] * v, 0)

    def prompt(i, carry):
        return attend(pk_ref, pv_ref, i * block, pbias_ref[pl.ds(i * block, block)], carry)

    index = idx_ref[0]

    def own(i, carry):
        slot = i * block + jax.lax.broadcasted_iota(jnp.int32, (block,), 0)
        return attend(ck_ref, cv_ref, i * block, jnp.where(slot <= index, 0.0, _NEG), carry)

    carry = (jnp.float32(_NEG), jnp.float32(0.0), jnp.zeros(q.shape, jnp.float32))
    carry = jax.lax.fori_loop(0, pk_ref.shape[0] // block, prompt, carry)
    _, total, acc = jax.lax.fori_loop(0, index // block + 1, own, carry)
    o_ref[...] = (acc / total).astype(o_ref.dtype)


def attention(q, pk, pv, pmask, ck, cv, index, block=BLOCK, warps=4, interpret=None):
    """q [B, G, h, d]; the prompt's keys/values pk/pv [B, h, P, d] and its real slots pmask
    [B, P]; the member cache ck/cv [B, G, h, S, d] written up to slot ``index`` (scalar).
    Returns [B, G, h, d] in q's dtype. ``interpret`` (default: on a CPU) runs the kernel
    through JAX's interpreter."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pl_triton

    b, g, h, d = q.shape
    s = ck.shape[3]
    if s % block or d & (d - 1):
        raise ValueError(f"decode kernel: cache length {s} must be a multiple of {block} and "
                         f"head dimension {d} a power of two")  # fmt: skip
    pad = -pk.shape[2] % block
    if pad:  # masked keys at the end: the prompt's real keys are unchanged
        pk, pv = (jnp.pad(x, [(0, 0), (0, 0), (0, pad), (0, 0)]) for x in (pk, pv))
        pmask = jnp.pad(pmask, [(0, 0), (0, pad)])
    p = pk.shape[2]
    member = lambda bi, gi, hi: (bi, gi, hi, 0)
    prompt = lambda bi, gi, hi: (bi, hi, 0, 0)
    cache = lambda bi, gi, hi: (bi, gi, hi, 0, 0)
    call = pl.pallas_call(
        functools.partial(_kernel, block=block),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        grid=(b, g, h),
        in_specs=[
            pl.BlockSpec((1,), lambda bi, gi, hi: (0,)),
            pl.BlockSpec((None, None, None, d), member),
            pl.BlockSpec((None, None, p, d), prompt),
            pl.BlockSpec((None, None, p, d), prompt),
            pl.BlockSpec((None, p), lambda bi, gi, hi: (bi, 0)),
            pl.BlockSpec((None, None, None, s, d), cache),
            pl.BlockSpec((None, None, None, s, d), cache),
        ],
        out_specs=pl.BlockSpec((None, None, None, d), member),
        compiler_params=pl_triton.CompilerParams(num_warps=warps, num_stages=2),
        interpret=jax.default_backend() == "cpu" if interpret is None else interpret,
    )
    pbias = jnp.where(pmask, 0.0, _NEG).astype(jnp.float32)
    return call(jnp.reshape(index, (1,)).astype(jnp.int32), q, pk, pv, pbias, ck, cv)
