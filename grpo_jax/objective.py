"""The GRPO objective as small pure, jittable functions.

Symbols follow the papers: DeepSeekMath GRPO (Shao et al. 2024) for group advantages Â and
the k3 KL estimator, PPO (Schulman et al. 2017) for the clipped ratio surrogate, DAPO (Yu et
al. 2025) for decoupled clipping ε_low/ε_high and token-mean aggregation, Dr.GRPO (Liu et
al. 2025) for the unscaled advantage and the constant-normaliser aggregation. Shapes: B
prompts, G group members, T tokens per completion (the static, padded maximum completion
length), V vocabulary (actions). String options are static: pass them through
`jax.jit(..., static_argnames=...)`.

Variable-length completions are padded to T and described by a token mask.  A
row (one completion: every index but the last axis) whose mask is all zero does
not exist (a padding group member, a masked prompt): it adds nothing to any sum
and is not counted by any normaliser.

Where this module differs from Hugging Face TRL's `GRPOTrainer` (checked against
huggingface/trl `trl/trainer/grpo_trainer.py`, `grpo_config.py` and the `nanstd`
helper in `trainer/utils.py`):

* Reward std: TRL uses the sample std (Bessel-corrected, ddof=1: torch `.std()`
  in older releases, its own NaN-aware `nanstd` now); `group_advantages` uses
  the population std (ddof=0).  For a group of G members, ours is
  sqrt((G-1)/G) times TRL's, so our scaled advantages are larger by sqrt(G/(G-1)).
* Std epsilon: TRL adds a fixed 1e-4 to the std; ours defaults to eps=1e-8, and
  a group whose valid rewards are all equal gets an advantage of exactly 0.
* Scaling options: TRL's `scale_rewards` "group" / "batch" / "none" (True and
  False alias "group" and "none") correspond to our `grpo.advantage_scale`
  (`group_advantages(scale=...)`) with the same three names: both centre by the
  group mean and divide by the group std, by the std of all rewards in the batch,
  or not at all (the ddof and eps differences above apply to both scaled cases).
* Loss aggregation (TRL `loss_type` -> ours; "rows" are completions):
  "grpo" -> "sequence-mean-token-mean", but TRL averages over every row of the
  local batch, an all-masked row counting as a 0, while we average over rows
  that exist only;  "bnpo" -> "token-mean" (tokens of the arrays passed in, like
  TRL's local-batch token count);  "dapo" -> "token-mean" only when one call sees
  the whole batch: TRL divides by the number of completion tokens of the whole
  generation batch gathered across processes (divided by the process count),
  which we do not do here;  "dr_grpo" -> "dr-grpo", but TRL divides by (all local
  rows) × the configured `max_completion_length`, while we divide by (rows that
  exist) × T, the static last axis of `per_token`.  TRL also divides its
  "grpo", "bnpo" and "dr_grpo" losses by the gradient-accumulation step count;
  that is the caller's business here.  "sequence-mean-token-sum" has no TRL counterpart.
* KL: TRL adds β·(per-token k3 KL) to the per-token loss and aggregates the sum;
  we aggregate the KL term with the same aggregation as the surrogate and add
  β times it.  Every aggregation here is linear with mask-only coefficients, so
  the two are equal.
"""

import jax
import jax.numpy as jnp

ADVANTAGE_SCALES = ("group", "batch", "none")

# Below this |d| the k3 series is used; its truncation error (first omitted term
# d^7/7!) is < 4e-9 relative here, while float32 expm1(d) - d loses ~1e-7/|d| relative.
_K3_SERIES_MAX = 0.1


def _check(name, value, choices):
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; choose from {', '.join(choices)}")


def _safe_div(num, den):
    # Double where: the unselected branch must not produce inf/NaN gradients.
    ok = den > 0
    return jnp.where(ok, num / jnp.where(ok, den, 1.0), 0.0)


def center(values, mask, weights, axis):
    """Weighted mean and centred values along `axis`, exactly 0 for constant sets.

    Subtracting the first valid member first makes every member of a constant
    set exactly 0 (x - y == 0 iff x == y in IEEE), so its mean and centred
    values are exactly 0 too; a naive mean of [0.1, 0.1, 0.1] in float32 is not
    0.1 and the residue, divided by a ~0 std, would become a ±1 advantage.
    """
    first = mask & (jnp.cumsum(mask, axis=axis) == 1)
    ref = jnp.sum(jnp.where(first, values, 0.0), axis=axis, keepdims=True)
    shifted = jnp.where(mask, values - ref, 0.0)
    w = jnp.where(mask, weights, 0.0)
    mean = _safe_div(
        jnp.sum(w * shifted, axis=axis, keepdims=True),
        jnp.sum(w, axis=axis, keepdims=True),
    )
    return jnp.where(mask, shifted - mean, 0.0)


