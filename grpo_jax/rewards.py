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
import reprlib
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

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


def parse_terms(spec: str, names=None) -> tuple[tuple[str, float], ...]:
    """ "match_partial:1.0,match:0.5" -> (("match_partial", 1.0), ("match", 0.5)).

    A term without ":weight" has weight 1.0; ``names`` are the task's terms (default: the
    char-level terms of this module).
    """
    names = tuple(sorted(REWARDS)) if names is None else tuple(names)
    fix = 'write reward.terms as "name:weight,name:weight"'
    parts = [p.strip() for p in str(spec).split(",")]
    if not any(parts):
        raise ValueError(f"reward.terms is empty: {fix}")
    terms = []
    for part in parts:
        name, sep, weight_str = (s.strip() for s in part.partition(":"))
        if not name or (sep and not weight_str) or ":" in weight_str:
            raise ValueError(f"malformed reward term {part!r} in {spec!r}: {fix}")
        if name not in names:
            raise ValueError(
                f"unknown reward {name!r} in reward.terms; choose from {', '.join(names)}"
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


# --- reward terms as the engine sees them -------------------------------------------------


class RewardTerm(NamedTuple):
    """One weighted reward term of a task.

    ``host=False``: a jittable ``fn(reward_state, prompts, tokens [B, K, T], mask [B, K, T],
    ref_logp) -> [B, K] (outcome) or [B, K, T] (per token)``, ref_logp [B, K, T, V] when
    ``reads_reference`` (else [B, K, T, 0]).
    ``host=True``: a plain Python ``fn(prompts: list[str], completions: list[str],
    **task_fields) -> list[float | None]`` on decoded text, one value per completion (B*K,
    prompt-major), as researchers write them; None means "not scored by this term".
    """

    name: str
    weight: float
    fn: Callable
    host: bool = False
    # the term reads the reference's whole distribution at every completion position (its
    # ref_logp argument [B, K, T, V]); the engine materialises it only for such a term
    reads_reference: bool = False


def _spread(values, mask):
    """An outcome [B, K] over the completion's tokens; per-token values are masked."""
    if values.ndim == mask.ndim - 1:
        values = values[..., None]
    return jnp.asarray(values, jnp.float32) * mask


def device_values(terms, reward_state, part):
    """[n_terms, B, K, T] per-token values of the jittable terms on one group part (returns
    are taken by scoring.score, after the terms are combined)."""
    mask = part.token_mask
    out = [
        _spread(t.fn(reward_state, part.prompts, part.tokens, mask, part.ref_logp), mask)
        for t in terms
    ]
    if not out:
        return jnp.zeros((0,) + mask.shape, jnp.float32)
    return jnp.stack(out)


def host_values(terms, shape, prompts, completions, fields):
    """Python terms on one part's decoded text: (values, valid) float32 [n_terms, B, K].

    A term that raises, returns a non-list, the wrong number of values or a value that is no
    finite number (NaN reads as None) stops the run with one line naming it."""
    n = int(np.prod(shape))
    values = np.zeros((len(terms), n), np.float32)
    valid = np.zeros((len(terms), n), np.float32)
    for j, term in enumerate(terms):
        try:
            out = term.fn(prompts=list(prompts), completions=list(completions), **fields)
        except Exception as err:  # the user's code: name it, keep the message to one line
            msg = " ".join(f"{type(err).__name__}: {err}".split())
            raise ValueError(f"reward term {term.name!r} raised {msg}") from None
        if not isinstance(out, list | tuple) or len(out) != n:
            got = len(out) if isinstance(out, list | tuple) else type(out).__name__
            raise ValueError(
                f"reward term {term.name!r} returned {got} values for {n} completions; "
                "return one float (or None) per completion"
            )
        for i, x in enumerate(out):
            score = _host_score(term.name, x)
            if score is not None:
                values[j, i], valid[j, i] = score, 1.0
    return values.reshape(len(terms), *shape), valid.reshape(len(terms), *shape)


FLOAT32_MAX = float(np.finfo(np.float32).max)  # a larger value is stored as inf


def _host_score(name: str, x) -> float | None:
    """One completion's value from a Python term: a number finite in float32 (the values are
    stored so), or None (unscored). NaN also means unscored, as in TRL, which stores None as
    NaN; anything else stops the run in one line naming the term."""
    if x is None:
        return None
    try:  # float("42") would read a string as a score
        score = float(x)
        ok = not isinstance(x, str | bytes) and not abs(score) > FLOAT32_MAX  # NaN passes
    except (TypeError, ValueError, OverflowError):  # OverflowError: an int past a float
        ok = False
    if not ok:
        raise ValueError(
            f"reward term {name!r} returned {reprlib.repr(x)}; return one finite float (or "
            f"None) per completion, finite in float32 too (|x| <= {FLOAT32_MAX:.4g})"
        )
    return None if math.isnan(score) else score


def combine(device_terms, dev, host_terms, host, mask):
    """The weighted total per token and each term's values, plus which members any term
    scored. Returns ({"total": [B, K, T], name: [B, K, T], f"{name}/valid": [B, K]},
    valid [B, K]). A term's None counts as 0 in the total (as TRL sums with nansum); a
    member no term scored is invalid and the engine gives it advantage 0."""
    ones = jnp.ones(mask.shape[:2], jnp.float32)
    out, total, any_valid = {}, jnp.zeros(mask.shape, jnp.float32), ones * 0.0
    for j, term in enumerate(device_terms):
        out[term.name], out[f"{term.name}/valid"] = dev[j], ones
        total = total + term.weight * dev[j]
        any_valid = ones
    for j, term in enumerate(host_terms):
        v, ok = jnp.asarray(host[0][j]), jnp.asarray(host[1][j])
        out[term.name] = _spread(v * ok, mask)
        out[f"{term.name}/valid"] = ok
        total = total + term.weight * out[term.name]
        any_valid = jnp.maximum(any_valid, ok)
    out["total"] = total
    return out, any_valid


def char_terms(reward_cfg, target_field: str = "target"):
    """The char-level terms of ``reward.terms`` as RewardTerm s reading the prompts' target."""

    def term(name):
        def fn(reward_state, prompts, tokens, mask, ref_logp):
            ref = ref_logp if ref_logp.shape[-1] else None
            return REWARDS[name](tokens, prompts.fields[target_field], ref, reward_cfg)

        return fn

    return tuple(
        RewardTerm(name, w, term(name), reads_reference=name in NEEDS_REFERENCE)
        for name, w in parse_terms(reward_cfg.terms)
    )
