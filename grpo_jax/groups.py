"""Forming the groups of one GRPO step (``group.mode``), all with static shapes, for any Policy.

A group mode picks each prompt's members and rolls them out. The result is one or two
``Part`` s: a *sampled* part (G members with sampled first tokens, the ordinary GRPO group)
and/or a *forced* part (every member's first token is forced: the whole vocabulary, or a
guide's candidates). Rewards are not computed here: the engine scores the parts afterwards
(``scoring.score``), on device or, for Python rewards, on the host between two jitted
programs. The loss (loss.py) treats the two kinds of part differently at the decision point
and alike after it.

Modes:
  sampled     one sampled part, K = group.size.
  exhaustive  one forced part, actions = all V tokens (x continuations_per_action members).
  guided      one forced part, actions = the guide's top-k plus r random explorers (K = k + r
              static); where the guide is confident (entropy below group.entropy_threshold)
              only its top-``guide_top_k_confident`` count, the other slots are masked out.
  pruned      one forced part, actions = the smallest top-probability set of the guide
              (policy or reference) covering group.coverage of its mass, at most
              group.max_candidates (static K); candidates.py.
  hierarchical  one forced part: a representative of every token class plus every member
              of the group.expand_classes classes with the most policy mass; candidates.py.
  adaptive    a fixed budget of ``ceil(B / 4)`` prompts per batch gets exhaustive groups:
              the most uncertain ones, and only those whose policy entropy exceeds
              group.entropy_threshold (a mask); every other prompt uses a sampled group.
              Compute is static: B*G sampled + budget*V forced rollouts per step.

Completions may end early at EOS: every part carries ``completion_mask [B, K, T]`` (1 up to
and including EOS) and everything downstream (rewards, advantages, loss, KL, entropy,
metrics) reads through it.

``group.value_horizon`` = h > 0 continues a forced part's members for h tokens instead of T:
their return is what those h tokens earn (the decision point's own signal is not diluted by
T - h later tokens), and the rollout, the reference and the training forward run h tokens.
The part's arrays keep the static T (tokens past h are masked), so rewards and metrics read
it like any other part.

``group.decision_points`` = k > 1 (forced modes, with a value horizon h): one sampled
rollout per prompt picks the k positions p in [0, T - h] where the policy's entropy is
highest, and the forced group runs at each of them, all B·k decision points in one batch. A
decision point at p is a prompt of its own: the last P tokens of prompt + rollout[:p], with
the task's completion-aligned fields (``completion_fields``, e.g. the true continuation)
shifted by p (``branch_prompts``). Fixed-length token prompts only.
"""

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from grpo_jax import candidates, chunking, objective
from grpo_jax import rollout as ro
from grpo_jax.policy import Policy, Reference, TokenPrompts, rollout
from grpo_jax.specs import GroupSpec


class Part(NamedTuple):
    """One kind of group for a batch of prompts; everything the μ updates reuse."""

    prompts: Any  # the part's prompts (adaptive's forced part: a sub-batch)
    tokens: jax.Array  # [B, K, T] (tokens[..., 0] = first action)
    completion_mask: jax.Array  # [B, K, T] float: 1 up to and including EOS
    member_mask: jax.Array  # [B, K] float: 1 where the member counts (prompt and slot valid)
    logp_old: jax.Array  # [B, K, T] sampler log-probs (π_old)
    actions: jax.Array  # [B, A] forced parts: the forced first actions ([B, 0] otherwise)
    action_mask: jax.Array  # [B, A] forced parts: which actions count
    # [B, K, T, V] reference log-probs, only for a reward term that reads the reference's
    # distribution (RewardTerm.reads_reference); [B, K, T, 0] otherwise: the loss never needs it
    ref_logp: jax.Array
    # filled by scoring.score() once the rewards are known
    rewards: jax.Array  # [B, K, T] per-token rewards (0 outside the completion)
    returns: jax.Array  # [B, K] per-member return
    advantages: jax.Array  # [B, K, T] per-token advantages for the clipped surrogate
    action_returns: jax.Array  # [B, A] forced parts: return of each forced first action
    valid: jax.Array  # [B, K] float: members some reward term scored (not all None)
    # [B, A] importance weights, read by candidates.hierarchical_values: hierarchical parts'
    # π_old(c)/π_old(a_c) of each class representative (0: expanded members), guided parts'
    # (V - k)/r of each random explorer (0: the guide's top-k); None otherwise
    action_weights: Any = None
    # log π_ref of each token [B, K, T] (sampled-token KL estimators k1/k2/k3), None otherwise
    ref_token_logp: Any = None
    # log π_ref at the decision point [B, V] (a forced part's exact KL there), None otherwise
    ref_first: Any = None

    @property
    def token_mask(self):
        """[B, K, T]: tokens that exist (member counts and the completion has not ended)."""
        return self.completion_mask * self.member_mask[..., None]


