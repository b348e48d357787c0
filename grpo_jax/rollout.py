"""Group rollouts: prefill the prompt once, then decode every group member in one batch.

A group member is fixed by its first action (sampled from the policy, or forced: every
vocabulary token, or a guide's candidates) and continued for ``horizon - 1`` tokens sampled
from the tempered policy π_old. All members of a prompt attend to the same prefix cache
(see model.py), so the prompt is never recomputed per member.

Randomness is drawn as one uniform per (prompt, member, step) from the step key and consumed
by inverse-CDF sampling. That makes a member's trajectory a function of its own uniforms only:
chunking the group (``lax.map`` over ``vocab_chunk`` members at a time) or sharding it over
devices gives the same samples as one big batch.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from grpo_jax.model import KV, Transformer, empty_cache


class Rollout(NamedTuple):
    """One batch of groups. B prompts, K members, H generated tokens, V vocabulary."""

    tokens: jax.Array  # [B, K, H] int32; tokens[..., 0] is the first (decision-point) action
    logp: jax.Array  # [B, K, H] log π_old(token) under the tempered policy
    entropy: jax.Array  # [B, K, H] entropy (nats) of the tempered policy at each step
    first_logits: jax.Array  # [B, V] raw policy logits at the decision point


class SamplingParams(NamedTuple):
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off


def sampling_params(group_cfg) -> SamplingParams:
    if group_cfg.temperature <= 0:
        raise ValueError(f"group.temperature={group_cfg.temperature} must be > 0")
    if not 0.0 < group_cfg.top_p <= 1.0:
        raise ValueError(f"group.top_p={group_cfg.top_p} must be in (0, 1]")
    return SamplingParams(
        float(group_cfg.temperature), int(group_cfg.top_k), float(group_cfg.top_p)
    )


def tempered_logp(logits, sp: SamplingParams):
    """log π(·) of the tempered policy: the distribution whose log-probs enter the ratio."""
    return jax.nn.log_softmax(logits / sp.temperature, axis=-1)


def _filtered(logp, sp: SamplingParams):
    """Restrict to top-k / nucleus; the training log-probs stay those of the tempered policy
    (the usual convention: filtering is a sampling heuristic, not part of π)."""
    if sp.top_k:
        kth = jax.lax.top_k(logp, sp.top_k)[0][..., -1:]
        logp = jnp.where(logp >= kth, logp, -jnp.inf)
    if sp.top_p < 1.0:
        srt = jnp.sort(logp, axis=-1)[..., ::-1]
        cum = jnp.cumsum(jnp.exp(srt), axis=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least the argmax)
        n_keep = jnp.sum(cum - jnp.exp(srt) < sp.top_p, axis=-1, keepdims=True)
        cutoff = jnp.take_along_axis(srt, n_keep - 1, axis=-1)
        logp = jnp.where(logp >= cutoff, logp, -jnp.inf)
    return logp


def sample_from_logits(logits, u, sp: SamplingParams):
    """Inverse-CDF sample. logits [..., V], u [...] uniform in [0, 1).

    Returns (token [...], logp [...] under the tempered policy, entropy [...])."""
    logp = tempered_logp(logits, sp)
    probs = jnp.exp(_filtered(logp, sp))
    cdf = jnp.cumsum(probs, axis=-1)
    # first index whose cdf exceeds u * total ("<=" skips leading filtered-out tokens)
    token = jnp.sum(cdf <= (u * cdf[..., -1])[..., None], axis=-1)
    token = jnp.minimum(token, logits.shape[-1] - 1).astype(jnp.int32)
    tok_logp = jnp.take_along_axis(logp, token[..., None], axis=-1)[..., 0]
    return token, tok_logp, entropy_of_logp(logp)


def entropy_of_logp(logp):
    return -jnp.sum(jnp.where(logp > -jnp.inf, jnp.exp(logp) * logp, 0.0), axis=-1)


def continue_members(model: Transformer, params, prefix: KV, first_tokens, u, context_len, sp):
    """Decode ``horizon - 1`` tokens after each member's first token.

    first_tokens [B, K] int32; u [B, K, H] uniforms (u[..., 0] unused here).
    Returns (tokens [B, K, H], logp [B, K, H-1], entropy [B, K, H-1]) for positions 1..H-1.
    """
    b, k, h = u.shape
    cache = empty_cache(model, b, k, max(h - 1, 1))

    def step(carry, t):
        cache, tok = carry
        logits, cache = model.apply(
            {"params": params},
            prefix,
            cache,
            tok,
            t,
            context_len,
            method=Transformer.decode,
        )
        nxt, lp, ent = sample_from_logits(logits, u[:, :, t + 1], sp)
        return (cache, nxt), (nxt, lp, ent)

    _, (toks, lps, ents) = jax.lax.scan(step, (cache, first_tokens), jnp.arange(h - 1))
    move = lambda x: jnp.moveaxis(x, 0, -1)
    tokens = jnp.concatenate([first_tokens[..., None], move(toks)], axis=-1)
    return tokens, move(lps), move(ents)


def chunked(fn, chunk: int, *member_args):
    """Apply ``fn`` to member-axis (axis 1) slices of ``chunk`` members with ``lax.map``.

    Bounds peak memory by the chunk instead of the group; pads K up to a multiple of chunk."""
    k = member_args[0].shape[1]
    if chunk <= 0 or chunk >= k:
        return fn(*member_args)
    n = -(-k // chunk)
    pad = n * chunk - k

    def split(x):
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(x.shape[0], n, chunk, *x.shape[2:]), 1, 0)

    outs = jax.lax.map(lambda a: fn(*a), tuple(split(a) for a in member_args))

    def merge(y):
        y = jnp.moveaxis(y, 0, 1)
        return y.reshape(y.shape[0], n * chunk, *y.shape[3:])[:, :k]

    return jax.tree.map(merge, outs)


def prefill(model, params, context):
    """context [B, C] -> (first_logits [B, V], prefix KV): the prompt's one forward."""
    logits, prefix = model.apply({"params": params}, context, method=Transformer.prefill)
    return logits[:, -1], prefix


