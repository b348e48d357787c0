"""The GRPO loss of one batch of group parts (see groups.py), as a pure function of params.

    L = Σ_parts w_part · [ pg_part + β · KL_part − c_H · H_part ]

w_part is the fraction of the batch's prompts the part covers (1 unless group.mode=adaptive).

Sampled parts: the clipped surrogate on every generated token, aggregated by grpo.loss_agg.
Forced parts (exhaustive / guided): at the decision point either
  * ``uniform``:  mean over the forced actions of the clipped surrogate with ratio
                  π_θ(a|s)/π_old(a|s) and advantages taken over the action axis, or
  * ``expected``: the exact all-action gradient −∇ Σ_a π_θ(a|s)(R(a) − b), b = Σ_a π(a|s)R(a)
                  (no sampling variance at the decision point given the rollouts' returns),
plus, when group.train_continuations, the clipped surrogate on tokens 1..H-1 with their
per-position group advantages. The decision point's KL and entropy are exact over V.

KL: ``grpo.kl_estimator`` = ``exact`` (reverse KL(π‖π_ref) summed over V), ``exact_forward``
(forward KL(π_ref‖π) over V: the reference's distribution as a soft target at every scored
position) or a sampled-token estimator k1/k2/k3 of the reverse KL.

Memory: a forced part's continuation tokens run their training forward ``group.loss_chunk``
members at a time (default: the rollout's ``group.vocab_chunk``), each chunk rematerialised in
the backward pass, so the [B, K, H, V] logits of a whole exhaustive group never exist at once
(see continuation_terms).

π_old: the μ updates reuse one batch of rollouts. The log-probs of iteration 0's forward are
π_old exactly (same params, same computation as every later iteration), so they are captured
there and carried to iterations 1..μ-1; the ratio is exactly 1 at iteration 0.
"""

import jax
import jax.numpy as jnp

from grpo_jax import objective
from grpo_jax.groups import Part
from grpo_jax.model import Transformer, group_logits
from grpo_jax.rollout import chunked, entropy_of_logp, prefill, sampling_params, tempered_logp

ESTIMATORS = ("uniform", "expected")


def token_logp(lp_all, tokens):
    """log π(token) from log-probs [..., V] and tokens [...]. A one-hot product instead of a
    gather: its gradient is dense instead of a scatter-add, which is slow on CPU."""
    return jnp.sum(lp_all * jax.nn.one_hot(tokens, lp_all.shape[-1], dtype=lp_all.dtype), -1)


def _masked_mean(x, w):
    return jnp.sum(x * w) / jnp.maximum(jnp.sum(w), 1.0)


