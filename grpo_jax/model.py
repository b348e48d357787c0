"""Decoder-only char transformer with an explicit, shared-prefix KV cache.

Every GRPO group shares its prompt. Instead of copying the prompt's KV cache to each of the
G (or V) members, activations are laid out as ``[B, G, T, D]`` and attention is split in two:
queries attend to the prompt's keys/values ``[B, heads, P, hd]`` (one copy per prompt) and to
their own member's keys/values ``[B, G, heads, S, hd]``; one softmax runs over both. The same
layout serves three uses:

  * ``__call__`` / ``prefill``: a causal forward over ``[B, T]`` tokens (G = 1, no prefix);
    ``prefill`` also returns the per-layer keys/values to use as the prefix.
  * ``extend``: the training forward of the continuations ``[B, G, T]`` given the prefix; the
    prompt is run once per prompt, and gradients flow back through the shared prefix.
  * ``decode``: one token per member ``[B, G]`` against the prefix plus a member cache
    ``L x [B, G, heads, S, hd]`` written at ``index``.

Params are float32; activations use ``dtype`` (float32 or bfloat16); logits come out float32.
"""

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

_NEG_INF = -1e30  # large-but-finite so fully masked rows never make NaNs


class KV(NamedTuple):
    """Keys and values per layer: tuples of L arrays, head-major so that attention's batched
    matmuls need no transpose of the cache: prefix ``[B, h, P, d]``, member cache
    ``[B, G, h, S, d]``. Per-layer arrays (not one stacked array) let the decode loop update
    each layer's cache in place."""

    k: tuple
    v: tuple


def _attention(q, pk, pv, sk, sv, self_mask, dtype):
    """Softmax attention over [prefix ; own] keys, one softmax over both.

    q: [B, G, T, h, d]; pk/pv: [B, h, P, d] or None; sk/sv: [B, G, h, S, d];
    self_mask: broadcastable to [B, G, h, T, S] (True = may attend). Returns [B, G, T, h, d].
    """
    b, g, t, nh, hd = q.shape
    q = q * jnp.asarray(hd**-0.5, q.dtype)
    qs = q.transpose(0, 1, 3, 2, 4)  # [B, G, h, T, d]
    s_self = jnp.einsum("bghtd,bghsd->bghts", qs, sk).astype(jnp.float32)
    s_self = jnp.where(self_mask, s_self, _NEG_INF)
    if pk is None:
        w = jax.nn.softmax(s_self, axis=-1).astype(dtype)
        out = jnp.einsum("bghts,bghsd->bghtd", w, sv)
        return out.transpose(0, 1, 3, 2, 4)
    # prefix keys are shared by the G members: fold (G, T) into one query axis
    qp = q.transpose(0, 3, 1, 2, 4).reshape(b, nh, g * t, hd)
    s_pre = jnp.einsum("bhqd,bhpd->bhqp", qp, pk).astype(jnp.float32)
    s_pre = s_pre.reshape(b, nh, g, t, -1).transpose(0, 2, 1, 3, 4)  # [B, G, h, T, P]
    w = jax.nn.softmax(jnp.concatenate([s_pre, s_self], axis=-1), axis=-1).astype(dtype)
    p = pk.shape[2]
    wp = w[..., :p].transpose(0, 2, 1, 3, 4).reshape(b, nh, g * t, p)
    out_p = jnp.einsum("bhqp,bhpd->bhqd", wp, pv).reshape(b, nh, g, t, hd)
    out_s = jnp.einsum("bghts,bghsd->bghtd", w[..., p:], sv)
    return out_p.transpose(0, 2, 3, 1, 4) + out_s.transpose(0, 1, 3, 2, 4)


class Block(nn.Module):
    num_heads: int
    d_model: int
    mlp_ratio: int
    dropout: float
    dtype: Any

    @nn.compact
    def __call__(self, x, prefix, cache, index, deterministic):
        """x: [B, G, T, D]. prefix: (k, v) [B, h, P, d] or None.

        cache: None -> causal self-attention within x (prefill / extend);
               (k, v) [B, G, h, S, d] -> decode (T = 1): x's key/value are written at slot
               ``index`` and x attends to slots <= index.
        Returns (x, (k, v)): x's own keys/values [B, G, h, T, d], or the updated cache.
        """
        b, g, t, _ = x.shape
        hd = self.d_model // self.num_heads
        dense = lambda n, name: nn.Dense(n, dtype=self.dtype, param_dtype=jnp.float32, name=name)
        drop = nn.Dropout(self.dropout, deterministic=deterministic)

        h = nn.LayerNorm(dtype=self.dtype, param_dtype=jnp.float32, name="ln1")(x)
        qkv = dense(3 * self.d_model, "qkv")(h).reshape(b, g, t, 3, self.num_heads, hd)
        q = qkv[..., 0, :, :]
        k = qkv[..., 1, :, :].transpose(0, 1, 3, 2, 4)  # [B, G, h, T, d]
        v = qkv[..., 2, :, :].transpose(0, 1, 3, 2, 4)
        if cache is None:
            sk, sv = k, v
            mask = jnp.tril(jnp.ones((t, t), bool))
        else:
            sk = jax.lax.dynamic_update_slice_in_dim(cache[0], k.astype(cache[0].dtype), index, 3)
            sv = jax.lax.dynamic_update_slice_in_dim(cache[1], v.astype(cache[1].dtype), index, 3)
            mask = (jnp.arange(sk.shape[3]) <= index)[None, :]
        pk, pv = prefix if prefix is not None else (None, None)
        att = _attention(q, pk, pv, sk, sv, mask, self.dtype).reshape(b, g, t, self.d_model)
        x = x + drop(dense(self.d_model, "proj")(att))

        h = nn.LayerNorm(dtype=self.dtype, param_dtype=jnp.float32, name="ln2")(x)
        h = nn.gelu(dense(self.mlp_ratio * self.d_model, "fc")(h))
        x = x + drop(dense(self.d_model, "out")(h))
        return x, (sk, sv)


