"""Groups that cost less than V rollouts (candidates.py): pruned candidates against hand
values and, at coverage 1, against the exhaustive step; the hierarchical estimator against the
exact all-action gradient; the value horizon against a run of that horizon."""

import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _engine_config import engine_config

from grpo_jax import candidates, engine, groups, objective, scoring
from grpo_jax.model import Transformer, init_params
from grpo_jax.policy import TokenPrompts, transformer_policy
from grpo_jax.rewards import RewardTerm
from grpo_jax.specs import EngineSpec
from grpo_jax.train_state import StepInputs, init_state

pytestmark = pytest.mark.usefixtures("fast_compiles")  # conftest.py

B, V = 2, 8
WEIGHTS = jnp.linspace(-1.0, 1.0, V) ** 2  # a token's reward


def test_pruned_candidates_by_hand():
    p = np.array([[0.5, 0.05, 0.3, 0.15], [0.25, 0.25, 0.25, 0.25]])
    actions, mask = candidates.pruned_candidates(jnp.log(p), coverage=0.7, max_candidates=3)
    # row 0: 0.5 < 0.7, 0.8 >= 0.7 -> {0, 2}; row 1: 0.25, 0.5 < 0.7, 0.75 -> 3 tokens (cap 3)
    np.testing.assert_array_equal(np.asarray(actions)[mask > 0], [0, 2, 0, 1, 2])
    np.testing.assert_array_equal(mask, [[1, 1, 0], [1, 1, 1]])
    everything, all_mask = candidates.pruned_candidates(jnp.log(p), 1.0, 4)
    np.testing.assert_array_equal(everything, [[0, 1, 2, 3]] * 2)  # id order: exhaustive's
    np.testing.assert_array_equal(all_mask, np.ones((2, 4)))


def test_token_classes_of_chars_and_blocks():
    texts = ["", "", "a", "B", " ", "\n", "7", ",", "+"]
    np.testing.assert_array_equal(
        candidates.token_classes("chars", texts, 0), [0, 0, 2, 2, 1, 1, 3, 4, 5]
    )
    np.testing.assert_array_equal(
        candidates.token_classes("blocks", texts, 3), [0] * 3 + [1] * 3 + [2] * 3
    )


def _hierarchical_grad(logits, q):
    return jax.grad(lambda x: objective.all_action_loss(jax.nn.log_softmax(x), q).sum())(logits)


def test_hierarchical_estimator_is_the_exact_gradient_in_expectation():
    """Every draw of the class representatives, weighted by its probability: the estimator's
    expected gradient equals the exact all-action gradient -∇ Σ_a π(a)R(a); one draw does not
    (the check can fail), and expanding every class is exact draw by draw."""
    classes = np.array([0, 0, 1, 1, 1, 2])
    members, mmask = candidates.class_members(classes)
    logits = jax.random.normal(jax.random.PRNGKey(0), (1, 6))
    returns = jax.random.uniform(jax.random.PRNGKey(1), (1, 6))
    lp = jax.nn.log_softmax(logits)
    pi = jnp.exp(lp)
    exact = _hierarchical_grad(logits, returns)
    actions, mask, w = candidates.hierarchical_candidates(
        jax.random.PRNGKey(2), lp, classes, members, mmask, expand=1
    )
    reps = [c for c in range(3) if mask[0, c] > 0]  # the classes that were not expanded
    assert len(reps) == 2
    mean = jnp.zeros_like(exact)
    for draw in itertools.product(*(np.flatnonzero(classes == c) for c in reps)):
        acts, ws, prob = actions, w, 1.0
        for c, a in zip(reps, draw, strict=True):
            mass = pi[0, classes == c].sum()
            acts, ws = acts.at[0, c].set(a), ws.at[0, c].set(mass / pi[0, a])
            prob *= pi[0, a] / mass
        q = candidates.hierarchical_values(pi, acts, mask, ws, returns[0, acts[0]][None])
        grad = _hierarchical_grad(logits, q)
        mean = mean + prob * grad
    np.testing.assert_allclose(mean, exact, atol=1e-6)
    assert not np.allclose(grad, exact, atol=1e-3)  # a single draw is an estimate
    actions, mask, w = candidates.hierarchical_candidates(
        jax.random.PRNGKey(3), lp, classes, members, mmask, expand=3
    )
    q = candidates.hierarchical_values(pi, actions, mask, w, returns[0, actions[0]][None])
    np.testing.assert_allclose(_hierarchical_grad(logits, q), exact, atol=1e-6)


