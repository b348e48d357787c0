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

Prompts of different lengths are left-padded to a static ``P`` with a ``prompt_mask [B, P]``:
the last position is always the last prompt token (the decision point), pad keys are masked
out of every softmax, and positions count real tokens only (a prompt of n tokens occupies
positions 0..n-1 and its completion n, n+1, ...), so a prompt's logits do not depend on how
much padding it got. Fixed-length prompts (mask all ones) take exactly the unmasked path.

``attention`` (``model.attention``) picks how the full-sequence passes (prefill, extend and
their backward) compute this softmax: ``shared_prefix`` as above, or one
``jax.nn.dot_product_attention`` call per member over its concatenated keys (``cudnn``: the
fused flash kernel on a CUDA GPU; ``xla``: the same call through XLA). Decode always shares;
``decode_kernel`` (``model.decode_kernel``) runs its attention as XLA's ops (``xla``) or as
Pallas kernels (decode_kernel.py, a CUDA GPU): the framework's own (``pallas``) or jax's
flash-decoding kernel (``flash``).

Params are float32; activations use ``dtype`` (float32 or bfloat16); logits come out float32.
"""

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from grpo_jax.decode_kernel import KERNELS as PALLAS_KERNELS
from grpo_jax.products import dense_dot, lookup

_NEG_INF = -1e30  # large-but-finite so fully masked rows never make NaNs


class KV(NamedTuple):
    """Keys and values per layer: tuples of L arrays, head-major so that attention's batched
    matmuls need no transpose of the cache: prefix ``[B, h, P, d]``, member cache
    ``[B, G, h, S, d]``. Per-layer arrays (not one stacked array) let the decode loop update
    each layer's cache in place."""

    k: tuple
    v: tuple


class Prefix(NamedTuple):
    """A prefilled prompt: its keys/values, which of its P slots are real tokens, and its
    length in real tokens (the position of the first completion token)."""

    kv: KV
    mask: jax.Array  # [B, P] bool
    length: jax.Array  # [B] int32


def _attention(q, pk, pv, pmask, sk, sv, self_mask, dtype):
    """Softmax attention over [prefix ; own] keys, one softmax over both.

    q: [B, G, T, h, d]; pk/pv: [B, h, P, d] or None; pmask: [B, P] bool (real prefix keys);
    sk/sv: [B, G, h, S, d]; self_mask: broadcastable to [B, G, h, T, S] (True = may attend).
    Returns [B, G, T, h, d].

    The two key sets are never concatenated: each gets its own exponentials against their
    common max, and the normaliser is the sum of both, so the result is the softmax over the
    concatenation without materialising (and, in the backward pass, splitting) the [.., P + S]
    scores and their transposed copies. The prefix's keys are shared by the G members: its
    scores are one matmul over all (G, T) queries.
    """
    b, g, t, nh, hd = q.shape
    q = q * jnp.asarray(hd**-0.5, q.dtype)
    s_self = jnp.einsum("bgthd,bghsd->bghts", q, sk).astype(jnp.float32)
    s_self = jnp.where(self_mask, s_self, _NEG_INF)
    m = jnp.max(s_self, axis=-1)  # [B, G, h, T]
    if pk is not None:
        # the prefix's scores in its own layout, [B, h, G*T, P]: one matmul per (B, h); only
        # their row maxima and sums, never the scores, change layout to meet the own part's
        qp = q.transpose(0, 3, 1, 2, 4).reshape(b, nh, g * t, hd)
        s_pre = jnp.einsum("bhqd,bhpd->bhqp", qp, pk).astype(jnp.float32)
        s_pre = jnp.where(pmask[:, None, None, :], s_pre, _NEG_INF)
        m_pre = jnp.max(s_pre, axis=-1).reshape(b, nh, g, t).transpose(0, 2, 1, 3)
        m = jnp.maximum(m, m_pre)
    m = jax.lax.stop_gradient(m)  # any shift gives the same softmax: no gradient through it
    e_self = jnp.exp(s_self - m[..., None])
    denom = jnp.sum(e_self, axis=-1)
    # the weights first: the product comes out [B, G, h, T, d] and its transpose keeps d minor
    # (jnp.einsum puts the values first and transposes [B, G, h, d, T]; on a CPU the
    # exhaustive step's update and the TRL-comparable step's rollout ran 3-4 % slower so)
    batched = (((4,), (3,)), ((0, 1, 2), (0, 1, 2)))
    out = jax.lax.dot_general(e_self.astype(dtype), sv, batched).transpose(0, 1, 3, 2, 4)
    if pk is not None:
        m_q = m.transpose(0, 2, 1, 3).reshape(b, nh, g * t, 1)
        e_pre = jnp.exp(s_pre - m_q)
        denom = denom + jnp.sum(e_pre, axis=-1).reshape(b, nh, g, t).transpose(0, 2, 1, 3)
        out_p = jnp.einsum("bhqp,bhpd->bhqd", e_pre.astype(dtype), pv)
        out = out + out_p.reshape(b, nh, g, t, hd).transpose(0, 2, 3, 1, 4)
    return (out / denom.transpose(0, 1, 3, 2)[..., None]).astype(dtype)


