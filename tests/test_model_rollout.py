"""Model KV cache vs full forward, and rollout invariants (chunking, log-probs, forcing)."""

import re
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax import rollout as ro
from grpo_jax.model import Transformer, decode_params, empty_cache, group_logits, init_params
from grpo_jax.policy import TokenPrompts, rollout, transformer_policy
from grpo_jax.products import ONE_HOT_GRAD_ROWS, _one_hot_grad_take, dense_dot, lookup

pytestmark = pytest.mark.usefixtures("fast_compiles")  # conftest.py

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
    ext = m.apply({"params": p}, prefix, gen, method=Transformer.extend)
    np.testing.assert_allclose(ext, ref[:, :, C:], atol=1e-5)
    cache, outs = empty_cache(m, B, G, H), []
    for t in range(H):
        lg, cache = m.apply(
            {"params": p}, prefix, cache, gen[:, :, t], t, method=Transformer.decode
        )
        outs.append(lg)
    np.testing.assert_allclose(jnp.stack(outs, 2), ref[:, :, C:], atol=1e-5)
    # group_logits: position t scores token t (token 0 from the context's last position)
    first, gl = group_logits(m, p, ctx, gen)
    np.testing.assert_allclose(gl, ref[:, :, C - 1 : C + H - 1], atol=1e-5)
    np.testing.assert_allclose(first, ref[:, 0, C - 1], atol=1e-5)


def _decode_all(m, p, ctx, gen):
    """Prefill, then decode gen [B, G, H] one step at a time: logits [B, G, H, V]."""
    _, prefix = m.apply({"params": p}, ctx, None, method=Transformer.prefill)
    cache, outs = empty_cache(m, B, G, H), []
    for t in range(H):
        lg, cache = m.apply(
            {"params": p}, prefix, cache, gen[:, :, t], t, method=Transformer.decode
        )
        outs.append(lg)
    return jnp.stack(outs, 2)


@pytest.mark.parametrize("dtype, atol", [(jnp.float32, 1e-5), (jnp.bfloat16, 5e-2)])
def test_decode_steps_give_the_full_forwards_logits_in_each_compute_dtype(
    model_params, dtype, atol
):
    """Token-by-token decode (batched matrix-vector products against each member's own cache)
    gives the full causal forward's logits: in float32 to rounding, in bfloat16 compute to
    bfloat16's (about 0.01 off there)."""
    m, p = model_params
    ctx = jax.random.randint(jax.random.PRNGKey(11), (B, C), 0, V)
    gen = jax.random.randint(jax.random.PRNGKey(12), (B, G, H), 0, V)
    want = _full_logits(m, p, ctx, gen)[:, :, C:]
    run = jax.jit(_decode_all, static_argnums=0)
    np.testing.assert_allclose(run(m.clone(dtype=dtype), p, ctx, gen), want, atol=atol)


def test_bfloat16_compute_runs_with_float32_params():
    m = Transformer(
        vocab_size=V, num_layers=1, num_heads=2, d_model=16, max_len=16, dtype=jnp.bfloat16
    )
    p = init_params(m, jax.random.PRNGKey(0))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(p))
    out = m.apply({"params": p}, jnp.zeros((2, 8), jnp.int32))
    assert out.dtype == jnp.float32 and np.isfinite(np.asarray(out)).all()


