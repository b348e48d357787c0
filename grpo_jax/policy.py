"""What a group mode and the loss need from a model, as three pure functions of params.

A ``Policy`` is how every task plugs its model into the one GRPO engine:

  prefill(params, prompts) -> (first_logits [B, V], state)
      the distribution of each prompt's first completion token (the decision point) and
      whatever the other two functions reuse (a transformer's prefix KV cache; a single-step
      model's per-position logits);
  complete(params, state, prompts, first [B, K], u [B, K, T]) -> (tokens [B, K, T],
      logp [B, K, T-1], entropy [B, K, T-1], mask [B, K, T])
      the rest of each member's completion after its first token, sampled by inverse CDF
      from the uniforms u (so chunking or sharding members cannot change a trajectory), with
      the completion mask (1 up to and including EOS);
  extend(params, state, prompts, tokens [B, c, T]) -> logits [B, c, T-1, V]
      the training forward of tokens 1..T-1 given the prompt and the tokens before them.

``prompts`` is the task's own pytree with a leading batch axis; only the policy and the
task's rewards read it. Two policies cover today's tasks: an autoregressive transformer with a
shared-prefix KV cache (``transformer_policy``: Shakespeare, arithmetic) and a single-step
model that scores every position of a window at once (``single_step_policy``: the toy bandit,
fill-in), whose "completion" is its acted span.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from grpo_jax import chunking
from grpo_jax import rollout as ro
from grpo_jax.model import Transformer
from grpo_jax.objective import entropy_from_logits


class Policy(NamedTuple):
    prefill: Callable
    complete: Callable
    extend: Callable
    vocab_size: int
    completion_length: int  # T, static


class TokenPrompts(NamedTuple):
    """Prompts of an autoregressive task: left-padded tokens, and the task's own fields
    (targets, answers, ...) that its rewards read."""

    tokens: jax.Array  # [B, P] int32
    mask: Any  # [B, P] float (1 = real token), or None when every prompt has P tokens
    fields: Any  # dict of [B, ...] arrays


def transformer_policy(model: Transformer, sp, completion_length: int, stop=None):
    """The decoder-only transformer: prefill once per prompt, members attend to its cache.
    ``stop`` (rollout.Stop) ends completions at its EOS id; None runs the fixed horizon."""
    v = model.vocab_size
    for name in ("eos_id", "pad_id"):
        value = None if stop is None else getattr(stop, name)
        if value is not None and not 0 <= value < v:
            raise ValueError(
                f"{name}={value} is outside the {v}-token vocabulary; use the tokenizer's id"
            )

    def prefill(params, prompts: TokenPrompts):
        logits, prefix = model.apply(
            {"params": params}, prompts.tokens, prompts.mask, method=Transformer.prefill
        )
        return logits[:, -1], prefix

    def complete(params, prefix, prompts, first, u):
        return ro.decode_members(model, params, prefix, first, u, sp, stop)

    def extend(params, prefix, prompts, tokens):
        return model.apply({"params": params}, prefix, tokens[..., :-1], method=Transformer.extend)

    return Policy(prefill, complete, extend, model.vocab_size, int(completion_length))


class SpanPrompts(NamedTuple):
    """Prompts of a single-step task: the network's input and the acted span (contiguous
    positions start..start+length-1 of the window), plus the task's fields."""

    inputs: Any  # what the task's logits function reads (e.g. the masked window [B, L])
    start: jax.Array  # [B] int32
    length: jax.Array  # [B] int32, 1..max_span
    fields: Any


def span_logits(logits, start, max_span: int):
    """logits [B, L, V] -> [B, S, V]: the span's positions first (clipped at the window)."""
    pos = jnp.minimum(start[:, None] + jnp.arange(max_span), logits.shape[1] - 1)
    return jnp.take_along_axis(logits, pos[..., None], axis=1)


def single_step_policy(logits_fn: Callable, vocab_size: int, max_span: int, sp):
    """A model that maps a prompt to independent per-position logits ``logits_fn(params,
    inputs) -> [B, L, V]`` in one forward, acting on a span of each window. Its completion is
    the span's tokens (T = max_span, masked beyond each span's length), so the engine's
    decision point is the span's first position; every other span position is sampled from
    the same forward, which is computed once per prompt, not per member."""

    def prefill(params, prompts: SpanPrompts):
        span = span_logits(logits_fn(params, prompts.inputs), prompts.start, max_span)
        return span[:, 0], span

    def complete(params, span, prompts, first, u):
        b, k, t = u.shape
        rest = jnp.broadcast_to(span[:, None, 1:t], (b, k, t - 1, span.shape[-1]))
        tokens, logp, ent = ro.sample_from_logits(rest, u[..., 1:], sp)
        tokens = jnp.concatenate([first[..., None], tokens], axis=-1)
        mask = jnp.arange(t) < prompts.length[:, None, None]
        return tokens, logp, ent, jnp.broadcast_to(mask, (b, k, t)).astype(jnp.float32)

    def extend(params, span, prompts, tokens):
        b, c, t = tokens.shape
        return jnp.broadcast_to(span[:, None, 1:t], (b, c, t - 1, span.shape[-1]))

    return Policy(prefill, complete, extend, int(vocab_size), int(max_span))


