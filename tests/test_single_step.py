"""Single-step groups (a tabular policy acting on one span at once) through the one engine,
against closed-form gradients.

The policy is a logit table θ[prompt, position, action]; the reward a fixed table, so the
objective E_π[R] and its gradient are known exactly (jax.grad of the closed form, not of the
estimator). With plain SGD at lr 1 the step moves θ by exactly minus the loss's gradient.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _engine_config import engine_config

from grpo_jax import metrics, objective, single_step
from grpo_jax.groups import Part
from grpo_jax.rewards import RewardTerm
from grpo_jax.specs import EngineSpec
from grpo_jax.train_state import init_state

pytestmark = pytest.mark.usefixtures("fast_compiles")

B, V = 3, 5


def _config(mode="exhaustive", kl="exact", beta=0.0, scale="none"):
    return engine_config(B, 4, mode, kl, beta, scale)


def _problem(num_positions, mask, reward_table):
    """A step over a tabular policy; reward = reward_table[prompt, the span's first action]."""
    start, length = single_step.spans_of(jnp.asarray(mask))

    def policy_logits(params, prompts):
        return params[prompts]  # [B, T, V]

    def sample_prompts(key, data):
        return single_step.SpanPrompts(jnp.arange(B), start, length, {})

    def reward_fn(state, prompts, tokens, m, ref):
        return reward_table[prompts.inputs[:, None], tokens[..., 0]]

    theta = jax.random.normal(jax.random.PRNGKey(0), (B, num_positions, V))
    return theta, policy_logits, sample_prompts, reward_fn


def _sgd_step(config, theta, problem_fns, ref=None):
    policy_logits, sample_prompts, reward_fn = problem_fns
    tx = optax.sgd(1.0)
    terms = (RewardTerm("table", 1.0, reward_fn),)
    fns = (policy_logits, V, 1, sample_prompts, terms, tx, lambda s: 1.0)
    step, inputs = single_step.build(EngineSpec.from_config(config), *fns, theta, None)
    if ref is not None:
        inputs = inputs._replace(ref_state=ref)
    state, m = jax.jit(step.fused)(init_state(theta, tx, 0), inputs)
    return state.params, m


def test_exhaustive_one_action_is_the_exact_policy_gradient():
    """One acted position (a bandit): the step is θ += ∇_θ mean_b Σ_a π_θ(a|b) R(b, a)."""
    reward = jax.random.uniform(jax.random.PRNGKey(1), (B, V))
    theta, *fns = _problem(1, np.ones((B, 1)), reward)
    new, metrics = _sgd_step(_config(), theta, fns)

    def expected_reward(th):
        return jnp.mean(jnp.sum(jax.nn.softmax(th[:, 0], -1) * reward, -1))

    np.testing.assert_allclose(new - theta, jax.grad(expected_reward)(theta), atol=1e-6)
    # the group is every action: V members per prompt; reward is their plain mean,
    # reward_policy_mean the policy's expected reward Σ_a π_old(a) R(a)
    np.testing.assert_allclose(metrics["reward"], reward.mean(), rtol=1e-6)
    pi = jax.nn.softmax(theta[:, 0], -1)
    np.testing.assert_allclose(
        metrics["reward_policy_mean"], jnp.mean(jnp.sum(pi * reward, -1)), rtol=1e-5
    )
    assert float(metrics["generated_tokens"]) == B * V


def test_exhaustive_group_normalised_advantages_scale_the_gradient():
    """advantage_scale=group divides the exact gradient by the π-weighted reward std."""
    reward = jax.random.uniform(jax.random.PRNGKey(2), (B, V))
    theta, *fns = _problem(1, np.ones((B, 1)), reward)
    new, _ = _sgd_step(_config(scale="group"), theta, fns)
    pi = jax.nn.softmax(theta[:, 0], -1)
    std = jnp.sqrt(jnp.sum(pi * (reward - jnp.sum(pi * reward, -1, keepdims=True)) ** 2, -1))

    def scaled(th):
        p = jax.nn.softmax(th[:, 0], -1)
        return jnp.mean(jnp.sum(p * reward, -1) / (std + 1e-8))

    np.testing.assert_allclose(new - theta, jax.grad(scaled)(theta), atol=1e-5)


def test_exhaustive_batch_scaled_advantages_divide_by_the_mean_variance():
    """advantage_scale=batch divides the exact gradient by the root of the prompts' mean
    π-weighted reward variance (it was silently read as none by the expected estimator)."""
    reward = 10.0 * jax.random.uniform(jax.random.PRNGKey(4), (B, V))  # std far from 1
    theta, *fns = _problem(1, np.ones((B, 1)), reward)
    new, _ = _sgd_step(_config(scale="batch"), theta, fns)
    pi = jax.nn.softmax(theta[:, 0], -1)
    var = jnp.sum(pi * (reward - jnp.sum(pi * reward, -1, keepdims=True)) ** 2, -1)

    def scaled(th):
        p = jax.nn.softmax(th[:, 0], -1)
        return jnp.mean(jnp.sum(p * reward, -1)) / (jnp.sqrt(jnp.mean(var)) + 1e-8)

    np.testing.assert_allclose(new - theta, jax.grad(scaled)(theta), atol=1e-6)


def test_adaptive_weights_every_prompt_one_batch_share():
    """group.mode=adaptive: the budget's exhaustive prompts and the sampled ones each weigh
    1/B, as one batch (the exhaustive sub-batch weighed 1/budget per prompt: 4x here)."""
    b, v = 8, 5
    config = engine_config(b, 4, "adaptive", "k3", 0.0, "none")
    config.group.entropy_threshold = 0.0  # the budget's ceil(8/4) = 2 prompts go exhaustive
    reward = jax.random.uniform(jax.random.PRNGKey(5), (b, v))
    theta = jax.random.normal(jax.random.PRNGKey(6), (b, 1, v))
    start, length = single_step.spans_of(jnp.ones((b, 1)))
    prompts = lambda key, data: single_step.SpanPrompts(jnp.arange(b), start, length, {})
    table = lambda s, pr, tok, m, ref: reward[pr.inputs[:, None], tok[..., 0]]
    tx = optax.sgd(1.0)
    fns = (lambda p, x: p[x], v, 1, prompts, (RewardTerm("table", 1.0, table),), tx, lambda s: 1.0)
    step, inputs = single_step.build(EngineSpec.from_config(config), *fns, theta, None)
    state0 = init_state(theta, tx, 0)
    new, metrics = jax.jit(step.fused)(state0, inputs)
    delta = np.asarray(new.params - theta)[:, 0]
    assert float(metrics["adaptive_exhaustive_frac"]) == 0.25
    pi = jax.nn.softmax(theta[:, 0], -1)
    exhaustive = np.argsort(-np.asarray(-jnp.sum(pi * jnp.log(pi), -1)))[:2]
    exact = jax.grad(lambda th: jnp.sum(jax.nn.softmax(th[:, 0], -1) * reward) / b)(theta)
    np.testing.assert_allclose(delta[exhaustive], exact[exhaustive, 0], atol=1e-6)
    # the sampled prompts: mean_k A_k ∇log π(a_k) / B (mu = 1: the clipped surrogate's gradient)
    sampled = step.score(step.rollout(state0, inputs))[0][0]

    def surrogate(th):
        lp = jnp.take_along_axis(jax.nn.log_softmax(th[:, 0], -1), sampled.tokens[..., 0], 1)
        return jnp.sum(sampled.member_mask * sampled.advantages[..., 0] * lp) / 4 / b

    rest = np.setdiff1d(np.arange(b), exhaustive)
    np.testing.assert_allclose(delta[rest], jax.grad(surrogate)(theta)[rest, 0], atol=1e-6)


def test_exhaustive_forces_the_first_acted_position_and_keeps_the_exact_kl():
    """The decision point is each prompt's first acted position (here position 1 for prompt
    0); a position the reward ignores gets no decision-point gradient, only the KL's."""
    reward = jax.random.uniform(jax.random.PRNGKey(3), (B, V))
    mask = np.array([[0.0, 1.0], [1.0, 0.0], [1.0, 0.0]])
    theta, policy_logits, sample_prompts, reward_fn = _problem(2, mask, reward)
    ref = jnp.zeros_like(theta)  # uniform reference
    new, metrics = _sgd_step(
        _config(beta=0.5), theta, (policy_logits, sample_prompts, reward_fn), ref
    )
    dp = jnp.asarray(mask)  # one acted position per prompt: it is the decision point

    def objective(th):
        lp = jax.nn.log_softmax(th, -1)  # [B, T, V]
        lp_dp = jnp.sum(lp * dp[..., None], 1)
        gain = jnp.mean(jnp.sum(jnp.exp(lp_dp) * reward, -1))
        kl = jnp.sum(jnp.exp(lp) * (lp - jax.nn.log_softmax(ref, -1)), -1)  # [B, T]
        return gain - 0.5 * jnp.sum(kl * dp) / dp.sum()

    np.testing.assert_allclose(new - theta, jax.grad(objective)(theta), atol=1e-6)
    assert np.all(np.asarray(new - theta)[mask == 0] == 0)  # unacted positions never move
    assert float(metrics["kl"]) > 0


def test_group_settings_are_checked_once_in_the_specs():
    # A sampled-token KL estimator is fine for forced groups now: the decision point's KL is
    # exact over V, and the span's later tokens are samples of π_old given the forced first
    # one (the old single-step step refused k3 for exhaustive groups; the engine does not).
    EngineSpec.from_config(_config(kl="k3"))
    with pytest.raises(ValueError, match="group.mode='bogus' is unknown"):
        EngineSpec.from_config(_config(mode="bogus"))


def test_reward_policy_mean_weights_forced_members_by_pi_old():
    """group_metrics by hand: a forced part's members weighted by π_old of their first action
    (masked members excluded); a sampled part's policy mean is its plain mean."""
    ret = np.array([[1.0, 0.0, 0.5], [0.2, 0.4, 0.9]])
    logp0 = np.log(np.array([[0.5, 0.25, 0.25], [0.1, 0.6, 0.3]]))
    mask = np.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    zeros = jnp.zeros((2, 3, 1))
    part = Part(
        prompts=None,
        tokens=jnp.zeros((2, 3, 1), jnp.int32),
        completion_mask=jnp.ones((2, 3, 1)),
        member_mask=jnp.asarray(mask),
        logp_old=jnp.asarray(logp0)[..., None],
        actions=jnp.zeros((2, 0), jnp.int32),
        action_mask=jnp.zeros((2, 0)),
        ref_logp=jnp.zeros((2, 3, 1, 0)),
        rewards=jnp.asarray(ret)[..., None],
        returns=jnp.asarray(ret) * mask,
        advantages=zeros,
        action_returns=jnp.zeros((2, 0)),
        valid=jnp.ones((2, 3)),
    )
    row0 = 0.5 * 1.0 + 0.25 * 0.0 + 0.25 * 0.5
    row1 = (0.1 * 0.2 + 0.6 * 0.4) / 0.7
    forced = metrics.group_metrics((part,), (True,), 3)
    np.testing.assert_allclose(forced["reward_policy_mean"], (row0 + row1) / 2, rtol=1e-6)
    sampled = metrics.group_metrics((part,), (False,), 3)
    np.testing.assert_allclose(sampled["reward_policy_mean"], sampled["reward"], rtol=1e-6)
    np.testing.assert_allclose(sampled["reward"], (1.5 / 3 + 0.6 / 2) / 2, rtol=1e-6)


def _returns_part(ret, logp0=None, actions=None, weights=None):
    """A part of one-token members with these returns [B, K] (forced when ``actions``)."""
    b, k = ret.shape
    a = np.zeros((b, 0), np.int32) if actions is None else actions
    logp0 = np.zeros((b, k)) if logp0 is None else logp0
    return Part(
        None, jnp.zeros((b, k, 1), jnp.int32), jnp.ones((b, k, 1)), jnp.ones((b, k)),
        jnp.asarray(logp0, jnp.float32)[..., None], jnp.asarray(a), jnp.ones(a.shape),
        jnp.zeros((b, k, 1, 0)), jnp.asarray(ret)[..., None], jnp.asarray(ret),
        jnp.zeros((b, k, 1)), jnp.zeros(a.shape), jnp.ones((b, k)),
        None if weights is None else jnp.asarray(weights, jnp.float32),
    )  # fmt: skip


def test_reward_policy_mean_counts_a_guided_explorers_weight():
    """A guided group of π = [.7, .1, .1, .1], R = [0, 1, 1, 1]: the guide's top-1 (token 0,
    weight 0) and one explorer of the other three (token 2, weight (V - k) / r = 3) give
    E_π[R] = (.7·0 + .1·3·1) / (.7 + .1·3) = 0.3, as scoring.return_credit weighs them; π_old
    alone would give .1 / .8 = 0.125."""
    part = _returns_part(
        np.array([[0.0, 1.0]]), np.log([[0.7, 0.1]]), np.array([[0, 2]], np.int32), [[0.0, 3.0]]
    )
    got = metrics.group_metrics((part,), (True,), 4)["reward_policy_mean"]
    np.testing.assert_allclose(got, 0.3, rtol=1e-6)


def test_frac_reward_zero_std_counts_exactly_the_groups_without_signal():
    """Groups of 3 equal returns at |r| ~ 100 (a float32 mean of three leaves a residue) are
    zero-std, with reward_std exactly 0; a group one float32 step apart is not (its advantages
    are ±1, not 0), though its std, 5.5e-7, is under the 1e-6 a threshold on the std used."""
    x = (np.random.default_rng(0).normal(size=64) * 100).astype(np.float32)
    ret = np.repeat(x[:, None], 3, 1)
    ret[0, 2] = np.nextafter(ret[0, 0], np.float32(np.inf))
    adv = objective.group_advantages(jnp.asarray(ret))
    assert float(jnp.abs(adv[0]).max()) > 0.5 and float(jnp.abs(adv[1:]).max()) == 0.0
    stats, _, _ = metrics._prompt_stats(_returns_part(ret), False)
    np.testing.assert_array_equal(stats["frac_reward_zero_std"], [0.0] + [1.0] * 63)
    np.testing.assert_array_equal(stats["reward_std"][1:], 0.0)
    assert 0 < float(stats["reward_std"][0]) < 1e-6


def test_first_token_stats_are_indexed_by_token_id():
    """first_token/reward and /best follow each slot's token id (a guided group holds its
    actions in guide-rank order), each token's mean taken over the prompts that forced it."""
    actions = jnp.array([[3, 2, 1, 0], [0, 1, 2, 3]], jnp.int32)
    action_mask = jnp.array([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 1.0]])  # row 1 lacks token 2
    returns = jnp.array([[40.0, 30.0, 20.0, 10.0], [5.0, 50.0, 0.0, 15.0]])  # slot order
    zeros = jnp.zeros((2, 4, 1))
    part = Part(
        None, actions[..., None], jnp.ones((2, 4, 1)), jnp.ones((2, 4)), zeros, actions,
        action_mask, jnp.zeros((2, 4, 1, 0)), zeros, returns, zeros, returns, jnp.ones((2, 4)),
    )  # fmt: skip
    out = metrics.group_metrics((part,), (True,), 4)
    # token 0: 10 and 5; token 1: 20 and 50; token 2: 30 (row 0 only); token 3: 40 and 15
    np.testing.assert_allclose(out["first_token/reward"], [7.5, 35.0, 30.0, 27.5])
    np.testing.assert_allclose(out["first_token/best"], [0.0, 0.5, 0.0, 0.5])  # 3, then 1


