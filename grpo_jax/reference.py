"""N-gram reference language models (orders 1-5) over token ids as jittable pytrees: chars,
or BPE tokens (data.tokenizer=bpe), where "char" below reads "token".

A dense order-5 table would need 65**4 contexts x 65 entries, so each order k
keeps only the contexts seen in train: their (k-1)-char contexts as sorted
int32 codes (base-V digits, oldest char most significant) and one log-prob row
per seen context (add-k smoothed). A lookup is `searchsorted` plus an equality
check; an unseen context backs off to order k-1, recursively down to the
unigram. Every suffix of a seen context is itself seen, so "the highest order
whose context was seen" is exactly that recursive backoff.

All per-order tables are stacked into one `logprobs` array (order k's rows
start at `offsets[k-1]`), so a whole batch of distributions is one gather.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

MAX_ORDER = 5
# Dense rows: an order's table holds (seen contexts + 1) x V log-probs. Chars never come near
# (order 5: 3.2M); a subword vocabulary does (order 3 over 1024 BPE tokens: 61M, over 4096:
# 378M, ~9 GB of counting temporaries), so a table past this is refused before it is built.
MAX_TABLE_ENTRIES = 1 << 26


@struct.dataclass
class NgramLM:
    """Backoff n-gram LM.

    codes: per order k = 1..order, sorted int32 [M_k] context codes (order 1 has
      the single empty context, code 0).
    logprobs: float32 [sum_k (M_k + 1), V]; order k's table is rows
      offsets[k-1] : offsets[k-1] + M_k + 1, whose last row (uniform) is padding
      so that a not-found searchsorted index M_k still lands inside the table.
    offsets, order, vocab_size: static Python ints (not traced leaves).
    """

    codes: tuple
    logprobs: jax.Array
    offsets: tuple = struct.field(pytree_node=False)
    order: int = struct.field(pytree_node=False)
    vocab_size: int = struct.field(pytree_node=False)

    def table(self, k: int) -> jax.Array:
        """Order k's log-prob table, [M_k + 1, V] (last row is padding)."""
        start = self.offsets[k - 1]
        return self.logprobs[start : start + self.codes[k - 1].shape[0] + 1]


def fit_ngram(
    train_tokens: np.ndarray, vocab_size: int, order: int, smoothing: float = 0.1
) -> NgramLM:
    """Counts orders 1..`order` on int tokens [N] with add-`smoothing` smoothing.

    p(c | ctx) = (count(ctx, c) + k) / (count(ctx) + k * V) for every context
    ctx seen in train (followed by some char); numpy counting, ~1 s for order 5
    on 1M chars.
    """
    if not 1 <= order <= MAX_ORDER:
        raise ValueError(
            f"n-gram order {order} is unsupported: set reference.ngram_order in 1..{MAX_ORDER}"
        )
    if not smoothing > 0:
        raise ValueError(f"n-gram smoothing must be > 0 (got {smoothing})")
    v = int(vocab_size)
    if v ** (order - 1) > np.iinfo(np.int32).max:
        raise ValueError(
            f"vocab_size {v} ** {order - 1} overflows int32 context codes: "
            "lower reference.ngram_order"
        )
    tokens = np.asarray(train_tokens).astype(np.int64).reshape(-1)
    if len(tokens) < order:
        raise ValueError(f"need at least {order} train tokens for order {order}")
    if tokens.min() < 0 or tokens.max() >= v:
        raise ValueError(f"train tokens must lie in [0, {v})")

    codes, tables, offsets, start = [], [], [], 0
    pad = np.full((1, v), -np.log(v), np.float32)
    for k in range(1, order + 1):
        ctx_len = k - 1
        nxt = tokens[ctx_len:]
        code = np.zeros(len(nxt), np.int64)
        for j in range(ctx_len):  # oldest char first = most significant digit
            code = code * v + tokens[j : j + len(nxt)]
        uniq, inv = np.unique(code, return_inverse=True)
        if (len(uniq) + 1) * v > MAX_TABLE_ENTRIES:
            raise ValueError(
                f"an order-{k} n-gram over {v} tokens needs a table of {len(uniq) + 1} seen "
                f"contexts x {v} = {(len(uniq) + 1) * v:,} log-probs (limit "
                f"{MAX_TABLE_ENTRIES:,}): lower reference.ngram_order / eval.ngram_baselines"
            )
        counts = np.bincount(inv.reshape(-1) * v + nxt, minlength=len(uniq) * v)
        counts = counts.reshape(len(uniq), v).astype(np.float64)
        denom = counts.sum(axis=1, keepdims=True) + smoothing * v
        logp = (np.log(counts + smoothing) - np.log(denom)).astype(np.float32)
        codes.append(jnp.asarray(uniq.astype(np.int32)))
        tables.append(np.concatenate([logp, pad]))
        offsets.append(start)
        start += len(uniq) + 1
    return NgramLM(
        codes=tuple(codes),
        logprobs=jnp.asarray(np.concatenate(tables)),
        offsets=tuple(offsets),
        order=order,
        vocab_size=v,
    )


