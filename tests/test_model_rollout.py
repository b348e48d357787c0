"""Model KV cache vs full forward, and rollout invariants (chunking, log-probs, forcing)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax import rollout as ro
from grpo_jax.model import Transformer, empty_cache, group_logits, init_params

V, B, G, C, H = 11, 2, 3, 5, 6


@pytest.fixture(scope="module")
def model_params():
    m = Transformer(vocab_size=V, num_layers=2, num_heads=2, d_model=16, max_len=C + H)
    return m, init_params(m, jax.random.PRNGKey(0))


def _full_logits(m, p, ctx, gen):
    seq = jnp.concatenate([jnp.broadcast_to(ctx[:, None], (B, G, C)), gen], -1)
    return m.apply({"params": p}, seq.reshape(B * G, C + H)).reshape(B, G, C + H, V)


def test_prefill_extend_decode_equal_full_forward(model_params):
    m, p = model_params
    ctx = jax.random.randint(jax.random.PRNGKey(1), (B, C), 0, V)
    gen = jax.random.randint(jax.random.PRNGKey(2), (B, G, H), 0, V)
    ref = _full_logits(m, p, ctx, gen)
    logits, prefix = m.apply({"params": p}, ctx, method=Transformer.prefill)
    np.testing.assert_allclose(logits, ref[:, 0, :C], atol=1e-5)
    ext = m.apply({"params": p}, prefix, gen, C, method=Transformer.extend)
    np.testing.assert_allclose(ext, ref[:, :, C:], atol=1e-5)
    cache, outs = empty_cache(m, B, G, H), []
    for t in range(H):
        lg, cache = m.apply(
            {"params": p}, prefix, cache, gen[:, :, t], t, C, method=Transformer.decode
        )
        outs.append(lg)
    np.testing.assert_allclose(jnp.stack(outs, 2), ref[:, :, C:], atol=1e-5)
    # group_logits: position t scores token t (token 0 from the context's last position)
    first, gl = group_logits(m, p, ctx, gen)
    np.testing.assert_allclose(gl, ref[:, :, C - 1 : C + H - 1], atol=1e-5)
    np.testing.assert_allclose(first, ref[:, 0, C - 1], atol=1e-5)


def test_bfloat16_compute_runs_with_float32_params():
    m = Transformer(
        vocab_size=V, num_layers=1, num_heads=2, d_model=16, max_len=16, dtype=jnp.bfloat16
    )
    p = init_params(m, jax.random.PRNGKey(0))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(p))
    out = m.apply({"params": p}, jnp.zeros((2, 8), jnp.int32))
    assert out.dtype == jnp.float32 and np.isfinite(np.asarray(out)).all()


def test_sampler_matches_numpy_inverse_cdf_and_filters():
    logits = jnp.array([[0.0, 1.0, 2.0, -1.0]])
    u = jnp.array([0.0, 0.2, 0.5, 0.99])
    probs = np.exp(np.asarray(logits[0])) / np.exp(np.asarray(logits[0])).sum()
    cdf = np.cumsum(probs)
    for ui in u:
        tok, lp, ent = ro.sample_from_logits(logits, ui[None], ro.SamplingParams())
        assert int(tok[0]) == int(np.searchsorted(cdf, float(ui), side="right"))
        np.testing.assert_allclose(lp[0], np.log(probs[int(tok[0])]), rtol=1e-6)
        np.testing.assert_allclose(ent[0], -(probs * np.log(probs)).sum(), rtol=1e-6)
    # top_k=1 is greedy whatever u is; top_p keeps the smallest nucleus reaching p
    for ui in u:
        tok, _, _ = ro.sample_from_logits(logits, ui[None], ro.SamplingParams(1.0, 1, 1.0))
        assert int(tok[0]) == 2
    nucleus = set()
    for ui in np.linspace(0, 0.999, 50):
        tok, _, _ = ro.sample_from_logits(logits, jnp.array([ui]), ro.SamplingParams(1.0, 0, 0.7))
        nucleus.add(int(tok[0]))
    order = np.argsort(-probs)
    keep = order[: np.searchsorted(np.cumsum(probs[order]), 0.7) + 1]
    assert nucleus == set(keep.tolist())


def test_rollout_logp_matches_training_forward_and_chunking(model_params):
    m, p = model_params
    ctx = jax.random.randint(jax.random.PRNGKey(3), (B, C), 0, V)
    sp = ro.SamplingParams(temperature=0.8)
    u = jax.random.uniform(jax.random.PRNGKey(4), (B, V, H))
    forced = jnp.broadcast_to(jnp.arange(V, dtype=jnp.int32), (B, V))
    full = ro.rollout(m, p, ctx, forced, u, sp)
    chex.assert_shape(full.tokens, (B, V, H))
    chex.assert_shape(full.first_logits, (B, V))
    np.testing.assert_array_equal(full.tokens[..., 0], forced)
    for chunk in (4, 5):  # 11 members: padded chunks
        part = ro.rollout(m, p, ctx, forced, u, sp, vocab_chunk=chunk)
        np.testing.assert_array_equal(part.tokens, full.tokens)
        np.testing.assert_allclose(part.logp, full.logp, atol=1e-5)
        np.testing.assert_allclose(part.entropy, full.entropy, atol=1e-5)
    # the sampler's π_old equals the training forward's tempered log-probs
    _, logits = group_logits(m, p, ctx, full.tokens)
    lp = jax.nn.log_softmax(logits / sp.temperature, -1)
    train_lp = jnp.take_along_axis(lp, full.tokens[..., None], -1)[..., 0]
    np.testing.assert_allclose(full.logp, train_lp, atol=1e-5)


def test_sampled_first_actions_follow_policy(model_params):
    m, p = model_params
    ctx = jax.random.randint(jax.random.PRNGKey(5), (1, C), 0, V)
    n = 4000
    u = jax.random.uniform(jax.random.PRNGKey(6), (1, n, 2))
    r = jax.jit(lambda u: ro.rollout(m, p, ctx, None, u, ro.SamplingParams()))(u)
    freq = np.bincount(np.asarray(r.tokens[0, :, 0]), minlength=V) / n
    probs = np.asarray(jax.nn.softmax(r.first_logits[0]))
    np.testing.assert_allclose(freq, probs, atol=0.03)