def test_bfloat16_lookup_sums_its_gradient_rows_in_float32():
    """4,096 tokens of 3 chars put ~1,400 cotangents in each of 3 table rows. A bfloat16
    model's lookup gradient equals the float32 model's for the same (bfloat16-exact)
    cotangents: the sums run in float32. Summed in bfloat16 (flax's Embed on a bfloat16
    model) they were 4 % off, relative."""

    def table_grad(dtype, tokens, cot):
        m = Transformer(vocab_size=V, num_layers=1, num_heads=2, d_model=16, max_len=8, dtype=dtype)
        p = init_params(m, jax.random.PRNGKey(0))

        def f(table):
            q = {**p, "embed": {"embedding": table}}
            x = m.apply({"params": q}, tokens, 0, True, method=Transformer._embed)
            return jnp.sum(x.astype(jnp.float32) * cot)

        return jax.grad(f)(p["embed"]["embedding"])

    tokens = jax.random.randint(jax.random.PRNGKey(1), (64, 64), 0, 3)
    cot = jax.random.normal(jax.random.PRNGKey(2), (64, 64, 16)).astype(jnp.bfloat16)
    g16 = table_grad(jnp.bfloat16, tokens, cot.astype(jnp.float32))
    g32 = table_grad(jnp.float32, tokens, cot.astype(jnp.float32))
    assert g16.dtype == jnp.float32 and float(jnp.abs(g32[:3]).min()) > 0
    np.testing.assert_allclose(g16, g32, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows", [65, ONE_HOT_GRAD_ROWS + 1])
def test_a_small_tables_lookup_gradient_is_a_matmul_off_a_cpu_equal_to_the_scatter(rows):
    """lookup's gradient, lowered for a GPU or a TPU (no device needed), is one dot_general and
    no scatter up to ONE_HOT_GRAD_ROWS rows, jnp.take's scatter-add above; for a CPU always
    the scatter. The matmul's gradient equals the scatter's (3 of every 4 tokens are one
    char, so its row sums hundreds of terms), and the CPU's is jnp.take's, bit for bit."""
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(4), 3)
    table = jax.random.normal(k1, (rows, 16))
    ids = jnp.where(jax.random.uniform(k2, (4, 8, 30)) < 0.75, 1, jnp.arange(30) * 7 % rows)
    cot = jax.random.normal(k3, (4, 8, 30, 16))
    grad = lambda take: jax.jit(jax.grad(lambda t: jnp.sum(take(t, ids) * cot)))
    plain = grad(lambda t, i: jnp.take(t, i, axis=0))(table)
    matmul = grad(lambda t, i: _one_hot_grad_take(t, i, rows))(table)
    assert int(jnp.sum(ids == 1)) > 500  # the cotangents one row sums
    np.testing.assert_allclose(matmul, plain, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(grad(lookup)(table), plain)  # this CPU's
    for platform in ("cpu", "cuda", "tpu"):
        hlo = grad(lookup).trace(table).lower(lowering_platforms=(platform,)).as_text()
        small = rows <= ONE_HOT_GRAD_ROWS and platform != "cpu"
        assert ("stablehlo.scatter" in hlo) != small and ("dot_general" in hlo) == small


def test_off_a_cpu_the_training_forwards_gradient_runs_no_scatter():
    """The training forward's gradient (group_logits: the prompt's prefill and the members'
    extend), lowered for a GPU or a TPU, sums both tables' rows as matmuls, the position
    table's at any length (here 300 rows, over ONE_HOT_GRAD_ROWS): no scatter. A CPU keeps
    both scatters. The position table's scatter made XLA gather its ids and cotangents from
    every data device (a v5e-16 at data=4 x member=4: 7,747 all-gathers a step)."""
    m = Transformer(vocab_size=V, num_layers=1, num_heads=2, d_model=16, max_len=300)
    p = init_params(m, jax.random.PRNGKey(6))
    context = jax.random.randint(jax.random.PRNGKey(7), (2, 12), 0, V)
    tokens = jax.random.randint(jax.random.PRNGKey(8), (2, 3, 5), 0, V)
    grad = jax.jit(jax.grad(lambda q: jnp.sum(group_logits(m, q, context, tokens)[1])))
    for platform in ("cpu", "cuda", "tpu"):
        hlo = grad.trace(p).lower(lowering_platforms=(platform,)).as_text()
        assert ("stablehlo.scatter" in hlo) == (platform == "cpu"), platform


def test_a_dense_layers_weight_gradient_contracts_a_transposed_copy_on_a_cpu_alone():
    """dense_dot: on a CPU, the weight gradient of x [N, K] · w [K, F] is copy(xᵀ) · g (an
    optimisation barrier keeps the copy), with autodiff's values; lowered for a GPU or a TPU
    (no device needed) it is autodiff's program, as is any product not over 2-D rows."""
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(5), 3)
    x, w = jax.random.normal(k1, (300, 48)), jax.random.normal(k2, (48, 20))
    cot = jax.random.normal(k3, (300, 20))
    rows = (((1,), (0,)), ((), ()))
    grads = lambda dot: jax.jit(jax.grad(lambda x, w: jnp.sum(dot(x, w, rows) * cot), (0, 1)))
    plain, ours = grads(jax.lax.dot_general), grads(dense_dot)
    np.testing.assert_array_equal(dense_dot(x, w, rows), x @ w)
    for mine, ref in zip(ours(x, w), plain(x, w), strict=True):
        np.testing.assert_allclose(mine, ref, rtol=1e-5, atol=1e-5)

    def products(fn, *args, platform):  # (op, operand and result types), in program order
        text = fn.trace(*args).lower(lowering_platforms=(platform,)).as_text()
        ops = r"stablehlo\.(dot_general|transpose|optimization_barrier)\b[^\n]* : ([^\n]*)"
        return re.findall(ops, text)

    cpu = products(ours, x, w, platform="cpu")
    assert ("optimization_barrier", "tensor<48x300xf32>") in cpu, cpu
    assert "optimization_barrier" not in str(products(plain, x, w, platform="cpu"))
    for platform in ("cuda", "tpu"):  # inside a constant-index case, which XLA drops
        assert products(ours, x, w, platform=platform) == products(plain, x, w, platform=platform)
    x3 = x.reshape(3, 100, 48)  # a batched operand: the plain product everywhere
    wide = (((2,), (0,)), ((), ()))
    grad3 = lambda dot: jax.jit(jax.grad(lambda x, w: jnp.sum(dot(x, w, wide)), (0, 1)))
    mine3 = products(grad3(dense_dot), x3, w, platform="cpu")
    assert mine3 == products(grad3(jax.lax.dot_general), x3, w, platform="cpu") and mine3