ATTENTION = ("shared_prefix", "xla", "cudnn")  # model.attention's choices
DECODE_KERNELS = ("xla", *PALLAS_KERNELS)  # model.decode_kernel's: XLA's or decode_kernel.py's


def _joint_attention(q, k, v, prefix, self_mask, implementation):
    """The same softmax as ``_attention``, as one ``jax.nn.dot_product_attention`` call per
    member over its concatenated [prompt ; own] keys, so that ``implementation="cudnn"`` runs
    it as one fused (flash) kernel, forward and backward.

    q/k/v: [B, G, T, h, d]; prefix: (pk, pv, pmask) as in ``_attention``, or None;
    self_mask: broadcastable to [B, G, 1, T, T]. Returns [B, G, T, h, d].

    The prompt's keys are copied to each member (cuDNN takes one key set per query batch),
    and the mask travels as a bias: cuDNN's own masks are causal or trailing padding, while
    prompts here are left-padded. Query and key lengths are padded to even lengths with
    masked slots (cuDNN's flash kernel with a bias in training takes only even lengths).
    Two partial attentions merged by their log-sum-exps would avoid the copies, but jax's
    cuDNN backward drops the log-sum-exp's cotangent, so their gradients would be wrong.
    """
    b, g, t, nh, hd = q.shape
    mask = jnp.broadcast_to(self_mask, (b, g, 1, t, t))
    if prefix is not None:
        pk, pv, pmask = prefix
        p = pk.shape[2]
        share = lambda x: jnp.broadcast_to(x.transpose(0, 2, 1, 3)[:, None], (b, g, p, nh, hd))
        k = jnp.concatenate([share(pk), k], axis=2)
        v = jnp.concatenate([share(pv), v], axis=2)
        pm = jnp.broadcast_to(pmask[:, None, None, None, :], (b, g, 1, t, p))
        mask = jnp.concatenate([pm, mask], axis=-1)
    s = k.shape[2]
    tp, sp = t + t % 2, s + s % 2
    q = jnp.pad(q, [(0, 0), (0, 0), (0, tp - t), (0, 0), (0, 0)])
    k, v = (jnp.pad(x, [(0, 0), (0, 0), (0, sp - s), (0, 0), (0, 0)]) for x in (k, v))
    mask = jnp.pad(mask, [(0, 0)] * 3 + [(0, tp - t), (0, sp - s)])  # pads: False
    fold = lambda x: x.reshape(b * g, *x.shape[2:])
    out = jax.nn.dot_product_attention(
        fold(q), fold(k), fold(v), mask=fold(mask), implementation=implementation
    )
    return out.reshape(b, g, tp, nh, hd)[:, :, :t]