def first_action_layout(actions, n_cont):
    """[B, A] actions -> [B, A * n_cont] members (each action repeated n_cont times)."""
    return jnp.repeat(actions, n_cont, axis=1)


def guided_candidates(key, guide_logp, top_k, top_k_confident, n_random, threshold):
    """Guide's top-k plus n_random distinct explorers drawn uniformly from the other V - k
    tokens. guide_logp [B, V].

    Returns (actions, mask float, weights) [B, top_k + n_random]: an explorer's weight is
    its inverse inclusion probability (V - k) / n_random, a top-k slot's 0 (weights None
    when n_random = 0: the top-k alone, exact on the candidate set). The all-action
    loss reads them as candidates.hierarchical_values does a representative's: q(a) = R(a)
    on the top-k, b + [a explored](R(a) - b)(V - k)/n_random elsewhere (b: the π-weighted
    mean return of the top-k), so E[q(a)] = R(a) and the expected gradient is the exact
    all-action one. Confident rows (entropy < threshold: top_k_confident slots, no
    explorers) leave the other tokens at q = b, a deliberate bias towards the guide."""
    b, v = guide_logp.shape
    _, top = jax.lax.top_k(guide_logp, top_k)
    taken = jnp.zeros((b, v), bool).at[jnp.arange(b)[:, None], top].set(True)
    noise = jax.random.uniform(key, (b, v))
    _, rand = jax.lax.top_k(jnp.where(taken, -1.0, noise), n_random)
    actions = jnp.concatenate([top, rand], axis=1).astype(jnp.int32)
    confident = objective.entropy_from_logits(guide_logp) < threshold
    slot = jnp.arange(top_k + n_random)
    mask = jnp.where(confident[:, None], slot < top_k_confident, True)
    if not n_random:  # the top-k alone: exact on the candidates, as a pruned group's
        return actions, mask.astype(jnp.float32), None
    weights = jnp.where(slot < top_k, 0.0, (v - top_k) / n_random)
    return actions, mask.astype(jnp.float32), jnp.broadcast_to(weights, actions.shape)


def adaptive_budget(batch_size: int) -> int:
    return max(1, math.ceil(batch_size / 4))