def test_blocked_sampler_matches_a_float64_inverse_cdf_across_blocks():
    """V = 1,000 is four SAMPLE_BLOCK blocks, the last one padded: every token is numpy's
    float64 inverse-CDF token except where u lies within float32 rounding of a CDF boundary,
    and the log-probs and entropies are the tempered softmax's."""
    v, temp = 1000, 0.7
    assert -(-v // ro.SAMPLE_BLOCK) == 4 and v % ro.SAMPLE_BLOCK
    k1, k2 = jax.random.split(jax.random.PRNGKey(3))
    logits = 2.0 * jax.random.normal(k1, (2, 1024, v))
    u = jax.random.uniform(k2, (2, 1024))
    tok, lp, ent = jax.jit(ro.sample_from_logits, static_argnums=2)(
        logits, u, ro.SamplingParams(temperature=temp)
    )
    chex.assert_shape((tok, lp, ent), (2, 1024))
    x = np.asarray(logits, np.float64) / temp
    prob = np.exp(x - x.max(-1, keepdims=True))
    prob /= prob.sum(-1, keepdims=True)
    cdf = np.cumsum(prob, -1)
    uu = np.asarray(u, np.float64)
    ref = np.minimum((cdf <= uu[..., None]).sum(-1), v - 1)
    edges = np.take_along_axis(cdf, ref[..., None], -1)[..., 0]
    below = np.take_along_axis(cdf, np.maximum(ref - 1, 0)[..., None], -1)[..., 0]
    gap = np.minimum(edges - uu, np.where(ref > 0, uu - below, 1.0))
    sure = gap > 1e-6  # float32's rounding of a CDF near 1 is about 6e-8
    assert sure.mean() > 0.98 and (ref[sure] >= 3 * ro.SAMPLE_BLOCK).any()  # the padded block
    np.testing.assert_array_equal(np.asarray(tok)[sure], ref[sure])
    picked = np.take_along_axis(prob, np.asarray(tok)[..., None], -1)[..., 0]
    np.testing.assert_allclose(lp, np.log(picked), atol=2e-5)
    np.testing.assert_allclose(ent, -(prob * np.log(prob)).sum(-1), rtol=1e-5)


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


def test_top_p_measures_the_top_k_tokens_renormalised_mass():
    """top_k=2, top_p=0.5 on [.30, .25, .15, .15, .15]: the top two renormalise to [.55, .45],
    so the nucleus is token 0 alone (HF's warpers, vLLM); on the raw mass it took 0 and 1."""
    logits = jnp.log(jnp.array([[0.30, 0.25, 0.15, 0.15, 0.15]]))
    sampled = {
        int(ro.sample_from_logits(logits, jnp.array([u]), ro.SamplingParams(1.0, 2, 0.5))[0][0])
        for u in np.linspace(0, 0.999, 50)
    }
    assert sampled == {0}


def _rollout(m, p, ctx, forced, u, sp, chunk=0, stop=None):
    """policy.rollout from a prefilled batch of fixed-length prompts."""
    pol = transformer_policy(m, sp, u.shape[-1], stop)
    prompts = TokenPrompts(ctx, None, {})
    first_logits, state = pol.prefill(p, prompts)
    tokens, logp, ent, mask = rollout(pol, p, prompts, first_logits, state, forced, u, sp, chunk)
    return tokens, logp, ent, mask, first_logits


def test_rollout_logp_matches_training_forward_and_chunking(model_params):
    m, p = model_params
    ctx = jax.random.randint(jax.random.PRNGKey(3), (B, C), 0, V)
    sp = ro.SamplingParams(temperature=0.8)
    u = jax.random.uniform(jax.random.PRNGKey(4), (B, V, H))
    forced = jnp.broadcast_to(jnp.arange(V, dtype=jnp.int32), (B, V))
    tokens, logp, ent, mask, first_logits = _rollout(m, p, ctx, forced, u, sp)
    chex.assert_shape(tokens, (B, V, H))
    chex.assert_shape(first_logits, (B, V))
    np.testing.assert_array_equal(tokens[..., 0], forced)
    np.testing.assert_array_equal(mask, 1.0)  # no EOS: every completion runs the horizon
    for chunk in (4, 5):  # 11 members: padded chunks
        part = _rollout(m, p, ctx, forced, u, sp, chunk)
        np.testing.assert_array_equal(part[0], tokens)
        np.testing.assert_allclose(part[1], logp, atol=1e-5)
        np.testing.assert_allclose(part[2], ent, atol=1e-5)
    # the sampler's π_old equals the training forward's tempered log-probs
    _, logits = group_logits(m, p, ctx, tokens)
    lp = jax.nn.log_softmax(logits / sp.temperature, -1)
    train_lp = jnp.take_along_axis(lp, tokens[..., None], -1)[..., 0]
    np.testing.assert_allclose(logp, train_lp, atol=1e-5)


def test_a_long_decode_grows_its_cache_in_segments_with_the_same_samples(monkeypatch):
    """40 tokens (39 decode steps >= rollout.SEGMENT_MIN_STEPS): the member cache grows 9 ->
    19 -> 39 slots over three scans; the samples are the single-cache decode's and their
    log-probs the training forward's."""
    h = 40
    m = Transformer(vocab_size=V, num_layers=2, num_heads=2, d_model=16, max_len=C + h)
    p = init_params(m, jax.random.PRNGKey(0))
    assert ro.cache_segments(h - 1) == (9, 19, 39)
    ctx = jax.random.randint(jax.random.PRNGKey(3), (B, C), 0, V)
    sp = ro.SamplingParams(temperature=0.8)
    u = jax.random.uniform(jax.random.PRNGKey(4), (B, G, h))
    forced = jnp.zeros((B, G), jnp.int32)
    tokens, logp, _, mask, _ = _rollout(m, p, ctx, forced, u, sp)
    np.testing.assert_array_equal(mask, 1.0)
    _, logits = group_logits(m, p, ctx, tokens)
    lp = jax.nn.log_softmax(logits / sp.temperature, -1)
    np.testing.assert_allclose(
        logp, jnp.take_along_axis(lp, tokens[..., None], -1)[..., 0], atol=1e-5
    )
    monkeypatch.setattr(ro, "SEGMENT_MIN_STEPS", 10**9)  # one cache of 39 slots
    assert ro.cache_segments(h - 1) == (39,)
    one_cache = _rollout(m, p, ctx, forced, u, sp)
    np.testing.assert_array_equal(one_cache[0], tokens)
    np.testing.assert_allclose(one_cache[1], logp, atol=1e-6)


def _sub_jaxprs(params):
    """The jaxprs in an equation's params (jax.extend.core.jaxprs_in_params, which jax 0.8.0,
    the oldest supported, lacks)."""
    for value in params.values():
        for x in value if isinstance(value, (tuple, list)) else (value,):
            inner = getattr(x, "jaxpr", x)
            if hasattr(inner, "eqns"):
                yield inner


def _weight_casts_in_loops(jaxpr, shapes, inside=False):
    """How many float32 -> other casts of an operand shaped as one of ``shapes`` run inside a
    scan or while body of ``jaxpr``."""
    n = 0
    for eqn in jaxpr.eqns:
        aval = eqn.invars[0].aval if eqn.invars else None
        n += (
            inside
            and eqn.primitive.name == "convert_element_type"
            and getattr(aval, "dtype", None) == jnp.float32
            and aval.shape in shapes
        )
        loop = inside or eqn.primitive.name in ("scan", "while")
        for sub in _sub_jaxprs(eqn.params):
            n += _weight_casts_in_loops(sub, shapes, loop)
    return n


def test_a_bfloat16_decode_casts_its_weights_once_before_the_loop(monkeypatch):
    """rollout.decode_members casts the float32 weights to bfloat16 before its decode loop
    (model.decode_params), not at every step inside it: no cast of a weight-shaped float32
    array runs in the loop's body, which without it holds 9 (per layer qkv, proj, fc and out,
    and the tied head). The samples and log-probs are bitwise the same; only the LayerNorms'
    params stay float32."""
    h = 8
    m = Transformer(vocab_size=V, num_layers=2, num_heads=2, d_model=16, max_len=C + h,
                    dtype=jnp.bfloat16)  # fmt: skip
    p = init_params(m, jax.random.PRNGKey(0))
    leaves = jax.tree_util.tree_flatten_with_path(decode_params(m, p))[0]
    kept = {jax.tree_util.keystr(k) for k, x in leaves if x.dtype == jnp.float32}
    assert kept == {f"['{ln}']['{w}']" for ln in ("ln_f",) for w in ("bias", "scale")} | {
        f"['blocks_{i}']['{ln}']['{w}']" for i in (0, 1) for ln in ("ln1", "ln2")
        for w in ("bias", "scale")}  # fmt: skip
    weights = {x.shape for x in jax.tree.leaves(p) if x.ndim == 2}
    ctx = jax.random.randint(jax.random.PRNGKey(3), (B, C), 0, V)
    sp = ro.SamplingParams(temperature=0.8)
    u = jax.random.uniform(jax.random.PRNGKey(4), (B, G, h))
    forced = jnp.zeros((B, G), jnp.int32)

    def run():  # a new function each time: jit and make_jaxpr cache by function
        fn = lambda: _rollout(m, p, ctx, forced, u, sp)[:2]
        return jax.jit(fn)(), _weight_casts_in_loops(jax.make_jaxpr(fn)().jaxpr, weights)

    hoisted, casts = run()
    monkeypatch.setattr(ro, "decode_params", lambda model, params: params)
    in_loop, casts_before = run()
    assert (casts, casts_before) == (0, 2 * 4 + 1)
    np.testing.assert_array_equal(hoisted[0], in_loop[0])
    np.testing.assert_array_equal(hoisted[1], in_loop[1])


@pytest.mark.parametrize("kernel", ["pallas", "flash"])
def test_a_pallas_decode_kernel_samples_what_xla_decodes(kernel):
    """model.decode_kernel="pallas" / "flash" (decode_kernel.py, interpreted on a CPU) in a
    39-step decode of left-padded prompts: the cache grows in segments aligned to the
    kernels' chunks (9, 19, 39 -> 32, 64 slots), the prompt (5 slots) is padded with masked
    keys (pallas: to one chunk, after it; flash: to 4 chunks, before it), and the samples
    and log-probs are XLA's decode's."""
    h = 40
    kw = dict(vocab_size=V, num_layers=2, num_heads=2, d_model=16, max_len=C + h)
    m = Transformer(**kw)
    p = init_params(m, jax.random.PRNGKey(0))
    assert ro.cache_segments(h - 1, 32) == (32, 64)
    sp = ro.SamplingParams(temperature=0.8)
    prompts = TokenPrompts(
        jax.random.randint(jax.random.PRNGKey(3), (B, C), 0, V),
        jnp.array([[0.0, 0.0, 1.0, 1.0, 1.0], [1.0] * C]),  # the first prompt left-padded
        {},
    )
    u = jax.random.uniform(jax.random.PRNGKey(4), (B, G, h))

    def run(model):
        pol = transformer_policy(model, sp, h, None)
        first_logits, state = pol.prefill(p, prompts)
        return rollout(pol, p, prompts, first_logits, state, jnp.zeros((B, G), jnp.int32), u, sp)

    want = jax.jit(lambda: run(m))()
    got = jax.jit(lambda: run(m.clone(decode_kernel=kernel)))()
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], atol=1e-5)
    np.testing.assert_allclose(got[2], want[2], atol=1e-5)