def test_kl_and_entropy_metrics_are_trls_token_means():
    """Spans of 1, 4 and 2 tokens under loss_agg=sequence-mean-token-mean: the kl and entropy
    metrics are token means over the batch (TRL's), not the loss's per-sequence means."""
    mask = np.array([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0]])
    theta, logits, prompts, reward = _problem(4, mask, jnp.ones((B, V)))
    tx = optax.sgd(1.0)
    fns = (logits, V, 4, prompts, (RewardTerm("table", 1.0, reward),), tx, lambda s: 1.0)
    config = _config("sampled", "exact", 0.5)
    step, inputs = single_step.build(EngineSpec.from_config(config), *fns, theta, None)
    inputs = inputs._replace(ref_state=jnp.zeros_like(theta))  # a uniform reference
    _, m = jax.jit(step.fused)(init_state(theta, tx, 0), inputs)
    lp = np.asarray(jax.nn.log_softmax(theta, -1), np.float64)
    kl = np.sum(np.exp(lp) * (lp - np.log(1 / V)), -1)  # [B, T]: every member's, per position
    ent = -np.sum(np.exp(lp) * lp, -1)
    np.testing.assert_allclose(m["kl"], np.sum(kl * mask) / mask.sum(), rtol=1e-5)
    np.testing.assert_allclose(m["entropy"], np.sum(ent * mask) / mask.sum(), rtol=1e-5)
    per_sequence = np.mean(np.sum(kl * mask, 1) / mask.sum(1))
    assert abs(per_sequence - np.sum(kl * mask) / mask.sum()) > 1e-2  # the two differ here