def group_advantages(rewards, scale="group", eps=1e-8, mask=None):
    """Group-relative advantages Â_i = (r_i - mean(r)) / (std(r) + eps).

    Args:
      rewards: `[B, G]` outcome rewards r_i, or `[B, G, T]` per-token rewards
        (statistics are then per (b, t) across the group axis 1).
      scale: "group" (GRPO: population std of the group), "batch" (population
        std of all valid rewards in the batch; Lite-PPO) or "none" (Dr.GRPO: no
        division).  Centring is always by the group mean.
      eps: added to the std.
      mask: optional `[B, G]` (or `[B, G, T]`) bool, members that exist (variable-size
        groups padded to a static G).  Statistics use valid members only.
    Returns: advantages, same shape as `rewards`; 0 for invalid members and for
      groups whose valid rewards are all equal (they carry no learning signal).

    Differences from TRL's GRPOTrainer (its `scale_rewards` takes the same three
    names): TRL divides by the sample std (ddof=1) plus 1e-4; we divide by the
    population std (ddof=0) plus `eps` (default 1e-8).  With G valid members our
    std is sqrt((G-1)/G) times TRL's.  Pass eps=1e-4 to match TRL's epsilon; the
    ddof difference remains.
    """
    _check("advantage scale", scale, ADVANTAGE_SCALES)
    mask = jnp.ones(rewards.shape[:2], bool) if mask is None else jnp.asarray(mask, bool)
    mask = jnp.broadcast_to(
        mask.reshape(mask.shape + (1,) * (rewards.ndim - mask.ndim)), rewards.shape
    )
    centred = center(rewards, mask, jnp.ones_like(rewards), axis=1)
    if scale == "none":
        return centred
    if scale == "group":
        count = jnp.sum(mask, axis=1, keepdims=True)
        std = jnp.sqrt(_safe_div(jnp.sum(centred**2, axis=1, keepdims=True), count))
    else:
        flat_mask = mask.reshape(-1)
        flat = center(
            rewards.reshape(-1),
            flat_mask,
            jnp.ones(flat_mask.shape, rewards.dtype),
            axis=0,
        )
        std = jnp.sqrt(_safe_div(jnp.sum(flat**2), jnp.sum(flat_mask)))
    return _safe_div(centred, std + eps)


def clipped_surrogate(logp, old_logp, advantages, epsilon=0.2, epsilon_high=None):
    """PPO/GRPO clipped surrogate loss per token, -min(ρ·Â, clip(ρ, 1-ε_low, 1+ε_high)·Â).

    Args:
      logp: `[..., T]` log π_θ(o_t | q, o_<t) of the sampled tokens.
      old_logp: same shape, log π_θold (stop-gradient; equal to logp when μ = 1).
      advantages: Â, broadcastable against logp (e.g. `[B, G, 1]` vs `[B, G, T]`).
      epsilon: ε_low.  epsilon_high: ε_high (DAPO clip-higher); None -> ε_low.
    Returns: per-token loss of the broadcast shape (minimise it).
    """
    ratio = jnp.exp(logp - old_logp)
    hi = epsilon if epsilon_high is None else epsilon_high
    unclipped = ratio * advantages
    clipped = jnp.clip(ratio, 1.0 - epsilon, 1.0 + hi) * advantages
    return -jnp.minimum(unclipped, clipped)


def _k1(logp, ref_logp):
    return logp - ref_logp


def _k2(logp, ref_logp):
    return 0.5 * (logp - ref_logp) ** 2


def _k3(logp, ref_logp):
    # k3 = π_ref/π - log(π_ref/π) - 1 = e^d - d - 1 with d = log π_ref - log π.
    d = ref_logp - logp
    small = jnp.abs(d) < _K3_SERIES_MAX
    ds = jnp.where(small, d, 0.0)  # keep the series finite where it is not selected
    db = jnp.where(small, 1.0, d)
    series = ds * ds * (1 / 2 + ds * (1 / 6 + ds * (1 / 24 + ds * (1 / 120 + ds / 720))))
    return jnp.maximum(jnp.where(small, series, jnp.expm1(db) - db), 0.0)


