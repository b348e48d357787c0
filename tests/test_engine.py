"""The one GRPO step's contracts, against hand computations: π_old over μ updates, EOS masking
in the loss, and rows no reward term scored."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _engine_config import engine_config
from ml_collections import ConfigDict

from grpo_jax import groups, metrics, rewards, scoring, single_step
from grpo_jax.loss import make_loss
from grpo_jax.model import Transformer, init_params
from grpo_jax.policy import TokenPrompts, policy_reference, token_logits, transformer_policy
from grpo_jax.rewards import RewardTerm
from grpo_jax.rollout import SamplingParams, token_logp
from grpo_jax.specs import EngineSpec, GroupSpec, ObjectiveSpec
from grpo_jax.train_state import init_state

pytestmark = pytest.mark.usefixtures("fast_compiles")  # conftest.py

B, G, V = 3, 4, 5


def _config(mu=1, mode="sampled", agg="sequence-mean-token-mean", beta=0.0, kl="k3"):
    return engine_config(B, G, mode, kl, beta, "group", mu, agg)


def _bandit_step(config, theta, reward, lr):
    """A tabular one-action policy θ[prompt, 0, action] with reward[prompt, action]."""

    def sample_prompts(key, data):
        one = jnp.ones((B,), jnp.int32)
        return single_step.SpanPrompts(jnp.arange(B), one * 0, one, {})

    def table(state, prompts, tokens, mask, ref):
        return reward[prompts.inputs[:, None], tokens[..., 0]]

    tx = optax.sgd(lr)
    terms = (RewardTerm("table", 1.0, table),)
    fns = (lambda p, x: p[x], V, 1, sample_prompts, terms, tx, lambda s: lr)
    step, inputs = single_step.build(EngineSpec.from_config(config), *fns, theta, None)
    return step, inputs, init_state(theta, tx, 0)


def test_mu_updates_keep_the_sampling_policy_as_pi_old():
    """μ = 3 SGD updates on one batch, by hand: every update's ratio is π_θi / π_θ0 (the policy
    that sampled the batch), clipped at 1 ± ε. A drifting π_old (θ_{i-1}) lands elsewhere."""
    theta = jax.random.normal(jax.random.PRNGKey(0), (B, 1, V))
    reward = jax.random.uniform(jax.random.PRNGKey(1), (B, V))
    lr, eps = 4.0, 0.2  # large steps: ratios leave the clip window after the first update
    step, inputs, state = _bandit_step(_config(mu=3), theta, reward, lr)
    batch = step.rollout(state, inputs)
    (part,), _ = step.score(batch)
    tokens = np.asarray(part.tokens[..., 0])  # [B, G]
    adv = np.asarray(part.advantages[..., 0])
    new_state, metrics = jax.jit(step.update)(state, inputs, batch)

    def surrogate(th, old_lp):  # written from the definition, not from objective.py
        lp = jax.nn.log_softmax(th[:, 0], -1)[jnp.arange(B)[:, None], tokens]
        ratio = jnp.exp(lp - old_lp)
        return -jnp.mean(jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - eps, 1 + eps) * adv))

    def logp(th):
        return jax.nn.log_softmax(th[:, 0], -1)[jnp.arange(B)[:, None], tokens]

    def run(drift: bool):
        th, old = theta, logp(theta)
        for _ in range(3):
            th_next = th - lr * jax.grad(surrogate)(th, old)
            old = logp(th) if drift else old
            th = th_next
        return th

    want = run(drift=False)
    np.testing.assert_allclose(new_state.params, want, atol=1e-5)
    assert not np.allclose(run(drift=True), want, atol=1e-3)  # the check can fail
    assert float(metrics["clip_ratio/region_mean"]) > 0  # clipping was active


@pytest.mark.parametrize("kl", ["exact", "k3"])
def test_a_tempered_policy_at_the_reference_params_has_kl_zero(kl):
    """At T = 0.5, from params equal to the reference's and with every advantage 0 (a
    constant reward), the step's KL is 0 and its update leaves the params where they are:
    the reference is read at the sampling temperature, log_softmax(θ / T), as TRL reads it.
    Read untempered, log_softmax(θ), the same step would see the KL below and move θ."""
    theta = 2.0 * jax.random.normal(jax.random.PRNGKey(0), (B, 1, V))
    config = _config(beta=0.5, kl=kl)
    config.group.temperature = 0.5
    step, inputs, state = _bandit_step(config, theta, jnp.zeros((B, V)), 1.0)
    batch = step.rollout(state, inputs)
    new_state, m = jax.jit(step.update)(state, inputs, batch)
    assert abs(float(m["kl"])) < 1e-6
    np.testing.assert_allclose(new_state.params, theta, atol=1e-6)
    (part,), _ = step.score(batch)
    if kl == "k3":  # the reference's token log-probs the rollout carries
        want = jax.nn.log_softmax(theta[:, 0] / 0.5, -1)[
            jnp.arange(B)[:, None], part.tokens[..., 0]
        ]
        np.testing.assert_allclose(part.ref_token_logp[..., 0], want, atol=1e-6)
    pi, untempered = jax.nn.softmax(theta[:, 0] / 0.5), jax.nn.log_softmax(theta[:, 0])
    assert float(jnp.mean(jnp.sum(pi * (jnp.log(pi) - untempered), -1))) > 0.05


@pytest.mark.parametrize("estimator", ["uniform", "expected"])
def test_a_forced_parts_clip_metrics_count_its_continuation_tokens(estimator):
    """An exhaustive part trained with its continuations, at a later update (μ = 2): the
    continuation tokens' π_old is π_θ / e, so their ratio is e, past 1 + ε. clip_ratio/* and
    ratio_mean are token means over every token the clipped surrogate scored, counted by
    hand: the forced actions (ratio 1; "uniform" only, "expected" has no ratio there) and
    the continuations, clipped where their advantage is positive."""
    length, span, b = 5, 3, 2
    w = jax.random.normal(jax.random.PRNGKey(0), (length, V))
    policy = single_step.single_step_policy(
        lambda p, x: jnp.broadcast_to(p, (x.shape[0], length, V)), V, span, SamplingParams()
    )
    one = jnp.ones((b,), jnp.int32)
    prompts = single_step.SpanPrompts(jnp.zeros((b, length)), 0 * one, span * one, {})
    actions = jnp.broadcast_to(jnp.arange(V, dtype=jnp.int32), (b, V))
    rest = jax.random.randint(jax.random.PRNGKey(1), (b, V, span - 1), 0, V)
    tokens = jnp.concatenate([actions[..., None], rest], -1)
    logp = token_logp(jax.nn.log_softmax(token_logits(policy, w, prompts, tokens)[1]), tokens)
    old = logp.at[..., 1:].add(-1.0)
    adv = jnp.where(jax.random.bernoulli(jax.random.PRNGKey(2), 0.5, tokens.shape), 1.0, -1.0)
    ones = jnp.ones(tokens.shape)
    part = groups.Part(
        prompts, tokens, ones, ones[..., 0], old, actions, jnp.ones((b, V)),
        jnp.zeros((*tokens.shape, 0)), 0 * ones, 0 * ones[..., 0], adv, jnp.zeros((b, V)),
        ones[..., 0],
    )  # fmt: skip
    config = _config(mu=2, mode="exhaustive", agg="token-mean")
    config.grpo.exhaustive_estimator = estimator
    spec = EngineSpec.from_config(config)
    loss_fn = make_loss(spec.objective, spec.group, policy, None)
    _, (m, _) = jax.jit(loss_fn, static_argnums=(3, 4))(w, (part,), (old,), False, (True,))
    n_dec = 0 if estimator == "expected" else b * V  # each at ratio 1, never clipped
    n_cont = b * V * (span - 1)
    high = int(np.sum(np.asarray(adv[..., 1:]) > 0))
    assert 0 < high < n_cont
    np.testing.assert_allclose(m["clip_ratio/high_mean"], high / (n_dec + n_cont), rtol=1e-6)
    np.testing.assert_allclose(m["clip_ratio/region_mean"], high / (n_dec + n_cont), rtol=1e-6)
    assert float(m["clip_ratio/low_mean"]) == 0.0
    want = (n_dec + n_cont * np.e) / (n_dec + n_cont)
    np.testing.assert_allclose(m["ratio_mean"], want, rtol=1e-5)


def _tiny_lm():
    m = Transformer(vocab_size=V, num_layers=1, num_heads=2, d_model=16, max_len=8)
    return m, init_params(m, jax.random.PRNGKey(2))


def test_tokens_after_eos_contribute_nothing():
    """A sampled part whose first member ends at EOS after 2 of 4 tokens: the loss and its
    gradient equal a hand computation over the real tokens only (ratio 1 at iteration 0:
    ∇L = -(1/rows) Σ_rows (1/len_row) Σ_{t < len} Â ∇log π + β ∇ k3 over the same tokens), and
    do not change whatever the tokens after EOS are."""
    model, params = _tiny_lm()
    sp = SamplingParams()
    policy = transformer_policy(model, sp, 4)
    ref_params = init_params(model, jax.random.PRNGKey(3))
    prompts = TokenPrompts(jnp.array([[2, 3, 4]]), None, {})
    tokens = jnp.array([[[3, 1, 0, 0], [2, 4, 3, 2]]])  # member 0: EOS (1) at t = 1
    mask = jnp.array([[[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]])
    adv = jnp.array([[0.7, -0.7]])[..., None] * mask
    ref = policy_reference(policy, sp.temperature)
    spec = EngineSpec.from_config(_config(beta=0.3))

    def part_of(tok):
        ref_lp = jax.nn.log_softmax(token_logits(policy, ref_params, prompts, tok)[1])
        ref_tok = token_logp(ref_lp, tok)
        return groups.Part(
            prompts, tok, mask, jnp.ones((1, 2)), jnp.zeros(tok.shape),
            jnp.zeros((1, 0), jnp.int32), jnp.zeros((1, 0)), jnp.zeros((1, 2, 4, 0)),
            mask, jnp.zeros((1, 2)), adv, jnp.zeros((1, 0)), jnp.ones((1, 2)),
            ref_token_logp=ref_tok,
        )  # fmt: skip

    loss_fn = make_loss(spec.objective, spec.group, policy, ref)

    def engine_loss(p, tok):
        part = part_of(tok)
        return loss_fn(p, (part,), (part.logp_old,), True, (False,))[0]

    def hand_loss(p):
        total = 0.0
        for k, n in ((0, 2), (1, 4)):  # member, real tokens
            seq = jnp.concatenate([prompts.tokens[0], tokens[0, k, : n - 1]])
            lp = jax.nn.log_softmax(model.apply({"params": p}, seq[None])[0, 2:], -1)
            rl = jax.nn.log_softmax(model.apply({"params": ref_params}, seq[None])[0, 2:], -1)
            tok = tokens[0, k, :n]
            lp_t, rl_t = lp[jnp.arange(n), tok], rl[jnp.arange(n), tok]
            pg = -jnp.exp(lp_t - jax.lax.stop_gradient(lp_t)) * adv[0, k, 0]
            d = rl_t - lp_t
            kl = jnp.exp(d) - d - 1.0
            total = total + jnp.mean(pg) + 0.3 * jnp.mean(kl)
        return total / 2

    engine_vg = jax.jit(jax.value_and_grad(engine_loss))
    got, got_grad = engine_vg(params, tokens)
    want, want_grad = jax.jit(jax.value_and_grad(hand_loss))(params)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(got_grad), jax.tree.leaves(want_grad), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    garbage = tokens.at[0, 0, 2:].set(jnp.array([4, 2]))  # other tokens after the EOS
    other, other_grad = engine_vg(params, garbage)
    np.testing.assert_allclose(other, got, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(other_grad), jax.tree.leaves(got_grad), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_a_member_no_term_scored_gets_advantage_zero():
    """A Python term returning None for a completion: that member is left out of its group's
    baseline and std and gets advantage 0; the other members are standardised without it."""

    def term(prompts, completions, **_):
        return [1.0, 0.0, None, 0.5, 0.5, 0.5]

    values, valid = rewards.host_values(
        (RewardTerm("t", 1.0, term, host=True),), (2, 3), ["p"] * 6, ["c"] * 6, {}
    )
    np.testing.assert_array_equal(valid[0], [[1, 1, 0], [1, 1, 1]])
    mask = jnp.ones((2, 3, 2))
    combined, ok = rewards.combine(
        (), None, (RewardTerm("t", 1.0, term, True),), (values, valid), mask
    )
    part = groups.Part(
        None, jnp.zeros((2, 3, 2), jnp.int32), mask, jnp.ones((2, 3)), jnp.zeros((2, 3, 2)),
        jnp.zeros((2, 0), jnp.int32), jnp.zeros((2, 0)), jnp.zeros((2, 3, 2, 0)),
        mask * 0, jnp.zeros((2, 3)), mask * 0, jnp.zeros((2, 0)), jnp.ones((2, 3)),
    )  # fmt: skip
    spec = GroupSpec.from_config(_config().group)
    scored = scoring.score(part, False, combined["total"], ok, spec, "group", False, 1.0)
    adv = np.asarray(scored.advantages[..., 0])
    np.testing.assert_allclose(adv[0], [1.0, -1.0, 0.0], atol=1e-6)  # mean 0.5, std 0.5
    np.testing.assert_array_equal(adv[1], [0.0, 0.0, 0.0])  # a constant group: no signal
    assert float(scored.valid[0, 2]) == 0.0


def test_an_unscored_continuation_is_left_out_of_its_actions_return():
    """continuations_per_action=2: an action's return is the mean of its scored continuations;
    one whose reward is None neither counts as 0 nor moves the decision point's advantages."""
    a, n, t = 3, 2, 2
    k, zeros = a * n, jnp.zeros((1, a * n, t))
    tokens = jnp.repeat(jnp.arange(a, dtype=jnp.int32), n)[None, :, None].repeat(t, -1)
    part = groups.Part(
        None, tokens, jnp.ones((1, k, t)), jnp.ones((1, k)), jnp.log(jnp.full((1, k, t), 1 / a)),
        jnp.arange(a, dtype=jnp.int32)[None], jnp.ones((1, a)), jnp.zeros((1, k, t, 0)),
        zeros, zeros[..., 0], zeros, jnp.zeros((1, a)), jnp.ones((1, k)),
    )  # fmt: skip
    config = _config(mode="exhaustive")
    config.group.continuations_per_action = n
    spec = GroupSpec.from_config(config.group)
    rewards_ = jnp.ones((1, k, t)).at[0, 2].set(3.0)  # action 1's first continuation returns 3
    valid = jnp.ones((1, k)).at[0, 1].set(0.0)  # action 0's second continuation: unscored
    scored = scoring.score(part, True, rewards_, valid, spec, "none", False, 1.0)
    np.testing.assert_allclose(scored.action_returns, [[1.0, 2.0, 1.0]])  # returns: per-token means
    np.testing.assert_allclose(scored.advantages[0, ::n, 0], [-1 / 3, 2 / 3, -1 / 3], rtol=1e-6)


