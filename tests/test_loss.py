"""The GRPO loss through the real model: estimators against analytic gradients, and a whole
train step that is invariant to chunking the vocabulary."""

import sys
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from grpo_jax import engine, rewards, scoring
from grpo_jax.chunking import accumulated
from grpo_jax.configs.shakespeare import get_config
from grpo_jax.data import load_corpus
from grpo_jax.data import sample_windows as load_corpus_windows
from grpo_jax.loss import make_loss as make_loss_from_specs
from grpo_jax.model import init_params, make_model
from grpo_jax.policy import TokenPrompts, token_logits, transformer_policy
from grpo_jax.specs import EngineSpec
from grpo_jax.tasks import shakespeare as shakespeare_task
from grpo_jax.tasks.shakespeare import make_reference
from grpo_jax.train_state import StepInputs, init_state, make_optimizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
from flop_count import executed_dots, matmul_flops_of  # the FLOP counter's own jaxpr walk

pytestmark = pytest.mark.usefixtures("fast_compiles")  # conftest.py


@pytest.fixture(scope="module")
def setup(shakespeare_path):
    cfg = get_config("exhaustive,tiny")
    cfg.data.path = str(shakespeare_path)
    corpus = load_corpus(cfg.data)
    model = make_model(cfg.model, corpus.vocab.size, cfg.data.context_len + cfg.data.horizon)
    params = init_params(model, jax.random.PRNGKey(0))
    return cfg, corpus, model, params


def _policy(cfg, model):
    return transformer_policy(model, EngineSpec.from_config(cfg).group.sampling, cfg.data.horizon)


def make_loss(cfg, model, reference):
    """The loss with the reference bound: loss_fn(params, parts, old, first, forced)."""
    spec = EngineSpec.from_config(cfg)
    ref, ref_state = reference
    fn = make_loss_from_specs(spec.objective, spec.group, _policy(cfg, model), ref)
    return lambda *args: fn(*args, ref_state)


def make_step(cfg, corpus, model, params, tx, sched, sample_prompts):
    """The engine's step for the Shakespeare task's reference and char rewards."""
    policy = _policy(cfg, model)
    ref, ref_state = make_reference(
        cfg.reference.kind, cfg.reference, corpus, policy, params, cfg.group.temperature
    )
    step = engine.make_grpo_step(
        EngineSpec.from_config(cfg), policy, ref, sample_prompts,
        rewards.char_terms(cfg.reward), tx, sched,
    )  # fmt: skip
    return step, (ref, ref_state)


def _parts(cfg, corpus, model, params, ref_state=None):
    """The scored group parts of two fixed val windows (the step's rollout and scoring),
    against the task's reference (or one with ``ref_state``)."""
    ctx = jnp.asarray(corpus.val[:32]).reshape(2, 16)
    tgt = jnp.asarray(corpus.val[32:48]).reshape(2, 8)
    prompts = TokenPrompts(ctx, None, {"target": tgt})
    tx, sched = make_optimizer(cfg.optim, 4)
    step, (ref, task_ref_state) = make_step(
        cfg, corpus, model, params, tx, sched, lambda k, d: prompts
    )
    state = init_state(params, tx, 0)._replace(rng=jax.random.PRNGKey(1))
    ref_state = ref_state if ref_state is not None else task_ref_state
    parts, _ = step.score(step.rollout(state, StepInputs(None, ref_state)))
    return parts, (ref, ref_state)