def _rows(lm: NgramLM, tokens: jax.Array) -> jax.Array:
    """int [..., L] -> int32 [..., L] rows of `lm.logprobs` (backoff applied).

    Row i is the distribution of the char after tokens[..., i] given the up to
    order-1 chars ending there; near the start only the orders with enough
    history are considered.
    """
    tokens = jnp.asarray(tokens, jnp.int32)
    length = tokens.shape[-1]
    pos = jnp.arange(length)
    row = jnp.full(tokens.shape, lm.offsets[0], jnp.int32)  # unigram fallback
    code = jnp.zeros_like(tokens)
    for k in range(2, lm.order + 1):
        j = k - 2  # order k adds tokens[i - j] as its most significant digit
        if j >= length:
            break
        lead = [(0, 0)] * (tokens.ndim - 1) + [(j, 0)]
        code = code + jnp.pad(tokens[..., : length - j], lead) * lm.vocab_size**j
        table_codes = lm.codes[k - 1]
        idx = jnp.searchsorted(table_codes, code).astype(jnp.int32)
        hit = table_codes[jnp.minimum(idx, table_codes.shape[0] - 1)] == code
        # pos >= j: the context really has k-1 chars (not left padding).
        row = jnp.where(hit & (pos >= j), lm.offsets[k - 1] + idx, row)
    return row


@jax.jit
def ngram_logprobs(lm: NgramLM, tokens: jax.Array) -> jax.Array:
    """int tokens [..., L] (ids in [0, V)) -> float32 log-probs [..., L, V].

    Entry i is log p(next char | the up to order-1 chars ending at tokens[i]).
    """
    return lm.logprobs[_rows(lm, tokens)]


@jax.jit
def rollout_ref_logprobs(lm: NgramLM, context: jax.Array, generated: jax.Array) -> jax.Array:
    """Reference distributions along rollouts.

    Args:
      context: int [B, C] prompts (C >= 1).
      generated: int [B, G, H] continuations, G per prompt.
    Returns:
      float32 [B, G, H, V]; [b, g, t] is the distribution of generated[b, g, t]
      given context[b] followed by generated[b, g, :t].
    """
    b, g, h = generated.shape
    c = context.shape[-1]
    if context.shape != (b, c) or c < 1:
        raise ValueError(
            f"context must be [B, C>=1] matching generated [B, G, H]; got "
            f"{context.shape} and {generated.shape}"
        )
    if lm.order == 1 or h == 0:
        unigram = lm.logprobs[lm.offsets[0]]
        return jnp.broadcast_to(unigram, (b, g, h, lm.vocab_size))
    # Only the last order-1 context chars matter; the G copies of them are a
    # cheap int broadcast, and only the [B, G, H, V] output is float.
    t = min(c, lm.order - 1)
    tail = jnp.broadcast_to(context[:, None, c - t :], (b, g, t))
    seq = jnp.concatenate([tail.astype(jnp.int32), generated[..., :-1]], axis=-1)
    rows = _rows(lm, seq)[..., t - 1 :]  # history ending just before each t
    return lm.logprobs[rows]


@jax.jit
def _argmax_next(lm: NgramLM, tokens: jax.Array) -> jax.Array:
    return jnp.argmax(lm.logprobs, axis=-1)[_rows(lm, tokens)]


def next_char_accuracy(lm: NgramLM, tokens: np.ndarray, chunk: int = 1 << 16) -> float:
    """Host helper: fraction of i with argmax p(. | history to i) == tokens[i+1].

    Runs in chunks (with order-2 chars of overlapping history) so a whole split
    never materialises an [N, V] array.
    """
    tokens = np.asarray(tokens, np.int32).reshape(-1)
    n = len(tokens) - 1  # number of predictions
    if n < 1:
        raise ValueError("need at least 2 tokens to measure next-char accuracy")
    overlap = max(lm.order - 2, 0)
    correct = 0
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        lo = max(s - overlap, 0)
        pred = np.asarray(_argmax_next(lm, tokens[lo:e]))[s - lo :]
        correct += int((pred == tokens[s + 1 : e + 1]).sum())
    return correct / n


def window_predictions(lm: NgramLM, context: np.ndarray, target: np.ndarray) -> np.ndarray:
    """int [W, H]: the n-gram's argmax next token at each target position, given its true
    history in the window (context [W, C], target [W, H])."""
    full = jnp.asarray(np.concatenate([context, target], axis=1), jnp.int32)
    return np.asarray(_argmax_next(lm, full[:, :-1]))[:, context.shape[1] - 1 :]


def window_hits(lm: NgramLM, context: np.ndarray, target: np.ndarray) -> np.ndarray:
    """bool [W, H]: the n-gram's argmax next char equals target, each target char given its
    true history in the window (context [W, C], target [W, H])."""
    return window_predictions(lm, context, target) == np.asarray(target)


def window_accuracy(lm: NgramLM, context: np.ndarray, target: np.ndarray) -> float:
    """The n-gram's figure on exactly the windows a policy's eval/next_char_accuracy uses."""
    return float(window_hits(lm, context, target).mean())