def rollout_from_prefix(
    model,
    params,
    first_logits,
    prefix,
    context_len,
    first_tokens,
    u,
    sp,
    vocab_chunk=0,
    member_map=None,
):
    """Roll out a group per prompt from its prefilled prompt.

    first_tokens [B, K]: forced first actions, or None to sample K = u.shape[1] first actions
    from the policy; u [B, K, H] uniforms. ``member_map(fn, first, u)`` (optional) wraps the
    member computation, e.g. to shard the K axis over devices (see sharding.py).
    """
    if first_tokens is None:
        bk = u.shape[:2]
        first_tokens, lp0, ent0 = sample_from_logits(
            jnp.broadcast_to(first_logits[:, None], (*bk, first_logits.shape[-1])),
            u[..., 0],
            sp,
        )
    else:
        logp0 = tempered_logp(first_logits, sp)
        lp0 = jnp.take_along_axis(logp0, first_tokens, axis=1)
        ent0 = jnp.broadcast_to(entropy_of_logp(logp0)[:, None], first_tokens.shape)

    def run(first, uu):
        fn = lambda f, v: continue_members(model, params, prefix, f, v, context_len, sp)
        return chunked(fn, vocab_chunk, first, uu)

    tokens, lps, ents = (member_map or (lambda f, *a: f(*a)))(run, first_tokens, u)
    logp = jnp.concatenate([lp0[..., None], lps], axis=-1)
    entropy = jnp.concatenate([ent0[..., None], ents], axis=-1)
    return Rollout(tokens, logp, entropy, first_logits)


def rollout(model, params, context, first_tokens, u, sp, vocab_chunk=0, member_map=None):
    """Prefill + rollout_from_prefix: context [B, C] -> Rollout."""
    first_logits, prefix = prefill(model, params, context)
    return rollout_from_prefix(
        model,
        params,
        first_logits,
        prefix,
        context.shape[1],
        first_tokens,
        u,
        sp,
        vocab_chunk,
        member_map,
    )