@pytest.mark.parametrize("scale", ["none", "batch"])
def test_expected_estimator_is_the_exact_all_action_gradient(setup, scale):
    """-∇ mean_b Σ_a π(a|s_b) R_b(a), divided with the "batch" scale by the root of the
    rows' mean π-weighted variance of R (float64 numpy; the loss sums its pieces over the
    rows, loss.decision_sums, so that devices holding different rows can add them)."""
    cfg, corpus, model, params = setup
    cfg = cfg.copy_and_resolve_references()
    cfg.group.train_continuations = False
    cfg.grpo.beta, cfg.grpo.exhaustive_estimator, cfg.grpo.advantage_scale = 0.0, "expected", scale
    parts, ref = _parts(cfg, corpus, model, params)
    (part,) = parts
    chex.assert_shape(part.action_returns, (2, corpus.vocab.size))
    loss_fn = make_loss(cfg, model, ref)
    g = jax.grad(lambda p: loss_fn(p, parts, (part.logp_old,), True, (True,))[0])(params)
    logits = model.apply({"params": params}, part.prompts.tokens)[:, -1]
    pi = np.asarray(jax.nn.softmax(logits), np.float64)
    r = np.asarray(part.action_returns, np.float64)
    var = np.sum(pi * (r - np.sum(pi * r, 1, keepdims=True)) ** 2, 1)
    assert var.min() > 0  # both rows' returns vary: the scale is not the identity
    sd = np.sqrt(var.mean()) + 1e-8 if scale == "batch" else 1.0

    def expected_return(p):  # J(θ) = mean_b Σ_a π_θ(a|s_b) R_b(a), written independently
        logits = model.apply({"params": p}, part.prompts.tokens)[:, -1]
        return jnp.mean(jnp.sum(jax.nn.softmax(logits) * part.action_returns, axis=-1)) / sd

    want = jax.grad(expected_return)(params)
    flat_g, flat_w = jax.tree.leaves(g), jax.tree.leaves(want)
    assert max(float(jnp.abs(w).max()) for w in flat_w) > 1e-6  # non-trivial gradient
    for a, b in zip(flat_g, flat_w, strict=True):
        np.testing.assert_allclose(a, -b, atol=1e-6, rtol=1e-4)


def test_uniform_estimator_gradient(setup):
    cfg, corpus, model, params = setup
    cfg = cfg.copy_and_resolve_references()
    cfg.group.train_continuations = False
    cfg.grpo.beta, cfg.grpo.exhaustive_estimator = 0.0, "uniform"
    cfg.grpo.advantage_scale = "group"
    parts, ref = _parts(cfg, corpus, model, params)
    (part,) = parts
    loss_fn = make_loss(cfg, model, ref)
    g = jax.grad(lambda p: loss_fn(p, parts, (part.logp_old,), True, (True,))[0])(params)
    # ratio = 1 at iteration 0, so ∇L = -mean_{b,a} A(a) ∇ log π(a); A standardised over V
    r = np.asarray(part.action_returns, np.float64)
    adv = (r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-8)

    def surrogate(p):
        logp = jax.nn.log_softmax(model.apply({"params": p}, part.prompts.tokens)[:, -1])
        return -jnp.mean(jnp.asarray(adv, jnp.float32) * logp)

    want = jax.grad(surrogate)(params)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("mode", ["exhaustive", "guided"])