def test_reward_term_means_are_discounted_like_the_reward():
    """With reward.discount γ = 0.5 a member's return is its γ-weighted token mean, the term's
    logged mean too (it was the plain mean, 0.25), so reward = Σ weight × rewards/<term>/mean."""
    t, ones = 4, jnp.ones((1, 1, 4))
    part = groups.Part(
        None, jnp.zeros((1, 1, t), jnp.int32), ones, jnp.ones((1, 1)), ones * 0,
        jnp.zeros((1, 0), jnp.int32), jnp.zeros((1, 0)), jnp.zeros((1, 1, t, 0)),
        ones * 0, jnp.zeros((1, 1)), ones * 0, jnp.zeros((1, 0)), jnp.ones((1, 1)),
    )  # fmt: skip
    values = {"first": jnp.array([[[1.0, 0.0, 0.0, 0.0]]]), "first/valid": jnp.ones((1, 1))}
    term = RewardTerm("first", 1.0, None, True)
    out = metrics.reward_term_metrics((term,), (part,), [(values, None)], 0.5)
    np.testing.assert_allclose(out["rewards/first/mean"], 1 / 1.875, rtol=1e-6)


def test_a_reward_term_that_fails_is_named_in_one_line():
    def raises(prompts, completions, **_):
        raise KeyError("answer")

    def short(prompts, completions, **_):
        return [1.0]

    def nested(**_):
        return [1.0, [0.5], 0.0, 1.0]

    def infinite(**_):
        return [1.0, float("-inf"), 0.0, 1.0]

    def string(**_):
        return [1.0, "42", 0.0, 1.0]

    def past_float32(**_):  # finite in Python, inf once stored as float32
        return [1.0, 1e39, 0.0, 1.0]

    def past_float(**_):  # float(10**400) raises OverflowError
        return [1.0, 10**400, 0.0, 1.0]

    for fn, text in (
        (raises, "raised KeyError"),
        (short, "returned 1 values for 4"),
        (nested, r"returned \[0.5\]; return one finite float"),
        (infinite, "returned -inf; return one finite float"),
        (string, "returned '42'; return one finite float"),
        (past_float32, r"returned 1e\+39; return one finite float .* float32"),
        (past_float, r"returned 1000.*; return one finite float"),
    ):
        with pytest.raises(ValueError, match=f"reward term 'mine' {text}") as err:
            rewards.host_values(
                (RewardTerm("mine", 1.0, fn, True),), (2, 2), [""] * 4, [""] * 4, {}
            )
        assert "\n" not in str(err.value)


