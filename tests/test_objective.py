"""Tests for grpo_jax.objective against independent float64 numpy references."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax import objective as obj
from grpo_jax.loss import clip_terms

SEEDS = (0, 1, 2)
MODES = ("sequence-mean-token-mean", "token-mean", "sequence-mean-token-sum", "dr-grpo")


# ----------------------------------------------------------------------------
# Independent numpy references (float64, loops, straight from the definitions).
# ----------------------------------------------------------------------------


def np_group_advantages(rewards, scale, eps, mask):
    r = np.asarray(rewards, np.float64)
    B, G = r.shape[:2]
    mask = np.ones((B, G), bool) if mask is None else np.asarray(mask, bool)
    valid = np.broadcast_to(mask.reshape(mask.shape + (1,) * (r.ndim - 2)), r.shape)
    batch_std = r[valid].std() if valid.any() else 0.0
    out = np.zeros_like(r)
    for b in range(B):
        for rest in np.ndindex(*r.shape[2:]):
            members = [g for g in range(G) if valid[(b, g) + rest]]
            vals = np.array([r[(b, g) + rest] for g in members])
            if len(vals) == 0 or np.all(vals == vals[0]):
                continue  # no signal: advantage 0 by definition
            for g in members:
                a = r[(b, g) + rest] - vals.mean()
                if scale == "group":
                    a /= vals.std() + eps
                elif scale == "batch":
                    a /= batch_std + eps
                out[(b, g) + rest] = a
    return out


def np_surrogate(logp, old_logp, adv, eps, eps_high):
    hi = eps if eps_high is None else eps_high
    ratio = np.exp(np.asarray(logp, np.float64) - old_logp)
    adv = np.broadcast_to(adv, ratio.shape)
    # Piecewise form: a positive advantage caps the ratio above, a negative one below.
    return np.where(adv >= 0, -adv * np.minimum(ratio, 1 + hi), -adv * np.maximum(ratio, 1 - eps))


def np_clip_fraction(logp, old_logp, adv, eps, eps_high):
    hi = eps if eps_high is None else eps_high
    ratio = np.exp(np.asarray(logp, np.float64) - old_logp)
    adv = np.broadcast_to(adv, ratio.shape)
    return (((adv > 0) & (ratio > 1 + hi)) | ((adv < 0) & (ratio < 1 - eps))).astype(float)


def np_kl(logp, ref, estimator):
    logp, ref = np.asarray(logp, np.float64), np.asarray(ref, np.float64)
    d = ref - logp
    return {"k1": -d, "k2": 0.5 * d**2, "k3": np.expm1(d) - d}[estimator]


def np_kl_grad(logp, ref, estimator):
    d = np.asarray(ref, np.float64) - logp
    return {"k1": np.ones_like(d), "k2": -d, "k3": -np.expm1(d)}[estimator]


def np_log_softmax(z):
    z = np.asarray(z, np.float64)
    zmax = np.max(z, -1, keepdims=True)
    return z - zmax - np.log(np.sum(np.exp(z - zmax), -1, keepdims=True))


def np_exact_kl(z, y):
    lp, lq = np_log_softmax(z), np_log_softmax(y)
    p = np.exp(lp)
    return np.sum(p * np.where(p > 0, lp - lq, 0.0), -1)


def np_entropy(z):
    lp = np_log_softmax(z)
    p = np.exp(lp)
    return -np.sum(np.where(p > 0, p * np.where(p > 0, lp, 0), 0), -1)


def np_aggregate(x, mask, mode):
    # Rows whose mask is all zero do not exist: they count in no normaliser.  (This
    # reference used to average over every row, all-masked ones included, and to
    # divide dr-grpo by all rows × T; the aggregation semantics changed to the
    # rows-that-exist normalisers, so the reference follows.)
    T = x.shape[-1]
    m = np.broadcast_to(np.asarray(mask, bool), x.shape).reshape(-1, T)
    x = np.asarray(x, np.float64).reshape(-1, T)
    total, tokens, live_rows, row_means = 0.0, 0, 0, 0.0
    for i in range(x.shape[0]):
        vals = [float(x[i, t]) for t in range(T) if m[i, t]]
        if not vals:
            continue
        live_rows += 1
        tokens += len(vals)
        total += sum(vals)
        row_means += sum(vals) / len(vals)
    if live_rows == 0:
        return 0.0
    return {
        "sequence-mean-token-mean": row_means / live_rows,
        "token-mean": total / tokens,
        "sequence-mean-token-sum": total / live_rows,
        "dr-grpo": total / (live_rows * T),
    }[mode]


def np_aggregate_weights(mask, mode):
    """d aggregate / d x_t: 1/normaliser at real tokens, 0 elsewhere (per-row loop)."""
    T = mask.shape[-1]
    m = np.asarray(mask, bool).reshape(-1, T)
    lengths = [int(row.sum()) for row in m]
    live_rows = sum(n > 0 for n in lengths)
    w = np.zeros(m.shape)
    for i, n in enumerate(lengths):
        for t in range(T):
            if not m[i, t]:
                continue
            w[i, t] = {
                "sequence-mean-token-mean": 1.0 / (live_rows * n),
                "token-mean": 1.0 / sum(lengths),
                "sequence-mean-token-sum": 1.0 / live_rows,
                "dr-grpo": 1.0 / (live_rows * T),
            }[mode]
    return w.reshape(mask.shape)


def np_entropy_finite_part(z):
    """Entropy of softmax over the finite entries only, per row; 0 for rows with none."""
    z = np.asarray(z, np.float64)
    out = np.zeros(z.shape[:-1])
    for i in np.ndindex(*z.shape[:-1]):
        f = z[i][np.isfinite(z[i])]
        if f.size == 0:
            continue
        p = np.exp(f - f.max())
        p /= p.sum()
        out[i] = -np.sum(p * np.log(p))
    return out


def np_all_action(logp, returns, scale, eps, mask):
    """Returns (per-row loss, d loss / d logp_all) with the advantage held fixed."""
    pi = np.exp(np.asarray(logp, np.float64))
    R = np.asarray(returns, np.float64)
    mask = np.ones(pi.shape, bool) if mask is None else np.asarray(mask, bool)
    adv = np.zeros_like(pi)
    variances = []
    for b in range(pi.shape[0]):
        m = mask[b]
        if not m.any() or np.all(R[b, m] == R[b, m][0]):
            variances.append(0.0)
            continue
        w = pi[b, m] / pi[b, m].sum()
        base = np.sum(w * R[b, m])
        adv[b, m] = R[b, m] - base
        variances.append(np.sum(w * (R[b, m] - base) ** 2))
    if scale == "group":
        adv /= np.sqrt(np.array(variances))[:, None] + eps
    elif scale == "batch":  # the rows that have actions (a constant row's variance is 0)
        adv /= np.sqrt(np.mean(np.array(variances)[mask.any(-1)])) + eps
    grad_logp = -np.where(mask, pi * adv, 0.0)
    return grad_logp.sum(-1), grad_logp


def fd_grad(f, x, h=1e-6):
    """Central finite-difference gradient of scalar f at x, in float64."""
    x = np.asarray(x, np.float64)
    g = np.zeros_like(x)
    for i in np.ndindex(*x.shape):
        e = np.zeros_like(x)
        e[i] = h
        g[i] = (f(x + e) - f(x - e)) / (2 * h)
    return g


def f32(x):
    return np.asarray(x, np.float32)


def random_rewards(rng, shape):
    kind = rng.integers(3, size=shape[:2] + (1,) * (len(shape) - 2))
    binary = rng.integers(2, size=shape).astype(float)
    cont = rng.normal(size=shape)
    const = np.broadcast_to(rng.choice([0.1, 0.3, 0.7, 1.0], size=kind.shape), shape)
    return f32(np.where(kind == 0, binary, np.where(kind == 1, cont, const)))


# Jitted entry points: one XLA compile per shape is far cheaper than op-by-op
# dispatch on a small shared CPU; test_eager_matches_jit covers the eager path.
group_advantages = jax.jit(obj.group_advantages, static_argnames=("scale",))
clipped_surrogate = jax.jit(obj.clipped_surrogate)
# TRL's clip_ratio/region_mean per token: where the clipped side is active (loss.clip_terms)
clip_fraction = jax.jit(lambda *a: clip_terms(*a)[2])
kl_estimate = jax.jit(obj.kl_estimate, static_argnames=("estimator",))
exact_kl = jax.jit(obj.exact_kl)
entropy_from_logits = jax.jit(obj.entropy_from_logits)
aggregate = jax.jit(obj.aggregate, static_argnames=("mode",))
all_action_loss = jax.jit(obj.all_action_loss, static_argnames=("scale",))


def jgrad(f, **kwargs):
    return jax.jit(jax.grad(f, **kwargs))


# ----------------------------------------------------------------------------
# group_advantages
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("scale", obj.ADVANTAGE_SCALES)
@pytest.mark.parametrize("shape", [(5, 4), (3, 4, 3)])
@pytest.mark.parametrize("masked", [False, True])
def test_group_advantages_matches_reference(seed, scale, shape, masked):
    rng = np.random.default_rng(seed)
    rewards = random_rewards(rng, shape)
    mask = rng.random(shape[:2]) < 0.75 if masked else None
    if masked:
        mask[0] = False  # a fully padded group
        mask[1, :2] = [True, False]  # a single-member group
    got = group_advantages(
        jnp.asarray(rewards), scale, 1e-8, None if mask is None else jnp.asarray(mask)
    )
    chex.assert_shape(got, shape)
    chex.assert_tree_all_finite(got)
    want = np_group_advantages(rewards, scale, 1e-8, mask)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    if masked:
        assert np.all(np.asarray(got)[~mask] == 0)


def test_group_advantages_golden():
    got = group_advantages(jnp.array([[0.0, 1.0, 1.0, 0.0]]))
    np.testing.assert_allclose(got, [[-1.0, 1.0, 1.0, -1.0]], atol=1e-6)
    got = group_advantages(jnp.array([[0.0, 1.0, 1.0, 0.0]]), scale="none")
    np.testing.assert_allclose(got, [[-0.5, 0.5, 0.5, -0.5]], atol=1e-7)


@pytest.mark.parametrize("scale", obj.ADVANTAGE_SCALES)
@pytest.mark.parametrize("eps", [1e-8, 0.0])
def test_group_advantages_zero_std_group_is_exactly_zero(scale, eps):
    rewards = jnp.array([[0.1, 0.1, 0.1], [0.3, 0.3, 0.3], [0.0, 1.0, 1.0]], jnp.float32)
    assert float(jnp.mean(rewards[0])) != np.float32(0.1)  # the naive residue is real
    got = np.asarray(group_advantages(rewards, scale, eps))
    assert np.all(np.isfinite(got))
    assert np.all(got[:2] == 0.0)
    assert np.all(got[2] != 0.0)
    per_token = group_advantages(jnp.full((2, 3, 4), 0.7), scale, eps)
    assert np.all(np.asarray(per_token) == 0.0)


def test_group_advantages_all_masked_and_unknown_scale():
    got = group_advantages(jnp.ones((2, 3)), mask=jnp.zeros((2, 3), bool))
    assert np.all(np.asarray(got) == 0.0)
    with pytest.raises(ValueError, match="group, batch, none"):
        obj.group_advantages(jnp.ones((1, 2)), scale="std")


# ----------------------------------------------------------------------------
# clipped surrogate and clip fraction
# ----------------------------------------------------------------------------


def surrogate_inputs(seed, shape=(2, 3, 4)):
    rng = np.random.default_rng(seed)
    logp = f32(rng.normal(-1.0, 0.5, shape))
    old = f32(logp - rng.normal(0.0, 0.3, shape))
    adv = f32(rng.normal(size=shape[:2] + (1,)))
    mask = rng.random(shape) < 0.8
    mask[0, 0] = False  # an all-masked row
    return logp, old, adv, mask


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("eps,eps_high", [(0.2, None), (0.2, 0.28), (0.1, 0.3)])
def test_clipped_surrogate_and_clip_fraction_match_reference(seed, eps, eps_high):
    logp, old, adv, _ = surrogate_inputs(seed)
    loss = clipped_surrogate(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv), eps, eps_high)
    frac = clip_fraction(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(adv), eps, eps_high)
    chex.assert_shape([loss, frac], logp.shape)
    np.testing.assert_allclose(
        loss, np_surrogate(logp, old, adv, eps, eps_high), rtol=1e-5, atol=1e-6
    )
    want_frac = np_clip_fraction(logp, old, adv, eps, eps_high)
    np.testing.assert_array_equal(frac, want_frac)
    assert 0 < want_frac.mean() < 1  # the inputs exercise both branches


def test_clip_fraction_golden():
    r = np.array([1.5, 1.5, 0.5, 0.5, 1.0, 1.5, 1.25])
    adv = jnp.array([1.0, -1.0, -1.0, 1.0, 1.0, 0.0, 1.0])
    logp = jnp.log(jnp.asarray(r, jnp.float32))
    old = jnp.zeros(7)
    # r=1.5,A>0 capped; r=0.5,A<0 capped; r=1.25 capped at 1.2 but kept at ε_high=0.3.
    np.testing.assert_array_equal(clip_fraction(logp, old, adv, 0.2, None), [1, 0, 1, 0, 0, 0, 1])
    np.testing.assert_array_equal(clip_fraction(logp, old, adv, 0.2, 0.3), [1, 0, 1, 0, 0, 0, 0])
    loss = clipped_surrogate(logp, old, adv, 0.2)
    np.testing.assert_allclose(loss, [-1.2, 1.5, 0.8, -0.5, -1.0, 0.0, -1.2], rtol=1e-6)


@pytest.mark.parametrize("seed", SEEDS[:2])
@pytest.mark.parametrize("mode", MODES)
def test_aggregated_surrogate_gradient_matches_finite_differences(seed, mode):
    logp, old, adv, mask = surrogate_inputs(seed)

    def loss(lp):
        per_token = clipped_surrogate(lp, jnp.asarray(old), jnp.asarray(adv), 0.2, 0.28)
        return aggregate(per_token, jnp.asarray(mask), mode)

    got = jgrad(loss)(jnp.asarray(logp))
    want = fd_grad(lambda lp: np_aggregate(np_surrogate(lp, old, adv, 0.2, 0.28), mask, mode), logp)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    assert np.all(np.asarray(got)[~mask] == 0)


# ----------------------------------------------------------------------------
# KL estimators, exact KL, entropy
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimate_and_gradient_match_reference(seed, estimator):
    rng = np.random.default_rng(seed)
    logp = f32(rng.normal(-2.0, 1.0, (3, 5)))
    ref = f32(logp + rng.normal(0.0, 0.5, (3, 5)) * (rng.random((3, 5)) < 0.7))
    got = kl_estimate(jnp.asarray(logp), jnp.asarray(ref), estimator)
    chex.assert_shape(got, logp.shape)
    np.testing.assert_allclose(got, np_kl(logp, ref, estimator), rtol=1e-5, atol=1e-7)
    grad = jgrad(lambda lp: jnp.sum(kl_estimate(lp, jnp.asarray(ref), estimator)))(
        jnp.asarray(logp)
    )
    np.testing.assert_allclose(grad, np_kl_grad(logp, ref, estimator), rtol=1e-5, atol=1e-6)
    fd = fd_grad(lambda lp: np.sum(np_kl(lp, ref, estimator)), logp)
    np.testing.assert_allclose(grad, fd, rtol=1e-4, atol=1e-6)


def test_k3_accuracy_near_reference_and_finite_gradients():
    logp = np.float32(-0.75)
    assert float(kl_estimate(jnp.float32(logp), jnp.float32(logp), "k3")) == 0.0
    g = jgrad(lambda lp: kl_estimate(lp, jnp.float32(logp), "k3"))(jnp.float32(logp))
    assert np.isfinite(g) and float(g) == 0.0

    ref = np.float32(logp - np.float32(1e-4))  # logp - ref = 1e-4
    d = np.float64(ref) - np.float64(logp)
    exact = np.expm1(d) - d
    got = float(kl_estimate(jnp.float32(logp), jnp.float32(ref), "k3"))
    assert abs(got - exact) / exact < 1e-3
    d32 = np.float32(ref) - np.float32(logp)
    naive = np.exp(d32) - d32 - np.float32(1)
    assert abs(naive - exact) / exact > 1e-3  # what the careful formulation avoids

    # Across scales and both signs, including the series/expm1 switch at |d| = 0.1.
    mags = np.concatenate([np.logspace(-6, 1, 29), [0.0999, 0.1, 0.1001]])
    ds = f32(np.concatenate([mags, -mags]))
    lp = f32(np.full_like(ds, -1.0))
    rf = f32(lp + ds)
    exact = np_kl(lp, rf, "k3")
    got = np.asarray(kl_estimate(jnp.asarray(lp), jnp.asarray(rf), "k3"))
    assert np.all(got >= 0)
    np.testing.assert_allclose(got, exact, rtol=1e-5)
    grads = jgrad(lambda x: jnp.sum(kl_estimate(x, jnp.asarray(rf), "k3")))(jnp.asarray(lp))
    np.testing.assert_allclose(grads, np_kl_grad(lp, rf, "k3"), rtol=1e-5, atol=1e-12)
    far = jgrad(lambda x: jnp.sum(kl_estimate(x, jnp.array([0.0, -60.0]), "k3")))(
        jnp.array([-60.0, 0.0])
    )
    assert np.all(np.isfinite(far))


def test_kl_estimate_unknown():
    with pytest.raises(ValueError, match="k1, k2, k3"):
        obj.kl_estimate(jnp.zeros(2), jnp.zeros(2), "k4")
    assert set(obj.KL_ESTIMATORS) == {"k1", "k2", "k3"}


@pytest.mark.parametrize("seed", SEEDS)
def test_exact_kl_and_entropy_match_reference(seed):
    rng = np.random.default_rng(seed)
    z = f32(rng.normal(size=(2, 3, 7)) * 2)
    y = f32(np_log_softmax(rng.normal(size=(2, 3, 7))))  # reference given as log-probs
    z[0, 0, :3] = -np.inf  # impossible tokens under the policy
    kl = exact_kl(jnp.asarray(z), jnp.asarray(y))
    ent = entropy_from_logits(jnp.asarray(z))
    chex.assert_shape([kl, ent], (2, 3))
    np.testing.assert_allclose(kl, np_exact_kl(z, y), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ent, np_entropy(z), rtol=1e-5, atol=1e-6)

    lp, lq = np_log_softmax(z), np_log_softmax(y)
    p, q = np.exp(lp), np.exp(lq)
    diff = np.where(p > 0, lp - lq, 0.0)
    gz, gy = jgrad(lambda a, b: jnp.sum(exact_kl(a, b)), argnums=(0, 1))(
        jnp.asarray(z), jnp.asarray(y)
    )
    chex.assert_tree_all_finite((gz, gy))
    np.testing.assert_allclose(gz, p * (diff - np_exact_kl(z, y)[..., None]), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(gy, q - p, rtol=1e-4, atol=1e-6)
    ge = jgrad(lambda a: jnp.sum(entropy_from_logits(a)))(jnp.asarray(z))
    chex.assert_tree_all_finite(ge)
    np.testing.assert_allclose(
        ge,
        -p * (np.where(p > 0, lp, 0) + np_entropy(z)[..., None]),
        rtol=1e-4,
        atol=1e-6,
    )


@pytest.mark.parametrize("seed", SEEDS)
def test_exact_forward_kl_matches_reference(seed):
    rng = np.random.default_rng(seed)
    z = f32(rng.normal(size=(2, 3, 7)) * 2)
    y = f32(np_log_softmax(rng.normal(size=(2, 3, 7))))
    lp, lq = np_log_softmax(z), np_log_softmax(y)
    q = np.exp(lq)
    want = np.sum(q * (lq - lp), -1)  # KL(π_ref ‖ π), float64
    fwd = jax.jit(obj.exact_forward_kl)
    got = fwd(jnp.asarray(z), jnp.asarray(y))
    chex.assert_shape(got, (2, 3))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # the gradient in the policy logits is the soft-target cross-entropy's: π - π_ref
    gz = jgrad(lambda a: jnp.sum(fwd(a, jnp.asarray(y))))(jnp.asarray(z))
    np.testing.assert_allclose(gz, np.exp(lp) - q, rtol=1e-4, atol=1e-6)
    # identical distributions: zero, never negative
    same = np.asarray(fwd(jnp.asarray(z), jnp.asarray(z)))
    assert np.all(same >= 0) and np.all(same < 1e-6)
    assert obj.KL_CHOICES == ("exact", "exact_forward", "k1", "k2", "k3")


def test_exact_kl_identical_is_zero_and_uniform_entropy():
    z = jnp.array([[3.0, -1.0, 0.5, 0.5], [100.0, 0.0, 0.0, 0.0]])
    kl = np.asarray(exact_kl(z, jax.nn.log_softmax(z)))
    assert np.all(kl >= 0) and np.all(kl < 1e-6)
    np.testing.assert_allclose(
        entropy_from_logits(jnp.zeros((2, 5))), np.log(5.0) * np.ones(2), rtol=1e-6
    )
    bf16 = entropy_from_logits(jnp.zeros((5,), jnp.bfloat16))
    np.testing.assert_allclose(bf16, np.log(5.0), rtol=1e-6)


@pytest.mark.parametrize("seed", SEEDS)
def test_entropy_with_filtered_log_probs(seed):
    rng = np.random.default_rng(seed)
    z = f32(rng.normal(size=(3, 4, 9)) * 2)
    z[0, :, :4] = -np.inf  # top-k style filtering
    z[1, 1, ::2] = -np.inf
    z[2, 2, :8] = -np.inf  # a single surviving token: entropy 0
    z[2, 3, :] = -np.inf  # nothing survives (a padding position)
    finite = np.isfinite(z)
    logp = f32(np.where(finite, np_log_softmax(np.where(finite, z, -1e30)), -np.inf))
    want = np_entropy_finite_part(z)
    assert want[2, 2] == 0.0 and want[0, 0] > 0.5
    for inp in (z, logp):  # raw logits or normalised log-probs, same distribution
        got = np.asarray(entropy_from_logits(jnp.asarray(inp)))
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        g = np.asarray(jgrad(lambda a: jnp.sum(entropy_from_logits(a)))(jnp.asarray(inp)))
        assert np.all(np.isfinite(g))
        assert np.all(g[~np.isfinite(inp)] == 0.0)
        # dH/dz_v = -p_v (log p_v + H) on the finite part
        lp = np_log_softmax(np.where(finite, z, -1e30))
        p = np.where(finite, np.exp(lp), 0.0)
        want_g = np.where(finite, -p * (lp + want[..., None]), 0.0)
        want_g[2, 3] = 0.0
        np.testing.assert_allclose(g, want_g, rtol=1e-4, atol=1e-6)


# ----------------------------------------------------------------------------
# aggregate
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", [(4, 5), (2, 3, 5)])
def test_aggregate_matches_reference(seed, mode, shape):
    rng = np.random.default_rng(seed)
    x = f32(rng.normal(size=shape))
    mask = rng.random(shape) < 0.6
    mask.reshape(-1, shape[-1])[1] = False  # an all-masked row
    x[~mask] = np.nan  # padding garbage must not leak
    got = aggregate(jnp.asarray(x), jnp.asarray(mask), mode)
    chex.assert_shape(got, ())
    np.testing.assert_allclose(got, np_aggregate(x, mask, mode), rtol=1e-5, atol=1e-6)
    grad = jgrad(lambda a: aggregate(a, jnp.asarray(mask), mode))(jnp.asarray(x))
    chex.assert_tree_all_finite(grad)


@pytest.mark.parametrize("mode", MODES)
def test_aggregate_all_masked_batch_is_zero(mode):
    x = jnp.ones((2, 3, 4))
    assert float(aggregate(x, jnp.zeros((2, 3, 4), bool), mode)) == 0.0
    g = jgrad(lambda a: aggregate(a, jnp.zeros((2, 3, 4)), mode))(x)
    assert np.all(np.asarray(g) == 0.0)


def test_aggregate_golden_and_unknown():
    x = jnp.array([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    m = jnp.array([[1, 1, 1], [1, 0, 0]])
    want = {
        "sequence-mean-token-mean": 3.0,
        "token-mean": 2.5,
        "sequence-mean-token-sum": 5.0,
        "dr-grpo": 10 / 6,
    }
    assert set(obj.AGGREGATIONS) == set(want)
    for mode, value in want.items():
        np.testing.assert_allclose(aggregate(x, m, mode), value, rtol=1e-6)
    with pytest.raises(ValueError, match="token-mean"):
        obj.aggregate(x, m, "mean")


def varied_length_batch(seed, B=2, G=3, T=5):
    """[B, G, T] values and masks with per-row lengths 1..T, one all-masked row, and
    NaN garbage at every masked position."""
    rng = np.random.default_rng(seed)
    lengths = np.concatenate([np.arange(1, T + 1), [0]])
    lengths = np.resize(lengths, B * G)
    rng.shuffle(lengths)
    lengths = lengths.reshape(B, G)
    mask = np.arange(T) < lengths[..., None]
    x = f32(rng.normal(size=(B, G, T)))
    x[~mask] = np.nan
    assert (lengths == 0).sum() == 1 and set(range(1, T + 1)) <= set(lengths.ravel())
    return x, mask


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", MODES)
def test_aggregate_varied_lengths_match_reference(seed, mode):
    x, mask = varied_length_batch(seed)
    got = aggregate(jnp.asarray(x), jnp.asarray(mask), mode)
    assert np.isfinite(float(got))
    np.testing.assert_allclose(got, np_aggregate(x, mask, mode), rtol=1e-5, atol=1e-6)
    # a float mask and a mask given per row ([B, G, 1] broadcast) mean the same
    got_f = aggregate(jnp.asarray(x), jnp.asarray(mask, jnp.float32), mode)
    np.testing.assert_allclose(got_f, got, rtol=1e-6)
    # the all-masked row does not count: dropping it leaves the value unchanged
    live = mask.reshape(-1, mask.shape[-1]).any(-1)
    rows_x = x.reshape(-1, x.shape[-1])[live]
    rows_m = mask.reshape(-1, mask.shape[-1])[live]
    got_live = aggregate(jnp.asarray(rows_x), jnp.asarray(rows_m), mode)
    np.testing.assert_allclose(got_live, got, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", MODES)
def test_aggregate_gradient_is_mask_over_normaliser(seed, mode):
    x, mask = varied_length_batch(seed)
    grad = np.asarray(jgrad(lambda a: aggregate(a, jnp.asarray(mask), mode))(jnp.asarray(x)))
    assert np.all(np.isfinite(grad))
    assert np.all(grad[~mask] == 0.0)  # NaN garbage there, still an exact 0
    want = np_aggregate_weights(mask, mode)
    np.testing.assert_allclose(grad, want, rtol=1e-6, atol=0)
    # linear with those weights: the value is Σ w·x over real tokens
    np.testing.assert_allclose(
        aggregate(jnp.asarray(x), jnp.asarray(mask), mode),
        np.sum(np.where(mask, want * x, 0.0)),
        rtol=1e-5,
        atol=1e-6,
    )


def test_aggregate_masked_row_golden():
    # 3 rows × T=4; row 2 is all masked (a padding member) and holds NaN garbage.
    #   row 0: 1 2 3 4  (length 4, sum 10, mean 2.5)
    #   row 1: 5 6 . .  (length 2, sum 11, mean 5.5)
    #   row 2: . . . .  (does not exist)
    # rows = 2 rows exist, 6 tokens, Σ m·x = 21:
    #   sequence-mean-token-mean = (2.5 + 5.5) / 2 = 4.0
    #   token-mean               = 21 / 6          = 3.5
    #   sequence-mean-token-sum  = (10 + 11) / 2   = 10.5
    #   dr-grpo                  = 21 / (2 · 4)    = 2.625  (not 21 / (3 · 4) = 1.75)
    # Gradients (per real token): 1/(2·4) and 1/(2·2) per row; 1/6; 1/2; 1/8.
    nan = np.nan
    x = jnp.array([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, nan, nan], [nan, nan, nan, nan]])
    m = jnp.array([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]], bool)
    want = {
        "sequence-mean-token-mean": (4.0, [0.125, 0.25, 0.0]),
        "token-mean": (3.5, [1 / 6, 1 / 6, 0.0]),
        "sequence-mean-token-sum": (10.5, [0.5, 0.5, 0.0]),
        "dr-grpo": (2.625, [0.125, 0.125, 0.0]),
    }
    for mode, (value, row_w) in want.items():
        np.testing.assert_allclose(aggregate(x, m, mode), value, rtol=1e-6)
        g = np.asarray(jgrad(lambda a, mode=mode: aggregate(a, m, mode))(x))
        np.testing.assert_allclose(g, np.asarray(m) * np.array(row_w)[:, None], rtol=1e-6)
    # Dr.GRPO's normaliser ignores the completion lengths of the rows that exist
    # but not their number: a second padding row changes nothing.
    x4 = jnp.concatenate([x, jnp.full((1, 4), nan)])
    m4 = jnp.concatenate([m, jnp.zeros((1, 4), bool)])
    np.testing.assert_allclose(aggregate(x4, m4, "dr-grpo"), 2.625, rtol=1e-6)


# ----------------------------------------------------------------------------
# all-action (expected) loss
# ----------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("scale",))
def all_action_grads(logp, z, returns, scale, mask):
    """Gradients of the summed all-action loss w.r.t. log-probs and w.r.t. logits."""

    def loss(a):
        return jnp.sum(obj.all_action_loss(a, returns, scale, 1e-8, mask))

    return jax.grad(loss)(logp), jax.grad(lambda a: loss(jax.nn.log_softmax(a)))(z)


def test_all_action_gradient_is_exact_policy_gradient():
    rng = np.random.default_rng(0)
    z = f32(rng.normal(size=(1, 5)))
    R = f32(rng.normal(size=(1, 5)))
    grad = jgrad(lambda a: all_action_loss(jax.nn.log_softmax(a), jnp.asarray(R))[0])(
        jnp.asarray(z)
    )
    pi = np.exp(np_log_softmax(z))
    analytic = -pi * (R - np.sum(pi * R))  # -∂/∂z Σ_a softmax(z)_a R_a
    np.testing.assert_allclose(grad, analytic, rtol=1e-5, atol=1e-7)
    fd = fd_grad(lambda a: -np.sum(np.exp(np_log_softmax(a)) * R), z)
    np.testing.assert_allclose(grad, fd, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("scale", obj.ADVANTAGE_SCALES)
@pytest.mark.parametrize("masked", [False, True])
def test_all_action_loss_matches_reference(seed, scale, masked):
    rng = np.random.default_rng(seed)
    B, V = 4, 6
    z = f32(rng.normal(size=(B, V)) * 1.5)
    R = f32(rng.normal(size=(B, V)))
    R[1] = 0.1  # constant returns: no signal
    mask = None
    if masked:
        mask = rng.random((B, V)) < 0.7
        mask[2] = False  # an all-masked row
        mask[0, :2] = True
    logp = f32(np_log_softmax(z))
    jmask = None if mask is None else jnp.asarray(mask)
    loss = all_action_loss(jnp.asarray(logp), jnp.asarray(R), scale, 1e-8, jmask)
    chex.assert_shape(loss, (B,))
    want_loss, want_glogp = np_all_action(logp, R, scale, 1e-8, mask)
    np.testing.assert_allclose(loss, want_loss, atol=1e-6)

    g_logp, g_z = all_action_grads(jnp.asarray(logp), jnp.asarray(z), jnp.asarray(R), scale, jmask)
    np.testing.assert_allclose(g_logp, want_glogp, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(g_logp)[1] == 0.0)
    pi = np.exp(logp.astype(np.float64))
    want_gz = want_glogp - pi * want_glogp.sum(-1, keepdims=True)  # log-softmax Jacobian
    chex.assert_tree_all_finite(g_z)
    np.testing.assert_allclose(g_z, want_gz, rtol=1e-4, atol=1e-6)


def test_all_action_unknown_scale():
    with pytest.raises(ValueError, match="group, batch, none"):
        obj.all_action_loss(jnp.zeros((1, 2)), jnp.zeros((1, 2)), scale="max")


def test_eager_matches_jit():
    rng = np.random.default_rng(0)
    r, lp, lq = (jnp.asarray(f32(rng.normal(size=(2, 3)))) for _ in range(3))
    m = jnp.asarray(rng.random((2, 3)) < 0.7)
    pairs = [
        (obj.group_advantages(r, "batch", 1e-8, m), group_advantages(r, "batch", 1e-8, m)),
        (obj.clipped_surrogate(lp, lq, r, 0.2, 0.3), clipped_surrogate(lp, lq, r, 0.2, 0.3)),
        (clip_terms(lp, lq, r, 0.2, None)[2], clip_fraction(lp, lq, r, 0.2, None)),
        (obj.kl_estimate(lp, lq, "k3"), kl_estimate(lp, lq, "k3")),
        (obj.exact_kl(lp, lq), exact_kl(lp, lq)),
        (obj.entropy_from_logits(lp), entropy_from_logits(lp)),
        (obj.aggregate(lp, m, "token-mean"), aggregate(lp, m, "token-mean")),
    ]
    for eager, jitted in pairs:
        np.testing.assert_allclose(eager, jitted, rtol=1e-6, atol=1e-7)
    # With group scaling the all-action loss is a sum of terms of size ~1 that cancels to 0, so
    # eager vs jit differ by float32 cancellation error (~2e-7 on jax < 0.10), not by 1e-7.
    aal = obj.all_action_loss(lp, r, "group"), all_action_loss(lp, r, "group")
    np.testing.assert_allclose(*aal, rtol=1e-6, atol=1e-6)