def test_train_step_invariant_to_vocab_chunk(setup, mode):
    cfg, corpus, model, params = setup
    results = []
    for chunk in (0, 16):
        c = get_config(f"{mode},tiny")
        c.data.path = cfg.data.path
        c.group.vocab_chunk = chunk
        c.grpo.num_iterations = 2
        # plain SGD: the params then differ by lr x the gradients' difference. Adam would
        # divide near-zero gradient entries by their own scale and turn a summation-order
        # difference of 1e-9 into a fraction of a whole update.
        _, sched = make_optimizer(c.optim, 4)
        tx = optax.sgd(0.5)
        h, ctx_len, b = c.data.horizon, c.data.context_len, c.train.batch_size

        def sample_prompts(key, tokens):
            context, target = load_corpus_windows(key, tokens, b, ctx_len, h)
            return TokenPrompts(context, None, {"target": target})

        step, (_, ref_state) = make_step(c, corpus, model, params, tx, sched, sample_prompts)
        state = init_state(params, tx, c.seed)
        inputs = StepInputs(jnp.asarray(corpus.train[:5000]), ref_state)
        state, m = jax.jit(step.fused)(state, inputs)
        results.append((state, m))
    (s0, m0), (s1, m1) = results
    moved = [
        not np.allclose(a, b)
        for a, b in zip(jax.tree.leaves(s0.params), jax.tree.leaves(params), strict=True)
    ]
    assert any(moved)  # the step did update the policy
    for k in ("loss", "reward", "kl", "pg_loss"):
        np.testing.assert_allclose(m0[k], m1[k], rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(s0.params), jax.tree.leaves(s1.params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "mode, kl", [("exhaustive", "exact"), ("sampled", "exact"), ("sampled", "k3")]
)
def test_member_chunked_loss_equals_unchunked(setup, mode, kl):
    """A part's training forward in member chunks (gradients accumulated) gives the same loss,
    metrics (TRL's clip ratios included), log-probs and gradient as all members at once, at
    iteration 0 and with a carried π_old: a forced part's continuations, and a sampled part
    with the exact KL (the trigram reference run inside each chunk) or k3 (the rollout's
    log π_ref(o_t) split with the members)."""
    cfg, corpus, model, params = setup
    if mode == "sampled":
        path, cfg = cfg.data.path, get_config("sampled,tiny")
        cfg.data.path, cfg.group.size = path, 12  # 7 does not divide 12 either
    cfg = cfg.copy_and_resolve_references()
    cfg.grpo.kl_estimator = kl
    cfg.grpo.exhaustive_estimator = "uniform"  # the decision point reads π_old too
    parts, ref = _parts(cfg, corpus, model, params)
    flags = (mode == "exhaustive",)
    outs = []
    # 7 does not divide V = 65: the last chunk is padded. The loss's own chunk overrides the
    # rollout's (vocab_chunk = 0 would otherwise run the loss unchunked).
    for chunk in (0, 7):
        c = cfg.copy_and_resolve_references()
        c.group.loss_chunk = chunk
        loss_fn = make_loss(c, model, ref)
        old = tuple(p.logp_old + 0.05 for p in parts)
        if mode == "sampled":  # ratios e^(±0.3) - 0.05: both sides of the clip window
            sign = jnp.sign(jnp.sin(jnp.arange(parts[0].logp_old.size) + 0.5))
            old = (parts[0].logp_old + 0.3 * sign.reshape(parts[0].logp_old.shape),)
        fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True), static_argnums=(4,))
        for first in (True, False):
            outs.append(fn(params, parts, old, jnp.asarray(first), flags))
    for i in (0, 1):
        (l0, (m0, lp0)), g0 = outs[i]
        (l1, (m1, lp1)), g1 = outs[2 + i]
        np.testing.assert_allclose(l0, l1, rtol=1e-5, atol=1e-7)
        for k in m0:
            np.testing.assert_allclose(m0[k], m1[k], rtol=1e-5, atol=1e-7, err_msg=k)
        np.testing.assert_allclose(lp0[0], lp1[0], rtol=1e-5, atol=1e-6)
        for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
    if mode == "sampled":  # TRL's clip metrics from their definition, in numpy
        (_, (m, lp)), _ = outs[3]  # chunked, carried π_old
        eps, mask = cfg.grpo.epsilon, np.asarray(parts[0].token_mask)
        ratio = np.exp(np.asarray(lp[0]) - np.asarray(old[0]))
        adv = np.asarray(parts[0].advantages)
        low, high = (ratio < 1 - eps) & (adv < 0), (ratio > 1 + eps) & (adv > 0)
        mean = lambda x: np.sum(x * mask) / np.sum(mask)
        for name, x in (("low", low), ("high", high), ("region", low | high)):
            assert mean(x) > 0, name  # the window is crossed on both sides
            np.testing.assert_allclose(m[f"clip_ratio/{name}_mean"], mean(x), rtol=1e-6)
        np.testing.assert_allclose(m["ratio_mean"], mean(ratio), rtol=1e-5)


