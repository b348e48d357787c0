"""GRPO for single-step policies: one forward per prompt, every group member acts at once.

The toy bandit (one action per prompt) and the fill-in task (every masked position of a
window, filled in one non-autoregressive step) share this step. The policy maps a batch of
prompts to independent per-position distributions ``logits [B, T, V]``; a group member samples
all T positions from them, and ``mask [B, T]`` says which positions are the member's actions
(the toy's single action; the fill-in's masked span). So the policy, the frozen reference and
the π_old log-probs are computed once per prompt, not once per member, and the KL to the
reference is exact over V at every acted position.

Group modes (``group.mode``):
  sampled     G members, every acted position sampled from π_old (the ordinary GRPO group).
  exhaustive  the single-step form of exhaustive GRPO: V members per prompt, member k with
              action k forced at the prompt's first acted position (the decision point) and the
              other acted positions sampled. The decision point learns by the exact all-action
              gradient -∇ Σ_a π_θ(a)(R(a) - b), b = Σ_a π(a)R(a) (objective.all_action_loss):
              no sampling variance there given the rewards. The other acted positions keep the
              clipped surrogate, each member weighted by π_old(its forced action), so that their
              gradient is the on-policy one (a uniform mean over forced actions would optimise
              them for a uniformly random decision point instead). With one acted position
              (the toy bandit) the step is the exact policy gradient.

The math is grpo_jax.objective's (group_advantages, clipped_surrogate, kl_estimate /
exact_kl, aggregate, all_action_loss); the reward statistics are train_step.group_metrics';
the μ updates per batch of rollouts and the non-finite guard follow
train_step.make_train_step, so the metric names are the same as the other tasks' (loss,
pg_loss, kl, entropy, reward_mean, reward_std, frac_reward_zero_std, advantage_var,
clip_frac, ratio_mean, grad_norm, learning_rate).
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from grpo_jax import objective
from grpo_jax import rollout as ro
from grpo_jax.groups import Part
from grpo_jax.train_step import TrainState, group_metrics

MODES = ("sampled", "exhaustive")


class Inputs(NamedTuple):
    """Read-only step arguments (passed to the jitted step, never part of the TrainState, so
    the optimizer cannot touch them)."""

    data: Any  # task arrays (e.g. the train split)
    ref_params: Any  # frozen reference policy params (or None when grpo.beta == 0)
    reward_params: Any  # frozen reward-model / judge params (or None)


def check_grpo_config(config):
    gr = config.grpo
    if gr.kl_estimator not in objective.KL_CHOICES:
        raise ValueError(
            f"grpo.kl_estimator={gr.kl_estimator!r} is unknown; choose {objective.KL_CHOICES}"
        )
    if gr.loss_agg not in objective.AGGREGATIONS:
        raise ValueError(
            f"grpo.loss_agg={gr.loss_agg!r} is unknown; choose from {list(objective.AGGREGATIONS)}"
        )
    if gr.advantage_scale not in objective.ADVANTAGE_SCALES:
        raise ValueError(
            f"grpo.advantage_scale={gr.advantage_scale!r} is unknown; "
            f"choose from {', '.join(objective.ADVANTAGE_SCALES)}"
        )
    mode = config.group.mode
    if mode not in MODES:
        raise ValueError(
            f"group.mode={mode!r} is unknown for single-step tasks; choose from {MODES}"
        )
    if mode == "sampled" and config.group.size < 2:
        raise ValueError(f"group.size={config.group.size} must be >= 2 (a group needs a baseline)")
    if mode == "exhaustive" and gr.kl_estimator not in objective.EXACT_KL:
        raise ValueError(
            f"group.mode=exhaustive needs an exact KL (forced actions are not samples of π); "
            f"set grpo.kl_estimator to one of {tuple(objective.EXACT_KL)}"
        )
    if int(gr.num_iterations) < 1:
        raise ValueError(f"grpo.num_iterations={gr.num_iterations} must be >= 1")


def build(
    config,
    policy_logits,
    sample_prompts,
    reward_fn,
    tx,
    schedule,
    initial_params,
    data,
    reward_params,
):
    """A task's (step, Inputs): make_step's step, with the frozen reference a copy of the
    initial params (none when grpo.beta == 0). A copy, because the trainer donates the state,
    whose params start as these very buffers."""
    step = make_step(config, policy_logits, sample_prompts, reward_fn, tx, schedule)
    ref = jax.tree.map(jnp.copy, initial_params) if config.grpo.beta > 0 else None
    return step, Inputs(data, ref, reward_params)


def make_step(
    config,
    policy_logits: Callable,
    sample_prompts: Callable,
    reward_fn: Callable,
    tx,
    schedule,
):
    """Returns a pure step(state, inputs: Inputs) -> (state, metrics); jit it once.

    policy_logits(params, prompts) -> logits [B, T, V]
    sample_prompts(key, data) -> (prompts pytree, mask [B, T] float)
    reward_fn(reward_params, data, prompts, tokens [B, G, T], mask) -> (rewards [B, G], info)
      where info is a dict of extra scalar metrics (e.g. the fill accuracy of the samples).
    """
    check_grpo_config(config)
    gr, g = config.grpo, config.group
    exhaustive = g.mode == "exhaustive"
    sp = ro.sampling_params(g)
    size, mu = int(g.size), int(gr.num_iterations)
    beta, eps, eps_high = float(gr.beta), float(gr.epsilon), gr.epsilon_high
    agg = lambda x, m: objective.aggregate(x, m, gr.loss_agg)
    token_mean = lambda x, m: objective.aggregate(x, m, "token-mean")

    def member_logp(lp_all, tokens):
        # lp_all [B, T, V] (shared by the group), tokens [B, G, T] -> [B, G, T]
        idx = jnp.moveaxis(tokens, 1, -1)  # [B, T, G]
        return jnp.moveaxis(jnp.take_along_axis(lp_all, idx, axis=-1), -1, 1)

    def loss_fn(params, prompts, tokens, tok_mask, adv, old, ref_lp, forced):
        """forced: None (sampled groups) or (decision one-hot [B, T], rewards [B, V],
        member weights π_old(forced action) [B, V])."""
        lp_all = ro.tempered_logp(policy_logits(params, prompts), sp)  # [B, T, V]
        logp = member_logp(lp_all, tokens)
        a = adv[..., None]  # one outcome advantage per member, on each of its actions
        surrogate = objective.clipped_surrogate(logp, old, a, eps, eps_high)
        if forced is None:
            pg = agg(surrogate, tok_mask)
        else:
            dp, rewards, w = forced
            lp_dp = jnp.sum(lp_all * dp[..., None], axis=1)  # [B, V] at the decision point
            pg = jnp.mean(objective.all_action_loss(lp_dp, rewards, gr.advantage_scale))
            # the other acted positions: per prompt, the π_old-weighted mean over members of
            # their surrogate's mean over those positions
            cont = tok_mask * (1.0 - dp[:, None])
            n_pos = jnp.sum(cont[:, 0], axis=-1)  # [B]
            per_member = jnp.sum(surrogate * cont, -1) / jnp.maximum(n_pos, 1.0)[:, None]
            has = (n_pos > 0).astype(jnp.float32)
            pg = pg + jnp.sum(jnp.sum(per_member * w, -1) * has) / jnp.maximum(has.sum(), 1.0)
        if ref_lp is None:
            kl = jnp.zeros(())
        elif gr.kl_estimator in objective.EXACT_KL:
            per_pos = objective.EXACT_KL[gr.kl_estimator](
                lp_all, ref_lp
            )  # [B, T]: exact, the same for members
            kl = agg(jnp.broadcast_to(per_pos[:, None], tokens.shape), tok_mask)
        else:
            ref_tok = member_logp(ref_lp, tokens)
            kl = agg(objective.kl_estimate(logp, ref_tok, gr.kl_estimator), tok_mask)
        ent_pos = objective.entropy_from_logits(lp_all)
        ent = agg(jnp.broadcast_to(ent_pos[:, None], tokens.shape), tok_mask)
        loss = pg + beta * kl - gr.entropy_coef * ent
        m = {
            "loss": loss,
            "pg_loss": pg,
            "kl": kl,
            "entropy": ent,
            "clip_frac": token_mean(objective.clip_fraction(logp, old, a, eps, eps_high), tok_mask),
            "ratio_mean": token_mean(jnp.exp(logp - old), tok_mask),
        }
        return loss, m

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def step(state: TrainState, inputs: Inputs):
        key = jax.random.fold_in(state.rng, state.step)
        k_data, k_sample = jax.random.split(key)
        prompts, mask = sample_prompts(k_data, inputs.data)
        logits = jax.lax.stop_gradient(policy_logits(state.params, prompts))  # [B, T, V]
        b, t, v = logits.shape
        k = v if exhaustive else size  # members: every action, or G samples
        u = jax.random.uniform(k_sample, (b, k, t))
        tokens, old, _ = ro.sample_from_logits(
            jnp.broadcast_to(logits[:, None], (b, k, t, v)), u, sp
        )
        if exhaustive:  # member a takes action a at the first acted position
            dp = jax.nn.one_hot(jnp.argmax(mask > 0, axis=1), t) * (mask.sum(1) > 0)[:, None]
            actions = jnp.arange(v, dtype=tokens.dtype)[None, :, None]
            tokens = jnp.where(dp[:, None] > 0, actions, tokens)
            lp_old = ro.tempered_logp(logits, sp)  # [B, T, V]
            old = member_logp(lp_old, tokens)
            lp_dp = jnp.sum(lp_old * dp[..., None], axis=1)  # [B, V]: log π_old(a) at the dp
        tok_mask = jnp.broadcast_to(mask[:, None].astype(jnp.float32), tokens.shape)
        rewards, info = reward_fn(inputs.reward_params, inputs.data, prompts, tokens, mask)
        rewards = jax.lax.stop_gradient(rewards.astype(jnp.float32))
        forced = None
        if exhaustive:
            pi_dp = jnp.exp(lp_dp)
            adv = objective.policy_weighted_advantages(rewards, pi_dp, gr.advantage_scale)
            forced = (dp, rewards, pi_dp)
        else:
            adv = objective.group_advantages(rewards, gr.advantage_scale)  # [B, G]
        ref_lp = None
        if inputs.ref_params is not None and beta > 0:
            ref_logits = policy_logits(jax.lax.stop_gradient(inputs.ref_params), prompts)
            ref_lp = jax.lax.stop_gradient(ro.tempered_logp(ref_logits, sp))

        def update(carry, _):
            params, opt_state = carry
            (_, m), grads = grad_fn(params, prompts, tokens, tok_mask, adv, old, ref_lp, forced)
            updates, opt_state = tx.update(grads, opt_state, params)
            m["grad_norm"] = optax.tree.norm(grads)
            return (optax.apply_updates(params, updates), opt_state), m

        (params, opt_state), ms = jax.lax.scan(
            update, (state.params, state.opt_state), None, length=mu
        )
        metrics = jax.tree.map(lambda x: x.mean(0), ms)
        finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
        keep = lambda new, old_: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old_)
        params, opt_state = keep(params, state.params), keep(opt_state, state.opt_state)
        empty = jnp.zeros((b, 0))
        part = Part(  # only the fields group_metrics reads are meaningful
            context=empty,
            tokens=tokens,
            member_mask=jnp.ones((b, k), jnp.float32),
            # [..., 0] is the first action's log-prob: the decision point's when forced
            logp_old=lp_dp[..., None] if exhaustive else old,
            advantages=adv[..., None],  # [B, G, 1]: advantage_var = mean Â²
            action_returns=empty,
            action_mask=empty,
            actions=empty.astype(jnp.int32),
            ref_logp=empty,
            rewards=rewards[..., None],
        )
        metrics.update(group_metrics((part,), (exhaustive,), v))
        metrics.update(info)
        metrics["learning_rate"] = schedule(state.step)
        metrics["generated_tokens"] = jnp.sum(tok_mask)
        return TrainState(state.step + 1, params, opt_state, state.rng), metrics

    return step
