"""The GRPO loss of one batch of group parts (see groups.py), as a pure function of params.

    L = Σ_parts w_part · [ pg_part + β · KL_part − c_H · H_part ]

w_part is the fraction of the batch's prompts the part covers (1 unless group.mode=adaptive).

Sampled parts: the clipped surrogate on every generated token, aggregated by grpo.loss_agg.
Forced parts (exhaustive / guided / pruned / hierarchical): at the decision point either
  * ``uniform``:  mean over the forced actions of the clipped surrogate with ratio
                  π_θ(a|s)/π_old(a|s) and advantages taken over the action axis, or
  * ``expected``: the exact all-action gradient −∇ Σ_a π_θ(a|s)(R(a) − b), b = Σ_a π(a|s)R(a)
                  (no sampling variance at the decision point given the rollouts' returns;
                  pruned: exact on the candidate set; hierarchical and guided: R(a) replaced
                  by unbiased per-action values, candidates.hierarchical_values, a guided
                  explorer weighted by its inverse inclusion probability),
plus, when group.train_continuations, the clipped surrogate on tokens 1..H-1 with their
per-position group advantages (only the first group.value_horizon tokens, when it is set).
The decision point's KL and entropy are exact over V.

KL: ``grpo.kl_estimator`` = ``exact`` (reverse KL(π‖π_ref) summed over V), ``exact_forward``
(forward KL(π_ref‖π) over V: the reference's distribution as a soft target at every scored
position) or a sampled-token estimator k1/k2/k3 of the reverse KL. The sampled-token
estimators read log π_ref(o_t), which the rollout computed member chunk by member chunk
(groups.make_reference_terms); the exact ones run the reference's forward inside the loss, on
the same member chunks as the policy's training forward, so the reference's [B, K, T, V]
log-probs are never materialised at any V (at the cost of one reference forward per update),
unless a reward term already asked for them (groups.Part.ref_logp), which the loss then reuses.

Memory: a sampled part's tokens and a forced part's continuation tokens run their training
forward ``group.loss_chunk`` members at a time (default: the rollout's ``group.vocab_chunk``),
each chunk's gradient taken right after its forward and summed (chunking.accumulated), so the
[B, K, T, V] logits and the activations of a whole group never exist at once and nothing is
recomputed (see sampled_loss, continuation_terms).

π_old: the μ updates reuse one batch of rollouts. The log-probs of iteration 0's forward are
π_old exactly (same params, same computation as every later iteration), so they are captured
there and carried to iterations 1..μ-1; the ratio is exactly 1 at iteration 0.
"""

import functools

import jax
import jax.numpy as jnp

from grpo_jax import candidates, objective
from grpo_jax.chunking import accumulated
from grpo_jax.groups import Part
from grpo_jax.policy import Policy, Reference, continue_logits
from grpo_jax.rollout import tempered_logp, token_logp
from grpo_jax.specs import GroupSpec, ObjectiveSpec

entropy = objective.entropy_from_logits


# TRL's clip metrics, in clip_terms' order; each a token-mean over the scored tokens
CLIP_METRICS = (
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "ratio_mean",
)


def clip_terms(logp, old, adv, eps, eps_high):
    """TRL's clip metrics per token, in CLIP_METRICS' order: ``low`` where the ratio fell below
    1 - ε with a negative advantage, ``high`` above 1 + ε_high with a positive one (the
    clipped side is active and the token's gradient is cut), their union ``region``, and the
    ratio itself."""
    ratio = jnp.exp(logp - old)
    hi = eps if eps_high is None else eps_high
    low = ((ratio < 1.0 - eps) & (adv < 0)).astype(jnp.float32)
    high = ((ratio > 1.0 + hi) & (adv > 0)).astype(jnp.float32)
    return low, high, jnp.maximum(low, high), ratio