# Per-token estimators of KL(π_θ ‖ π_ref) from sampled-token log-probs, fn(logp, ref_logp).
KL_ESTIMATORS = {"k1": _k1, "k2": _k2, "k3": _k3}


def kl_estimate(logp, ref_logp, estimator):
    """Per-token KL estimate D_KL[π_θ ‖ π_ref] for sampled tokens o_t ~ π_θ.

    Args:
      logp, ref_logp: `[...]` log π_θ(o_t) and log π_ref(o_t).
      estimator: "k1" (log ratio; unbiased, high variance, can be < 0), "k2"
        (½ log-ratio²) or "k3" (DeepSeekMath: π_ref/π - log(π_ref/π) - 1;
        unbiased, ≥ 0, accurate in float32 even when π ≈ π_ref).
    Returns: `[...]` per-token estimate.
    """
    _check("KL estimator", estimator, tuple(KL_ESTIMATORS))
    return KL_ESTIMATORS[estimator](logp, ref_logp)


def _log_probs(logits):
    # bfloat16 logits lose too much in log_softmax; compute in at least float32.
    return jax.nn.log_softmax(logits.astype(jnp.promote_types(logits.dtype, jnp.float32)), axis=-1)


def exact_kl(logits, ref_logits):
    """Exact KL(π ‖ π_ref) = Σ_v π(v)(log π(v) - log π_ref(v)) per position.

    Args:
      logits: `[..., V]` policy logits (-inf allowed for impossible tokens).
      ref_logits: `[..., V]` reference logits or log-probs (finite).
    Returns: `[...]`, ≥ 0 (float rounding negatives are clamped).
    """
    logp, ref = _log_probs(logits), _log_probs(ref_logits)
    p = jnp.exp(logp)
    # π(v) = 0 contributes 0, not 0·(-inf) = NaN, in value and in gradient.
    diff = jnp.where(p > 0, logp - ref, 0.0)
    return jnp.maximum(jnp.sum(p * diff, axis=-1), 0.0)


def exact_forward_kl(logits, ref_logits):
    """Exact forward KL(π_ref ‖ π) = Σ_v π_ref(v)(log π_ref(v) - log π(v)) per position.

    The mass-covering direction: its gradient in the policy logits is π - π_ref, the
    cross-entropy gradient with π_ref as a soft target, so it stays strong where π puts
    little mass on chars the reference likes (the reverse KL's gradient there scales with π
    and vanishes). Against an n-gram reference trained from scratch it is the faster teacher.

    Args:
      logits: `[..., V]` policy logits (finite wherever π_ref > 0).
      ref_logits: `[..., V]` reference logits or log-probs (finite).
    Returns: `[...]`, ≥ 0 (float rounding negatives are clamped).
    """
    logp, ref = _log_probs(logits), _log_probs(ref_logits)
    return jnp.maximum(jnp.sum(jnp.exp(ref) * (ref - logp), axis=-1), 0.0)


# Exact KL penalties over the vocabulary, fn(policy logits [..., V], ref logits [..., V]) -> [...].
EXACT_KL = {"exact": exact_kl, "exact_forward": exact_forward_kl}
# Every grpo.kl_estimator: the exact ones above, or a sampled-token estimator of KL(π ‖ π_ref).
KL_CHOICES = (*EXACT_KL, *KL_ESTIMATORS)


def entropy_from_logits(logits):
    """Shannon entropy H(π) = -Σ_v π(v) log π(v) in nats, `[..., V] -> [...]`.

    `logits` may be unnormalised logits or log-probs; -inf entries (tokens removed
    by top-k/top-p filtering) have π(v) = 0 and add 0, so the result is the
    entropy of the renormalised finite part.  A position whose entries are all
    -inf has entropy 0.  Value and gradient are finite in every case.
    """
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    live = jnp.any(logits > -jnp.inf, axis=-1)
    # an all -inf row would make log_softmax NaN; give it finite logits, then drop it
    logp = jax.nn.log_softmax(jnp.where(live[..., None], logits, 0.0), axis=-1)
    p = jnp.exp(logp)
    # p · where(...) rather than where(p > 0, p · logp, 0): 0 · -inf would be NaN in the gradient
    return jnp.where(live, -jnp.sum(p * jnp.where(p > 0, logp, 0.0), axis=-1), 0.0)