def test_guided_explorers_make_the_estimator_exact_in_expectation():
    """Guided groups: the guide's top-2 plus 2 explorers drawn uniformly from the other 4
    tokens, each explorer weighted by its inverse inclusion probability 4/2. Averaged over
    the 6 equally likely explorer pairs, the estimator's gradient is the exact all-action
    gradient (unweighted explorers gave 1/2 of its non-top part); one pair is not."""
    from grpo_jax.groups import guided_candidates

    logits = jax.random.normal(jax.random.PRNGKey(4), (1, 6))
    returns = jax.random.uniform(jax.random.PRNGKey(5), (1, 6))
    pi = jax.nn.softmax(logits)
    exact = _hierarchical_grad(logits, returns)
    actions, mask, w = guided_candidates(jax.random.PRNGKey(6), jnp.log(pi), 2, 2, 2, -1.0)
    np.testing.assert_array_equal(w, [[0.0, 0.0, 2.0, 2.0]])
    others = [a for a in range(6) if a not in np.asarray(actions[0, :2])]
    mean = jnp.zeros_like(exact)
    for pair in itertools.combinations(others, 2):
        acts = actions.at[0, 2:].set(jnp.asarray(pair))
        q = candidates.hierarchical_values(pi, acts, mask, w, returns[0, acts[0]][None])
        grad = _hierarchical_grad(logits, q)
        mean = mean + grad / 6
    np.testing.assert_allclose(mean, exact, atol=1e-6)
    assert not np.allclose(grad, exact, atol=1e-3)  # a single pair is an estimate
    # no explorers: the top-k alone, no weights (exact on the candidates, as pruned)
    assert guided_candidates(jax.random.PRNGKey(6), jnp.log(pi), 2, 2, 0, -1.0)[2] is None


def _engine_run(horizon, key=0, steps=1, **group):
    """``steps`` fused GRPO steps (one jit) of a 1-layer transformer on B prompts whose target
    is the token after the prompt's last: (new params, last metrics)."""
    model = Transformer(vocab_size=V, num_layers=1, num_heads=2, d_model=16, max_len=6)
    params = init_params(model, jax.random.PRNGKey(key))
    config = engine_config(B, 4, group.pop("mode"), beta=0.0)
    config.group.update(group)
    spec = EngineSpec.from_config(config)
    policy = transformer_policy(model, spec.group.sampling, horizon)

    def sample_prompts(k, data):
        return TokenPrompts(data, None, {"target": data[:, -1:] + jnp.arange(horizon)})

    def term(state, prompts, tokens, mask, ref):  # the mean token weight of the completion
        return jnp.sum(WEIGHTS[tokens] * mask, -1) / jnp.maximum(mask.sum(-1), 1.0)

    tx = optax.sgd(0.5)
    classes = candidates.task_classes(spec.group, ["a", "b", "c", " ", "d", ",", "1", ""])
    step = engine.make_grpo_step(
        spec, policy, None, sample_prompts, (RewardTerm("w", 1.0, term),), tx, lambda s: 0.5,
        token_classes=classes, completion_fields=("target",),
    )  # fmt: skip
    prompts = jnp.array([[1, 2], [3, 4]], jnp.int32)
    chex.clear_trace_counter()  # the counter is per code location: count this run only
    fused = jax.jit(chex.assert_max_traces(step.fused, n=1))
    state = init_state(params, tx, 0)
    for _ in range(steps):
        state, metrics = fused(state, StepInputs(prompts, None))
    return state.params, metrics


