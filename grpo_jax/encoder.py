"""A small bidirectional (non-causal) char transformer with two heads.

head="tokens": per-position logits ``[B, L, out_size]`` (the fill-in generator: every
               position sees the whole window, masked positions included);
head="score":  one score per window ``[B]`` (the judge, a sequence scorer). A Dense(1)
               named ``score_head`` (the name is how a judge checkpoint is recognised) gives
               each position a logit s_t of "this char is original" (ELECTRA-style replaced
               token detection: one label per char, so it learns from far fewer windows than
               one label per window); the window's logit is Σ_t log σ(s_t) (log P(every
               char original)) plus a learned bias (calibrated by a window-level loss).
               ``per_token=True`` returns the s_t ``[B, L]``.
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

HEADS = ("tokens", "score")
SCORE_HEAD = "score_head"


class Encoder(nn.Module):
    vocab_size: int  # input vocabulary (the generator's includes the mask token)
    out_size: int = 0  # tokens head: output vocabulary (the real chars only)
    num_layers: int = 2
    num_heads: int = 2
    d_model: int = 64
    mlp_ratio: int = 4
    max_len: int = 64
    head: str = "tokens"
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, tokens, per_token: bool = False):
        """tokens [B, L] int32 -> logits [B, L, out_size] (tokens) or scores [B] (score)."""
        if self.head not in HEADS:
            raise ValueError(f"encoder head {self.head!r} is unknown; choose from {HEADS}")
        if self.d_model % self.num_heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}"
            )
        length = tokens.shape[-1]
        pos = self.param(
            "pos_embedding", nn.initializers.normal(0.02), (self.max_len, self.d_model)
        )
        x = nn.Embed(self.vocab_size, self.d_model, name="embed")(tokens) + pos[:length]
        x = x.astype(self.dtype)
        for i in range(self.num_layers):
            h = nn.LayerNorm(dtype=self.dtype, name=f"ln1_{i}")(x)
            x = x + nn.MultiHeadDotProductAttention(
                num_heads=self.num_heads, dtype=self.dtype, name=f"attn_{i}"
            )(h)  # no mask: every position attends to the whole window
            h = nn.LayerNorm(dtype=self.dtype, name=f"ln2_{i}")(x)
            h = nn.gelu(
                nn.Dense(self.mlp_ratio * self.d_model, dtype=self.dtype, name=f"fc_{i}")(h)
            )
            x = x + nn.Dense(self.d_model, dtype=self.dtype, name=f"out_{i}")(h)
        x = nn.LayerNorm(dtype=self.dtype, name="ln_f")(x)
        if self.head == "score":
            s = nn.Dense(1, name=SCORE_HEAD)(x)[..., 0].astype(jnp.float32)  # [B, L]
            if per_token:
                return s
            bias = self.param("score_bias", nn.initializers.zeros, ())  # window calibration
            return jnp.sum(jax.nn.log_sigmoid(s), -1) + bias
        return nn.Dense(self.out_size, name="lm_head")(x).astype(jnp.float32)
