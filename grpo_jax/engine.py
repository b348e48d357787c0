"""The GRPO step, written once for every task: prompts -> groups -> rewards -> μ optax updates.

purejaxrl-style: ``make_grpo_step(...)`` closes over the static specs and returns pure
functions; the trainer jits them once with the state donated.

  rollout(state, inputs) -> Batch           sample prompts, collect the groups (groups.py),
                                            and evaluate the jittable reward terms
  update(state, inputs, batch, host) -> (state, metrics)
                                            combine the rewards, score the groups
                                            (advantages, scoring.py), μ optimizer updates in one
                                            lax.scan, the non-finite guard, metrics

With only jittable rewards the two run as one program (``Step.fused``) and nothing leaves the
device. A Python reward on decoded strings (``RewardTerm(host=True)``) splits the step there:
the trainer runs the jitted rollout, calls ``Step.host`` on the host, then the jitted update.

The step's key is ``fold_in(state.rng, state.step)``, so a resumed run draws exactly what an
uninterrupted one would, and vmapping the step over states with different ``rng`` trains
several seeds in one program. π_old is the policy that sampled the batch for all μ updates:
iteration 0's training forward (the same params) provides its log-probs, which are kept, not
replaced, for iterations 1..μ-1.
"""

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from grpo_jax import groups, metrics, objective, rewards, scoring, sharding
from grpo_jax.loss import make_loss
from grpo_jax.specs import EngineSpec
from grpo_jax.train_state import StepInputs, TrainState, keep_if_finite

# The per-step metrics every GRPO step returns (the trainer adds tokens_per_s and step_time_s;
# reward terms add rewards/<term>/mean and /std). Tests and dashboards read these names.
STEP_METRICS = (
    "loss",
    "pg_loss",
    "kl",
    "entropy",
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "reward_policy_mean",
    "advantage_var",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "ratio_mean",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "num_tokens",
    "generated_tokens",
    "grad_norm",
    "learning_rate",
)


class Batch(NamedTuple):
    """What the rollout hands to the update (and, for Python rewards, to the host)."""

    parts: tuple  # groups.Part per part
    device_rewards: tuple  # per part: [n_device_terms, B, K, T] per-token term values
    info: dict  # group-mode scalars (guided_candidates, adaptive_exhaustive_frac)


class Step(NamedTuple):
    """The step's pure functions; ``host`` is None when every reward is jittable.

    Exposed for tests and diagnostics (experiments/grad_variance.py), the stages of
    ``rollout`` and ``update``: ``prompts(key, data)`` the prompt batch a key draws;
    ``groups(state, inputs, prompts, key) -> Batch`` the groups of given prompts;
    ``score(batch, host) -> (parts, term values)`` rewards, returns and advantages;
    ``loss(params, parts, old_logps, first_iter, forced, ref_state)`` the loss the updates
    minimise, with ``forced`` the parts' kinds (GroupSpec.forced)."""

    rollout: Callable
    update: Callable
    host: Callable | None
    score: Callable
    prompts: Callable
    groups: Callable
    loss: Callable
    forced: tuple

    def fused(self, state, inputs):
        return self.update(state, inputs, self.rollout(state, inputs), None)