class Block(nn.Module):
    num_heads: int
    d_model: int
    mlp_ratio: int
    dropout: float
    dtype: Any
    attention: str = "shared_prefix"
    decode_kernel: str = "xla"

    @nn.compact
    def __call__(self, x, prefix, cache, index, deterministic, key_mask=None):
        """x: [B, G, T, D]. prefix: (k, v, mask) with k/v [B, h, P, d], mask [B, P], or None.

        key_mask: [B, T] bool, x's own real tokens (prefill of padded prompts), or None.
        cache: None -> causal self-attention within x (prefill / extend);
               (k, v) [B, G, h, S, d] -> decode (T = 1): x's key/value are written at slot
               ``index`` and x attends to slots <= index.
        Returns (x, (k, v)): x's own keys/values [B, G, h, T, d], or the updated cache.
        """
        b, g, t, _ = x.shape
        hd = self.d_model // self.num_heads
        dense = lambda n, name: nn.Dense(
            n, dtype=self.dtype, param_dtype=jnp.float32, dot_general=dense_dot, name=name
        )
        drop = nn.Dropout(self.dropout, deterministic=deterministic)

        # the dense layers and norms see [B*G*T, D] rows: a 2-D matmul's weight gradient is
        # one contraction over the rows, where a [B, G, T, D] operand costs a transposed copy
        x = x.reshape(b * g * t, self.d_model)
        h = nn.LayerNorm(dtype=self.dtype, param_dtype=jnp.float32, name="ln1")(x)
        qkv = dense(3 * self.d_model, "qkv")(h).reshape(b, g, t, 3, self.num_heads, hd)
        q = qkv[..., 0, :, :]
        k = qkv[..., 1, :, :].transpose(0, 1, 3, 2, 4)  # [B, G, h, T, d]
        v = qkv[..., 2, :, :].transpose(0, 1, 3, 2, 4)
        if cache is None:
            sk, sv = k, v
            mask = jnp.tril(jnp.ones((t, t), bool))
            if key_mask is not None:
                mask = mask & key_mask[:, None, None, None, :]
        else:
            sk = jax.lax.dynamic_update_slice_in_dim(cache[0], k.astype(cache[0].dtype), index, 3)
            sv = jax.lax.dynamic_update_slice_in_dim(cache[1], v.astype(cache[1].dtype), index, 3)
            mask = (jnp.arange(sk.shape[3]) <= index)[None, :]
        if cache is not None and self.decode_kernel != "xla":
            kernel = PALLAS_KERNELS[self.decode_kernel]
            att = kernel(q[:, :, 0], *prefix, sk, sv, index)[:, :, None]
        elif cache is None and self.attention != "shared_prefix":
            # decode keeps the shared-prefix path: one query per member would copy the
            # prompt's keys per member at every step, multiplying decode's memory traffic
            own_k, own_v = qkv[..., 1, :, :], qkv[..., 2, :, :]  # [B, G, T, h, d], as q
            att = _joint_attention(q, own_k, own_v, prefix, mask, self.attention)
        else:
            pk, pv, pm = prefix if prefix is not None else (None, None, None)
            att = _attention(q, pk, pv, pm, sk, sv, mask, self.dtype)
        att = att.reshape(x.shape)
        x = x + drop(dense(self.d_model, "proj")(att))

        h = nn.LayerNorm(dtype=self.dtype, param_dtype=jnp.float32, name="ln2")(x)
        h = nn.gelu(dense(self.mlp_ratio * self.d_model, "fc")(h))
        x = x + drop(dense(self.d_model, "out")(h))
        return x.reshape(b, g, t, self.d_model), (sk, sv)


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
    attention: str = "shared_prefix"  # one of ATTENTION: the full-sequence passes' attention
    decode_kernel: str = "xla"  # one of DECODE_KERNELS: the decode step's attention

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
            Block(
                self.num_heads,
                self.d_model,
                self.mlp_ratio,
                self.dropout,
                self.dtype,
                self.attention,
                self.decode_kernel,
            )
            for _ in range(self.num_layers)
        ]
        self.ln_f = nn.LayerNorm(dtype=self.dtype, param_dtype=jnp.float32)
        self.drop = nn.Dropout(self.dropout)

    def _embed(self, tokens, positions, deterministic):
        """tokens [..., T] and their positions (int, broadcastable to tokens).

        Both tables are read in float32 and cast afterwards: a lookup's gradient sums every
        token's cotangent into its row (a scatter-add), and a frequent char's row collects
        thousands of terms, which a bfloat16 running sum (8 bits) rounds away: 4 % relative
        error in the table's gradient at 4,096 tokens of 3 chars, none in float32 (test).
        Off a CPU a small table's sum runs as a matmul instead (lookup); the position table's
        at any length: its ids are the prompts' positions, which the G members share (the
        broadcast sums their cotangents first), so its one-hot is [B * T, max_len]."""
        tok = lookup(self.embed.embedding, tokens).astype(self.dtype)
        # "clip": XLA's own gather semantics, no out-of-range mask (positions stay in range:
        # max_len covers the prompt and the horizon)
        pos = lookup(self.pos, positions, one_hot_rows=self.max_len, mode="clip").astype(self.dtype)
        return self.drop(tok + pos, deterministic=deterministic)

    def _logits(self, x):
        return self.embed.attend(self.ln_f(x)).astype(jnp.float32)

    def prefill(self, tokens, prompt_mask=None, deterministic=True):
        """tokens [B, T] (left-padded when ``prompt_mask`` [B, T] is given) ->
        (logits [B, T, V], Prefix with L x [B, h, T, d] keys/values)."""
        b, t = tokens.shape
        if prompt_mask is None:
            mask = jnp.ones((b, t), bool)
            positions = jnp.arange(t)
        else:
            mask = prompt_mask > 0
            positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
        x = self._embed(tokens, positions, deterministic)[:, None]
        key_mask = None if prompt_mask is None else mask
        ks, vs = [], []
        for blk in self.blocks:
            x, (k, v) = blk(x, None, None, None, deterministic, key_mask)
            ks.append(k[:, 0])
            vs.append(v[:, 0])
        length = jnp.sum(mask, axis=1).astype(jnp.int32)
        return self._logits(x[:, 0]), Prefix(KV(tuple(ks), tuple(vs)), mask, length)

    def __call__(self, tokens, deterministic=True, prompt_mask=None):
        """Full causal forward: tokens [B, T] -> logits [B, T, V]."""
        return self.prefill(tokens, prompt_mask, deterministic)[0]

    def _layer_prefix(self, prefix: Prefix, i: int):
        return prefix.kv.k[i], prefix.kv.v[i], prefix.mask

    def extend(self, prefix: Prefix, tokens):
        """Continuations [B, G, T] right after the prompt, attending to the shared prefix.

        Returns logits [B, G, T, V]; position t predicts token t + 1.
        """
        positions = prefix.length[:, None, None] + jnp.arange(tokens.shape[-1])
        x = self._embed(tokens, positions, True)
        for i, blk in enumerate(self.blocks):
            x, _ = blk(x, self._layer_prefix(prefix, i), None, None, True)
        return self._logits(x)

    def decode(self, prefix: Prefix, cache: KV, tokens, index):
        """One step: tokens [B, G] at completion slot ``index`` (position length + index),
        written into ``cache`` (L x [B, G, h, S, d]). Returns (logits [B, G, V], cache)."""
        positions = (prefix.length + index)[:, None, None]
        x = self._embed(tokens[..., None], positions, True)
        ks, vs = [], []
        for i, blk in enumerate(self.blocks):
            layer_cache = (cache.k[i], cache.v[i])
            x, (k, v) = blk(x, self._layer_prefix(prefix, i), layer_cache, index, True)
            ks.append(k)
            vs.append(v)
        return self._logits(x[:, :, 0]), KV(tuple(ks), tuple(vs))


