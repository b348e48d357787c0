"""Tests for grpo_jax.reference: backoff n-gram LMs against a plain-python oracle."""

import math
from collections import Counter, defaultdict

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ml_collections import config_dict

from grpo_jax import data, reference

V = 5


def oracle_logprobs(train, vocab_size, order, k, seq):
    """Dict counting with recursive backoff, one position at a time."""
    train, seq = [int(x) for x in train], [int(x) for x in seq]
    counts = {m: defaultdict(Counter) for m in range(1, order + 1)}
    for m in range(1, order + 1):
        for p in range(m - 1, len(train)):
            counts[m][tuple(train[p - m + 1 : p])][train[p]] += 1
    out = []
    for i in range(len(seq)):
        # Highest order whose context fits in seq[:i+1] and was seen in train.
        for m in range(min(order, i + 2), 0, -1):
            ctx = tuple(seq[i - m + 2 : i + 1]) if m > 1 else ()
            if ctx in counts[m]:
                break
        c = counts[m][ctx]
        total = sum(c.values())
        out.append([math.log((c[x] + k) / (total + k * vocab_size)) for x in range(vocab_size)])
    return np.array(out)


@pytest.fixture(scope="module")
def small_train():
    rng = np.random.default_rng(0)
    # Skewed so that many order-3/4 contexts are unseen and backoff is exercised.
    return rng.choice(V, size=400, p=[0.4, 0.3, 0.15, 0.1, 0.05]).astype(np.int32)


@pytest.mark.parametrize("order", [1, 2, 3, 4])
def test_ngram_logprobs_match_dict_oracle(small_train, order):
    lm = reference.fit_ngram(small_train, V, order, smoothing=0.3)
    seq = np.random.default_rng(order).integers(0, V, size=(3, 60)).astype(np.int32)
    got = np.asarray(reference.ngram_logprobs(lm, jnp.asarray(seq)))
    assert got.shape == (3, 60, V) and got.dtype == np.float32
    for row, want_seq in zip(got, seq, strict=True):
        want = oracle_logprobs(small_train, V, order, 0.3, want_seq)
        np.testing.assert_allclose(row, want, atol=1e-6, rtol=0)
    # Each entry is a normalised distribution.
    np.testing.assert_allclose(np.exp(got).sum(-1), 1.0, atol=1e-5)


def test_backoff_really_happens(small_train):
    """Guards the oracle test: order-4 contexts exist that train never saw."""
    lm = reference.fit_ngram(small_train, V, 4)
    assert lm.codes[3].shape[0] < V**3
    assert [c.shape[0] for c in lm.codes[:2]] == [1, V]
    # Table layout: order k's table has M_k + 1 rows.
    assert lm.table(4).shape == (lm.codes[3].shape[0] + 1, V)


@pytest.mark.parametrize("order,context_len", [(1, 4), (3, 6), (4, 6), (4, 2), (4, 1)])
def test_rollout_equals_logprobs_of_concatenation(small_train, order, context_len):
    lm = reference.fit_ngram(small_train, V, order)
    rng = np.random.default_rng(7)
    context = rng.integers(0, V, size=(2, context_len)).astype(np.int32)
    generated = rng.integers(0, V, size=(2, 3, 5)).astype(np.int32)
    got = np.asarray(reference.rollout_ref_logprobs(lm, context, generated))
    assert got.shape == (2, 3, 5, V)
    for b in range(2):
        for g in range(3):
            full = np.concatenate([context[b], generated[b, g]])
            want = np.asarray(reference.ngram_logprobs(lm, full))
            # Position t is predicted from the history ending at C - 1 + t.
            np.testing.assert_allclose(
                got[b, g], want[context_len - 1 : context_len + 4], atol=1e-6
            )


@pytest.mark.parametrize("order", [1, 2, 3])
def test_window_accuracy_matches_oracle_argmax(small_train, order):
    """The eval-window baseline scores only the target chars, each given its true history."""
    lm = reference.fit_ngram(small_train, V, order, smoothing=0.3)
    rng = np.random.default_rng(10 + order)
    context = rng.integers(0, V, size=(4, 6)).astype(np.int32)
    target = rng.integers(0, V, size=(4, 5)).astype(np.int32)
    hits = []
    for ctx, tgt in zip(context, target, strict=True):
        full = np.concatenate([ctx, tgt])
        lp = oracle_logprobs(small_train, V, order, 0.3, full[:-1])  # row i predicts full[i+1]
        hits += list(np.argmax(lp, -1)[len(ctx) - 1 :] == tgt)
    assert reference.window_accuracy(lm, context, target) == pytest.approx(np.mean(hits))


def test_fit_rejects_bad_orders(small_train):
    for order in (0, 6):
        with pytest.raises(ValueError, match="ngram_order"):
            reference.fit_ngram(small_train, V, order)
    with pytest.raises(ValueError, match="smoothing"):
        reference.fit_ngram(small_train, V, 2, smoothing=0.0)


def test_jit_static_fields_and_no_retrace(small_train):
    lm = reference.fit_ngram(small_train, V, 3)
    leaves = jax.tree_util.tree_leaves(lm)
    assert all(isinstance(x, jax.Array) for x in leaves)  # order etc. are static
    assert len(leaves) == 3 + 1

    @jax.jit
    @chex.assert_max_traces(n=1)
    def total(lm, tokens):
        return reference.ngram_logprobs(lm, tokens).sum()

    a = total(lm, jnp.zeros((4, 9), jnp.int32))
    b = total(lm, jnp.ones((4, 9), jnp.int32))
    assert np.isfinite(a) and np.isfinite(b) and a != b


@pytest.fixture(scope="module")
def corpus(shakespeare_path):
    cfg = config_dict.ConfigDict({"path": str(shakespeare_path)})
    return data.load_corpus(cfg)


def test_val_accuracy_on_tiny_shakespeare(corpus):
    accs = {}
    for order in (1, 2, 3, 5):
        lm = reference.fit_ngram(corpus.train, corpus.vocab.size, order, 0.1)
        accs[order] = reference.next_char_accuracy(lm, corpus.val)
    assert accs[1] == pytest.approx(0.149, abs=0.01)
    assert accs[2] == pytest.approx(0.270, abs=0.01)
    assert accs[3] == pytest.approx(0.381, abs=0.01)
    assert accs[5] > accs[3] + 0.1  # measured 0.525
    # Chunking does not change the answer.
    lm = reference.fit_ngram(corpus.train, corpus.vocab.size, 3, 0.1)
    small = reference.next_char_accuracy(lm, corpus.val[:5000], chunk=777)
    assert small == reference.next_char_accuracy(lm, corpus.val[:5000])