def make_grpo_step(
    spec: EngineSpec,
    policy,
    reference,
    sample_prompts: Callable,
    reward_terms: tuple,
    tx,
    schedule,
    eos_id: int | None = None,
    decode: Callable | None = None,
    hooks=None,
    reward_discount: float = 1.0,
    per_token_advantages: bool = False,
    token_classes=None,
    completion_fields: tuple = (),
) -> Step:
    """The one GRPO step.

    sample_prompts(key, data) -> prompts (the task's pytree, leading axis B);
    reward_terms: rewards.RewardTerm s (jittable on token arrays, or Python on strings);
    decode(prompts, tokens, mask) -> (prompt texts, completion texts, fields): the host
    side of Python rewards (numpy in, lists out), needed only when one is configured;
    hooks: a mesh's sharding.StepHooks (sharding.step_hooks(mesh); None on one device);
    token_classes: [V] class ids for group.mode=hierarchical (candidates.task_classes);
    completion_fields: prompt fields aligned with the completion (shifted at later decision
    points, group.decision_points > 1; groups.branch_prompts)."""
    g, obj = spec.group, spec.objective
    forced_flags = g.forced
    mu = obj.num_iterations
    device_terms = tuple(t for t in reward_terms if not t.host)
    # what the parts carry of π_ref: each token's log-prob for a sampled-token KL estimator
    # (the exact ones run the reference inside the loss), the whole distribution only for a
    # reward term that reads it
    needs = set() if obj.kl_estimator in objective.EXACT_KL else {"token"}
    needs |= {"dist"} if any(t.reads_reference for t in device_terms) else set()
    hooks = hooks or sharding.step_hooks(None)
    member_map, shard_batch, member_sum, batch_multiple, whole = hooks
    collect = groups.make_collect(
        g, policy, reference, member_map, token_classes, completion_fields, frozenset(needs),
        batch_multiple,
    )  # fmt: skip
    loss_fn = make_loss(obj, g, policy, reference, member_sum)
    host_terms = tuple(t for t in reward_terms if t.host)
    if host_terms and decode is None:
        raise ValueError("a Python reward term needs the task's decode function")

    def prompts_of(key, data):
        return shard_batch(sample_prompts(key, data))

    def groups_of(state: TrainState, inputs: StepInputs, prompts, key) -> Batch:
        # the rollout's params whole on every device, once (sharding.step_hooks)
        parts, info = collect(whole(state.params), inputs.ref_state, prompts, key)
        parts = jax.lax.stop_gradient(parts)
        dev = tuple(rewards.device_values(device_terms, inputs.reward_state, p) for p in parts)
        return Batch(parts, dev, info)

    @jax.named_scope("rollout")  # named scopes label the step's stages in a profile
    def rollout(state: TrainState, inputs: StepInputs) -> Batch:
        key = jax.random.fold_in(state.rng, state.step)
        k_data, k_roll = jax.random.split(key)
        return groups_of(state, inputs, prompts_of(k_data, inputs.data), k_roll)

    def host(batch: Batch, fetch=jax.device_get):
        """Python rewards of every part, on the host: per part (values, valid) arrays
        [n_host_terms, B, K]. ``fetch`` brings the arrays decoding reads to this host whole
        (sharding.fetch_global when they span other processes' devices)."""
        out = []
        for part in batch.parts:  # only what decoding reads crosses to the host
            prompts, tokens, mask = fetch((part.prompts, part.tokens, part.completion_mask))
            texts = decode(prompts, np.asarray(tokens), np.asarray(mask))
            out.append(rewards.host_values(host_terms, tokens.shape[:2], *texts))
        return tuple(out)

    def score(batch: Batch, host_out=None):
        scored, term_returns = [], {}
        for i, (part, forced) in enumerate(zip(batch.parts, forced_flags, strict=True)):
            values, valid = rewards.combine(
                device_terms, batch.device_rewards[i], host_terms,
                None if host_out is None else host_out[i], part.token_mask,
            )  # fmt: skip
            scored.append(
                scoring.score(
                    part,
                    forced,
                    values["total"],
                    valid,
                    g,
                    obj.advantage_scale,
                    per_token_advantages,
                    reward_discount,
                )
            )
            term_returns[i] = (values, valid)
        return tuple(scored), term_returns

    @jax.named_scope("update")
    def update(state: TrainState, inputs: StepInputs, batch: Batch, host_out=None):
        parts, term_returns = score(batch, host_out)
        # FSDP's params reach the loss sharded: its map gathers them and reduce-scatters
        # their gradient (sharding.make_member_sum)
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

        def one_update(carry, i):
            params, opt_state, old = carry
            (_, (m, logps)), grads = grad_fn(
                params, parts, old, i == 0, forced_flags, inputs.ref_state
            )
            with jax.named_scope("optimizer"):
                updates, opt_state = tx.update(grads, opt_state, params)
            m["grad_norm"] = optax.tree.norm(grads)
            # π_old stays the sampling policy's: iteration 0's log-probs, never replaced
            old = jax.tree.map(lambda new, prev: jnp.where(i == 0, new, prev), logps, old)
            return (optax.apply_updates(params, updates), opt_state, old), m

        old0 = tuple(p.logp_old for p in parts)
        (params, opt_state, _), ms = jax.lax.scan(
            one_update, (state.params, state.opt_state, old0), jnp.arange(mu)
        )
        out = jax.tree.map(lambda x: x.mean(0), ms)
        # A non-finite loss must not poison the state: keep the old one, the host stops.
        finite = jnp.isfinite(out["loss"]) & jnp.isfinite(out["grad_norm"])
        params = keep_if_finite(finite, params, state.params)
        opt_state = keep_if_finite(finite, opt_state, state.opt_state)
        out.update(metrics.group_metrics(parts, forced_flags, policy.vocab_size))
        out.update(metrics.reward_term_metrics(reward_terms, parts, term_returns, reward_discount))
        out.update(metrics.completion_metrics(parts, eos_id))
        out.update(batch.info)
        out["learning_rate"] = schedule(state.step)
        tokens = out["num_tokens"] + state.num_tokens
        out["num_tokens"] = tokens
        new = state._replace(
            step=state.step + 1, params=params, opt_state=opt_state, num_tokens=tokens
        )
        return new, out

    return Step(
        rollout, update, host if host_terms else None, score, prompts_of, groups_of, loss_fn,
        forced_flags,
    )  # fmt: skip