def _masked_rows(per_token, mask):
    """`[R, T]` values with masked positions zeroed, the float mask, and the number
    of rows that exist (at least one unmasked token).  Rows are all leading axes;
    masked positions may hold garbage (NaN, inf): `where` drops it in the value and
    in the gradient."""
    mask = jnp.broadcast_to(mask, per_token.shape).reshape(-1, per_token.shape[-1]).astype(bool)
    x = jnp.where(mask, per_token.reshape(mask.shape), 0.0)
    rows = jnp.sum(jnp.any(mask, axis=-1)).astype(x.dtype)
    return x, mask.astype(x.dtype), rows


def _seq_mean_token_mean(per_token, mask):
    """GRPO: (1/rows) Σ_rows (Σ_t m·x / Σ_t m), rows = rows that exist.

    TRL's "grpo" takes the same per-row means but averages them over every row of
    the batch, so an all-masked row there counts as a 0 and shrinks the loss."""
    x, m, rows = _masked_rows(per_token, mask)
    return _safe_div(jnp.sum(_safe_div(jnp.sum(x, -1), jnp.sum(m, -1))), rows)


def _token_mean(per_token, mask):
    """DAPO / BNPO: Σ m·x / Σ m over every token of the arrays passed in.

    This is TRL's "bnpo" (local-batch token count).  TRL's "dapo" divides instead by
    the token count of the whole generation batch gathered across processes (per
    process); the two agree when one call sees that whole batch."""
    x, m, _ = _masked_rows(per_token, mask)
    return _safe_div(jnp.sum(x), jnp.sum(m))


def _seq_mean_token_sum(per_token, mask):
    """(1/rows) Σ_rows Σ_t m·x, rows = rows that exist.  No TRL counterpart."""
    x, _, rows = _masked_rows(per_token, mask)
    return _safe_div(jnp.sum(x), rows)


def _dr_grpo(per_token, mask):
    """Dr.GRPO: Σ m·x / (rows · T), rows = rows that exist, T = per_token.shape[-1].

    A normaliser that does not depend on the completion lengths: no length bias
    towards short or long answers.  TRL's "dr_grpo" divides by (every row of the
    local batch, all-masked ones included) × the configured max_completion_length,
    which can exceed the padded width; here T is the static padded length and
    all-masked rows are not counted."""
    x, _, rows = _masked_rows(per_token, mask)
    return _safe_div(jnp.sum(x), rows * per_token.shape[-1])


# Reductions of `[..., T]` per-token values and masks to a scalar, fn(per_token, mask).
# Each is linear in per_token with coefficients that depend on the mask only, so
# jax.grad of one w.r.t. per_token gives its per-token weights (mask / normaliser).
AGGREGATIONS = {
    "sequence-mean-token-mean": _seq_mean_token_mean,
    "token-mean": _token_mean,
    "sequence-mean-token-sum": _seq_mean_token_sum,
    "dr-grpo": _dr_grpo,
}


def aggregate(per_token, mask, mode):
    """Reduce masked per-token values to a scalar loss.

    Rows are all axes but the last; a row whose mask is all zero does not exist
    (padding member, masked prompt) and counts in no normaliser.  With
    rows = number of rows with at least one unmasked token and T = per_token.shape[-1]:

      "sequence-mean-token-mean" (GRPO):   (1/rows) Σ_rows (Σ_t m·x / Σ_t m)
      "token-mean" (DAPO / BNPO):          Σ m·x / Σ m
      "sequence-mean-token-sum":           (1/rows) Σ_rows Σ_t m·x
      "dr-grpo" (Dr.GRPO):                 Σ m·x / (rows · T)

    Each is linear in `per_token` with mask-only coefficients, so
    `jax.grad(aggregate)` w.r.t. `per_token` is the per-token weight m / normaliser,
    and aggregating a sum of per-token terms (surrogate + β·KL) equals the sum of
    their aggregates.

    TRL's GRPOTrainer names these loss_type "grpo", "bnpo" / "dapo" and "dr_grpo";
    it counts all-masked rows in the "grpo" and "dr_grpo" normalisers, divides
    "dr_grpo" by its configured max_completion_length rather than the padded
    width, and normalises "dapo" by the token count gathered across processes
    (see the module docstring).

    Args:
      per_token: `[..., T]`, e.g. `[B, T]` or `[B, G, T]`.  Masked positions may
        hold NaN/inf; they affect neither the value nor the gradient.
      mask: same shape or broadcastable to it, 1/True for real completion tokens.
      mode: one of `AGGREGATIONS`.
    Returns: scalar; an all-masked batch gives exactly 0 (and a zero gradient).
    """
    _check("aggregation", mode, tuple(AGGREGATIONS))
    return AGGREGATIONS[mode](per_token, mask)