def make_loss(config, model, has_reference: bool):
    """Returns loss_fn(params, parts, old_logps, first_iter) -> (loss, (metrics, logps))."""
    gr = config.grpo
    sp = sampling_params(config.group)
    if gr.kl_estimator not in objective.KL_CHOICES:
        raise ValueError(
            f"grpo.kl_estimator={gr.kl_estimator!r} is unknown; choose from {objective.KL_CHOICES}"
        )
    # the decision point's KL is exact over V whatever the estimator; its direction follows it
    exact_kl = objective.EXACT_KL.get(gr.kl_estimator, objective.exact_kl)
    if gr.exhaustive_estimator not in ESTIMATORS:
        raise ValueError(
            f"grpo.exhaustive_estimator={gr.exhaustive_estimator!r} is unknown; "
            f"choose from {ESTIMATORS}"
        )
    if gr.loss_agg not in objective.AGGREGATIONS:
        raise ValueError(
            f"grpo.loss_agg={gr.loss_agg!r} is unknown; choose from {list(objective.AGGREGATIONS)}"
        )
    eps, eps_high = gr.epsilon, gr.epsilon_high
    beta = gr.beta if has_reference else 0.0
    train_cont = bool(config.group.train_continuations)
    n_cont = int(config.group.continuations_per_action)
    # the training forward's chunk is its own: its [B, c, H, V] logits outgrow the rollout's
    # [B*c, V] per decode step by a factor H, so a large V wants a smaller chunk here
    loss_chunk = int(config.group.loss_chunk) or int(config.group.vocab_chunk)
    if loss_chunk < 0:
        raise ValueError(f"group.loss_chunk={loss_chunk} must be >= 0 (0 = group.vocab_chunk)")
    aa_scale = "group" if gr.advantage_scale == "group" else "none"

    def agg(x, mask):
        """objective.aggregate over the rows that exist. Guided groups mask candidate slots and
        adaptive parts mask whole prompts; the per-row means must not count those rows, or the
        part's loss, KL and entropy shrink by the masked share (adaptive parts are already
        weighted by their prompt share in loss_fn)."""
        out = objective.aggregate(x, mask, gr.loss_agg)
        if gr.loss_agg in ("sequence-mean-token-mean", "sequence-mean-token-sum"):
            rows = jnp.broadcast_to(mask, x.shape).reshape(-1, x.shape[-1]).any(-1)
            out = out * rows.size / jnp.maximum(rows.sum(), 1)
        return out

    def surrogate_terms(logp, old, adv, mask):
        """Aggregated clipped surrogate plus its clip fraction and mean ratio."""
        pg = objective.clipped_surrogate(logp, old, adv, eps, eps_high)
        clip = objective.clip_fraction(logp, old, adv, eps, eps_high)
        ratio = jnp.exp(logp - old)
        return agg(pg, mask), _masked_mean(clip, mask), _masked_mean(ratio, mask)

    def kl_terms(logits_lp, logp, ref_lp, tokens):
        if not has_reference:
            return jnp.zeros_like(logp)
        if gr.kl_estimator in objective.EXACT_KL:
            return exact_kl(logits_lp, ref_lp)
        ref_tok = jnp.take_along_axis(ref_lp, tokens[..., None], axis=-1)[..., 0]
        return objective.kl_estimate(logp, ref_tok, gr.kl_estimator)

    def agg_weights(mask):
        """Per-token weights w with agg(x, mask) == Σ x·w for every x. Every aggregation is
        linear in x with mask-only coefficients, so the weights are agg's gradient in x; they
        let the member chunks of a forced part each add their share of the exact aggregate."""
        return jax.grad(lambda x: agg(x, mask))(jnp.zeros(mask.shape, jnp.float32))

    def sampled_loss(params, part: Part, old_logp, first_iter):
        b, k, h = part.tokens.shape
        _, logits = group_logits(model, params, part.context, part.tokens)
        lp_all = tempered_logp(logits, sp)  # [B, K, H, V]
        logp = token_logp(lp_all, part.tokens)
        old = jnp.where(first_iter, jax.lax.stop_gradient(logp), old_logp)
        tok_mask = jnp.broadcast_to(part.member_mask[..., None], (b, k, h))
        m = {}
        pg, m["clip_frac"], m["ratio_mean"] = surrogate_terms(logp, old, part.advantages, tok_mask)
        kl = agg(kl_terms(lp_all, logp, part.ref_logp, part.tokens), tok_mask)
        ent = agg(entropy_of_logp(lp_all), tok_mask)
        return pg, kl, ent, jnp.mean(part.member_mask.max(1)), m, logp

    def continuation_terms(params, prefix, context_len, part: Part, old_logp, first_iter):
        """Tokens 1..H-1 of a forced part, ``group.loss_chunk`` members at a time.

        Each chunk runs the training forward of its members against the shared prefix and
        returns its members' weighted sums of the clipped surrogate, KL and entropy (weights
        from agg_weights, so the chunks add up to the unchunked aggregate exactly). Chunks
        are rematerialised (jax.checkpoint): the backward pass recomputes one chunk's
        activations at a time, so the [B, K, H, V] logits never exist at once and peak
        memory is bounded by the chunk, as in the rollout.
        Returns (pg, kl, ent) scalars and logp [B, K, H-1]."""
        b, k, h = part.tokens.shape
        w = agg_weights(jnp.broadcast_to(part.member_mask[..., None], (b, k, h - 1)))

        def chunk(tokens, old_c, adv_c, w_c, ref_c):
            logits = model.apply(
                {"params": params}, prefix, tokens[..., :-1], context_len, method=Transformer.extend
            )
            lp = tempered_logp(logits, sp)  # [B, c, H-1, V]
            tok = tokens[..., 1:]
            logp = token_logp(lp, tok)
            old = jnp.where(first_iter, jax.lax.stop_gradient(logp), old_c)
            wsum = lambda x: jnp.sum(jnp.where(w_c > 0, x, 0.0) * w_c, axis=-1)
            pg = wsum(objective.clipped_surrogate(logp, old, adv_c, eps, eps_high))
            return pg, wsum(kl_terms(lp, logp, ref_c, tok)), wsum(entropy_of_logp(lp)), logp

        fn = jax.checkpoint(chunk) if 0 < loss_chunk < k else chunk
        pg, kl, ent, logp = chunked(
            fn,
            loss_chunk,
            part.tokens,
            old_logp[..., 1:],
            part.advantages[..., 1:],
            w,
            part.ref_logp[..., 1:, :],
        )
        return pg.sum(), kl.sum(), ent.sum(), logp

    def forced_loss(params, part: Part, old_logp, first_iter):
        b, k, h = part.tokens.shape
        first_logits, prefix = prefill(model, params, part.context)
        lp_first = tempered_logp(first_logits, sp)  # [B, V]
        logp = jnp.take_along_axis(lp_first, part.tokens[..., 0], axis=1)[..., None]
        m = {}
        # decision point
        lp_act = jnp.take_along_axis(lp_first, part.actions, axis=1)  # [B, A]
        prompt_w = part.action_mask.max(1)  # prompts whose group counts
        if gr.exhaustive_estimator == "expected":
            pg_rows = objective.all_action_loss(
                lp_act, part.action_returns, scale=aa_scale, mask=part.action_mask > 0
            )
            pg = _masked_mean(pg_rows, prompt_w)
            m["clip_frac"], m["ratio_mean"] = jnp.zeros(()), jnp.ones(())
        else:
            old_act = jnp.where(first_iter, jax.lax.stop_gradient(logp), old_logp[..., :1])
            old_act = old_act[:, ::n_cont, 0]
            adv_act = part.advantages[:, ::n_cont, 0]
            pg, m["clip_frac"], m["ratio_mean"] = surrogate_terms(
                lp_act, old_act, adv_act, part.action_mask
            )
        ent_dp = entropy_of_logp(lp_first)
        kl_dp = exact_kl(lp_first, part.ref_logp[:, 0, 0]) if has_reference else jnp.zeros((b,))
        m["entropy_decision"] = _masked_mean(ent_dp, prompt_w)
        m["kl_decision"] = _masked_mean(kl_dp, prompt_w)
        kl, ent = m["kl_decision"], m["entropy_decision"]
        if train_cont and h > 1:
            pg_c, kl_c, ent_c, logp_rest = continuation_terms(
                params, prefix, part.context.shape[1], part, old_logp, first_iter
            )
            logp = jnp.concatenate([logp, logp_rest], axis=-1)
            m["pg_continuation"] = pg_c
            # KL and entropy stay per-token means (the decision point is one of H tokens), so
            # they read the same as a sampled group's; the decision point's pg term keeps its
            # full weight: it is the exhaustive group's main signal.
            pg = pg + pg_c
            kl = (kl + (h - 1) * kl_c) / h
            ent = (ent + (h - 1) * ent_c) / h
        else:
            logp = jnp.pad(logp, ((0, 0), (0, 0), (0, h - 1)))
        return pg, kl, ent, jnp.mean(prompt_w), m, logp

    def part_loss(params, part: Part, old_logp, first_iter, forced: bool):
        if forced:
            return forced_loss(params, part, old_logp, first_iter)
        return sampled_loss(params, part, old_logp, first_iter)

    def loss_fn(params, parts, old_logps, first_iter, forced_flags):
        total = pg_t = kl_t = ent_t = 0.0
        metrics, logps = {}, []
        for part, old, forced in zip(parts, old_logps, forced_flags, strict=True):
            pg, kl, ent, w, m, logp = part_loss(params, part, old, first_iter, forced)
            # a zero coefficient still costs a backward pass through the term: detach it
            kl_term = beta * kl if beta else jax.lax.stop_gradient(kl) * 0.0
            ent_term = (
                gr.entropy_coef * ent if gr.entropy_coef else jax.lax.stop_gradient(ent) * 0.0
            )
            total = total + w * (pg + kl_term - ent_term)
            pg_t, kl_t, ent_t = pg_t + w * pg, kl_t + w * kl, ent_t + w * ent
            for name, val in m.items():
                metrics[name] = metrics.get(name, 0.0) + w * val
            logps.append(logp)
        metrics.update(pg_loss=pg_t, kl=kl_t, entropy=ent_t, loss=total)
        return total, (metrics, tuple(logps))

    return loss_fn