def continue_logits(policy: Policy, params, first, state, prompts, tokens):
    """The training forward of tokens [B, K, T] from a prefilled prompt batch (``first``
    [B, V], ``state``: what ``policy.prefill`` returned) -> logits [B, K, T, V] where
    logits[:, :, t] scores tokens[:, :, t]: token 0's are the decision point's, the rest
    come from ``policy.extend``."""
    b, k, t = tokens.shape
    head = jnp.broadcast_to(first[:, None, None], (b, k, 1, first.shape[-1]))
    if t == 1:
        return head
    return jnp.concatenate([head, policy.extend(params, state, prompts, tokens)], axis=2)


def token_logits(policy: Policy, params, prompts, tokens):
    """The whole training forward of a group: tokens [B, K, T] -> (first_logits [B, V],
    logits [B, K, T, V]) where logits[:, :, t] scores tokens[:, :, t]."""
    first, state = policy.prefill(params, prompts)
    return first, continue_logits(policy, params, first, state, prompts, tokens)


class Reference(NamedTuple):
    """A frozen reference π_ref as two pure functions of its state (a pytree argument),
    shaped like a Policy's prefill / extend so that the prompt runs once per batch, however
    many chunks of members the rollout or the loss splits a group into.

    prefill(state, prompts) -> (first [B, V], context): log π_ref at the decision point, and
      what ``logprobs`` reuses (a transformer's prompt cache; nothing for an n-gram);
    logprobs(state, context, prompts, tokens [B, K, T]) -> [B, K, T, V]: log π_ref of every
      token at every completion position (position t given the prompt and tokens[..., :t]).
    """

    prefill: Callable
    logprobs: Callable


def policy_reference(policy: Policy, temperature: float) -> Reference:
    """π_ref = the same policy with frozen params, at the policy's sampling temperature T:
    log_softmax(z_ref / T), as TRL's GRPOTrainer divides the reference model's logits by the
    temperature too. So while the params are the reference's, π = π_ref and every KL
    estimate is 0, whatever T. (Untempered, log_softmax(z_ref), the KL at T ≠ 1 was nonzero
    from step 0 and its optimum softmax(z / T) = softmax(z_ref) undid the temperature.) Top-k
    and top-p are not applied, as for π (sampling heuristics). Reward terms that read the
    reference (rewards.NEEDS_REFERENCE) read this same tempered distribution."""
    sp = ro.SamplingParams(temperature=float(temperature))

    def prefill(params, prompts):
        first, state = policy.prefill(params, prompts)
        return ro.tempered_logp(first, sp), (first, state)

    def logprobs(params, context, prompts, tokens):
        return ro.tempered_logp(continue_logits(policy, params, *context, prompts, tokens), sp)

    return Reference(prefill, logprobs)


def rollout(
    policy: Policy, params, prompts, first_logits, state, first, u, sp, chunk=0, member_map=None
):
    """Members' completions from a prefilled prompt batch.

    first [B, K]: forced first tokens, or None to sample them from ``first_logits`` with
    ``sp`` and u[..., 0]; u [B, K, T] uniforms. ``chunk`` members at a time (lax.map, 0 = all)
    and ``member_map(fn, *member_args)`` (sharding.py: shard_map over the member axis) wrap
    the per-member work; neither changes a trajectory. Returns (tokens [B, K, T], logp [B, K, T]
    under the tempered policy, entropy [B, K, T], completion mask [B, K, T])."""
    v = first_logits.shape[-1]
    logp0 = ro.tempered_logp(first_logits, sp)
    if first is None:
        logits = jnp.broadcast_to(first_logits[:, None], (*u.shape[:2], v))
        first, lp0, _ = ro.sample_from_logits(logits, u[..., 0], sp)
    else:
        lp0 = jnp.take_along_axis(logp0, first, axis=1)
    ent0 = jnp.broadcast_to(entropy_from_logits(logp0)[:, None], first.shape)
    complete = lambda f, uu: policy.complete(params, state, prompts, f, uu)
    run = lambda f, uu: chunking.chunked(complete, chunk, f, uu)
    tokens, lps, ents, mask = (member_map or (lambda f, *a: f(*a)))(run, first, u)
    logp = jnp.concatenate([lp0[..., None], lps], axis=-1)
    return tokens, logp, jnp.concatenate([ent0[..., None], ents], axis=-1), mask


def sample(policy: Policy, params, prompts, u, sp):
    """K fresh completions per prompt (first token from ``sp``, the rest from the policy's own
    sampling): u [B, K, T] -> (tokens [B, K, T], mask [B, K, T]). With ``top_k = 1`` both are
    greedy and u is irrelevant."""
    first_logits, state = policy.prefill(params, prompts)
    tokens, _, _, mask = rollout(policy, params, prompts, first_logits, state, None, u, sp)
    return tokens, mask
