"""Held-out evaluation of a char policy on fixed validation windows (one jitted function).

Metrics (N windows of C context chars + H target chars):
  eval/next_char_accuracy  teacher-forced argmax accuracy on the H target positions
  eval/val_loss            teacher-forced cross-entropy, nats/char, on the same positions
  eval/rollout_accuracy    a greedy rollout's per-char match with the true continuation
  eval/pass_at_k           P(at least one of k first-char samples is right) = E[1 - (1 - π(y0))^k],
                           computed exactly from the policy instead of by sampling
  eval/best_char_frac      share of windows whose greedy first char is the most frequent one;
                           the char itself is returned as text (a collapse onto ' ' is visible)
"""

import math

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import rollout as ro
from grpo_jax.model import Transformer
from grpo_jax.policy import TokenPrompts, sample, transformer_policy

GREEDY = ro.SamplingParams(temperature=1.0, top_k=1, top_p=1.0)


def make_eval_fn(model: Transformer, context_len: int, horizon: int, batch_size: int, pass_k):
    """Returns evaluate(params, context [N, C], target [N, H]) -> dict of arrays (jittable)."""
    greedy_policy = transformer_policy(model, GREEDY, horizon)

    def one_batch(params, ctx, tgt):
        full = jnp.concatenate([ctx, tgt], axis=1)
        logits = model.apply({"params": params}, full[:, :-1])[:, context_len - 1 :]  # [n, H, V]
        logp = jax.nn.log_softmax(logits, -1)
        nll = -jnp.take_along_axis(logp, tgt[..., None], -1)[..., 0]
        acc = (jnp.argmax(logits, -1) == tgt).astype(jnp.float32)
        p0 = jnp.exp(logp[:, 0])[jnp.arange(tgt.shape[0]), tgt[:, 0]]
        # greedy rollout: top-1 filtering makes the inverse-CDF sampler an argmax
        u = jnp.zeros((ctx.shape[0], 1, horizon))
        tokens, _ = sample(greedy_policy, params, TokenPrompts(ctx, None, {}), u, GREEDY)
        greedy = tokens[:, 0]
        return {
            "nll": nll.mean(1),
            "acc": acc.mean(1),
            "rollout_acc": (greedy == tgt).astype(jnp.float32).mean(1),
            "p0": p0,
            "greedy": greedy,
        }

    def evaluate(params, context, target):
        n = context.shape[0]
        nb = n // batch_size
        ctx = context[: nb * batch_size].reshape(nb, batch_size, -1)
        tgt = target[: nb * batch_size].reshape(nb, batch_size, -1)
        out = jax.lax.map(lambda a: one_batch(params, *a), (ctx, tgt))
        out = jax.tree.map(lambda x: x.reshape(nb * batch_size, *x.shape[2:]), out)
        res = {
            "eval/val_loss": out["nll"].mean(),
            "eval/next_char_accuracy": out["acc"].mean(),
            "eval/rollout_accuracy": out["rollout_acc"].mean(),
            "greedy": out["greedy"],
        }
        for k in pass_k:
            res[f"eval/pass_at_{k}"] = jnp.mean(1.0 - (1.0 - out["p0"]) ** k)
        return res

    return evaluate


def summarize(res: dict, vocab, context: np.ndarray, num_samples: int):
    """Host side: scalars, the greedy best first char, and decoded samples as text."""
    greedy = np.asarray(res["greedy"])
    counts = np.bincount(greedy[:, 0], minlength=vocab.size)
    best = int(np.argmax(counts))
    scalars = {k: float(v) for k, v in res.items() if k.startswith("eval/")}
    scalars["eval/best_char_frac"] = float(counts[best] / max(len(greedy), 1))
    scalars["eval/best_char_id"] = float(best)
    lines = [f"best greedy first char: {vocab.decode([best])!r} ({counts[best]}/{len(greedy)})"]
    for i in range(min(num_samples, len(greedy))):
        lines.append(f"--- context: {vocab.decode(context[i][-60:])!r}")
        lines.append(f"    greedy : {vocab.decode(greedy[i])!r}")
    return scalars, vocab.decode([best]), "\n".join(lines)


def pass_at_k(num_correct: np.ndarray, n: int, k: int) -> float:
    """Unbiased pass@k, 1 - C(n-c, k) / C(n, k), averaged over problems (Chen et al. 2021).

    num_correct [P] holds c, the correct samples among n per problem.
    """
    c = np.asarray(num_correct, np.int64).reshape(-1)
    if not 1 <= k <= n or c.size == 0 or np.any((c < 0) | (c > n)):
        raise ValueError(f"pass_at_k needs 1 <= k <= n and 0 <= c <= n: {n=}, {k=}, c={c}")
    # The product form avoids the huge binomials of the ratio.
    per_problem = [
        1.0 if n - ci < k else 1.0 - math.prod(1.0 - k / m for m in range(n - ci + 1, n + 1))
        for ci in c
    ]
    return float(np.mean(per_problem))