@pytest.mark.parametrize("mode, chunk", [("exhaustive", 13), ("sampled", 4)])
def test_member_chunks_recompute_nothing(setup, mode, chunk):
    """The loss and its gradient in member chunks execute exactly the matmul FLOPs of all
    members at once (chunks that divide K: no padded members): each chunk's gradient is
    taken after its own forward, where jax.checkpoint ran every chunk's forward again in the
    backward pass (on that code: 1.32x the FLOPs here for the forced part, 1.28x for the
    sampled one)."""
    cfg, corpus, model, params = setup
    if mode == "sampled":
        path, cfg = cfg.data.path, get_config("sampled,tiny")
        cfg.data.path, cfg.group.size = path, 12
    parts, ref = _parts(cfg, corpus, model, params)
    flags = (mode == "exhaustive",)
    flops = []
    for c_size in (0, chunk):
        c = cfg.copy_and_resolve_references()
        c.group.loss_chunk = c_size
        grad = jax.value_and_grad(make_loss(c, model, ref), has_aux=True)
        args = (params, parts, tuple(p.logp_old for p in parts), jnp.asarray(False), flags)
        flops.append(matmul_flops_of(jax.make_jaxpr(grad, static_argnums=(4,))(*args).jaxpr))
    assert flops[0] > 0 and flops[1] == flops[0]


@pytest.mark.parametrize("chunk", [0, 2, 3, 5])
def test_accumulated_leaves_the_padding_members_out(chunk):
    """chunking.accumulated's Σ j and its gradient over K = 5 members of j = w·(x + 1), by
    hand 30 and 15 at w = 2, x = 0..4, with any chunk: chunk 2 pads the last of three
    slices with a zero member, whose j = w would count (32 and 16) if it entered the sum."""
    x = jnp.arange(5.0)[None]  # [B = 1, K = 5]
    fn = lambda d, xs: (d["w"] * (xs + 1.0), xs)
    f = lambda w: accumulated(fn, chunk, {"w": w}, x)
    (val, aux), grad = jax.value_and_grad(f, has_aux=True)(jnp.float32(2.0))
    assert (float(val), float(grad)) == (30.0, 15.0)
    np.testing.assert_array_equal(aux, x)  # the members' aux, padding sliced off


