"""The training state and the optimizer every mode shares (GRPO, pretraining, the judge).

The state is one pytree: step, params, optimizer state, the root PRNG key (a step's key is
``fold_in(rng, step)``, so a resumed run draws exactly what an uninterrupted one would) and
the cumulative token count TRL logs as ``num_tokens``.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from grpo_jax.specs import OptimSpec


class TrainState(NamedTuple):
    step: jax.Array  # int32 scalar
    params: Any
    opt_state: Any
    rng: jax.Array  # root key (uint32[2]); per-step keys are fold_in(rng, step)
    num_tokens: jax.Array  # float32 scalar: prompt + completion tokens processed so far


class StepInputs(NamedTuple):
    """Large read-only arrays passed to the jitted step as arguments (not baked into the
    program as constants, and never part of the TrainState, so the optimizer cannot touch
    them)."""

    data: Any  # the task's prompt source (e.g. the train split's tokens)
    ref_state: Any  # the frozen reference: n-gram tables or params (or None)
    reward_state: Any = None  # frozen reward-model / judge params (or None)


def make_optimizer(
    optim: OptimSpec, num_steps: int, peak_lr: float | None = None, updates_per_step: int = 1
):
    """AdamW with linear warmup + cosine decay and global-norm clipping.

    ``num_steps`` and ``optim.warmup_steps`` count training steps. A GRPO step makes
    ``updates_per_step`` (μ = grpo.num_iterations) optimizer updates and optax's schedule counts
    updates, so the schedule spans num_steps × μ of them: over num_steps updates it would reach
    its floor halfway through a μ = 2 run.

    Returns (tx, schedule) with ``schedule(step)`` the learning rate of a step's first update
    (what the step logs)."""
    lr = optim.learning_rate if peak_lr is None else peak_lr
    mu = int(updates_per_step)
    total = num_steps * mu
    warmup = min(int(optim.warmup_steps) * mu, max(total - 1, 0))
    update_schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0 if warmup else lr,
        peak_value=lr,
        warmup_steps=warmup,
        decay_steps=max(total, warmup + 1),
        end_value=lr * optim.end_lr_fraction,
    )

    def schedule(step):  # a training step's first update
        return update_schedule(step * mu)

    chain = [optax.clip_by_global_norm(optim.grad_clip)] if optim.grad_clip > 0 else []
    chain.append(
        optax.adamw(update_schedule, b1=optim.b1, b2=optim.b2, weight_decay=optim.weight_decay)
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
    return state._replace(step=state.step + 1, params=params, opt_state=opt_state), metrics


def init_state(params, tx, seed: int) -> TrainState:
    zero = jnp.zeros((), jnp.int32)
    return TrainState(zero, params, tx.init(params), jax.random.PRNGKey(seed), jnp.zeros(()))
