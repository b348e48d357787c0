"""Tests for grpo_jax.rewards on hand-computed golden examples."""

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ml_collections import config_dict

from grpo_jax import rewards
from grpo_jax.config_blocks import load_config
from grpo_jax.policy import TokenPrompts

# One prompt (B=1), two rollouts (G=2), horizon 3, vocabulary of 4.
TOKENS = np.array([[[0, 1, 2], [3, 1, 0]]], np.int32)
TARGET = np.array([[0, 2, 2]], np.int32)
UP = [0.1, 0.2, 0.3, 0.4]
DOWN = [0.4, 0.3, 0.2, 0.1]
FLAT = [0.25] * 4
# Reference distribution at each (g, t); the token's rank is noted alongside.
PROBS = np.array([[[UP, DOWN, FLAT], [UP, UP, DOWN]]])
#   g=0: token 0 under UP -> rank 3; token 1 under DOWN -> rank 1;
#        token 2 under FLAT -> all tied, rank 0
#   g=1: token 3 under UP -> rank 0; token 1 under UP -> rank 2;
#        token 0 under DOWN -> rank 0
REF = np.log(PROBS).astype(np.float32)


def cfg(**kw):
    base = {"terms": "match", "partial_credit": 0.2, "partial_topk": 2}
    base.update(kw)
    return config_dict.ConfigDict(base)


def call(name, c=None):
    return np.asarray(rewards.REWARDS[name](TOKENS, TARGET, REF, c or cfg()))


def test_match():
    got = call("match")
    np.testing.assert_array_equal(got, [[[1, 0, 1], [0, 0, 0]]])
    assert got.dtype == np.float32
    # match needs no reference.
    no_ref = rewards.REWARDS["match"](TOKENS, TARGET, None, cfg())
    np.testing.assert_array_equal(no_ref, got)


def test_match_partial():
    np.testing.assert_allclose(call("match_partial"), [[[1, 0.2, 1], [0.2, 0, 0.2]]])
    # k=3 also credits g=1, t=1 (rank 2); a match still scores 1.
    got = call("match_partial", cfg(partial_topk=3, partial_credit=0.5))
    np.testing.assert_allclose(got, [[[1, 0.5, 1], [0.5, 0.5, 0.5]]])


def test_match_partial_needs_reference():
    with pytest.raises(ValueError, match=r"reference\.kind=ngram\|policy"):
        rewards.REWARDS["match_partial"](TOKENS, TARGET, None, cfg())


def test_ref_topk():
    np.testing.assert_array_equal(call("ref_topk"), [[[0, 1, 1], [1, 0, 1]]])
    np.testing.assert_array_equal(call("ref_topk", cfg(partial_topk=1)), [[[0, 0, 1], [1, 0, 1]]])
    with pytest.raises(ValueError, match="partial_topk"):
        call("ref_topk", cfg(partial_topk=0))


def test_ref_logprob():
    want = np.log([[[0.1, 0.3, 0.25], [0.4, 0.2, 0.4]]])
    np.testing.assert_allclose(call("ref_logprob"), want, rtol=1e-6)


def test_parse_terms():
    assert rewards.parse_terms("match_partial:1.0,match:0.5") == (
        ("match_partial", 1.0),
        ("match", 0.5),
    )
    assert rewards.parse_terms("match") == (("match", 1.0),)
    assert rewards.parse_terms(" ref_topk : -2 , match ") == (
        ("ref_topk", -2.0),
        ("match", 1.0),
    )
    with pytest.raises(ValueError, match="match, match_partial, ref_logprob, ref_topk"):
        rewards.parse_terms("match,bleu:1")
    for bad in ("", "match:", ":1", "match,,ref_topk", "match:1:2", "match:x"):
        with pytest.raises(ValueError, match="malformed|empty"):
            rewards.parse_terms(bad)
    with pytest.raises(ValueError, match="twice"):
        rewards.parse_terms("match:1,match:2")
    with pytest.raises(ValueError, match="non-finite"):
        rewards.parse_terms("match:nan")


def test_needs_reference():
    assert not rewards.needs_reference(cfg(terms="match:2"))
    assert rewards.needs_reference(cfg(terms="match,ref_logprob:0.1"))
    assert rewards.needs_reference(cfg(terms="match_partial"))


def make_reward_fn(reward_cfg):
    """The engine's path for the char terms: char_terms -> device_values -> combine's total."""
    terms = rewards.char_terms(reward_cfg)

    def fn(tokens, target, ref):
        tokens = jnp.asarray(tokens)
        prompts = TokenPrompts(None, None, {"target": jnp.asarray(target)})
        ref_lp = jnp.zeros(tokens.shape + (0,)) if ref is None else jnp.asarray(ref)
        mask = jnp.ones(tokens.shape)
        part = SimpleNamespace(prompts=prompts, tokens=tokens, token_mask=mask, ref_logp=ref_lp)
        dev = rewards.device_values(terms, None, part)
        return rewards.combine(terms, dev, (), None, mask)[0]["total"]

    return fn


def test_weighted_sum_and_jit():
    fn = make_reward_fn(cfg(terms="match_partial:1.0,match:0.5"))
    want = [[[1.5, 0.2, 1.5], [0.2, 0.0, 0.2]]]
    np.testing.assert_allclose(fn(TOKENS, TARGET, REF), want, rtol=1e-6)
    np.testing.assert_allclose(jax.jit(fn)(TOKENS, TARGET, REF), want, rtol=1e-6)

    fn2 = make_reward_fn(cfg(terms="match:2,ref_logprob:0.1"))
    want2 = 2 * np.array([[[1, 0, 1], [0, 0, 0]]]) + 0.1 * np.log(
        [[[0.1, 0.3, 0.25], [0.4, 0.2, 0.4]]]
    )
    np.testing.assert_allclose(fn2(TOKENS, TARGET, REF), want2, rtol=1e-6)

    only_match = make_reward_fn(cfg(terms="match:3"))
    np.testing.assert_array_equal(only_match(TOKENS, TARGET, None), [[[3, 0, 3], [0] * 3]])
    with pytest.raises(ValueError, match="reference"):
        fn(TOKENS, TARGET, None)
    with pytest.raises(ValueError, match="unknown reward"):
        make_reward_fn(cfg(terms="nope"))


def test_shape_errors():
    with pytest.raises(ValueError, match=r"\[B, G, H\]"):
        rewards.REWARDS["match"](TOKENS[0], TARGET, None, cfg())
    with pytest.raises(ValueError, match="ref_logprobs"):
        rewards.REWARDS["ref_logprob"](TOKENS, TARGET, REF[:, :1], cfg())


def test_default_config_reward():
    reward_cfg = load_config("shakespeare", "tiny").reward
    assert rewards.needs_reference(reward_cfg)
    fn = make_reward_fn(reward_cfg)
    # Default k=5 >= V=4: every wrong char gets the 0.2 partial credit.
    np.testing.assert_allclose(fn(TOKENS, TARGET, REF), [[[1, 0.2, 1], [0.2] * 3]])