def adaptive_rows(batch_size: int, batch_multiple: int = 1) -> int:
    """The forced sub-batch's rows: the budget padded with unchosen prompts to a multiple of
    ``batch_multiple`` (the mesh's data axis), at most the batch (see ``make_collect``)."""
    budget = adaptive_budget(batch_size)
    return min(-(-budget // batch_multiple) * batch_multiple, batch_size)


def _needed(classes):
    if classes is None:  # a task without token classes (the single-step ones)
        raise ValueError("group.mode=hierarchical needs the task's token classes")
    return classes


def members_per_prompt(spec: GroupSpec, vocab_size: int, batch_size: int, classes=None) -> float:
    """Rollouts per prompt (for throughput figures); ``classes``: hierarchical's token classes."""
    n = spec.continuations_per_action
    if spec.mode == "sampled":
        return spec.size
    if spec.mode == "exhaustive":
        return vocab_size * n
    if spec.mode == "guided":
        return (spec.guide_top_k + spec.guide_random) * n
    if spec.mode == "pruned":
        return spec.max_candidates * n
    if spec.mode == "hierarchical":
        return candidates.group_slots(_needed(classes), spec.expand_classes) * n
    return spec.size + adaptive_budget(batch_size) * vocab_size * n / batch_size


def generated_per_prompt(spec: GroupSpec, vocab_size, batch_size, horizon, classes=None):
    """Generated tokens per prompt and step at the full horizon (EOS-terminated completions
    generate fewer, see the ``generated_tokens`` metric). Forced members run the value
    horizon; decision points add k forced groups and their one branch rollout (the metric
    counts the groups' tokens only)."""
    if spec.mode == "sampled":
        return spec.size * horizon
    forced_h = spec.forced_horizon(horizon)
    members = members_per_prompt(spec, vocab_size, batch_size, classes)
    if spec.mode == "adaptive":
        forced = members - spec.size
        return spec.size * horizon + forced * forced_h
    branch = horizon if spec.decision_points > 1 else 0
    return members * forced_h * spec.decision_points + branch


def pad_time(x, t: int, value=0):
    """Pad axis 2 (time) of a [B, K, h, ...] array to t."""
    pad = [(0, 0)] * x.ndim
    pad[2] = (0, t - x.shape[2])
    return jnp.pad(x, pad, constant_values=value)


def branch_prompts(prompts: TokenPrompts, tokens, positions, completion_fields=()):
    """Decision points inside completions as prompts of their own.

    prompts: fixed-length TokenPrompts [B, P]; tokens [B, T]: one completion per prompt;
    positions [B, k] in [0, T]. Returns TokenPrompts [B·k, P]: row (b, j) holds the last P
    tokens of prompts[b] + tokens[b, :positions[b, j]], and every field named in
    ``completion_fields`` ([B, T, ...], aligned with the completion) shifted left by the
    position (its tail repeats the last entry: only positions the value horizon reaches are
    read)."""
    b, p = prompts.tokens.shape
    k = positions.shape[1]
    seq = jnp.concatenate([prompts.tokens, tokens], axis=1)  # [B, P + T]
    window = jnp.take_along_axis(seq[:, None], positions[..., None] + jnp.arange(p), 2)
    flat = positions.reshape(-1)

    def field(name, x):
        x = jnp.repeat(x, k, axis=0)
        if name not in completion_fields:
            return x
        idx = jnp.minimum(flat[:, None] + jnp.arange(x.shape[1]), x.shape[1] - 1)
        return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), 1)

    fields = {name: field(name, x) for name, x in prompts.fields.items()}
    return TokenPrompts(window.reshape(b * k, p).astype(jnp.int32), None, fields)


def decision_positions(entropy, k: int, horizon: int):
    """The k positions p <= T - horizon of highest entropy [B, T] (distinct, sorted)."""
    t = entropy.shape[1]
    allowed = jnp.arange(t) <= t - horizon
    _, pos = jax.lax.top_k(jnp.where(allowed, entropy, -jnp.inf), k)
    return jnp.sort(pos, axis=1)


def make_reference_terms(
    reference: Reference | None, needs: frozenset, chunk: int, member_map=None
):
    """Returns ref_terms(ref_state, context, prompts, tokens [B, K, h]) -> dict of what the
    step reads of π_ref (``needs`` ⊆ {"token", "dist"}): "token" log π_ref of each token
    [B, K, h], "dist" the whole [B, K, h, V] (only a reward term that reads it asks for it);
    ``context`` is ``reference.prefill``'s, computed once for all the chunks.

    The reference runs ``chunk`` members at a time and each chunk keeps only what is needed,
    so its [B, K, h, V] log-probs never exist at once unless "dist" is asked for: an
    exhaustive group's reference costs a chunk's memory at any V. ``member_map`` (as the
    rollout's) splits the members over the mesh's member axis first: left to GSPMD, every
    member device ran the reference forward of all K members (on 8 fake CPU devices, 0.97 of
    one device's FLOPs; a v5e-16 at data=4 x member=4 gathered the members' activations)."""
    if reference is None or not needs:
        return lambda ref_state, context, prompts, tokens: {}

    @jax.named_scope("reference")
    def one_chunk(ref_state, context, prompts, tokens):
        lp = jax.lax.stop_gradient(reference.logprobs(ref_state, context, prompts, tokens))
        out = {"dist": lp} if "dist" in needs else {}
        if "token" in needs:
            out["token"] = ro.token_logp(lp, tokens)
        return out

    def local(ref_state, context, prompts, tokens):
        return chunking.chunked(lambda t: one_chunk(ref_state, context, prompts, t), chunk, tokens)

    def ref_terms(ref_state, context, prompts, tokens):
        if member_map is None:
            return local(ref_state, context, prompts, tokens)
        return member_map(local, tokens, shared=(ref_state, context, prompts))

    return ref_terms


