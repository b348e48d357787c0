"""The engine's step for single-step tasks: a model that acts on a whole span at once.

The toy bandit (one action per prompt) and the fill-in task (a masked span of a window,
filled in one non-autoregressive step) are ``policy.single_step_policy`` s: the policy, the
frozen reference and π_old are computed once per prompt, and a member's completion is its
span's tokens. Everything else is the one GRPO step (engine.py): the same group modes (an
exhaustive group forces every token at the span's first position, learning there by the exact
all-action gradient), the same loss, metrics and μ updates as the autoregressive tasks.
"""

import jax
import jax.numpy as jnp

from grpo_jax import engine
from grpo_jax.policy import SpanPrompts, policy_reference, single_step_policy
from grpo_jax.specs import EngineSpec
from grpo_jax.train_state import StepInputs


def spans_of(mask):
    """A contiguous acted mask [B, L] -> (start [B], length [B]) int32."""
    mask = mask > 0
    return jnp.argmax(mask, axis=1).astype(jnp.int32), jnp.sum(mask, axis=1).astype(jnp.int32)


def span_positions(start, width: int, window_len: int):
    """[B, width] window positions of each span slot (clipped inside the window)."""
    return jnp.minimum(start[:, None] + jnp.arange(width), window_len - 1)


def fill_span(window, start, length, tokens):
    """Each member's span tokens [B, K, S] written into its prompt's window [B, L] at
    positions start..start+length-1 -> filled windows [B, K, L]."""
    window_len, width = window.shape[-1], tokens.shape[-1]
    offset = jnp.arange(window_len)[None, :] - start[:, None]  # [B, L]: slot in the span
    inside = (offset >= 0) & (offset < length[:, None])
    idx = jnp.broadcast_to(
        jnp.clip(offset, 0, width - 1)[:, None], tokens.shape[:2] + (window_len,)
    )
    return jnp.where(inside[:, None], jnp.take_along_axis(tokens, idx, -1), window[:, None])


def build(
    espec: EngineSpec,
    logits_fn,
    vocab_size: int,
    max_span: int,
    sample_prompts,
    reward_terms,
    tx,
    schedule,
    initial_params,
    data,
    reward_state=None,
    hooks=None,
):
    """A single-step task's (Step, StepInputs), its prompts split over the mesh's data axis
    and its members over the member axis, as an autoregressive task's. The KL reference is a
    frozen copy of the initial params (none when grpo.beta == 0): a copy, because the
    trainer donates the state, whose params start as these very buffers."""
    policy = single_step_policy(logits_fn, vocab_size, max_span, espec.group.sampling)
    use_ref = espec.objective.beta > 0
    step = engine.make_grpo_step(
        espec,
        policy,
        policy_reference(policy, espec.group.sampling.temperature) if use_ref else None,
        sample_prompts,
        reward_terms,
        tx,
        schedule,
        hooks=hooks,  # sharding.step_hooks: None on one device
    )
    ref_state = jax.tree.map(jnp.copy, initial_params) if use_ref else None
    return step, StepInputs(data, ref_state, reward_state)


__all__ = ["SpanPrompts", "build", "fill_span", "span_positions", "spans_of"]