def _primitives(jaxpr, inside=()):
    """Every (primitive name, names of the primitives enclosing it) in a jaxpr, sub-jaxprs
    (scan and while bodies, shard_map, pjit) included."""
    for eqn in jaxpr.eqns:
        yield eqn.primitive.name, inside
        for sub in _sub_jaxprs(eqn.params):
            yield from _primitives(sub, (*inside, eqn.primitive.name))


@pytest.mark.parametrize("kernel, per_layer", [("pallas", 1), ("flash", 2)])
def test_the_pallas_setting_reaches_the_grpo_steps_decode(
    kernel, per_layer, monkeypatch, shakespeare_path
):
    """--config.model.decode_kernel=pallas / flash through the task's build on the trainer's
    mesh (the GPU suite's `pallas` part): the step's decode loop calls the kernel (flash: its
    two, prompt and own cache) inside the member shard_map, and nothing else does (prefill,
    the reference's and the update's passes keep XLA's attention). Traced only, with the GPU
    check passed as on a CUDA device (the tiny config's heads are 16 wide, as flash needs)."""
    from grpo_jax import sharding, specs, trainer
    from grpo_jax.config_blocks import load_config
    from grpo_jax.tasks import build_task

    monkeypatch.setattr(specs, "gpu_runtime", lambda: "cuda 12080")
    config = load_config("shakespeare", "tiny,sampled", **{"model.decode_kernel": kernel})
    config.data.path = str(shakespeare_path)
    task = build_task(config, "train")
    params = trainer.initial_params(config, task)
    step, inputs = task.build(params, mesh=sharding.make_mesh(config.get("mesh")))
    jaxpr = jax.make_jaxpr(step.fused)(task.make_state(params), inputs).jaxpr
    calls = [inside for name, inside in _primitives(jaxpr) if name == "pallas_call"]
    assert len(calls) == per_layer * config.model.num_layers  # in the decode step's body
    assert all("shard_map" in inside and "scan" in inside for inside in calls)


