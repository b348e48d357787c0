"""Registry of per-token rewards for character rollouts.

Every reward has the signature

  fn(tokens [B, G, H] int32, target [B, H] int32,
     ref_logprobs [B, G, H, V] float or None, cfg) -> float32 [B, G, H]

where `tokens` are G rollouts per prompt, `target` the true continuation
(broadcast over G), `ref_logprobs` the reference's next-char distribution at
every rollout position (see reference.rollout_ref_logprobs) and `cfg` is
`config.reward`. `config.reward.terms` combines them as a weighted sum,
e.g. "match_partial:1.0,match:0.5". All rewards are pure and jittable.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

_DEFAULTS = {"partial_credit": 0.2, "partial_topk": 5}


def _get(cfg, name: str):
    if cfg is None:
        return _DEFAULTS[name]
    return cfg.get(name, _DEFAULTS[name])


def _prepare(tokens, target, ref_logprobs, name: str, needs_ref: bool):
    """Validates shapes (static, so at trace time) and returns jax arrays."""
    tokens, target = jnp.asarray(tokens), jnp.asarray(target)
    if tokens.ndim != 3 or target.shape != (tokens.shape[0], tokens.shape[2]):
        raise ValueError(
            f"reward {name!r}: tokens must be [B, G, H] and target [B, H]; got "
            f"{tokens.shape} and {target.shape}"
        )
    if needs_ref:
        if ref_logprobs is None:
            raise ValueError(
                f"reward {name!r} (partial credit / reference terms) needs reference "
                "log-probs: set reference.kind=ngram|policy or drop it from "
                "reward.terms"
            )
        ref_logprobs = jnp.asarray(ref_logprobs)
        if ref_logprobs.shape[:3] != tokens.shape:
            raise ValueError(
                f"reward {name!r}: ref_logprobs must be [B, G, H, V] with [B, G, H] "
                f"= {tokens.shape}; got {ref_logprobs.shape}"
            )
    return tokens, target, ref_logprobs


def _token_logprob(tokens, ref_logprobs) -> jax.Array:
    """log p_ref(tokens) [B, G, H] from the full distributions [B, G, H, V]."""
    return jnp.take_along_axis(ref_logprobs, tokens[..., None], axis=-1)[..., 0]


def in_topk(tokens, ref_logprobs, k: int) -> jax.Array:
    """bool [B, G, H]: is the token among the reference's top-k chars?

    Rank by comparison: a token is in the top-k when fewer than k chars have a
    strictly higher log-prob. Ties are therefore generous (every char tied at
    the k-th value counts), which is deterministic and cheaper than top_k.
    """
    if k < 1:
        raise ValueError(f"reward.partial_topk must be >= 1 (got {k})")
    own = _token_logprob(tokens, ref_logprobs)
    higher = jnp.sum(ref_logprobs > own[..., None], axis=-1)
    return higher < k


def match(tokens, target, ref_logprobs, cfg) -> jax.Array:
    """1.0 where the rollout char equals the true char at that position, else 0."""
    tokens, target, ref_logprobs = _prepare(tokens, target, ref_logprobs, "match", needs_ref=False)
    return (tokens == target[:, None, :]).astype(jnp.float32)


def match_partial(tokens, target, ref_logprobs, cfg) -> jax.Array:
    """1.0 on a match, cfg.partial_credit if in the reference top-k, else 0.

    The partial credit densifies the otherwise sparse exact-match signal with
    "plausible" chars, so groups rarely have all-zero rewards.
    """
    tokens, target, ref_logprobs = _prepare(
        tokens, target, ref_logprobs, "match_partial", needs_ref=True
    )
    hit = tokens == target[:, None, :]
    near = in_topk(tokens, ref_logprobs, int(_get(cfg, "partial_topk")))
    credit = jnp.float32(_get(cfg, "partial_credit"))
    return jnp.where(hit, 1.0, jnp.where(near, credit, 0.0)).astype(jnp.float32)


def ref_topk(tokens, target, ref_logprobs, cfg) -> jax.Array:
    """1.0 where the char is in the reference's top-k (k = cfg.partial_topk)."""
    tokens, target, ref_logprobs = _prepare(
        tokens, target, ref_logprobs, "ref_topk", needs_ref=True
    )
    k = int(_get(cfg, "partial_topk"))
    return in_topk(tokens, ref_logprobs, k).astype(jnp.float32)


def ref_logprob(tokens, target, ref_logprobs, cfg) -> jax.Array:
    """The reference's log-prob of the char (<= 0; a fluency reward)."""
    tokens, target, ref_logprobs = _prepare(
        tokens, target, ref_logprobs, "ref_logprob", needs_ref=True
    )
    return _token_logprob(tokens, ref_logprobs).astype(jnp.float32)


REWARDS = {
    "match": match,
    "match_partial": match_partial,
    "ref_topk": ref_topk,
    "ref_logprob": ref_logprob,
}
NEEDS_REFERENCE = frozenset({"match_partial", "ref_topk", "ref_logprob"})


def parse_terms(spec: str) -> tuple[tuple[str, float], ...]:
    """ "match_partial:1.0,match:0.5" -> (("match_partial", 1.0), ("match", 0.5)).

    A term without ":weight" has weight 1.0.
    """
    fix = 'write reward.terms as "name:weight,name:weight"'
    parts = [p.strip() for p in str(spec).split(",")]
    if not any(parts):
        raise ValueError(f"reward.terms is empty: {fix}")
    terms = []
    for part in parts:
        name, sep, weight_str = (s.strip() for s in part.partition(":"))
        if not name or (sep and not weight_str) or ":" in weight_str:
            raise ValueError(f"malformed reward term {part!r} in {spec!r}: {fix}")
        if name not in REWARDS:
            raise ValueError(
                f"unknown reward {name!r} in reward.terms; choose from {', '.join(sorted(REWARDS))}"
            )
        try:
            weight = float(weight_str) if sep else 1.0
        except ValueError:
            raise ValueError(
                f"malformed weight {weight_str!r} for reward {name!r}: {fix}"
            ) from None
        if not math.isfinite(weight):
            raise ValueError(f"reward {name!r} has non-finite weight {weight}")
        if name in dict(terms):
            raise ValueError(f"reward {name!r} appears twice in reward.terms {spec!r}")
        terms.append((name, weight))
    return tuple(terms)


def needs_reference(reward_cfg) -> bool:
    """Whether any term of reward_cfg.terms reads the reference's log-probs."""
    return any(name in NEEDS_REFERENCE for name, _ in parse_terms(reward_cfg.terms))


def make_reward_fn(reward_cfg):
    """Returns fn(tokens [B,G,H], target [B,H], ref_logprobs or None) -> [B,G,H].

    The terms are parsed once here (so a bad spec fails at startup); the
    returned function is pure and jittable (weights are Python constants).
    """
    terms = parse_terms(reward_cfg.terms)

    def reward_fn(tokens, target, ref_logprobs=None):
        total = None
        for name, weight in terms:
            r = weight * REWARDS[name](tokens, target, ref_logprobs, reward_cfg)
            total = r if total is None else total + r
        return total.astype(jnp.float32)

    return reward_fn


def reduce_rewards(rewards: jax.Array, per_token: bool) -> jax.Array:
    """[B, G, H] per-token rewards -> unchanged if per_token, else mean over H [B, G]."""
    return rewards if per_token else jnp.mean(rewards, axis=-1)