def make_loss(
    spec: ObjectiveSpec,
    group: GroupSpec,
    policy: Policy,
    reference: Reference | None,
    member_sum=None,
):
    """Returns loss_fn(params, parts, old_logps, first_iter, forced_flags, ref_state=None) ->
    (loss, (metrics, logps)); ``ref_state`` is the reference's (read by the exact KL
    estimators, which run the reference inside the loss). ``member_sum(fn, shared,
    per_prompt, *member_args)`` (sharding.make_member_sum) splits the members' training
    forward, and their prompts' prefill, over the mesh."""
    member_sum = member_sum or (lambda fn, *args: fn(*args))  # no mesh, or one device
    gr, sp = spec, group.sampling
    has_reference = reference is not None
    # the decision point's KL is exact over V whatever the estimator; its direction follows it
    exact_kl = objective.EXACT_KL.get(gr.kl_estimator, objective.exact_kl)
    exact_tokens = gr.kl_estimator in objective.EXACT_KL
    eps, eps_high = gr.epsilon, gr.epsilon_high
    beta = gr.beta if has_reference else 0.0
    train_cont = group.train_continuations
    n_cont = group.continuations_per_action
    # the training forward's chunk is its own: its [B, c, T, V] logits outgrow the rollout's
    # [B*c, V] per decode step by a factor T, so a large V wants a smaller chunk here
    loss_chunk = group.loss_chunk or group.vocab_chunk
    # the all-action loss's "batch" scale reads every row: the decision point's devices sum
    # its pieces, and forced_loss divides once they are in
    batch_scale = gr.advantage_scale == "batch" and gr.exhaustive_estimator == "expected"

    def over_members(chunk, diff_of, shared, per_prompt, member_args):
        """(Σ j, prompt terms, aux) of ``chunk(held, diff, *member_slices)`` over every
        member, ``loss_chunk`` at a time (accumulated), through ``member_sum``: ``shared`` =
        (params, ref_state, first_iter) whole on every device, ``per_prompt`` split as the
        prompts are. ``diff_of(shared, per_prompt) -> (diff, held, prompt terms)`` builds, on
        each device, what the chunks differentiate, what they only read, and the terms of its
        prompts alone (a forced part's decision point: sums over its rows, counted once
        however many member devices share the rows). Everything a chunk reads comes in
        through these arguments, none by closure over the step's arrays: on a mesh each
        device sees its own prompts' and members' slices (sharding.make_member_sum)."""

        def body(shared, per_prompt, *slices):
            diff, held, once = diff_of(shared, per_prompt)
            j, aux = accumulated(functools.partial(chunk, held), loss_chunk, diff, *slices)
            return j, once, aux

        return member_sum(body, shared, per_prompt, *member_args)

    def kl_terms(lp, logp, ref_tok, ref_dist):
        """Per-token KL: exact over V against ``ref_dist()`` (the reference's log-probs at
        these very positions, computed only here: a chunk's worth at a time), or a sampled-
        token estimator of log π_ref(o_t) ``ref_tok`` carried from the rollout."""
        if not has_reference:
            return jnp.zeros_like(logp)
        if exact_tokens:
            return exact_kl(lp, jax.lax.stop_gradient(ref_dist()))
        return objective.kl_estimate(logp, ref_tok, gr.kl_estimator)

    def reference_context(ref_state, part: Part):
        """π_ref's prompt state for the exact estimators' forwards (``reference.prefill``),
        once per part however many member chunks then read it; None where nothing will."""
        if not (has_reference and exact_tokens) or part.ref_logp.shape[-1]:
            return None
        return jax.named_scope("reference")(reference.prefill)(ref_state, part.prompts)[1]

    def reference_dist(ref_state, context, prompts, tokens, carried, start):
        """A thunk for the reference's log-probs at completion positions start.. of ``tokens``:
        ``carried`` (the part's own [.., V] slice, when a reward term asked the rollout for
        the distribution) or the reference's forward on these very tokens from ``context``,
        run only if an exact estimator calls it."""
        if carried.shape[-1]:
            return lambda: carried
        return jax.named_scope("reference")(
            lambda: reference.logprobs(ref_state, context, prompts, tokens)[:, :, start:]
        )

    def agg_weights(mask, mode=None):
        """Per-token weights w with aggregate(x, mask, mode) == Σ x·w for every x (mode:
        grpo.loss_agg unless given). Every aggregation is linear in x with mask-only
        coefficients, so the weights are its gradient in x; they let member chunks each add
        their share of the exact aggregate."""
        mode = mode or gr.loss_agg
        zeros = jnp.zeros(mask.shape, jnp.float32)
        return jax.grad(lambda x: objective.aggregate(x, mask, mode))(zeros)

    def wsum(x, w):
        """Σ_t x·w per member; masked positions (w = 0) may hold NaN / inf."""
        return jnp.sum(jnp.where(w != 0, x, 0.0) * w, axis=-1)

    def objective_terms(pg, kl, ent, share=1.0):
        """pg + β·share·KL − c_H·share·H: what the loss differentiates. A zero coefficient
        leaves its term out, not multiplied by 0 (that would still run its backward pass)."""
        out = pg
        if beta:
            out = out + (beta * share) * kl
        if gr.entropy_coef:
            out = out - (gr.entropy_coef * share) * ent
        return out

    def sampled_loss(params, ref_state, part: Part, old_logp, first_iter):
        """Every generated token of a sampled part, ``group.loss_chunk`` members at a time
        (all at once when it and group.vocab_chunk are 0), each chunk's gradient taken right
        after its forward (accumulated): the [B, K, T, V] logits never exist at once, nothing
        is recomputed, and the chunks' weighted sums add up to the unchunked aggregates and
        TRL's clip metrics exactly."""
        w, wm = agg_weights(part.token_mask), agg_weights(part.token_mask, "token-mean")
        ref_tok = part.ref_token_logp
        ref_tok = jnp.zeros(w.shape) if ref_tok is None else ref_tok
        context = reference_context(ref_state, part)

        def chunk(held, diff, tokens, old_c, adv_c, w_c, wm_c, ref_tok_c, ref_lp_c):
            ref_state, first_iter, prompts, context = held
            logits = continue_logits(policy, *diff, prompts, tokens)
            lp = tempered_logp(logits, sp)  # [B, c, T, V]
            logp = token_logp(lp, tokens)
            old = jnp.where(first_iter, jax.lax.stop_gradient(logp), old_c)
            pg = wsum(objective.clipped_surrogate(logp, old, adv_c, eps, eps_high), w_c)
            clip = tuple(wsum(x, wm_c) for x in clip_terms(logp, old, adv_c, eps, eps_high))
            ref_dist = reference_dist(ref_state, context, prompts, tokens, ref_lp_c, 0)
            kl_tok, ent_tok = kl_terms(lp, logp, ref_tok_c, ref_dist), entropy(lp)
            kl, ent = wsum(kl_tok, w_c), wsum(ent_tok, w_c)
            # the kl / entropy metrics are TRL's token means, whatever grpo.loss_agg is
            shown = (wsum(kl_tok, wm_c), wsum(ent_tok, wm_c))
            return objective_terms(pg, kl, ent), ((pg, clip + shown), logp)

        def diff_of(shared, per_prompt):
            # the prompt's prefill runs where its members do: its gradient then joins theirs
            # in the one sum over the devices, not a second one over ``data``
            (params, ref_state, first_iter), (prompts, context) = shared, per_prompt
            first, state = policy.prefill(params, prompts)
            return (params, first, state), (ref_state, first_iter, prompts, context), {}

        args = (part.tokens, old_logp, part.advantages, w, wm, ref_tok, part.ref_logp)
        shared, per_prompt = (params, ref_state, first_iter), (part.prompts, context)
        j, _, (sums, logp) = over_members(chunk, diff_of, shared, per_prompt, args)
        pg, shown = jax.tree.map(jnp.sum, sums)
        m = dict(zip((*CLIP_METRICS, "kl", "entropy"), shown, strict=True))
        return j, pg, jnp.sum(part.member_mask.max(1)), m, logp

    def decision_inputs(part: Part, old_logp):
        """What the decision point reads per prompt (split over ``data`` with the prompts):
        the forced actions, the data its estimator reads, and the weights of its batch
        aggregates (agg_weights), so each device's rows add their exact share of them."""
        prompt_w = part.action_mask.max(1)  # prompts whose group counts
        d = {
            "actions": part.actions,
            "ref_first": part.ref_first,
            "w_rows": agg_weights(prompt_w, "token-mean"),
        }
        if gr.exhaustive_estimator == "expected":
            mask, returns = part.action_mask, part.action_returns
            return {**d, "mask": mask, "returns": returns, "weights": part.action_weights}
        return {
            **d,
            "old": old_logp[:, ::n_cont, 0],  # members repeat each action n_cont times
            "adv": part.advantages[:, ::n_cont, 0],
            "w_act": agg_weights(part.action_mask),
            "wm_act": agg_weights(part.action_mask, "token-mean"),
        }

    def decision_sums(params, prompts, d, first_iter):
        """The decision point on these prompts: (its terms as sums over their rows, weighted
        by the batch's aggregates, lp_first [b, V], the prompts' prefilled state).
        "expected": the exact all-action gradient (a "batch" advantage scale: unscaled, with
        its variance's sums, which forced_loss divides by once every row is in); "uniform":
        the clipped surrogate over the forced actions and TRL's clip metrics. KL (exact over
        V) and entropy are means over the prompts."""
        first_logits, state = policy.prefill(params, prompts)
        lp_first = tempered_logp(first_logits, sp)  # [b, V]
        lp_act = jnp.take_along_axis(lp_first, d["actions"], axis=1)  # [b, A]
        rows = lambda x: jnp.sum(wsum(x, d["w_rows"]))
        if gr.exhaustive_estimator == "expected":
            logp_set, values, mask = lp_act, d["returns"], d["mask"] > 0
            if d["weights"] is not None:  # hierarchical, guided: values over all V
                pi = jax.lax.stop_gradient(jnp.exp(lp_first))
                q = (d["actions"], d["mask"], d["weights"], d["returns"])
                logp_set, values, mask = lp_first, candidates.hierarchical_values(pi, *q), None
            if batch_scale:  # unscaled, with the variance's sums
                pg, var, has = objective.all_action_terms(logp_set, values, mask)
                s = {"pg": rows(pg), "var": jnp.sum(var), "var_rows": jnp.sum(has)}
            else:
                pg = objective.all_action_loss(logp_set, values, gr.advantage_scale, mask=mask)
                s = {"pg": rows(pg)}
        else:
            old = jnp.where(first_iter, jax.lax.stop_gradient(lp_act), d["old"])
            args = (lp_act, old, d["adv"], eps, eps_high)
            s = {"pg": jnp.sum(wsum(objective.clipped_surrogate(*args), d["w_act"]))}
            clip = zip(CLIP_METRICS, clip_terms(*args), strict=True)
            s.update({n: jnp.sum(wsum(x, d["wm_act"])) for n, x in clip})
        if has_reference:
            s["kl"] = rows(exact_kl(lp_first, d["ref_first"]))
        s["entropy"] = rows(entropy(lp_first))
        return s, lp_first, state

    def continuation_terms(params, ref_state, part: Part, d, old_logp, first_iter, t):
        """The decision point and tokens 1..t-1 of a forced part (t: the value horizon), in
        one pass over the members, ``group.loss_chunk`` at a time.

        On each device the prompts' prefill gives the decision point's sums (decision_sums)
        and the state its members' chunks continue from; so on a mesh the prefill's gradient
        joins the members' in one sum over the devices. Each chunk runs the training forward
        of its members and returns their weighted sums of the clipped surrogate, KL and
        entropy (weights from agg_weights, so the chunks add up to the unchunked aggregate
        exactly), its gradient taken right after its forward (accumulated): one chunk's
        activations exist at a time, so the [B, K, T, V] logits never exist at once and
        nothing is recomputed. The exact KL estimators run the reference inside the chunk
        too, so its [B, K, T, V] log-probs never exist either. Returns the continuations'
        objective (the part's loss takes (t-1)/t of their KL and entropy), the decision
        point's sums, the continuations' (pg, kl, ent, clip metrics) sums and logp [B, K, t]."""
        # weights of the full-width aggregate, cut at t: the same loss as unsliced arrays
        w = agg_weights(part.token_mask[..., 1:])[..., : t - 1]
        wm = agg_weights(part.token_mask[..., 1:], "token-mean")[..., : t - 1]
        ref_tok = part.ref_token_logp
        ref_tok = jnp.zeros(w.shape) if ref_tok is None else ref_tok[..., 1:t]
        ref_lp = part.ref_logp[..., 1:t, :]  # [B, K, t-1, V] when carried, else [..., 0]
        context = reference_context(ref_state, part)

        def chunk(held, diff, tokens, old_c, adv_c, w_c, wm_c, ref_tok_c, ref_lp_c):
            ref_state, first_iter, prompts, context, lp_first = held
            lp = tempered_logp(policy.extend(*diff, prompts, tokens), sp)
            logp = token_logp(lp, tokens[..., 1:])
            old = jnp.where(first_iter, jax.lax.stop_gradient(logp), old_c)
            pg = wsum(objective.clipped_surrogate(logp, old, adv_c, eps, eps_high), w_c)
            clip = tuple(wsum(x, wm_c) for x in clip_terms(logp, old, adv_c, eps, eps_high))
            ref_dist = reference_dist(ref_state, context, prompts, tokens, ref_lp_c, 1)
            kl = wsum(kl_terms(lp, logp, ref_tok_c, ref_dist), w_c)
            ent = wsum(entropy(lp), w_c)
            first = jnp.take_along_axis(lp_first, tokens[..., 0], axis=1)[..., None]
            logp = jnp.concatenate([first, logp], axis=-1)
            return objective_terms(pg, kl, ent, (t - 1) / t), ((pg, kl, ent, clip), logp)

        def diff_of(shared, per_prompt):
            (params, ref_state, first_iter), (prompts, context, d) = shared, per_prompt
            s, lp_first, state = decision_sums(params, prompts, d, first_iter)
            lp_first = jax.lax.stop_gradient(lp_first)
            return (params, state), (ref_state, first_iter, prompts, context, lp_first), s

        shared, per_prompt = (params, ref_state, first_iter), (part.prompts, context, d)
        args = (
            part.tokens[..., :t],
            old_logp[..., 1:t],
            part.advantages[..., 1:t],
            w,
            wm,
            ref_tok,
            ref_lp,
        )
        j, s, (sums, logp) = over_members(chunk, diff_of, shared, per_prompt, args)
        return j, s, jax.tree.map(jnp.sum, sums), logp

    def decision_only(params, ref_state, part: Part, d, first_iter):
        """A forced part without continuations: its decision point's sums through
        ``member_sum`` too (no member loop; each member's first log-prob [B, K, 1] as aux),
        so that on a mesh its gradient is summed as the others' are."""

        def body(shared, per_prompt, first_tokens):
            (params, _, first_iter), (prompts, d) = shared, per_prompt
            s, lp_first, _ = decision_sums(params, prompts, d, first_iter)
            logp = jnp.take_along_axis(lp_first, first_tokens, axis=1)[..., None]
            return jnp.zeros(()), s, jax.lax.stop_gradient(logp)

        shared, per_prompt = (params, ref_state, first_iter), (part.prompts, d)
        return member_sum(body, shared, per_prompt, part.tokens[..., 0])

    def scored_clip(part: Part, decision, continuation):
        """TRL's clip metrics of a forced part over every token its clipped surrogate scored:
        the forced actions ("uniform"; "expected" has no ratio at the decision point) and the
        continuation tokens, each set's token mean weighted by its token count."""
        n_cont = jnp.sum(part.token_mask[..., 1:])  # the continuations' token-mean count
        n_dec = 0.0 if gr.exhaustive_estimator == "expected" else jnp.sum(part.action_mask)
        total = jnp.maximum(n_dec + n_cont, 1.0)
        pairs = zip(CLIP_METRICS, continuation, strict=True)
        return {n: (n_dec * decision[n] + n_cont * c) / total for n, c in pairs}

    def forced_loss(params, ref_state, part: Part, old_logp, first_iter):
        full_t = part.tokens.shape[-1]
        t = group.forced_horizon(full_t)  # tokens past it are all masked
        d = decision_inputs(part, old_logp)
        cont = train_cont and t > 1
        if cont:
            j_c, s, (pg_c, kl_c, ent_c, clip_c), logp = continuation_terms(
                params, ref_state, part, d, old_logp, first_iter, t
            )
        else:
            _, s, logp = decision_only(params, ref_state, part, d, first_iter)
        pg, kl, ent = s["pg"], s.get("kl", jnp.zeros(())), s["entropy"]
        if batch_scale:
            pg = objective.scale_by_batch_std(pg, s["var"], s["var_rows"])
        no_clip = (0.0, 0.0, 0.0, 1.0)  # "expected" has no ratio there: nothing is clipped
        m = {n: s.get(n, jnp.asarray(x)) for n, x in zip(CLIP_METRICS, no_clip, strict=True)}
        m["kl_decision"], m["entropy_decision"] = kl, ent
        count = jnp.sum(part.action_mask.max(1))
        logp = jnp.pad(logp, ((0, 0), (0, 0), (0, full_t - logp.shape[-1])))
        if not cont:
            m["kl"], m["entropy"] = kl, ent
            return objective_terms(pg, kl, ent), pg, count, m, logp
        # KL and entropy stay per-token means (the decision point is one of T tokens), so they
        # read the same as a sampled group's; the decision point's pg term keeps its full
        # weight: it is the exhaustive group's main signal.
        m["pg_continuation"] = pg_c
        m.update(scored_clip(part, m, clip_c))
        m["kl"], m["entropy"] = (kl + (t - 1) * kl_c) / t, (ent + (t - 1) * ent_c) / t
        return objective_terms(pg, kl, ent, 1 / t) + j_c, pg + pg_c, count, m, logp

    def loss_fn(params, parts, old_logps, first_iter, forced_flags, ref_state=None):
        total = pg_t = 0.0
        metrics, logps = {}, []
        # every part's prompts are the batch's or a sub-batch of it (adaptive's forced part)
        num_prompts = max(part.tokens.shape[0] for part in parts)
        for part, old, forced in zip(parts, old_logps, forced_flags, strict=True):
            part_loss = forced_loss if forced else sampled_loss
            j, pg, count, m, logp = part_loss(params, ref_state, part, old, first_iter)
            w = count / num_prompts  # the part's share of the batch's prompts
            total, pg_t = total + w * j, pg_t + w * pg
            for name, val in m.items():
                metrics[name] = metrics.get(name, 0.0) + w * val
            logps.append(logp)
        metrics.update(pg_loss=pg_t, loss=total)
        return total, (metrics, tuple(logps))

    return loss_fn
