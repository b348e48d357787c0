"""Held-out evaluation of a policy on fixed validation windows (one jitted function).

Metrics (N windows of C context tokens + H target tokens; a token is a char by default), each
over all N windows: the last batch is padded to the static batch size and the padding dropped
before any mean (pad_windows), so the n-gram baselines logged beside them see the same windows:
  eval/next_char_accuracy  teacher-forced argmax accuracy on the H target positions; with a
                           subword vocabulary, the greedy token's first char vs the true next
                           char (the same figure for chars, comparable across tokenizers)
  eval/val_loss            teacher-forced cross-entropy, nats/token, on the same positions
  eval/bits_per_char       the same held-out NLL in bits over the chars the scored tokens
                           decode to (val_loss / ln 2 for chars)
  eval/next_token_accuracy, eval/bits_per_token   (subword vocabularies only) per token
  eval/rollout_accuracy    a greedy rollout's per-char match with the true continuation
  eval/pass_at_k           P(at least one of k first-char samples is right) = E[1 - (1 - π(y0))^k],
                           computed exactly from the policy instead of by sampling; with a
                           subword vocabulary π(y0) is the mass of every token that starts
                           with the true next char (first_char_prob)
  eval/best_char_frac      share of windows whose greedy first char is the most frequent one;
                           the char itself is returned as text (a collapse onto ' ' is visible)
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import rollout as ro
from grpo_jax.model import Transformer
from grpo_jax.policy import TokenPrompts, sample, transformer_policy

GREEDY = ro.SamplingParams(temperature=1.0, top_k=1, top_p=1.0)
LN2 = math.log(2.0)


class TokenChars(NamedTuple):
    """What each token of a subword vocabulary decodes to (bpe.BpeTokenizer's arrays)."""

    first_char: np.ndarray  # int32 [V]: code point of its first char
    num_chars: np.ndarray  # int32 [V]: chars it decodes to


def teacher_forced(logits, target, token_chars: TokenChars | None) -> dict:
    """Per-window rows over the H target positions, from logits [n, H, V] and target [n, H]:
    mean NLL (nats per token) and argmax accuracy; for subwords also the first-char accuracy,
    the NLL sum and the number of chars the targets decode to (per_char's ratio of sums)."""
    logp = jax.nn.log_softmax(logits, -1)
    nll = -jnp.take_along_axis(logp, target[..., None], -1)[..., 0]
    pred = jnp.argmax(logits, -1)
    rows = {"nll": nll.mean(1), "acc": (pred == target).astype(jnp.float32).mean(1)}
    if token_chars is not None:
        first, count = jnp.asarray(token_chars.first_char), jnp.asarray(token_chars.num_chars)
        rows["char_acc"] = (first[pred] == first[target]).astype(jnp.float32).mean(1)
        rows["nll_sum"] = nll.sum(1)
        rows["chars"] = count[target].sum(1)
    return rows


def per_char(out: dict, token_chars: TokenChars | None) -> dict:
    """The accuracy and bits that compare across tokenizers, from one_batch's per-window rows:
    for chars a token is a char; for subwords the char figures count decoded chars and the
    per-token ones are kept beside them."""
    val_loss = out["nll"].mean()
    if token_chars is None:
        return {"eval/next_char_accuracy": out["acc"].mean(), "eval/bits_per_char": val_loss / LN2}
    return {
        "eval/next_char_accuracy": out["char_acc"].mean(),
        "eval/bits_per_char": out["nll_sum"].sum() / out["chars"].sum() / LN2,
        "eval/next_token_accuracy": out["acc"].mean(),
        "eval/bits_per_token": val_loss / LN2,
    }


def first_char_prob(logp0, tgt0, token_chars: TokenChars | None):
    """π(y0) for pass@k from the first target position's log-probs [n, V] and tokens [n]: the
    target token's probability, or for subwords the summed probability of all tokens whose
    first char is the target's (pass@k counts a sample right when its first char is)."""
    probs = jnp.exp(logp0)
    if token_chars is None:
        return jnp.take_along_axis(probs, tgt0[:, None], -1)[:, 0]
    first = jnp.asarray(token_chars.first_char)
    same = first[None, :] == first[tgt0][:, None]
    return jnp.where(same, probs, 0.0).sum(-1)


def pad_windows(context, target, batch_size: int):
    """[N, .] -> [nb, batch_size, .] with nb = ceil(N / batch_size), the last batch filled with
    copies of window N-1 (real tokens, so finite logits); the caller cuts the rows back to N."""
    pad = -context.shape[0] % batch_size
    # static shapes: every batch is the same, so lax.map compiles one body for all of them
    ctx, tgt = (jnp.pad(x, ((0, pad), (0, 0)), mode="edge") for x in (context, target))
    return ctx.reshape(-1, batch_size, ctx.shape[1]), tgt.reshape(-1, batch_size, tgt.shape[1])


def make_eval_fn(
    model: Transformer,
    context_len: int,
    horizon: int,
    batch_size: int,
    pass_k,
    token_chars: TokenChars | None = None,
):
    """Returns evaluate(params, context [N, C], target [N, H]) -> dict of arrays (jittable).
    ``token_chars``: None for a char vocabulary, else its tokens' chars (per_char)."""
    greedy_policy = transformer_policy(model, GREEDY, horizon)

    def one_batch(params, ctx, tgt):
        full = jnp.concatenate([ctx, tgt], axis=1)
        logits = model.apply({"params": params}, full[:, :-1])[:, context_len - 1 :]  # [n, H, V]
        logp = jax.nn.log_softmax(logits, -1)  # the same op as teacher_forced's (one, fused)
        p0 = first_char_prob(logp[:, 0], tgt[:, 0], token_chars)
        # greedy rollout: top-1 filtering makes the inverse-CDF sampler an argmax
        u = jnp.zeros((ctx.shape[0], 1, horizon))
        tokens, _ = sample(greedy_policy, params, TokenPrompts(ctx, None, {}), u, GREEDY)
        greedy = tokens[:, 0]
        return {
            **teacher_forced(logits, tgt, token_chars),
            "rollout_acc": (greedy == tgt).astype(jnp.float32).mean(1),
            "p0": p0,
            "greedy": greedy,
        }

    def evaluate(params, context, target):
        n = context.shape[0]
        out = jax.lax.map(lambda a: one_batch(params, *a), pad_windows(context, target, batch_size))
        # the rows are per window: cutting the padding here keeps it out of every metric below
        out = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:])[:n], out)
        res = {
            "eval/val_loss": out["nll"].mean(),
            **per_char(out, token_chars),
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
