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
each chunk's gradient taken right after its forward and summed (``accumulated``), so the
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
from grpo_jax.groups import Part
from grpo_jax.policy import Policy, Reference, continue_logits
from grpo_jax.rollout import member_chunks, tempered_logp, token_logp
from grpo_jax.specs import GroupSpec, ObjectiveSpec

entropy = objective.entropy_from_logits


def _masked_mean(x, w):
    return objective.aggregate(x, w, "token-mean")


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


def accumulated(fn, chunk: int, diff, *member_args):
    """(Σ over members of j, aux) for ``fn(diff, *member_slices) -> (j [B, c], aux)`` run
    ``chunk`` members at a time (member axis 1 of ``member_args``), with the gradient of Σ j
    in ``diff`` and nothing recomputed.

    Each chunk's gradient is taken in the forward pass, right after its own forward
    (``jax.vjp``), and added to a float32 running sum; the backward pass only scales that sum
    by the cotangent of Σ j, which is exact because Σ j is linear in the chunks' j (the
    loss's coefficients live in ``fn``). So one chunk's activations exist at a time, as
    with ``jax.checkpoint``, but the forward runs once per chunk, not twice. ``aux`` (the
    metrics, the log-probs) carries no gradient. ``fn`` must read the differentiated values
    through ``diff`` only. Unchunked (chunk 0 or >= K), ``fn`` runs once under plain
    autodiff."""
    k = member_args[0].shape[1]
    if chunk <= 0 or chunk >= k:
        j, aux = fn(diff, *member_args)
        return jnp.sum(j), jax.lax.stop_gradient(aux)
    leaves, tree = jax.tree.flatten(diff)
    inexact = [jnp.issubdtype(x.dtype, jnp.inexact) for x in leaves]
    fixed = [None if d else x for x, d in zip(leaves, inexact, strict=True)]
    live = [x for x, d in zip(leaves, inexact, strict=True) if d]  # what gets a gradient
    dtypes = [x.dtype for x in live]
    split, merge = member_chunks(k, chunk)
    slices = tuple(split(a) for a in member_args)

    def rebuild(live):  # the differentiated leaves back among the fixed (integer) ones
        it = iter(live)
        return tree.unflatten([next(it) if x is None else x for x in fixed])

    def run(live, with_grad: bool):
        def body(acc, xs):
            f = lambda live: fn(rebuild(live), *xs)
            if not with_grad:
                j, aux = f(live)
                return acc, (jnp.sum(j), aux)
            j, vjp, aux = jax.vjp(f, live, has_aux=True)
            (g,) = vjp(jnp.ones_like(j))
            return [a + x.astype(a.dtype) for a, x in zip(acc, g, strict=True)], (jnp.sum(j), aux)

        acc0 = [jnp.zeros(x.shape, jnp.promote_types(x.dtype, jnp.float32)) for x in live]
        grads, (js, aux) = jax.lax.scan(body, acc0, slices)
        return (jnp.sum(js), jax.tree.map(merge, aux)), grads

    @jax.custom_vjp
    def total(live):
        return run(live, False)[0]

    def bwd(grads, ct):
        return ([(ct[0] * g).astype(dt) for g, dt in zip(grads, dtypes, strict=True)],)

    total.defvjp(lambda live: run(live, True), bwd)
    j, aux = total(live)
    return j, jax.lax.stop_gradient(aux)


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
    per_prompt, *member_args, whole_loss=False)`` (sharding.make_member_sum) splits the
    members' training forward over the mesh."""
    member_sum = member_sum or (lambda fn, *args, whole_loss=False: fn(*args))
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

    def over_members(chunk, diff_of, shared, per_prompt, member_args, whole_loss=False):
        """(Σ j, aux) of ``chunk(held, diff, *member_slices)`` over every member,
        ``loss_chunk`` at a time (accumulated), through ``member_sum``: ``shared`` = (params,
        ref_state, first_iter) whole on every device, ``per_prompt`` split as the prompts
        are. ``diff_of(shared, per_prompt) -> (diff, held)`` builds, on each device, what
        the chunks differentiate and what they only read. Everything a chunk reads comes in
        through these arguments, none by closure over the step's arrays: on a mesh each
        device sees its own members' (and with ``whole_loss``, its own prompts') slices
        (sharding.make_member_sum)."""

        def body(shared, per_prompt, *slices):
            diff, held = diff_of(shared, per_prompt)
            return accumulated(functools.partial(chunk, held), loss_chunk, diff, *slices)

        return member_sum(body, shared, per_prompt, *member_args, whole_loss=whole_loss)

    def agg(x, mask):
        """objective.aggregate over the rows (members) and tokens that exist."""
        return objective.aggregate(x, mask, gr.loss_agg)

    def surrogate_terms(logp, old, adv, mask):
        """Aggregated clipped surrogate plus TRL's clip metrics and the mean ratio."""
        pg = objective.clipped_surrogate(logp, old, adv, eps, eps_high)
        clip = zip(CLIP_METRICS, clip_terms(logp, old, adv, eps, eps_high), strict=True)
        return agg(pg, mask), {n: _masked_mean(x, mask) for n, x in clip}

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
            return (params, first, state), (ref_state, first_iter, prompts, context)

        args = (part.tokens, old_logp, part.advantages, w, wm, ref_tok, part.ref_logp)
        shared, per_prompt = (params, ref_state, first_iter), (part.prompts, context)
        j, (sums, logp) = over_members(chunk, diff_of, shared, per_prompt, args, True)
        pg, shown = jax.tree.map(jnp.sum, sums)
        m = dict(zip((*CLIP_METRICS, "kl", "entropy"), shown, strict=True))
        return j, pg, jnp.sum(part.member_mask.max(1)), m, logp

    def continuation_terms(params, ref_state, state, part: Part, old_logp, first_iter, t):
        """Tokens 1..t-1 of a forced part (t: the value horizon), ``group.loss_chunk``
        members at a time.

        Each chunk runs the training forward of its members against the shared prompt state
        and returns its members' weighted sums of the clipped surrogate, KL and entropy
        (weights from agg_weights, so the chunks add up to the unchunked aggregate exactly),
        its gradient taken right after its forward (accumulated): one chunk's activations
        exist at a time, so the [B, K, T, V] logits never exist at once and peak memory is
        bounded by the chunk, as in the rollout, and nothing is recomputed. The exact KL
        estimators run the reference inside the chunk too, so its [B, K, T, V] log-probs
        never exist either. Returns the differentiated objective (the part's loss takes
        (t-1)/t of the continuations' KL and entropy), (pg, kl, ent) sums and logp
        [B, K, t-1]."""
        # weights of the full-width aggregate, cut at t: the same loss as unsliced arrays
        w = agg_weights(part.token_mask[..., 1:])[..., : t - 1]
        ref_tok = part.ref_token_logp
        ref_tok = jnp.zeros(w.shape) if ref_tok is None else ref_tok[..., 1:t]
        ref_lp = part.ref_logp[..., 1:t, :]  # [B, K, t-1, V] when carried, else [..., 0]
        context = reference_context(ref_state, part)

        def chunk(held, diff, tokens, old_c, adv_c, w_c, ref_tok_c, ref_lp_c):
            ref_state, first_iter, prompts, context = held
            lp = tempered_logp(policy.extend(*diff, prompts, tokens), sp)
            tok = tokens[..., 1:]
            logp = token_logp(lp, tok)
            old = jnp.where(first_iter, jax.lax.stop_gradient(logp), old_c)
            pg = wsum(objective.clipped_surrogate(logp, old, adv_c, eps, eps_high), w_c)
            ref_dist = reference_dist(ref_state, context, prompts, tokens, ref_lp_c, 1)
            kl = wsum(kl_terms(lp, logp, ref_tok_c, ref_dist), w_c)
            ent = wsum(entropy(lp), w_c)
            return objective_terms(pg, kl, ent, (t - 1) / t), ((pg, kl, ent), logp)

        def diff_of(shared, per_prompt):
            (params, ref_state, first_iter), (state, prompts, context) = shared, per_prompt
            return (params, state), (ref_state, first_iter, prompts, context)

        shared, per_prompt = (params, ref_state, first_iter), (state, part.prompts, context)
        args = (
            part.tokens[..., :t],
            old_logp[..., 1:t],
            part.advantages[..., 1:t],
            w,
            ref_tok,
            ref_lp,
        )
        j, (sums, logp) = over_members(chunk, diff_of, shared, per_prompt, args)
        return j, jax.tree.map(jnp.sum, sums), logp

    def decision_point(lp_first, logp0, part: Part, old_logp, first_iter):
        """The forced first actions: the exact all-action gradient ("expected") or the
        clipped surrogate over the forced actions ("uniform")."""
        lp_act = jnp.take_along_axis(lp_first, part.actions, axis=1)  # [B, A]
        prompt_w = part.action_mask.max(1)  # prompts whose group counts
        if gr.exhaustive_estimator == "expected":
            if part.action_weights is not None:  # hierarchical, guided: values over all V
                pi = jax.lax.stop_gradient(jnp.exp(lp_first))
                q = candidates.hierarchical_values(
                    pi, part.actions, part.action_mask, part.action_weights, part.action_returns
                )
                pg_rows = objective.all_action_loss(lp_first, q, scale=gr.advantage_scale)
            else:
                pg_rows = objective.all_action_loss(
                    lp_act, part.action_returns, scale=gr.advantage_scale, mask=part.action_mask > 0
                )
            no_clip = (0.0, 0.0, 0.0, 1.0)  # no ratio at the decision point: nothing clipped
            m = {n: jnp.asarray(x) for n, x in zip(CLIP_METRICS, no_clip, strict=True)}
            return _masked_mean(pg_rows, prompt_w), m
        old_act = jnp.where(first_iter, jax.lax.stop_gradient(logp0), old_logp[..., :1])
        old_act = old_act[:, ::n_cont, 0]
        adv_act = part.advantages[:, ::n_cont, 0]
        return surrogate_terms(lp_act, old_act, adv_act, part.action_mask)

    def forced_loss(params, ref_state, part: Part, old_logp, first_iter):
        b, k, full_t = part.tokens.shape
        t = group.forced_horizon(full_t)  # tokens past it are all masked
        first_logits, state = policy.prefill(params, part.prompts)
        lp_first = tempered_logp(first_logits, sp)  # [B, V]
        logp = jnp.take_along_axis(lp_first, part.tokens[..., 0], axis=1)[..., None]
        pg, m = decision_point(lp_first, logp, part, old_logp, first_iter)
        prompt_w = part.action_mask.max(1)
        kl_dp = exact_kl(lp_first, part.ref_first) if has_reference else jnp.zeros((b,))
        kl, ent = _masked_mean(kl_dp, prompt_w), _masked_mean(entropy(lp_first), prompt_w)
        m["kl_decision"], m["entropy_decision"] = kl, ent
        pad = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, full_t - x.shape[-1])))
        if not (train_cont and t > 1):
            m["kl"], m["entropy"] = kl, ent
            return objective_terms(pg, kl, ent), pg, jnp.sum(prompt_w), m, pad(logp)
        # KL and entropy stay per-token means (the decision point is one of T tokens), so they
        # read the same as a sampled group's; the decision point's pg term keeps its full
        # weight: it is the exhaustive group's main signal.
        j_c, (pg_c, kl_c, ent_c), logp_rest = continuation_terms(
            params, ref_state, state, part, old_logp, first_iter, t
        )
        j = objective_terms(pg, kl, ent, 1 / t) + j_c
        m["pg_continuation"] = pg_c
        m["kl"], m["entropy"] = (kl + (t - 1) * kl_c) / t, (ent + (t - 1) * ent_c) / t
        logp = pad(jnp.concatenate([logp, logp_rest], axis=-1))
        return j, pg + pg_c, jnp.sum(prompt_w), m, logp

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