def empty_cache(model: Transformer, batch: int, group: int, length: int) -> KV:
    """Zeroed member cache, L x ``[B, G, heads, length, hd]``, in the compute dtype."""
    hd = model.d_model // model.num_heads
    z = jnp.zeros((batch, group, model.num_heads, length, hd), model.dtype)
    return KV((z,) * model.num_layers, (z,) * model.num_layers)


def decode_params(model: Transformer, params):
    """``params`` as a loop of decode steps reads them: every weight but the LayerNorms' cast
    to the compute dtype once, before the loop. Each step would cast them again (XLA does not
    hoist the casts out of the loop: on one H100 the 12 x 768 model's rollout spent 22.6 of
    its 245 decode-loop ms per step in the qkv, fc and out kernels' casts). The same values:
    a Dense layer and the tied head cast their float32 weights to the compute dtype, and an
    embedding row cast after the lookup is the cast table's row. LayerNorm multiplies its
    float32 statistics by its float32 scale, so a cast scale would round: those stay."""
    if model.dtype == jnp.float32:
        return params

    def cast(path, x):
        in_norm = any(str(getattr(k, "key", "")).startswith("ln") for k in path)
        return x if in_norm else x.astype(model.dtype)

    return jax.tree_util.tree_map_with_path(cast, params)


DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def make_model(model_cfg, vocab_size: int, max_len: int) -> Transformer:
    """Build the Transformer from a validated ``specs.ModelSpec``."""
    return Transformer(
        vocab_size=vocab_size,
        num_layers=model_cfg.num_layers,
        num_heads=model_cfg.num_heads,
        d_model=model_cfg.d_model,
        mlp_ratio=model_cfg.mlp_ratio,
        max_len=max_len,
        dropout=model_cfg.dropout,
        dtype=DTYPES[model_cfg.dtype],
        attention=model_cfg.attention,
        decode_kernel=model_cfg.decode_kernel,
    )


def init_params(model: Transformer, key, seq_len: int = 8):
    return model.init(key, jnp.zeros((1, seq_len), jnp.int32))["params"]


def group_logits(model: Transformer, params, context, tokens, prompt_mask=None):
    """Training forward of a group: context [B, C] (left-padded under ``prompt_mask``),
    tokens [B, K, H] -> (first_logits [B, V], logits [B, K, H, V]) where logits[:, :, t]
    scores tokens[:, :, t].

    The context runs once per prompt; token 0's distribution is the context's last position,
    tokens 1..H-1 come from ``extend`` over tokens 0..H-2 attending to the shared prefix."""
    logits_c, prefix = model.apply(
        {"params": params}, context, prompt_mask, method=Transformer.prefill
    )
    first = logits_c[:, -1]
    b, k, h = tokens.shape
    head = jnp.broadcast_to(first[:, None, None], (b, k, 1, first.shape[-1]))
    if h == 1:
        return first, head
    rest = model.apply({"params": params}, prefix, tokens[..., :-1], method=Transformer.extend)
    return first, jnp.concatenate([head, rest], axis=2)