def test_a_python_terms_nan_and_none_are_unscored_and_numbers_of_any_type_count():
    def term(**_):
        return [None, float("nan"), np.float32(0.5), True]

    values, valid = rewards.host_values(
        (RewardTerm("mine", 1.0, term, True),), (2, 2), [""] * 4, [""] * 4, {}
    )
    np.testing.assert_array_equal(valid, [[[0, 0], [1, 1]]])
    np.testing.assert_array_equal(values, [[[0, 0], [0.5, 1.0]]])


def test_objective_spec_checks_each_setting_once():
    base = _config().grpo
    for field, value, text in (
        ("beta", -1.0, "grpo.beta=-1.0 must be"),
        ("epsilon", -0.2, "grpo.epsilon=-0.2 must be"),
        ("num_iterations", 0, "grpo.num_iterations=0 must be an integer >= 1"),
        ("loss_agg", "mean", "grpo.loss_agg='mean' is unknown; choose from"),
    ):
        bad = ConfigDict(base.to_dict())
        bad[field] = value
        with pytest.raises(ValueError, match=text):
            ObjectiveSpec.from_config(bad)


def test_group_spec_checks_each_setting_once():
    base = _config().group
    for field, value, text in (
        ("size", 1, "group.size=1 must be an integer >= 2"),
        ("mode", "all", "group.mode='all' is unknown; choose from"),
        ("top_p", 0.0, r"group.top_p=0.0 must be a finite number in \(0.0, 1.0\]"),
        ("train_continuations", "False", "group.train_continuations='False' must be True or"),
    ):
        bad = ConfigDict(base.to_dict())
        bad[field] = value
        with pytest.raises(ValueError, match=text):
            GroupSpec.from_config(bad)
