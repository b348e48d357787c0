"""The decode step's attention as Pallas kernels (``model.decode_kernel``: ``pallas`` or
``flash``).

A decode step has one query per member. XLA computes its attention as several small kernels
per layer (scores against the prompt and against the member's cache, their maxima, sums and
weighted values), each matrix-vector product a reduction over the whole static cache: on one
H100 the large model's decode loop spent 153.6 of its 244.5 kernel-ms per step in reductions
(experiments/results/gpu_suite_nvidia-h100-80gb-hbm3.md).

``pallas`` (``attention``): one Triton program per prompt, head and ``members`` members reads
the prompt's keys and values (once for all its members), then only each member's written
cache slots, a chunk of keys at a time under an online softmax, no intermediate written back
to memory. The model runs one member per program (MEMBERS); experiments/decode_ops.py
--members measures others, and which is fastest is unmeasured on a GPU. At one member per
program, one H100 (2026-11-28) ran the large model's rollout slower with this kernel than
with XLA's ops: 0.3357 against 0.2699 s (experiments/results/gpu_h100_2026-11-28), hence
``model.decode_kernel``'s default ``xla``.

``flash`` (``flash_attention``): jax's maintained flash-decoding kernel
(``jax.experimental.pallas.ops.gpu.decode_attention.mqa``), twice: the prompt once per
(prompt, head) for all its members' queries as tensor-core products, then each member's own
written slots; merged by the kernel's residuals. Unmeasured on a GPU.

Requirements (checked by specs.ModelSpec, or raised here): a CUDA GPU (elsewhere the kernels
run interpreted: tests only), a power-of-two head dimension (``flash``: at least 16, the
least Triton product), and a member cache whose length is a multiple of ``BLOCK``
(rollout.cache_segments aligns it). A prompt whose length is not a multiple (``flash``: of
FLASH_PROMPT_SPLITS x BLOCK) is padded here with masked keys. experiments/decode_ops.py times
both beside XLA's forms of the same attention.
"""

import functools

import jax
import jax.numpy as jnp

BLOCK = 32  # keys per chunk (fewer where many members share a program): the cache's alignment
MEMBERS = 1  # members per program in the model
_NEG = -1e30  # finite, as model._NEG_INF: a chunk of padding never makes inf - inf
FLASH_PROMPT_SPLITS = 4  # flash: the prompt's keys in this many parallel splits
FLASH_OWN_SPLITS = 1  # flash: the member cache's splits in the model (decode_ops.py times others)
# per kernel: the multiple its prompt is padded to (whole chunks; flash: a whole number of
# chunks per split), and the least head dimension it takes (flash's products are Triton's
# tl.dot, whose operands need 16 or more rows and columns)
PROMPT_ALIGN = {"pallas": BLOCK, "flash": FLASH_PROMPT_SPLITS * BLOCK}
LEAST_HEAD_DIM = {"pallas": 1, "flash": 16}