class Transformer(nn.Module):
    """GPT-style char model; the output head is tied to the token embedding."""

    vocab_size: int
    num_layers: int = 4
    num_heads: int = 4
    d_model: int = 128
    mlp_ratio: int = 4
    max_len: int = 170
    dropout: float = 0.0
    dtype: Any = jnp.float32

    def setup(self):
        if self.d_model % self.num_heads:
            raise ValueError(
                f"model.d_model={self.d_model} is not divisible by model.num_heads={self.num_heads}"
            )
        self.embed = nn.Embed(
            self.vocab_size,
            self.d_model,
            embedding_init=nn.initializers.normal(0.02),
            param_dtype=jnp.float32,
            dtype=self.dtype,
        )
        self.pos = self.param(
            "pos_embedding", nn.initializers.normal(0.02), (self.max_len, self.d_model)
        )
        self.blocks = [
            Block(self.num_heads, self.d_model, self.mlp_ratio, self.dropout, self.dtype)
            for _ in range(self.num_layers)
        ]
        self.ln_f = nn.LayerNorm(dtype=self.dtype, param_dtype=jnp.float32)
        self.drop = nn.Dropout(self.dropout)

    def _embed(self, tokens, offset, deterministic):
        t = tokens.shape[-1]
        pos = jax.lax.dynamic_slice_in_dim(self.pos, offset, t, 0).astype(self.dtype)
        return self.drop(self.embed(tokens) + pos, deterministic=deterministic)

    def _logits(self, x):
        return self.embed.attend(self.ln_f(x)).astype(jnp.float32)

    def prefill(self, tokens, deterministic=True):
        """tokens [B, T] -> (logits [B, T, V], prefix KV of L x [B, h, T, d])."""
        x = self._embed(tokens, 0, deterministic)[:, None]
        ks, vs = [], []
        for blk in self.blocks:
            x, (k, v) = blk(x, None, None, None, deterministic)
            ks.append(k[:, 0])
            vs.append(v[:, 0])
        return self._logits(x[:, 0]), KV(tuple(ks), tuple(vs))

    def __call__(self, tokens, deterministic=True):
        """Full causal forward: tokens [B, T] -> logits [B, T, V]."""
        return self.prefill(tokens, deterministic)[0]

    def extend(self, prefix: KV, tokens, offset):
        """Continuations [B, G, T] at positions offset.. attending to the shared prefix.

        Returns logits [B, G, T, V]; position t predicts token t + 1.
        """
        x = self._embed(tokens, offset, True)
        for i, blk in enumerate(self.blocks):
            x, _ = blk(x, (prefix.k[i], prefix.v[i]), None, None, True)
        return self._logits(x)

    def decode(self, prefix: KV, cache: KV, tokens, index, offset):
        """One step: tokens [B, G] at position offset + index, written into ``cache``
        (L x [B, G, h, S, d]) at slot ``index``. Returns (logits [B, G, V], cache)."""
        x = self._embed(tokens[..., None], offset + index, True)
        ks, vs = [], []
        for i, blk in enumerate(self.blocks):
            x, (k, v) = blk(x, (prefix.k[i], prefix.v[i]), (cache.k[i], cache.v[i]), index, True)
            ks.append(k)
            vs.append(v)
        return self._logits(x[:, :, 0]), KV(tuple(ks), tuple(vs))


def empty_cache(model: Transformer, batch: int, group: int, length: int) -> KV:
    """Zeroed member cache, L x ``[B, G, heads, length, hd]``, in the compute dtype."""
    hd = model.d_model // model.num_heads
    z = jnp.zeros((batch, group, model.num_heads, length, hd), model.dtype)
    return KV((z,) * model.num_layers, (z,) * model.num_layers)


DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def make_model(model_cfg, vocab_size: int, max_len: int) -> Transformer:
    """Build the Transformer from ``config.model``; an unknown dtype is a one-line error."""
    if model_cfg.dtype not in DTYPES:
        raise ValueError(f"model.dtype={model_cfg.dtype!r} is unknown; choose from {list(DTYPES)}")
    return Transformer(
        vocab_size=vocab_size,
        num_layers=model_cfg.num_layers,
        num_heads=model_cfg.num_heads,
        d_model=model_cfg.d_model,
        mlp_ratio=model_cfg.mlp_ratio,
        max_len=max_len,
        dropout=model_cfg.dropout,
        dtype=DTYPES[model_cfg.dtype],
    )


def init_params(model: Transformer, key, seq_len: int = 8):
    return model.init(key, jnp.zeros((1, seq_len), jnp.int32))["params"]


def group_logits(model: Transformer, params, context, tokens):
    """Training forward of a group: context [B, C], tokens [B, K, H] ->
    (first_logits [B, V], logits [B, K, H, V]) where logits[:, :, t] scores tokens[:, :, t].

    The context runs once per prompt; token 0's distribution is the context's last position,
    tokens 1..H-1 come from ``extend`` over tokens 0..H-2 attending to the shared prefix."""
    logits_c, prefix = model.apply({"params": params}, context, method=Transformer.prefill)
    first = logits_c[:, -1]
    b, k, h = tokens.shape
    head = jnp.broadcast_to(first[:, None, None], (b, k, 1, first.shape[-1]))
    if h == 1:
        return first, head
    rest = model.apply(
        {"params": params},
        prefix,
        tokens[..., :-1],
        context.shape[1],
        method=Transformer.extend,
    )
    return first, jnp.concatenate([head, rest], axis=2)