def all_action_loss(logp_all, returns, scale="none", eps=1e-8, mask=None):
    """Exact all-action ("expected") policy-gradient surrogate at a decision point.

    With every action a scored, the group is the whole action set weighted by
    π(a|s) instead of sampled: baseline b = Σ_a π̄(a)R(a), Â(a) = R(a) - b, and
    loss = -Σ_a π_θ(a|s)·Â(a) with π̄ = sg(π_θ) and Â stop-gradient, so
    ∇loss = -Σ_a π(a)Â(a)∇log π(a) = -∇_θ Σ_a π_θ(a|s)R(a) exactly (Σ_a ∇π = 0).

    Args:
      logp_all: `[B, V]` log π_θ(a|s) for every action a.
      returns: `[B, V]` R(a), return of forcing a (treated as stop-gradient).
      scale: "none" (default), "group" (Â / (sqrt(Σ_a π̄(a)Â(a)²) + eps) per row) or
        "batch" (by the root of those variances' mean over the rows with actions, + eps).
      mask: optional `[B, V]` bool of actions to include: π is restricted to it without
        renormalising in the loss, the baseline and std use π̄ renormalised over it; the
        gradient is that of -Σ_{a∈M} π(a)(R(a) - b).
    Returns: `[B]` per-row loss (its value is ~0 by construction; use its gradient).
    """
    return _scaled(*all_action_terms(logp_all, returns, mask), scale, eps)


def all_action_terms(logp_all, returns, mask=None):
    """all_action_loss unscaled and its scales' pieces ([B] each: -Σ_a π_θ(a)Â(a), the row's
    π̄-weighted variance of Â, 1 where it has actions): devices holding different rows add
    them (loss.py's forced parts) before scale_by_batch_std divides by √(Σ var / Σ rows)."""
    mask = jnp.ones(logp_all.shape, bool) if mask is None else jnp.asarray(mask, bool)
    pi = jnp.where(mask, jnp.exp(logp_all), 0.0)
    adv, var, rows = _centred(returns, pi, mask)
    return -jnp.sum(pi * adv, axis=-1), var, rows


def policy_weighted_advantages(returns, pi, scale="none", eps=1e-8, mask=None):
    """Â(a) = R(a) - Σ_a π̄(a)R(a) over a whole action set (returns `[B, A]`), scaled as
    all_action_loss's; π̄ = sg(π) renormalised over ``mask`` (optional `[B, A]` bool) for
    the statistics. Returns `[B, A]` stop-gradient advantages, 0 outside the mask."""
    return jax.lax.stop_gradient(_scaled(*_centred(returns, pi, mask), scale, eps))


def _scaled(x, var, rows, scale, eps):
    """x ([B, ...]) divided by its row's std sqrt(var) + eps ("group": a constant of the row,
    so a row's sum divides alike) or by √(Σ var / Σ rows) + eps ("batch"); as is ("none")."""
    _check("advantage scale", scale, ADVANTAGE_SCALES)
    if scale == "group":
        return _safe_div(x, jnp.sqrt(var).reshape(var.shape + (1,) * (x.ndim - 1)) + eps)
    if scale == "batch":
        return scale_by_batch_std(x, jnp.sum(var), jnp.sum(rows), eps)
    return x


def _centred(returns, pi, mask):
    """(Â = R - b, 0 outside the mask; [B] each row's π̄-weighted variance of Â, 0 for a row
    without actions; [B] 1 where the row has actions), π̄ = sg(π) over the mask."""
    mask = jnp.ones(pi.shape, bool) if mask is None else jnp.asarray(mask, bool)
    pi_sg = jax.lax.stop_gradient(jnp.where(mask, pi, 0.0))
    adv = center(jax.lax.stop_gradient(returns), mask, pi_sg, axis=-1)
    rows, var = jnp.any(mask, -1), _safe_div(jnp.sum(pi_sg * adv**2, -1), jnp.sum(pi_sg, -1))
    return adv, jnp.where(rows, var, 0.0), rows * 1.0  # all stop-gradient: from π̄ and sg(R)


def scale_by_batch_std(x, var_sum, rows, eps=1e-8):
    """x / (sqrt(var_sum / rows) + eps), 0 where that is undefined (all_action_terms' sums)."""
    return _safe_div(x, jnp.sqrt(_safe_div(var_sum, rows)) + eps)
