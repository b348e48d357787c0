"""make_optimizer's schedule counts optimizer updates: μ per GRPO step."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from ml_collections import ConfigDict

from grpo_jax.train_state import make_optimizer


def _optim(warmup=0):
    return ConfigDict(
        {
            "learning_rate": 1.0,
            "warmup_steps": warmup,
            "end_lr_fraction": 0.1,
            "weight_decay": 0.0,
            "grad_clip": 0.0,
            "b1": 0.9,
            "b2": 0.99,
        }
    )


def cosine(update, total, end=0.1):
    return end + (1 - end) * 0.5 * (1 + math.cos(math.pi * update / total))


def _updates(tx, grads):
    params = jnp.zeros(3)
    state, out = tx.init(params), []
    for g in grads:
        u, state = tx.update(g, state, params)
        out.append(np.asarray(u))
    return np.stack(out)


def test_schedule_spans_num_steps_times_mu_updates():
    """4 steps × μ = 2: the logged lr of step s is the cosine at update 2s of 8, and the
    optimizer's 8 updates equal Adam's under an 8-update cosine, not a 4-update one (which
    would sit at its floor for the second half of the run)."""
    tx, schedule = make_optimizer(_optim(), num_steps=4, updates_per_step=2)
    for step in range(4):
        np.testing.assert_allclose(schedule(step), cosine(2 * step, 8), rtol=1e-6)
    grads = jax.random.normal(jax.random.PRNGKey(0), (8, 3))

    def adam_over(total):
        sched = lambda n: 0.1 + 0.9 * 0.5 * (1 + jnp.cos(jnp.pi * jnp.minimum(n, total) / total))
        return optax.adamw(sched, b1=0.9, b2=0.99, weight_decay=0.0)

    got = _updates(tx, grads)
    np.testing.assert_allclose(got, _updates(adam_over(8), grads), rtol=1e-5, atol=1e-7)
    assert not np.allclose(got, _updates(adam_over(4), grads), rtol=1e-3)


def test_warmup_counts_steps():
    _, schedule = make_optimizer(_optim(warmup=2), num_steps=10, updates_per_step=3)
    np.testing.assert_allclose([schedule(0), schedule(1), schedule(2)], [0.0, 0.5, 1.0], atol=1e-6)