def _differs(a, b, atol=1e-6):
    return not all(
        np.allclose(x, y, atol=atol)
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def _assert_same(a, b, atol=1e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(x, y, atol=atol)


@pytest.mark.parametrize("coverage", [1.0])
def test_pruned_at_full_coverage_is_the_exhaustive_step(coverage):
    """Coverage 1 with room for all V: the same rollouts, loss and update as exhaustive."""
    want, m_want = _engine_run(3, mode="exhaustive")
    got, m_got = _engine_run(3, mode="pruned", coverage=coverage, max_candidates=V)
    _assert_same(got, want)
    np.testing.assert_allclose(m_got["loss"], m_want["loss"], atol=1e-7)
    assert float(m_got["group/uncovered_mass"]) < 1e-6
    # a smaller set: the policy's mass outside it is reported, and the update differs
    part, m_part = _engine_run(3, mode="pruned", coverage=0.5, max_candidates=V)
    assert 0.0 < float(m_part["group/uncovered_mass"]) < 0.5
    assert float(m_part["group/candidates"]) < V
    assert _differs(part, want)


def test_hierarchical_expanding_every_class_is_the_exhaustive_step():
    """With one token per completion (nothing sampled after the decision point) and every
    class expanded, the hierarchical update is the exhaustive one; with one class expanded it
    is an estimate of it."""
    want, _ = _engine_run(1, mode="exhaustive")
    got, m_got = _engine_run(1, mode="hierarchical", class_kind="chars", expand_classes=5)
    _assert_same(got, want)
    np.testing.assert_allclose(m_got["group/expanded_mass"], 1.0, atol=1e-6)
    blocks = {"mode": "hierarchical", "class_kind": "blocks", "num_classes": 2}
    both, _ = _engine_run(1, **blocks, expand_classes=2)
    _assert_same(both, want)
    # one of two blocks of 4 expanded (the chars classes would leave only singletons, exact)
    one, m_one = _engine_run(1, **blocks, expand_classes=1)
    assert float(m_one["group/expanded_mass"]) < 1.0
    assert _differs(one, want)


def test_value_horizon_is_a_run_of_that_horizon():
    """Greedy continuations (top_k = 1), so the trajectories do not depend on the uniforms:
    exhaustive with T = 3 and value_horizon = 2 updates like exhaustive with T = 2."""
    want, m_want = _engine_run(2, mode="exhaustive", top_k=1)
    got, m_got = _engine_run(3, mode="exhaustive", top_k=1, value_horizon=2)
    _assert_same(got, want, atol=1e-5)
    np.testing.assert_allclose(m_got["completions/mean_length"], 2.0)
    full, _ = _engine_run(3, mode="exhaustive", top_k=1)
    assert _differs(full, want, atol=1e-5)


def test_branch_prompts_by_hand():
    """A decision point at p is the last P tokens of prompt + completion[:p], its target
    shifted by p; other fields are repeated."""
    prompts = TokenPrompts(
        jnp.array([[1, 2, 3]]),
        None,
        {"target": jnp.array([[10, 11, 12, 13]]), "id": jnp.array([7])},
    )
    completion = jnp.array([[20, 21, 22, 23]])
    out = groups.branch_prompts(prompts, completion, jnp.array([[0, 2]]), ("target",))
    np.testing.assert_array_equal(out.tokens, [[1, 2, 3], [3, 20, 21]])
    np.testing.assert_array_equal(out.fields["target"], [[10, 11, 12, 13], [12, 13, 13, 13]])
    np.testing.assert_array_equal(out.fields["id"], [7, 7])
    ent = jnp.array([[0.1, 0.9, 0.5, 0.8, 2.0]])
    np.testing.assert_array_equal(groups.decision_positions(ent, 2, horizon=2), [[1, 3]])


def test_decision_points_run_in_one_program():
    """k = 3 decision points per rollout: 3 steps, one trace (chex.assert_max_traces in
    _engine_run), B·k forced groups of value_horizon tokens each."""
    _, metrics = _engine_run(4, steps=3, mode="exhaustive", value_horizon=2, decision_points=3)
    np.testing.assert_allclose(metrics["completions/mean_length"], 2.0)
    np.testing.assert_allclose(metrics["generated_tokens"], B * 3 * V * 2)
    assert 0.0 <= float(metrics["group/decision_position"]) <= 2.0


def test_return_credit_weights_continuations_by_the_first_tokens_probability():
    """continuation_credit=return, against numpy: member k's continuation advantage is
    (R_k - Σπ̄R/Σπ̄)·K'·π̄_k/Σπ̄ (π̄ = π_old of its first token; a masked member gets 0)."""
    logp0 = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32))
    returns = np.array([[1.0, 0.0, 2.0, 4.0]], np.float32)
    ok = np.array([[True, True, True, False]])
    part = groups.Part(
        None, jnp.zeros((1, 4, 3), jnp.int32), jnp.ones((1, 4, 3)), jnp.ones((1, 4)),
        jnp.asarray(np.repeat(logp0[..., None], 3, -1)), jnp.arange(4)[None], jnp.ones((1, 4)),
        None, None, None, None, None, None,
    )  # fmt: skip
    got = scoring.return_credit(part, jnp.asarray(returns), jnp.asarray(ok), "none")
    pi = np.exp(logp0) * ok
    b = (pi * returns).sum() / pi.sum()
    want = (returns - b) * 3 * pi / pi.sum() * ok
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert abs(float((got * ok).sum())) < 1e-6  # π-weighted advantages centre at 0 · K'