def test_sampled_first_actions_follow_policy(model_params):
    m, p = model_params
    ctx = jax.random.randint(jax.random.PRNGKey(5), (1, C), 0, V)
    n = 4000
    u = jax.random.uniform(jax.random.PRNGKey(6), (1, n, 2))
    r = jax.jit(lambda u: _rollout(m, p, ctx, None, u, ro.SamplingParams()))(u)
    freq = np.bincount(np.asarray(r[0][0, :, 0]), minlength=V) / n
    probs = np.asarray(jax.nn.softmax(r[4][0]))
    np.testing.assert_allclose(freq, probs, atol=0.03)


def test_left_padded_prompts_score_like_unpadded_ones(model_params):
    """A prompt's logits, keys and continuation do not depend on its padding: the same prompt
    left-padded to a wider batch gives the same first logits, extend and decode outputs."""
    m, p = model_params
    ctx = jax.random.randint(jax.random.PRNGKey(7), (1, 3), 0, V)
    gen = jax.random.randint(jax.random.PRNGKey(8), (1, G, 4), 0, V)
    padded = jnp.concatenate([jnp.full((1, 2), 5), ctx], axis=1)  # 2 pad slots of garbage
    mask = jnp.array([[0.0, 0.0, 1.0, 1.0, 1.0]])
    forward = jax.jit(lambda *a: group_logits(m, p, *a)[1])
    want = forward(ctx, gen)
    got = jax.jit(lambda *a: group_logits(m, p, *a)[1])(padded, gen, mask)
    np.testing.assert_allclose(got, want, atol=1e-5)
    logits, prefix = m.apply({"params": p}, padded, mask, method=Transformer.prefill)
    assert int(prefix.length[0]) == 3
    cache = empty_cache(m, 1, G, 4)
    lg, _ = m.apply({"params": p}, prefix, cache, gen[:, :, 0], 0, method=Transformer.decode)
    np.testing.assert_allclose(lg, want[:, :, 1], atol=1e-5)