def make_collect(
    spec: GroupSpec,
    policy: Policy,
    reference: Reference | None,
    member_map=None,
    classes=None,
    completion_fields=(),
    reference_needs=frozenset(),
    batch_multiple=1,
):
    """Returns collect(params, ref_state, prompts, key) -> (parts, info) (pure).

    ``member_map(fn, *member_args)`` optionally wraps the per-member rollout and reference
    (sharding.py shard_maps them over the mesh's member axis); ``classes`` [V] are the token
    classes of group.mode=hierarchical (candidates.token_classes);
    ``completion_fields``: the prompt fields that branch_prompts shifts;
    ``reference_needs``: what the parts carry of π_ref per token (make_reference_terms); a
    forced part also carries the reference at its decision point, [B, V];
    ``batch_multiple``: a sub-batch's prompt count is padded to a multiple of it (the mesh's
    data axis, sharding.StepHooks)."""
    g, sp = spec, spec.sampling
    t, v = policy.completion_length, policy.vocab_size
    ref_terms = make_reference_terms(
        reference, reference_needs, g.loss_chunk or g.vocab_chunk, member_map
    )
    h = g.forced_horizon(t)
    n_cont = g.continuations_per_action
    empty_actions = lambda b: (jnp.zeros((b, 0), jnp.int32), jnp.zeros((b, 0)))
    if g.mode == "hierarchical":
        members, member_mask = (jnp.asarray(x) for x in candidates.class_members(_needed(classes)))
        classes = jnp.asarray(classes)

    def roll(params, state, prompts, first_logits, first, u, chunk):
        """Members' completions from their first tokens (None: sample them from π_old)."""
        out = rollout(policy, params, prompts, first_logits, state, first, u, sp, chunk, member_map)
        return out[0], out[1], out[3]

    def part(ref_state, prompts, tokens, logp, mask, member_mask, actions, action_mask, w=None):
        # π_ref's prompt runs once: the decision point's exact KL (forced parts only: a
        # sampled part has no such point) and the context of every member chunk
        forced = actions.shape[1] > 0
        first, context = (None, None)
        if reference is not None and (forced or reference_needs):
            first, context = jax.named_scope("reference")(reference.prefill)(ref_state, prompts)
        first = first if forced else None
        ref = ref_terms(ref_state, context, prompts, tokens)
        ref = {k: pad_time(x, t) for k, x in ref.items()}
        ref_dist = ref.get("dist", jnp.zeros(tokens.shape[:2] + (t, 0), jnp.float32))
        tokens, logp, mask = pad_time(tokens, t), pad_time(logp, t), pad_time(mask, t)
        zeros = jnp.zeros(tokens.shape, jnp.float32)
        return Part(
            prompts, tokens, mask, member_mask, logp, actions, action_mask, ref_dist,
            zeros, zeros[..., 0], zeros, jnp.zeros(actions.shape, jnp.float32), member_mask, w,
            ref.get("token"), None if first is None else jax.lax.stop_gradient(first),
        )  # fmt: skip

    def sampled_part(params, ref_state, prompts, first_logits, state, key, prompt_mask):
        b = first_logits.shape[0]
        u = jax.random.uniform(key, (b, g.size, t))
        tokens, logp, mask = roll(params, state, prompts, first_logits, None, u, 0)
        mm = jnp.broadcast_to(prompt_mask[:, None], (b, g.size)).astype(jnp.float32)
        return part(ref_state, prompts, tokens, logp, mask, mm, *empty_actions(b))

    def forced_part(
        params, ref_state, prompts, first_logits, state, actions, action_mask, key, w=None
    ):
        b, a = actions.shape
        first = first_action_layout(actions, n_cont)
        u = jax.random.uniform(key, (b, a * n_cont, t))[..., :h]
        tokens, logp, mask = roll(params, state, prompts, first_logits, first, u, g.vocab_chunk)
        mm = first_action_layout(action_mask, n_cont)
        return part(ref_state, prompts, tokens, logp, mask, mm, actions, action_mask, w)

    def guide_logp(ref_state, prompts, first_logits):
        if g.guide == "reference":
            return reference.prefill(ref_state, prompts)[0]
        return ro.tempered_logp(first_logits, sp)

    def forced_mode(common, key, k_guide):
        """exhaustive / guided / pruned / hierarchical: one forced part and its info."""
        params, ref_state, prompts, first_logits, _ = common
        b = first_logits.shape[0]
        if g.mode == "exhaustive":
            actions = jnp.broadcast_to(jnp.arange(v, dtype=jnp.int32), (b, v))
            return forced_part(*common, actions, jnp.ones((b, v)), key), {}
        policy_lp = ro.tempered_logp(first_logits, sp)
        if g.mode == "hierarchical":
            actions, amask, w = candidates.hierarchical_candidates(
                k_guide, policy_lp, classes, members, member_mask, g.expand_classes
            )
            covered = jnp.zeros((b, v)).at[jnp.arange(b)[:, None], actions].max(amask * (w == 0))
            info = {"group/expanded_mass": jnp.sum(jnp.exp(policy_lp) * covered, -1).mean()}
            return forced_part(*common, actions, amask, key, w), info
        guide = guide_logp(ref_state, prompts, first_logits)
        if g.mode == "pruned":
            actions, amask = candidates.pruned_candidates(guide, g.coverage, g.max_candidates)
            covered = jnp.sum(jnp.exp(jnp.take_along_axis(policy_lp, actions, 1)) * amask, -1)
            info = {
                "group/uncovered_mass": jnp.mean(jnp.clip(1.0 - covered, 0.0, 1.0)),
                "group/candidates": amask.sum(1).mean(),
            }
            return forced_part(*common, actions, amask, key), info
        sizes = (g.guide_top_k, g.guide_top_k_confident, g.guide_random, g.entropy_threshold)
        actions, amask, w = guided_candidates(k_guide, guide, *sizes)
        info = {"guided_candidates": amask.sum(1).mean()}
        return forced_part(*common, actions, amask, key, w), info

    def branch(params, prompts, key):
        """group.decision_points > 1: the B·k decision points of one sampled rollout each."""
        first_logits, state = policy.prefill(params, prompts)
        u = jax.random.uniform(key, (first_logits.shape[0], 1, t))
        tokens, _, entropy, _ = rollout(policy, params, prompts, first_logits, state, None, u, sp)
        pos = decision_positions(entropy[:, 0], g.decision_points, h)
        info = {"group/decision_position": jnp.mean(pos.astype(jnp.float32))}
        return branch_prompts(prompts, tokens[:, 0], pos, completion_fields), info

    def collect(params, ref_state, prompts, key):
        k_sample, k_forced, k_guide = jax.random.split(key, 3)
        info = {}
        if g.decision_points > 1:
            prompts, info = branch(params, prompts, k_sample)
        first_logits, state = policy.prefill(params, prompts)
        b = first_logits.shape[0]
        common = (params, ref_state, prompts, first_logits, state)
        if g.mode == "sampled":
            return (sampled_part(*common, k_sample, jnp.ones((b,))),), {}
        if g.mode != "adaptive":
            forced, mode_info = forced_mode(common, k_forced, k_guide)
            return (forced,), {**info, **mode_info}
        # adaptive: the budget's most uncertain prompts, gated by the entropy threshold
        ent = objective.entropy_from_logits(ro.tempered_logp(first_logits, sp))
        # The sub-batch is padded with the next prompts, never chosen (zero weight, as a prompt
        # under the threshold), to a multiple of the data axis: split unevenly over it, GSPMD's
        # padding rows turned the forced part's gradient into NaN (B = 4 on data=2, member=2)
        # and the step kept its old state. No device runs more rows than GSPMD's padding gave
        # it. The trainer has checked that the data axis divides b (sharding.check_batch), so
        # rows <= b; adaptive_rows' cap only keeps top_k defined for a caller that has not.
        budget, rows = adaptive_budget(b), adaptive_rows(b, batch_multiple)
        top_ent, idx = jax.lax.top_k(ent, rows)
        chosen = (top_ent > g.entropy_threshold) & (jnp.arange(rows) < budget)
        exhaustive_rows = jnp.zeros((b,), jnp.float32).at[idx].set(chosen.astype(jnp.float32))
        sub = lambda tree: jax.tree.map(lambda x: x[idx], tree)
        amask = jnp.broadcast_to(chosen[:, None], (rows, v)).astype(jnp.float32)
        all_actions = jnp.broadcast_to(jnp.arange(v, dtype=jnp.int32), (rows, v))
        forced = forced_part(
            params, ref_state, sub(prompts), first_logits[idx], sub(state), all_actions, amask,
            k_forced,
        )  # fmt: skip
        sampled = sampled_part(*common, k_sample, 1.0 - exhaustive_rows)
        return (sampled, forced), {"adaptive_exhaustive_frac": exhaustive_rows.mean()}

    return collect
