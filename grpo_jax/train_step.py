"""One GRPO iteration as one jitted program: windows -> groups -> rewards -> μ optax updates.

purejaxrl-style: ``make_train_step(...)`` closes over the static config and returns a pure
``step(state, inputs) -> (state, metrics)``; the trainer jits it once with the state donated.
The step's key is ``fold_in(state.rng, state.step)``, so a resumed run draws exactly what an
uninterrupted one would, and vmapping ``step`` over states with different ``rng`` trains
several seeds in one program.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from grpo_jax import data as data_lib
from grpo_jax.groups import Part

# The per-step metrics every GRPO task's step returns (the trainer adds tokens_per_s); tasks
# may add their own. Tests and dashboards read these names.
STEP_METRICS = (
    "loss",
    "pg_loss",
    "kl",
    "entropy",
    "reward_mean",
    "reward_std",
    "frac_reward_zero_std",
    "advantage_var",
    "clip_frac",
    "ratio_mean",
    "grad_norm",
    "learning_rate",
)


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar
    params: Any
    opt_state: Any
    rng: jax.Array  # root key (uint32[2]); per-step keys are fold_in(rng, step)


class StepInputs(NamedTuple):
    """Large read-only arrays passed as arguments (not baked into the program as constants)."""

    train_tokens: jax.Array  # [N] int32 train split
    ref_state: Any  # n-gram tables or frozen params (or None)


def make_optimizer(
    optim_cfg, num_steps: int, peak_lr: float | None = None, updates_per_step: int = 1
):
    """AdamW with linear warmup + cosine decay and global-norm clipping.

    ``num_steps`` and ``optim.warmup_steps`` count training steps. A GRPO step makes
    ``updates_per_step`` (μ = grpo.num_iterations) optimizer updates and optax's schedule counts
    updates, so the schedule spans num_steps × μ of them: over num_steps updates it would reach
    its floor halfway through a μ = 2 run.

    Returns (tx, schedule) with ``schedule(step)`` the learning rate of a step's first update
    (what the step logs)."""
    lr = optim_cfg.learning_rate if peak_lr is None else peak_lr
    mu = int(updates_per_step)
    total = num_steps * mu
    warmup = min(int(optim_cfg.warmup_steps) * mu, max(total - 1, 0))
    update_schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0 if warmup else lr,
        peak_value=lr,
        warmup_steps=warmup,
        decay_steps=max(total, warmup + 1),
        end_value=lr * optim_cfg.end_lr_fraction,
    )

    def schedule(step):  # a training step's first update
        return update_schedule(step * mu)

    chain = [optax.clip_by_global_norm(optim_cfg.grad_clip)] if optim_cfg.grad_clip > 0 else []
    chain.append(
        optax.adamw(
            update_schedule, b1=optim_cfg.b1, b2=optim_cfg.b2, weight_decay=optim_cfg.weight_decay
        )
    )
    return optax.chain(*chain), schedule


def keep_if_finite(finite, new, old):
    """``new`` where ``finite`` else ``old``, leaf by leaf: a non-finite loss must not poison
    params or optimizer state (the host then stops, keeping the last good checkpoint)."""
    return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)


def supervised_update(state: TrainState, loss, grads, tx, schedule, **task_metrics):
    """One optimizer step of a supervised objective (pretraining, the judge), skipped when the
    loss is not finite; returns (next state, the metrics every supervised mode logs plus
    ``task_metrics``, e.g. its train accuracy under the task's name)."""
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    finite = jnp.isfinite(loss)
    params = keep_if_finite(finite, optax.apply_updates(state.params, updates), state.params)
    opt_state = keep_if_finite(finite, opt_state, state.opt_state)
    metrics = {
        "loss": loss,
        "grad_norm": optax.tree.norm(grads),
        "learning_rate": schedule(state.step),
        **task_metrics,
    }
    return TrainState(state.step + 1, params, opt_state, state.rng), metrics


def init_state(params, tx, seed: int) -> TrainState:
    return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), jax.random.PRNGKey(seed))