def test_completions_stop_at_eos_and_mask_the_rest(model_params):
    """With an EOS id the sampler stops each member at its first EOS: the EOS itself counts,
    every later slot holds the pad id with mask 0; forcing EOS first leaves one token."""
    m, p = model_params
    ctx = jax.random.randint(jax.random.PRNGKey(9), (B, C), 0, V)
    eos, pad = 3, 0
    forced = jnp.broadcast_to(jnp.arange(V, dtype=jnp.int32), (B, V))
    u = jax.random.uniform(jax.random.PRNGKey(10), (B, V, H))
    stop = ro.Stop(eos, pad)
    tokens, logp, _, mask, _ = _rollout(m, p, ctx, forced, u, ro.SamplingParams(2.0), stop=stop)
    tokens, mask = np.asarray(tokens), np.asarray(mask)
    for b in range(B):
        for k in range(V):
            t, mk = tokens[b, k], mask[b, k]
            hits = np.flatnonzero(t == eos)
            end = hits[0] + 1 if hits.size else H
            np.testing.assert_array_equal(mk, np.arange(H) < end)
            assert (t[end:] == pad).all()
    assert (mask[:, eos].sum(-1) == 1).all()  # forced EOS: an empty answer, one token
    assert (mask.sum(-1) < H).any() and (mask.sum(-1) == H).any()  # both cases occur
    # the same uniforms without a stop token: identical up to each member's EOS
    free, _, _, _, _ = _rollout(m, p, ctx, forced, u, ro.SamplingParams(2.0))
    np.testing.assert_array_equal(np.where(mask > 0, tokens, -1), np.where(mask > 0, free, -1))