def _kernel(idx_ref, q_ref, pk_ref, pv_ref, pbias_ref, ck_ref, cv_ref, o_ref, *, block):
    """M members' queries ([M, d]) against their prompt's keys, then each against its own
    slots <= index (only the chunks holding them are read), ``block`` keys at a time."""
    from jax.experimental import pallas as pl

    q = q_ref[...].astype(jnp.float32) * (q_ref.shape[-1] ** -0.5)

    def attend(k, v, bias, carry):  # k, v: [M or 1, block, d]; bias: [1, block]
        m, total, acc = carry  # [M], [M], [M, d]
        s = jnp.sum(k * q[:, None, :], axis=2) + bias
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        # a chunk of padding before any real key adds exp(0)s, which the first real key's
        # larger maximum then scales to zero
        e, rescale = jnp.exp(s - m_new[:, None]), jnp.exp(m - m_new)
        acc = acc * rescale[:, None] + jnp.sum(e[:, :, None] * v, axis=1)
        return m_new, total * rescale + jnp.sum(e, axis=1), acc

    def prompt(i, carry):
        chunk = pl.ds(i * block, block)
        k, v = (r[chunk, :].astype(jnp.float32)[None] for r in (pk_ref, pv_ref))
        return attend(k, v, pbias_ref[chunk][None], carry)

    index = idx_ref[0]

    def own(i, carry):
        chunk = pl.ds(i * block, block)
        k, v = (r[:, chunk, :].astype(jnp.float32) for r in (ck_ref, cv_ref))
        slot = i * block + jax.lax.broadcasted_iota(jnp.int32, (1, block), 1)
        return attend(k, v, jnp.where(slot <= index, 0.0, _NEG), carry)

    m = q.shape[0]
    carry = (jnp.full((m,), _NEG, jnp.float32), jnp.zeros((m,), jnp.float32), jnp.zeros_like(q))
    carry = jax.lax.fori_loop(0, pk_ref.shape[0] // block, prompt, carry)
    _, total, acc = jax.lax.fori_loop(0, index // block + 1, own, carry)
    o_ref[...] = (acc / total[:, None]).astype(o_ref.dtype)


def attention(q, pk, pv, pmask, ck, cv, index, members=MEMBERS, warps=4, interpret=None):
    """q [B, G, h, d]; the prompt's keys/values pk/pv [B, h, P, d] and its real slots pmask
    [B, P]; the member cache ck/cv [B, G, h, S, d] written up to slot ``index`` (scalar).
    Returns [B, G, h, d] in q's dtype.

    A program serves ``members`` members of one prompt and head (a divisor of G): they share
    each chunk of the prompt's keys it reads, in chunks of ``block`` = 8192 / (members x d)
    keys (at most BLOCK) so that a chunk of all their own keys, [members, block, d] in
    float32, stays in registers. ``interpret`` (default: on a CPU) runs the kernel through
    JAX's interpreter."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as pl_triton

    b, g, h, d = q.shape
    s = ck.shape[3]
    block = max(1, min(BLOCK, 8192 // (members * d)))
    if g % members or s % BLOCK or d & (d - 1) or block & (block - 1):
        raise ValueError(f"decode kernel: {members} members per program must divide G = {g} "
                         f"and, with head dimension {d}, a power of two; the cache length {s} "
                         f"a multiple of {BLOCK}")  # fmt: skip
    pad = -pk.shape[2] % PROMPT_ALIGN["pallas"]
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
        grid=(b, g // members, h),
        in_specs=[
            pl.BlockSpec((1,), lambda bi, gi, hi: (0,)),
            pl.BlockSpec((None, members, None, d), member),
            pl.BlockSpec((None, None, p, d), prompt),
            pl.BlockSpec((None, None, p, d), prompt),
            pl.BlockSpec((None, p), lambda bi, gi, hi: (bi, 0)),
            pl.BlockSpec((None, members, None, s, d), cache),
            pl.BlockSpec((None, members, None, s, d), cache),
        ],
        out_specs=pl.BlockSpec((None, members, None, d), member),
        compiler_params=pl_triton.CompilerParams(num_warps=warps, num_stages=2),
        interpret=jax.default_backend() == "cpu" if interpret is None else interpret,
    )
    pbias = jnp.where(pmask, 0.0, _NEG).astype(jnp.float32)
    return call(jnp.reshape(index, (1,)).astype(jnp.int32), q, pk, pv, pbias, ck, cv)


def flash_attention(q, pk, pv, pmask, ck, cv, index, own_splits=FLASH_OWN_SPLITS, interpret=None):
    """The same attention through jax's flash-decoding kernel (``mqa``: one key set per batch
    row, any number of queries against it), twice:

    - the prompt: a row per (prompt, head), its G members' queries against its keys (read
      once for all of them), in FLASH_PROMPT_SPLITS parallel splits, BLOCK keys at a time;
      the real keys from ``start_idx`` on: prompts are left-padded (the model's layout), so
      a prompt's real keys are its last ``pmask.sum()``, and padding added here goes first;
    - the own cache: a row per (prompt, member, head), one query against its own slots up
      to ``index`` only (``kv_seq_len``), BLOCK at a time, in ``own_splits`` parallel splits
      (a split wholly past ``index`` reads nothing).

    Each call returns its weighted values unnormalised (in q's dtype), with each row's score
    maximum and exponential sum (``return_residuals``); they merge here, in float32, into the
    one softmax over both key sets. Arguments and result as ``attention``'s."""
    # jax's kernel module imports Triton's Pallas backend: only models that run it load it
    from jax.experimental.pallas.ops.gpu import decode_attention

    b, g, h, d = q.shape
    pad = -pk.shape[2] % PROMPT_ALIGN["flash"]
    pk, pv = (jnp.pad(x, [(0, 0), (0, 0), (pad, 0), (0, 0)]) for x in (pk, pv))
    p = pk.shape[2]
    run = functools.partial(
        decode_attention.mqa,
        sm_scale=d**-0.5,
        block_k=BLOCK,
        interpret=jax.default_backend() == "cpu" if interpret is None else interpret,
        return_residuals=True,
        normalize_output=False,
    )
    start = jnp.repeat(p - jnp.sum(pmask, axis=-1), h)  # [B * h]: each row's first real key
    rows = lambda x, n: x.reshape(n, *x.shape[-2:])
    bh, n = b * h, b * g * h
    o_p, (l_p, m_p) = run(rows(q.transpose(0, 2, 1, 3), bh), rows(pk, bh), rows(pv, bh),
                          start_idx=start, k_splits=FLASH_PROMPT_SPLITS)  # fmt: skip
    o_s, (l_s, m_s) = run(q.reshape(n, 1, d), rows(ck, n), rows(cv, n),
                          kv_seq_len=index + 1, k_splits=own_splits)  # fmt: skip
    members = lambda x: x.reshape(b, h, g, *x.shape[2:]).swapaxes(1, 2)  # [B, G, h, ...]
    o_p, l_p, m_p = members(o_p), members(l_p), members(m_p)
    o_s, l_s, m_s = o_s.reshape(b, g, h, d), l_s.reshape(b, g, h), m_s.reshape(b, g, h)
    m = jnp.maximum(m_p, m_s)
    a_p, a_s = jnp.exp(m_p - m), jnp.exp(m_s - m)
    out = o_p.astype(jnp.float32) * a_p[..., None] + o_s.astype(jnp.float32) * a_s[..., None]
    return (out / (l_p * a_p + l_s * a_s)[..., None]).astype(q.dtype)


KERNELS = {"pallas": attention, "flash": flash_attention}  # model.decode_kernel's Pallas ones