def group_metrics(parts, forced_flags, vocab_size):
    """Reward statistics of the step's groups (host-free, all scalars but the char stats)."""
    out, weights = {}, []
    for part, forced in zip(parts, forced_flags, strict=True):
        mm = part.member_mask
        ret = part.rewards.mean(-1)  # [B, K]
        n = jnp.maximum(mm.sum(1), 1.0)
        mean = (ret * mm).sum(1) / n
        std = jnp.sqrt(((ret - mean[:, None]) ** 2 * mm).sum(1) / n)
        valid = (mm.sum(1) > 0).astype(jnp.float32)
        big, small = jnp.where(mm > 0, ret, -jnp.inf), jnp.where(mm > 0, ret, jnp.inf)
        spread = jnp.where(valid > 0, big.max(1) - small.min(1), 0.0)
        # members weighted by π_old of their first action: for a forced group (every first
        # action, or a guide's candidates) this is the policy's expected return, which the
        # plain mean over forced actions is not; for a sampled group it is reward_mean
        pw = jnp.exp(part.logp_old[..., 0]) * mm if forced else mm
        policy_mean = (ret * pw).sum(1) / jnp.maximum(pw.sum(1), 1e-30)
        adv = part.advantages
        tm = jnp.broadcast_to(mm[..., None], adv.shape)
        w = valid.sum()
        wm = lambda x: jnp.sum(x * valid) / jnp.maximum(w, 1.0)
        stats = {
            "reward_mean": wm(mean),
            "reward_policy_mean": wm(policy_mean),
            "reward_std": wm(std),
            "frac_reward_zero_std": wm((std < 1e-6).astype(jnp.float32)),
            "reward_spread": wm(spread),
            "advantage_var": jnp.sum(adv**2 * tm) / jnp.maximum(tm.sum(), 1.0),
        }
        weights.append(w)
        for k, v in stats.items():
            out.setdefault(k, []).append((v, w))
        if forced and part.actions.shape[1] == vocab_size:
            # per first char: mean return and how often it is the group's best
            am = part.action_mask
            rows = jnp.maximum(am.max(1).sum(), 1.0)
            out["char/reward"] = (part.action_returns * am).sum(0) / rows
            best = jax.nn.one_hot(
                jnp.argmax(jnp.where(am > 0, part.action_returns, -jnp.inf), 1), vocab_size
            )
            out["char/best"] = (best * am.max(1, keepdims=True)).sum(0) / rows
    total = jnp.maximum(sum(weights), 1.0)
    merged = {}
    for k, v in out.items():
        merged[k] = v if k.startswith("char/") else sum(x * w for x, w in v) / total
    return merged


def make_train_step(
    config, collect, loss_fn, tx, schedule, forced_flags, vocab_size, shard_batch=None
):
    """Returns step(state, inputs) -> (state, metrics). Pure; jit it once.

    ``shard_batch`` (sharding.step_hooks) constrains the sampled prompts to the data axis."""
    b, c, h = config.train.batch_size, config.data.context_len, config.data.horizon
    mu = int(config.grpo.num_iterations)
    if mu < 1:
        raise ValueError(f"grpo.num_iterations={mu} must be >= 1")

    def step(state: TrainState, inputs: StepInputs):
        key = jax.random.fold_in(state.rng, state.step)
        k_data, k_roll = jax.random.split(key)
        context, target = data_lib.sample_windows(k_data, inputs.train_tokens, b, c, h)
        if shard_batch is not None:
            context, target = shard_batch((context, target))
        parts, info = collect(state.params, inputs.ref_state, context, target, k_roll)
        parts = jax.lax.stop_gradient(parts)
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

        def update(carry, i):
            params, opt_state, old = carry
            (_, (m, logps)), grads = grad_fn(params, parts, old, i == 0, forced_flags)
            updates, opt_state = tx.update(grads, opt_state, params)
            m["grad_norm"] = optax.tree.norm(grads)
            return (optax.apply_updates(params, updates), opt_state, logps), m

        old0 = tuple(p.logp_old for p in parts)
        (params, opt_state, _), ms = jax.lax.scan(
            update, (state.params, state.opt_state, old0), jnp.arange(mu)
        )
        metrics = jax.tree.map(lambda x: x.mean(0), ms)
        # A non-finite loss must not poison the state: keep the old one, the host stops.
        finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
        params = keep_if_finite(finite, params, state.params)
        opt_state = keep_if_finite(finite, opt_state, state.opt_state)
        metrics.update(group_metrics(parts, forced_flags, vocab_size))
        metrics.update(info)
        metrics["learning_rate"] = schedule(state.step)
        metrics["generated_tokens"] = jnp.asarray(sum(p.tokens.size for p in parts), jnp.float32)
        return TrainState(state.step + 1, params, opt_state, state.rng), metrics

    return step


def parts_forced_flags(config) -> tuple[bool, ...]:
    """Which parts of collect()'s output are forced groups (static, mirrors groups.py)."""
    return {
        "sampled": (False,),
        "exhaustive": (True,),
        "guided": (True,),
        "adaptive": (False, True),
    }[config.group.mode]


__all__ = ["Part", "StepInputs", "TrainState", "make_optimizer", "make_train_step"]