def test_joint_attention_equals_the_shared_prefix_path_with_its_gradients():
    """model.attention="xla" (one jax.nn.dot_product_attention call per member over its
    [prompt ; own] keys, the call cuDNN fuses) gives the shared-prefix path's logits and
    parameter gradients: left-padded prompts of three lengths (fully masked pad queries in
    the prefill), odd lengths (the prefill's 7 queries and keys, the extend's 5 queries),
    padded to even with masked slots."""
    kw = dict(vocab_size=V, num_layers=2, num_heads=2, d_model=16, max_len=12)
    shared, joint = Transformer(**kw), Transformer(**kw, attention="xla")
    p = init_params(shared, jax.random.PRNGKey(0))
    ctx = jax.random.randint(jax.random.PRNGKey(1), (3, 7), 0, V)
    mask = (jnp.arange(7)[None] >= jnp.array([[0], [2], [5]])).astype(jnp.float32)
    gen = jax.random.randint(jax.random.PRNGKey(2), (3, G, 6), 0, V)

    def loss(params, m):
        first, logits = group_logits(m, params, ctx, gen, mask)
        return jnp.sum(jnp.sin(logits)) + jnp.sum(jnp.cos(first)), logits

    grad = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
    (want, want_logits), want_grad = grad(p, shared)
    (got, got_logits), got_grad = grad(p, joint)
    chex.assert_shape(got_logits, (3, G, 6, V))
    np.testing.assert_allclose(got_logits, want_logits, atol=2e-5)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g_got, g_want in zip(jax.tree.leaves(got_grad), jax.tree.leaves(want_grad), strict=True):
        np.testing.assert_allclose(g_got, g_want, atol=2e-5, rtol=1e-4)