def test_masked_rows_do_not_dilute_the_loss(setup):
    """A forced part whose second prompt is masked out (as adaptive and guided groups do)
    gives the valid prompt's own loss, weighted once by the part's prompt share (1/2)."""
    cfg, corpus, model, params = setup
    (part,), ref = _parts(cfg, corpus, model, params)
    loss_fn = make_loss(cfg, model, ref)
    keep = jnp.array([1.0, 0.0])
    masked = part._replace(
        member_mask=part.member_mask * keep[:, None],
        action_mask=part.action_mask * keep[:, None],
    )
    alone = jax.tree.map(lambda x: x[:1], part)
    # one compile per shape: run eagerly, this loss made the test take about twice as long
    loss_fn = jax.jit(loss_fn, static_argnums=(3, 4))
    lm, (mm, _) = loss_fn(params, (masked,), (part.logp_old,), True, (True,))
    la, (ma, _) = loss_fn(params, (alone,), (alone.logp_old,), True, (True,))
    for k in ("kl", "entropy", "pg_continuation"):
        np.testing.assert_allclose(mm[k], 0.5 * ma[k], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(lm, 0.5 * la, rtol=1e-5, atol=1e-7)


def test_discounted_returns_weight_early_chars():
    """R = Σ_t γ^t r_t / Σ_t γ^t, by hand; γ = 1 is the mean, γ = 0 the first char's reward."""
    r = jnp.asarray([[[1.0, 0.0, 0.5], [0.0, 1.0, 1.0]]])  # [B=1, K=2, H=3]
    # the mask is per token now (completions may end at EOS); member 1 is masked out whole
    mask = jnp.asarray([[1.0, 0.0]])[..., None] * jnp.ones(3)
    got = np.asarray(scoring.sequence_returns(r, mask, 0.5))
    np.testing.assert_allclose(got, [[(1.0 + 0.0 + 0.25 * 0.5) / 1.75, 0.0]], rtol=1e-6)
    ones = jnp.ones((1, 2, 3))
    np.testing.assert_allclose(scoring.sequence_returns(r, ones, 1.0), [[0.5, 2 / 3]])
    np.testing.assert_allclose(scoring.sequence_returns(r, ones, 0.0), [[1.0, 0.0]])
    # a completion that ended after 2 tokens: its return is over those 2 only
    short = jnp.asarray([[[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]])
    np.testing.assert_allclose(scoring.sequence_returns(r, short, 0.5), [[1.0 / 1.5, 0.75 / 1.75]])
    cfg = get_config("exhaustive,tiny")
    cfg.reward.discount = 1.5
    # the check moved from the group builder to the task's validation (one check per setting)
    with pytest.raises(ValueError, match=r"reward.discount=1.5 must lie in \[0, 1\]"):
        shakespeare_task.validate(cfg, "train")


@pytest.mark.parametrize(
    "estimator,terms",
    [("exact", "match"), ("exact_forward", "match"), ("k3", "match"), ("exact", "match_partial")],
)
def test_reference_in_member_chunks_equals_the_materialised_kl(setup, estimator, terms):
    """The KL term with the reference computed inside the loss's member chunks (exact
    estimators) or chunk by chunk in the rollout (k3) equals the KL computed, independently in
    numpy, from the materialised [B, K, T, V] log-probs of the policy and the reference, at
    V = 65: the decision point's exact KL and the continuation tokens' token-mean. With a
    reward term that reads the reference's distribution (match_partial) the part carries it
    and the loss reuses it: the same KL."""
    cfg, corpus, model, params = setup
    c = cfg.copy_and_resolve_references()
    c.reference.kind, c.grpo.kl_estimator, c.grpo.loss_agg = "policy", estimator, "token-mean"
    c.group.vocab_chunk, c.group.loss_chunk = 13, 7  # 7 does not divide V = 65
    c.reward.terms = terms
    ref_params = init_params(model, jax.random.PRNGKey(5))  # a reference unlike the policy
    parts, (ref, _) = _parts(c, corpus, model, params, ref_state=ref_params)
    (part,) = parts
    loss_fn = make_loss(c, model, (ref, ref_params))
    _, (m, _) = jax.jit(loss_fn, static_argnums=(4,))(
        params, parts, (part.logp_old,), True, (True,)
    )
    policy = _policy(c, model)
    lp = np.asarray(jax.nn.log_softmax(token_logits(policy, params, part.prompts, part.tokens)[1]))
    rl = jax.nn.log_softmax(token_logits(policy, ref_params, part.prompts, part.tokens)[1])
    rl = np.asarray(rl, np.float64)
    lp = lp.astype(np.float64)
    tok = np.asarray(part.tokens)
    lp_t = np.take_along_axis(lp, tok[..., None], -1)[..., 0]
    rl_t = np.take_along_axis(rl, tok[..., None], -1)[..., 0]
    if estimator == "exact":
        kl = np.sum(np.exp(lp) * (lp - rl), -1)
    elif estimator == "exact_forward":
        kl = np.sum(np.exp(rl) * (rl - lp), -1)
    else:
        kl = np.exp(rl_t - lp_t) - (rl_t - lp_t) - 1.0
        np.testing.assert_allclose(part.ref_token_logp, rl_t, rtol=1e-5, atol=1e-5)
    carried = rl.shape[-1] if terms == "match_partial" else 0  # [B, K, T, V] only if read
    chex.assert_shape(part.ref_logp, (*tok.shape, carried))
    dp_fn = np.sum(np.exp(lp) * (lp - rl), -1) if estimator != "exact_forward" else kl
    t = tok.shape[-1]
    mask = np.asarray(part.token_mask)[..., 1:]
    kl_c = np.sum(kl[..., 1:] * mask) / mask.sum()
    kl_dp = dp_fn[:, 0, 0].mean()
    assert kl_c > 1e-3  # the reference differs from the policy: a test that can fail
    np.testing.assert_allclose(m["kl_decision"], kl_dp, rtol=1e-4)
    np.testing.assert_allclose(m["kl"], (kl_dp + (t - 1) * kl_c) / t, rtol=1e-4)


def _executed_dots(jaxpr, lhs_shape) -> int:
    """dot_generals with this lhs shape that a jaxpr executes: a scan's (lax.map's) body
    counts once per iteration (flop_count.executed_dots)."""
    return sum(n for eqn, n in executed_dots(jaxpr) if eqn.invars[0].aval.shape == lhs_shape)


def test_the_references_prompt_runs_once_however_the_members_are_chunked(setup):
    """π_ref's prefill is one per batch in the rollout (k3: log π_ref of each token, 5 member
    chunks of 13, plus the decision point's distribution) and in the loss (exact estimator:
    10 chunks of 7): the prompt's dense matmuls, lhs [B*P, D] = [32, 32] (the qkv, proj and fc
    layers of the 1-layer tiny model), run for the policy and the reference once each, not
    again in every chunk (on the code before this test: 12 prefills in the rollout, 11 in the
    loss)."""
    cfg, corpus, model, params = setup
    b, p, d = 2, cfg.data.context_len, cfg.model.d_model
    per_prefill = 3  # qkv, proj and fc read [B*P, D]
    ctx = jnp.asarray(corpus.val[:32]).reshape(b, p)
    prompts = TokenPrompts(ctx, None, {"target": jnp.asarray(corpus.val[32:48]).reshape(b, 8)})
    for estimator in ("k3", "exact"):
        c = cfg.copy_and_resolve_references()
        c.reference.kind, c.grpo.kl_estimator, c.reward.terms = "policy", estimator, "match"
        c.group.vocab_chunk, c.group.loss_chunk = 13, 7
        tx, sched = make_optimizer(c.optim, 4)
        step, reference = make_step(c, corpus, model, params, tx, sched, lambda k, x: prompts)
        state, inputs = init_state(params, tx, 0), StepInputs(None, reference[1])
        if estimator == "k3":
            rollout = jax.make_jaxpr(step.rollout)(state, inputs).jaxpr
            assert _executed_dots(rollout, (b * p, d)) == 2 * per_prefill
            continue
        parts, _ = step.score(step.rollout(state, inputs))
        args = (params, parts, (parts[0].logp_old,), True, (True,))
        loss = jax.make_jaxpr(make_loss(c, model, reference), static_argnums=(4,))(*args)
        assert _executed_dots(loss.jaxpr, (b * p, d)) == 2 * per_prefill


def test_bfloat16_compute_keeps_float32_params_and_the_loss(setup):
    """model.dtype=bfloat16 computes activations in bfloat16 but keeps params (and the
    optimizer's moments) float32 through a step, and on a fixed batch its loss and KL are
    within 1e-3 relative of float32's (observed 2e-5 at this tiny model's initialisation;
    bfloat16 keeps 8 mantissa bits, ~4e-3 per rounding, mostly averaging out over the sums),
    yet not equal to them: the bfloat16 path did run."""
    cfg, corpus, model, params = setup
    parts, ref = _parts(cfg, corpus, model, params)
    (part,) = parts
    c = cfg.copy_and_resolve_references()
    c.model.dtype = "bfloat16"
    model16 = make_model(c.model, corpus.vocab.size, c.data.context_len + c.data.horizon)
    args = (params, parts, (part.logp_old,), True, (True,))
    l32, (m32, _) = make_loss(cfg, model, ref)(*args)
    l16, (m16, _) = make_loss(c, model16, ref)(*args)
    assert float(jnp.abs(l32)) > 1e-3
    np.testing.assert_allclose(l16, l32, rtol=1e-3)
    np.testing.assert_allclose(m16["kl"], m32["kl"], rtol=1e-3)
    assert float(l16) != float(l32)
    tx, sched = make_optimizer(c.optim, 4)
    prompts = part.prompts
    step, (_, ref_state) = make_step(c, corpus, model16, params, tx, sched, lambda k, d: prompts)
    state, m = jax.jit(step.fused)(init_state(params, tx, 0), StepInputs(None, ref_state))
    assert np.isfinite(float(m["loss"]))
    for leaf in jax.tree.leaves((state.params, state.opt_state)):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            assert leaf.dtype == jnp.float32, leaf.dtype
