"""Scoring a collected part: its members' returns and their group-relative advantages.

The engine calls ``score`` once the rewards are known (on device, or on the host for Python
rewards), between the rollout (groups.py) and the loss. A sampled part gets the ordinary
GRPO advantage of each member's return; a forced part gets the advantages over its forced
actions at the decision point and a credit for its continuation tokens (``return_credit``).
"""

import jax.numpy as jnp

from grpo_jax import objective
from grpo_jax.groups import Part, first_action_layout
from grpo_jax.specs import GroupSpec


def sequence_returns(rewards, mask, discount=1.0):
    """Per-token rewards [B, K, T] -> per-member returns [B, K].

    R = Σ_t γ^t m_t r_t / Σ_t γ^t m_t: a γ-weighted mean over the completion's tokens, in
    reward units (γ = 1 is the plain mean; an outcome reward spread over the tokens returns
    itself). A small γ makes an early token's own reward dominate the return instead of the
    later tokens', most of which are scored after the member has left the true text."""
    t = rewards.shape[-1]
    w = jnp.asarray(discount, jnp.float32) ** jnp.arange(t, dtype=jnp.float32) * mask
    return jnp.sum(rewards * w, -1) / jnp.maximum(jnp.sum(w, -1), 1e-30)


def first_token_weights(part: Part):
    """π̄ [B, K] of each forced member's first token: π_old, times the importance weight of a
    member that stands for others (``action_weights`` > 0: a class representative, a guided
    explorer). The K members repeat each of the A actions K / A times (first_action_layout)."""
    pi = jnp.exp(part.logp_old[..., 0])
    if part.action_weights is None:
        return pi
    w = first_action_layout(part.action_weights, pi.shape[1] // part.actions.shape[1])
    return pi * jnp.where(w > 0, w, 1.0)


def return_credit(part: Part, returns, ok, scale):
    """``group.continuation_credit=return``: every continuation token of a forced member gets
    its member's return advantage, weighted by the policy's probability of the member's first
    token.

    Forced first tokens are not drawn from π, so an unweighted mean over members would weight
    the continuations of unlikely tokens as much as likely ones. Here member k (first token
    a_k) gets A_k = (R_k - b)·ρ_k with b = Σ π̄_k R_k / Σ π̄_k and ρ_k = K'·π̄_k / Σ π̄_k
    (K' members that count; π̄ = π_old, a class representative's its class mass π_old(c), a
    guided explorer's π_old(a_k)·(V - k)/r: its inverse inclusion probability), so
    ``grpo.loss_agg=sequence-mean-token-sum`` (a mean over members of each member's token
    sum) gives Σ_k π̄_k (R_k - b) ∇ log π(continuation_k | a_k) / Σ π̄_k: together with the
    exact all-action term at the decision point, the gradient of Σ_a π(a) E[R | a],
    continuations included (b holds R_k itself with weight π̄_k: a bias of order π̄_k). The
    token-mean aggregations (the configs' default sequence-mean-token-mean) divide member k's
    continuation term by its token count: the continuation part is then that gradient's
    divided by about t - 1 against the decision point's. Advantage scale
    ``group`` divides by the π̄-weighted std, ``batch`` by the root of its mean over the
    prompts, as the decision point's does."""
    pi = jnp.where(ok, first_token_weights(part), 0.0)
    adv = objective.policy_weighted_advantages(returns, pi, scale, mask=ok)
    rho = pi / jnp.maximum(pi.sum(1, keepdims=True), 1e-30) * ok.sum(1, keepdims=True)
    return adv * rho


def score(part: Part, forced: bool, rewards, valid, spec: GroupSpec, scale, per_token, discount):
    """Fill a part's rewards, returns and advantages.

    rewards [B, K, T] per-token rewards (outcome rewards spread over the completion);
    valid [B, K]: members with at least one reward (a member whose every term returned None
    is left out of its group's statistics and gets advantage 0).

    Sampled parts: the group-relative advantage of each member's return on all its tokens
    (or, with ``per_token``, per-position advantages over the group). Forced parts: at the
    decision point the advantages over the forced actions (the "uniform" estimator's; the
    "expected" estimator reads ``action_returns`` itself), and on the continuation tokens a
    per-position baseline over the members that are still generating there
    (``group.continuation_credit=position``), or the member's π-weighted return advantage
    (``return``, see return_credit)."""
    mask = part.token_mask
    rewards = rewards * mask
    ok = (part.member_mask > 0) & (valid > 0)
    returns = sequence_returns(rewards, mask, discount) * ok
    tok_ok = mask * ok[..., None] > 0
    if not forced:
        if per_token:
            adv = objective.group_advantages(rewards, scale, mask=tok_ok)
        else:
            seq = objective.group_advantages(returns, scale, mask=ok)
            adv = seq[..., None] * mask
        return part._replace(rewards=rewards, returns=returns, advantages=adv, valid=valid * 1.0)
    b, a = part.actions.shape
    n = spec.continuations_per_action
    # an action's return: the mean over its scored continuations (an unscored one is no 0)
    ok_n = ok.reshape(b, a, n)
    action_returns = jnp.sum(returns.reshape(b, a, n), -1) / jnp.maximum(ok_n.sum(-1), 1)
    action_ok = (part.action_mask > 0) & ok_n.any(-1)
    adv0 = first_action_layout(objective.group_advantages(action_returns, scale, mask=action_ok), n)
    if spec.continuation_credit == "return":
        adv_rest = jnp.broadcast_to(
            return_credit(part, returns, ok, scale)[..., None], rewards[..., 1:].shape
        )
    else:
        adv_rest = objective.group_advantages(rewards[..., 1:], scale, mask=tok_ok[..., 1:])
    adv = jnp.concatenate([adv0[..., None], adv_rest], axis=-1) * mask
    return part._replace(
        rewards=rewards,
        returns=returns,
        advantages=adv,
        action_returns=action_returns,
        action_mask=part.action_mask * action_ok,
        valid=valid * 1.0,
    )
