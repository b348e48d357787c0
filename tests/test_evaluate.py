"""evaluate.make_eval_fn against numpy: every one of N windows is scored when the eval batch
size does not divide N (the n-gram baselines score all N), and with a subword vocabulary
pass@k is the probability that the first char is right."""

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from grpo_jax import data as data_lib
from grpo_jax import evaluate as eval_lib
from grpo_jax.model import Transformer, init_params

pytestmark = pytest.mark.usefixtures("fast_compiles")

V, C, H, N = 5, 5, 3, 10
PASS_K = (1, 4)
PIECES = ["a", "bc", "b", "ab", "def"]  # ids 0..4: first chars a, b, b, a, d
CHARS = eval_lib.TokenChars(
    np.array([ord(p[0]) for p in PIECES], np.int32), np.array([len(p) for p in PIECES], np.int32)
)


@pytest.fixture(scope="module")
def setup():
    model = Transformer(vocab_size=V, num_layers=1, num_heads=2, d_model=16, max_len=16)
    params = init_params(model, jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    ctx = rng.integers(0, V, (N, C)).astype(np.int32)
    tgt = rng.integers(0, V, (N, H)).astype(np.int32)
    return model, params, ctx, tgt


def run_eval(setup, batch_size, token_chars=None):
    model, params, ctx, tgt = setup
    fn = jax.jit(eval_lib.make_eval_fn(model, C, H, batch_size, PASS_K, token_chars))
    return fn(params, jnp.asarray(ctx), jnp.asarray(tgt))


def numpy_golden(setup, token_chars=None):
    """Every metric per window in numpy from one full forward over all N windows; the greedy
    rollout decodes one token at a time by recomputing the whole prefix."""
    model, params, ctx, tgt = setup
    full = np.concatenate([ctx, tgt], 1)
    logits = np.asarray(model.apply({"params": params}, full[:, :-1]), np.float64)[:, C - 1 :]
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, tgt[..., None], -1)[..., 0]
    pred = logits.argmax(-1)
    probs0 = np.exp(logp[:, 0])
    if token_chars is None:
        p0, char_acc = probs0[np.arange(N), tgt[:, 0]], (pred == tgt).mean()
        bpc = nll.mean() / math.log(2)
    else:
        first = token_chars.first_char
        p0 = np.array([probs0[i, first == first[tgt[i, 0]]].sum() for i in range(N)])
        char_acc = (first[pred] == first[tgt]).mean()
        bpc = nll.sum() / token_chars.num_chars[tgt].sum() / math.log(2)
    seq = ctx
    for _ in range(H):
        step = np.asarray(model.apply({"params": params}, seq))[:, -1].argmax(-1)
        seq = np.concatenate([seq, step[:, None].astype(np.int32)], 1)
    greedy = seq[:, C:]
    gold = {
        "eval/val_loss": nll.mean(),
        "eval/next_char_accuracy": char_acc,
        "eval/bits_per_char": bpc,
        "eval/rollout_accuracy": (greedy == tgt).mean(),
        **{f"eval/pass_at_{k}": np.mean(1 - (1 - p0) ** k) for k in PASS_K},
    }
    if token_chars is not None:
        gold["eval/next_token_accuracy"] = (pred == tgt).mean()
        gold["eval/bits_per_token"] = nll.mean() / math.log(2)
    return gold, greedy


@pytest.mark.parametrize("token_chars", [None, CHARS], ids=["chars", "subwords"])
@pytest.mark.parametrize("batch_size", [3, 4, 8, N])
def test_every_window_is_scored_when_batch_size_does_not_divide_n(setup, batch_size, token_chars):
    gold, greedy = numpy_golden(setup, token_chars)
    res = run_eval(setup, batch_size, token_chars)
    assert set(k for k in res if k.startswith("eval/")) == set(gold)
    for key, want in gold.items():
        assert float(res[key]) == pytest.approx(want, rel=1e-5, abs=1e-6), key
    np.testing.assert_array_equal(np.asarray(res["greedy"]), greedy)


def test_summary_counts_every_window(setup):
    vocab = data_lib.Vocab("".join(chr(ord("a") + i) for i in range(V)))
    _, greedy = numpy_golden(setup)
    scalars, best, text = eval_lib.summarize(run_eval(setup, 8), vocab, setup[2], N)
    counts = np.bincount(greedy[:, 0], minlength=V)
    assert scalars["eval/best_char_frac"] == counts.max() / N
    assert f"({counts.max()}/{N})" in text.splitlines()[0]
    assert text.count("--- context:") == N


def test_first_char_prob_by_hand():
    # probabilities over "a", "bc", "b", "ab", "def"
    probs = np.array([[0.1, 0.2, 0.3, 0.15, 0.25]] * 3)
    tgt0 = jnp.array([3, 1, 4])  # first chars a, b, d
    got = eval_lib.first_char_prob(jnp.log(jnp.asarray(probs)), tgt0, CHARS)
    np.testing.assert_allclose(np.asarray(got), [0.25, 0.5, 0.25], rtol=1e-6)
    # a char vocabulary: the target token's own probability
    got = eval_lib.first_char_prob(jnp.log(jnp.asarray(probs)), tgt0, None)
    np.testing.assert_allclose(np.asarray(got), [0.15, 0.2, 0.25], rtol=1e-6)


def test_shakespeare_eval_scores_all_windows_like_its_baselines(shakespeare_path):
    from grpo_jax.configs import shakespeare as cfgmod
    from grpo_jax.model import make_model
    from grpo_jax.specs import ModelSpec
    from grpo_jax.tasks import shakespeare as sh

    os.environ["GRPO_JAX_DATA"] = str(shakespeare_path)
    results = {}
    for bs in (8, 12):
        c = cfgmod.get_config("tiny")
        c.eval.num_windows, c.eval.batch_size, c.eval.num_samples = 12, bs, 0
        corpus = sh.load_corpus(c.data)
        model = make_model(ModelSpec.from_config(c.model), corpus.vocab.size, 24)
        params = init_params(model, jax.random.PRNGKey(0))
        results[bs] = sh.make_evaluate(c, model, corpus, None)(params)
    (scalars8, texts8), (scalars12, texts12) = results[8], results[12]
    assert "/12)" in texts8["samples"].splitlines()[0] and texts8 == texts12
    assert "eval/ngram2_next_char_accuracy" in scalars8  # the baselines beside, on all 12
    assert scalars8.keys() == scalars12.keys()
    for key, want in scalars12.items():
        assert scalars8[key] == pytest.approx(want, rel=1e-5, abs=1e-6), key