def test_cudnn_attention_lowers_for_a_cuda_gpu(monkeypatch):
    """model.attention="cudnn" lowers, forward and backward, to cuDNN's fused attention for a
    CUDA GPU, checked here without one (jax.export for the "cuda" platform, the cuDNN version
    query stubbed): jax's own shape checks pass, an odd extend length (7) included, which the
    flash kernel with a bias rejects in training unless padded."""
    fa = pytest.importorskip("jax._src.cudnn.fused_attention_stablehlo")
    if not hasattr(fa, "check_cudnn_version"):
        pytest.skip("this jax checks cuDNN elsewhere")
    monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91000)
    kw = dict(vocab_size=V, num_layers=2, num_heads=2, d_model=64, max_len=14)
    m = Transformer(**kw, dtype=jnp.bfloat16, attention="cudnn")
    p = init_params(Transformer(**kw), jax.random.PRNGKey(0))  # init runs eagerly, on the CPU
    ctx, gen = jnp.zeros((2, 6), jnp.int32), jnp.zeros((2, G, 8), jnp.int32)
    mask = jnp.ones((2, 6))
    loss = lambda params: jnp.sum(group_logits(m, params, ctx, gen, mask)[1])
    targets = ("__cudnn$fmhaScaleBiasSoftmax", "__cudnn$fmhaScaleBiasSoftmaxBackward")
    checks = [jax.export.DisabledSafetyCheck.custom_call(t) for t in targets]
    text = jax.export.export(jax.jit(jax.grad(loss)), platforms=["cuda"], disabled_checks=checks)(
        p
    ).mlir_module()
    # 2 layers x (prefill, extend) x (forward, backward); the decode loop is not in this loss
    assert text.count(f"@{targets[0]}(") == 4 and text.count(f"@{targets[1]}(") == 4


def test_cudnn_attention_is_checked_up_front(monkeypatch):
    """The cuDNN path's requirements are config errors, each naming the fix."""
    from ml_collections import ConfigDict

    from grpo_jax import specs

    base = dict(num_layers=1, num_heads=4, d_model=128, mlp_ratio=4, attention="cudnn")
    # jax names a ROCm GPU "gpu" too: only the runtime string tells it from CUDA
    monkeypatch.setattr(specs.jax, "default_backend", lambda: "gpu")
    rocm = types.SimpleNamespace(platform_version="rocm 60300")
    monkeypatch.setattr(specs.jax.extend.backend, "get_backend", lambda: rocm)
    with pytest.raises(ValueError, match="needs a CUDA GPU, not rocm 60300"):
        specs.ModelSpec.from_config(ConfigDict({**base, "dtype": "bfloat16"}))
    cuda = types.SimpleNamespace(platform_version="cuda 12080")
    monkeypatch.setattr(specs.jax.extend.backend, "get_backend", lambda: cuda)
    spec = specs.ModelSpec.from_config(ConfigDict({**base, "dtype": "bfloat16"}))
    assert spec.attention == "cudnn"
    with pytest.raises(ValueError, match="needs model.dtype bfloat16 or float16, not float32"):
        specs.ModelSpec.from_config(ConfigDict({**base, "dtype": "float32"}))
    with pytest.raises(ValueError, match=r"model.num_heads = 12\) that is a multiple of 8"):
        specs.ModelSpec.from_config(
            ConfigDict({**base, "dtype": "float16", "d_model": 120, "num_heads": 10})
        )


def test_the_pallas_decode_kernels_are_checked_up_front(monkeypatch):
    """model.decode_kernel="pallas" wants a CUDA GPU and a power-of-two head dimension,
    "flash" one of at least 16: config errors naming the fix ('xla')."""
    from ml_collections import ConfigDict

    from grpo_jax import specs

    base = dict(num_layers=1, num_heads=4, d_model=128, mlp_ratio=4, decode_kernel="pallas")
    monkeypatch.setattr(specs.jax, "default_backend", lambda: "gpu")
    rocm = types.SimpleNamespace(platform_version="rocm 60300")
    monkeypatch.setattr(specs.jax.extend.backend, "get_backend", lambda: rocm)
    with pytest.raises(ValueError, match="needs a CUDA GPU, not rocm 60300; else use 'xla'"):
        specs.ModelSpec.from_config(ConfigDict(base))
    cuda = types.SimpleNamespace(platform_version="cuda 12080")
    monkeypatch.setattr(specs.jax.extend.backend, "get_backend", lambda: cuda)
    assert specs.ModelSpec.from_config(ConfigDict(base)).decode_kernel == "pallas"
    with pytest.raises(ValueError, match=r"model.num_heads = 24\) that is a power of two"):
        specs.ModelSpec.from_config(ConfigDict({**base, "d_model": 96}))
    flash = {**base, "decode_kernel": "flash"}
    assert specs.ModelSpec.from_config(ConfigDict(flash)).decode_kernel == "flash"
    with pytest.raises(ValueError, match=r"= 8\) that is a power of two of at least 16; else"):
        specs.ModelSpec.from_config(ConfigDict({**flash, "d_model": 32}))
