"""Forming the groups of one GRPO step (``config.group.mode``), all with static shapes.

A group mode picks each prompt's members, rolls them out, and scores them. The result is one
or two ``Part`` s: a *sampled* part (G members with sampled first actions, the ordinary GRPO
group) and/or a *forced* part (every member's first action is forced: the whole vocabulary,
or a guide's candidates). The loss (loss.py) treats the two kinds differently at the decision
point and alike after it.

Modes:
  sampled     one sampled part, K = group.size.
  exhaustive  one forced part, actions = all V tokens (x continuations_per_action members).
  guided      one forced part, actions = the guide's top-k plus r random explorers (K = k + r
              static); where the guide is confident (entropy below group.entropy_threshold)
              only its top-``guide_top_k_confident`` count, the other slots are masked out.
  adaptive    a fixed budget of ``ceil(B / 4)`` contexts per batch gets exhaustive groups:
              the most uncertain ones, and only those whose policy entropy exceeds
              group.entropy_threshold (a mask); every other context uses a sampled group.
              Compute is static: B*G sampled + budget*V forced rollouts per step.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from grpo_jax import objective
from grpo_jax import rollout as ro

MODES = ("sampled", "exhaustive", "guided", "adaptive")


class Part(NamedTuple):
    """One kind of group for a batch of prompts; everything the μ updates reuse."""

    context: jax.Array  # [B, C]
    tokens: jax.Array  # [B, K, H] (tokens[..., 0] = first action)
    member_mask: jax.Array  # [B, K] float: 1 where the member counts (prompt and slot valid)
    logp_old: jax.Array  # [B, K, H] sampler log-probs (π_old)
    advantages: jax.Array  # [B, K, H] per-token advantages for the clipped surrogate
    action_returns: jax.Array  # [B, A] forced parts: return of each forced first action
    action_mask: jax.Array  # [B, A] forced parts: which actions count
    actions: jax.Array  # [B, A] forced parts: the forced first actions
    ref_logp: jax.Array  # [B, K, H, V] reference log-probs (or [B, K, H, 0] when unused)
    rewards: jax.Array  # [B, K, H] per-token rewards (for metrics)


def first_action_layout(actions, n_cont):
    """[B, A] actions -> [B, A * n_cont] members (each action repeated n_cont times)."""
    return jnp.repeat(actions, n_cont, axis=1)


def guided_candidates(key, guide_logp, top_k, top_k_confident, n_random, threshold):
    """Guide's top-k plus n_random distinct explorers. guide_logp [B, V].

    Returns (actions [B, top_k + n_random] int32, mask [B, top_k + n_random] float)."""
    b, v = guide_logp.shape
    _, top = jax.lax.top_k(guide_logp, top_k)
    taken = jnp.zeros((b, v), bool).at[jnp.arange(b)[:, None], top].set(True)
    noise = jax.random.uniform(key, (b, v))
    _, rand = jax.lax.top_k(jnp.where(taken, -1.0, noise), n_random)
    actions = jnp.concatenate([top, rand], axis=1).astype(jnp.int32)
    confident = ro.entropy_of_logp(guide_logp) < threshold
    slot = jnp.arange(top_k + n_random)
    mask = jnp.where(confident[:, None], slot < top_k_confident, True)
    return actions, mask.astype(jnp.float32)


def adaptive_budget(batch_size: int) -> int:
    return max(1, math.ceil(batch_size / 4))


def sequence_returns(rewards, member_mask, discount=1.0):
    """Per-token rewards [B, K, H] -> per-member returns [B, K].

    R = Σ_t γ^t r_t / Σ_t γ^t: a γ-weighted mean over the horizon, in reward units (γ = 1 is
    the plain mean). A small γ makes an early char's own reward dominate the return instead
    of the horizon's later chars, most of which are scored after the member has left the
    true text."""
    h = rewards.shape[-1]
    w = jnp.asarray(discount, jnp.float32) ** jnp.arange(h, dtype=jnp.float32)
    return (rewards @ (w / w.sum())) * member_mask


def make_collect(config, model, vocab_size, reference, reward_fn, member_map=None):
    """Returns collect(params, ref_state, context, target, key) -> (parts, info) (pure).

    ``member_map(fn, first_tokens, u)`` optionally wraps the per-member rollout (sharding.py
    uses it to shard_map the member axis over the mesh's vocab axis)."""
    g = config.group
    mode = g.mode
    if mode not in MODES:
        raise ValueError(f"group.mode={mode!r} is unknown; choose from {', '.join(MODES)}")
    sp = ro.sampling_params(g)
    h = config.data.horizon
    n_cont = int(g.continuations_per_action)
    scale = config.grpo.advantage_scale
    per_token_adv = bool(config.reward.per_token)
    discount = float(config.reward.get("discount", 1.0))
    if not 0.0 <= discount <= 1.0:
        raise ValueError(
            f"reward.discount={discount} must lie in [0, 1]; "
            "pass --config.reward.discount=γ with 0 <= γ <= 1"
        )
    cont_token_adv = True  # continuation tokens: per-position group baseline (see loss.py)
    needs_ref = reference is not None

    def score(ref_state, context, target, r: ro.Rollout, member_mask):
        ref_lp = (
            reference.logprobs(ref_state, context, r.tokens)
            if needs_ref
            else jnp.zeros(r.tokens.shape + (0,), jnp.float32)
        )
        rewards = reward_fn(r.tokens, target, ref_lp if needs_ref else None)
        return ref_lp, rewards * member_mask[..., None]

    def sampled_part(params, ref_state, context, target, first_logits, prefix, key, prompt_mask):
        b = context.shape[0]
        u = jax.random.uniform(key, (b, g.size, h))
        r = ro.rollout_from_prefix(
            model, params, first_logits, prefix, context.shape[1], None, u, sp, 0, member_map
        )
        mm = jnp.broadcast_to(prompt_mask[:, None], (b, g.size)).astype(jnp.float32)
        ref_lp, rewards = score(ref_state, context, target, r, mm)
        if per_token_adv:
            adv = objective.group_advantages(rewards, scale, mask=mm > 0)
        else:
            seq = objective.group_advantages(
                sequence_returns(rewards, mm, discount), scale, mask=mm > 0
            )
            adv = jnp.broadcast_to(seq[..., None], rewards.shape)
        empty = jnp.zeros((b, 0))
        return Part(
            context,
            r.tokens,
            mm,
            r.logp,
            adv,
            empty,
            empty,
            empty.astype(jnp.int32),
            ref_lp,
            rewards,
        )

    def forced_part(
        params, ref_state, context, target, first_logits, prefix, actions, action_mask, key
    ):
        b, a = actions.shape
        first = first_action_layout(actions, n_cont)
        mm = first_action_layout(action_mask, n_cont)
        u = jax.random.uniform(key, (b, a * n_cont, h))
        r = ro.rollout_from_prefix(
            model,
            params,
            first_logits,
            prefix,
            context.shape[1],
            first,
            u,
            sp,
            g.vocab_chunk,
            member_map,
        )
        ref_lp, rewards = score(ref_state, context, target, r, mm)
        returns = sequence_returns(rewards, mm, discount).reshape(b, a, n_cont).mean(-1)
        # decision point: advantages over the forced actions (the "uniform" estimator);
        # continuations: a per-position baseline over the group (their own credit).
        adv0 = objective.group_advantages(returns, scale, mask=action_mask > 0)
        adv0 = first_action_layout(adv0, n_cont)
        if cont_token_adv:
            adv_rest = objective.group_advantages(rewards[..., 1:], scale, mask=mm > 0)
        else:
            seq = objective.group_advantages(
                sequence_returns(rewards, mm, discount), scale, mask=mm > 0
            )
            adv_rest = jnp.broadcast_to(seq[..., None], rewards[..., 1:].shape)
        adv = jnp.concatenate([adv0[..., None], adv_rest], axis=-1)
        return Part(
            context, r.tokens, mm, r.logp, adv, returns, action_mask, actions, ref_lp, rewards
        )

    def collect(params, ref_state, context, target, key):
        b = context.shape[0]
        k_sample, k_forced, k_guide = jax.random.split(key, 3)
        first_logits, prefix = ro.prefill(model, params, context)
        ones = jnp.ones((b,), jnp.float32)
        info = {}
        if mode == "sampled":
            return (
                sampled_part(
                    params, ref_state, context, target, first_logits, prefix, k_sample, ones
                ),
            ), info
        if mode == "exhaustive":
            actions = jnp.broadcast_to(jnp.arange(vocab_size, dtype=jnp.int32), (b, vocab_size))
            part = forced_part(
                params,
                ref_state,
                context,
                target,
                first_logits,
                prefix,
                actions,
                jnp.ones((b, vocab_size)),
                k_forced,
            )
            return (part,), info
        if mode == "guided":
            if g.guide == "reference" and needs_ref:
                guide_logp = reference.first_logprobs(ref_state, context)
            elif g.guide in ("policy", "reference"):
                if g.guide == "reference":
                    raise ValueError("group.guide=reference needs reference.kind=ngram|policy")
                guide_logp = ro.tempered_logp(first_logits, sp)
            else:
                raise ValueError(f"group.guide={g.guide!r} is unknown; choose reference|policy")
            actions, amask = guided_candidates(
                k_guide,
                guide_logp,
                g.guide_top_k,
                g.guide_top_k_confident,
                g.guide_random,
                g.entropy_threshold,
            )
            info["guided_candidates"] = amask.sum(1).mean()
            part = forced_part(
                params, ref_state, context, target, first_logits, prefix, actions, amask, k_forced
            )
            return (part,), info
        # adaptive: the budget's most uncertain contexts, gated by the entropy threshold
        ent = ro.entropy_of_logp(ro.tempered_logp(first_logits, sp))
        budget = adaptive_budget(b)
        top_ent, idx = jax.lax.top_k(ent, budget)
        chosen = top_ent > g.entropy_threshold
        exhaustive_rows = jnp.zeros((b,), jnp.float32).at[idx].set(chosen.astype(jnp.float32))
        sub_prefix = jax.tree.map(lambda x: x[idx], prefix)
        actions = jnp.broadcast_to(jnp.arange(vocab_size, dtype=jnp.int32), (budget, vocab_size))
        amask = jnp.broadcast_to(chosen[:, None], actions.shape).astype(jnp.float32)
        forced = forced_part(
            params,
            ref_state,
            context[idx],
            target[idx],
            first_logits[idx],
            sub_prefix,
            actions,
            amask,
            k_forced,
        )
        sampled = sampled_part(
            params,
            ref_state,
            context,
            target,
            first_logits,
            prefix,
            k_sample,
            1.0 - exhaustive_rows,
        )
        info["adaptive_exhaustive_frac"] = exhaustive_rows.mean()
        return (sampled, forced), info

    return collect
