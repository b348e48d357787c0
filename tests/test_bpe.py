"""The BPE vocabulary of the Shakespeare task (grpo_jax/bpe.py, ``shakespeare:bpe<N>``): exact
round trips, training on the train split only, a run through the entry point that keeps its
tokenizer.json, resumes refused in one line when the tokenizer differs (the workdir untouched),
and the per-char held-out metrics against numpy."""

import json
import math
import os

import jax.numpy as jnp
import numpy as np
import pytest
from ml_collections import config_dict
from test_bad_input import assert_refused, digest, run_cli

from grpo_jax import bpe
from grpo_jax import evaluate as eval_lib
from grpo_jax.metric_writers import read_metrics

pytestmark = pytest.mark.usefixtures("fast_compiles")

V = 256
RUN = ["--config=shakespeare:bpe256,tiny", "--config.train.num_steps=2"]


@pytest.fixture(scope="module")
def text(shakespeare_path):
    return shakespeare_path.read_text(encoding="utf-8")


def test_round_trip_of_the_corpus_and_training_on_the_train_split_only(text, shakespeare_path):
    cfg = config_dict.ConfigDict({"path": str(shakespeare_path), "vocab_size": V})
    corpus = bpe.load_corpus(cfg)
    tok = corpus.vocab
    assert tok.size == V and tok.decode(tok.encode(text)) == text
    assert tok.decode(corpus.train) + tok.decode(corpus.val) == text
    split = int(len(text) * 0.9)
    alphabet = "".join(sorted(set(text)))
    assert tok.json == bpe.train(text[:split], V, alphabet).json  # deterministic, train split
    assert tok.json != bpe.train(text, V, alphabet).json  # the val split would change it
    with pytest.raises(ValueError, match="'~' is not in the 256-token"):
        tok.encode("to be~")
    with pytest.raises(ValueError, match="data.vocab_size=64 must be >= the corpus's 65"):
        bpe.train(text[:split], 64, alphabet)


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory, shakespeare_path):
    os.environ["GRPO_JAX_DATA"] = str(shakespeare_path)
    work = tmp_path_factory.mktemp("bpe") / "run"
    code, lines, _ = run_cli([*RUN, f"--workdir={work}"])
    assert code == 0, lines
    return work


def test_run_keeps_its_tokenizer_and_logs_finite_per_char_metrics(bpe_run, text):
    tok = bpe.load(bpe_run / bpe.FILE_NAME)
    assert tok.size == V and tok.decode(tok.encode(text[:5000])) == text[:5000]
    ckpt = bpe_run / "checkpoints" / "2" / "integrity" / "metadata"
    identity = json.loads(ckpt.read_text())["identity"]
    assert identity["vocab_sha256"] == digest(bpe_run)[bpe.FILE_NAME]
    (row,) = [r for r in read_metrics(bpe_run) if "eval/bits_per_char" in r]
    for key in ("bits_per_char", "bits_per_token", "next_char_accuracy", "next_token_accuracy"):
        assert math.isfinite(row[f"eval/{key}"]), key
    # a token holds more than one char on average, so fewer bits per char than per token
    assert 0 < row["eval/bits_per_char"] < row["eval/bits_per_token"]
    assert math.isclose(
        row["eval/bits_per_token"] * math.log(2), row["eval/val_loss"], rel_tol=1e-5
    )
    assert 0 <= row["eval/ngram2_next_token_accuracy"] <= row["eval/ngram2_next_char_accuracy"]


def swap_two_tokens(path):
    """The same size and format, but ' the' and ' and' trade ids: a silent change of meaning."""
    tokenizer = json.loads(path.read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab[" the"], vocab[" and"] = vocab[" and"], vocab[" the"]
    path.write_text(json.dumps(tokenizer))


@pytest.mark.parametrize(
    "case, args, texts",
    [
        ("other_size", ["--config=shakespeare:bpe300,tiny"], ["holds a 256-token", "=256"]),
        ("swapped_tokens", RUN, ["trained on a tokenizer", "restore the tokenizer.json"]),
        ("garbage_file", RUN, ["tokenizer.json is not a readable BPE tokenizer"]),
        (
            "char_with_size",
            ["--config=shakespeare:tiny", "--config.data.vocab_size=9"],
            ["='char'"],
        ),
        ("unknown_kind", [*RUN, "--config.data.tokenizer=wordpiece"], ["data.tokenizer='word"]),
    ],
)
def test_resume_with_another_tokenizer_is_one_line_and_touches_nothing(
    bpe_run, tmp_path, case, args, texts
):
    work = tmp_path / "run"
    work.mkdir()
    for src in bpe_run.rglob("*"):  # a copy per case: each may be refused differently
        dst = work / src.relative_to(bpe_run)
        dst.mkdir(exist_ok=True) if src.is_dir() else dst.write_bytes(src.read_bytes())
    if case == "swapped_tokens":
        swap_two_tokens(work / bpe.FILE_NAME)
    elif case == "garbage_file":
        (work / bpe.FILE_NAME).write_text("{not json")
    before = digest(work)
    code, lines, _ = run_cli([*args, "--config.train.num_steps=4", f"--workdir={work}"])
    assert_refused(code, lines, *texts)
    assert digest(work) == before


PIECES = ["a", "bc", "def", "b", "ab"]  # first chars a, b, d, b, a
CHARS = eval_lib.TokenChars(
    np.array([ord(p[0]) for p in PIECES], np.int32), np.array([len(p) for p in PIECES], np.int32)
)


def metrics(logits, target):
    rows = eval_lib.teacher_forced(jnp.asarray(logits), jnp.asarray(target), CHARS)
    return {k: float(v) for k, v in eval_lib.per_char(rows, CHARS).items()}


def test_bits_per_char_by_hand_and_against_numpy():
    # uniform over 5 tokens: log2(5) bits per token; targets "bc", "def" | "a", "ab" = 8 chars
    target = np.array([[1, 2], [0, 4]])
    res = metrics(np.zeros((2, 2, 5), np.float32), target)
    assert res["eval/bits_per_token"] == pytest.approx(math.log2(5))
    assert res["eval/bits_per_char"] == pytest.approx(4 * math.log2(5) / 8)
    # argmax of all-equal logits is token 0 ("a"): first chars right for "a" and "ab" only
    assert res["eval/next_char_accuracy"] == 0.5 and res["eval/next_token_accuracy"] == 0.25

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 4, 5)).astype(np.float32)
    target = rng.integers(0, 5, (6, 4))
    res = metrics(logits, target)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, target[..., None], -1)[..., 0]
    chars = CHARS.num_chars[target].sum()
    assert res["eval/bits_per_char"] == pytest.approx(nll.sum() / chars / math.log(2), rel=1e-5)
    assert res["eval/bits_per_token"] == pytest.approx(nll.mean() / math.log(2), rel=1e-5)
    pred, first = logits.argmax(-1), CHARS.first_char
    assert res["eval/next_char_accuracy"] == pytest.approx((first[pred] == first[target]).mean())
    assert res["eval/next_token_accuracy"] == pytest.approx((pred == target).mean())


def test_char_vocabulary_keeps_its_keys_and_bits_per_char_is_val_loss_in_bits():
    res = eval_lib.per_char({"nll": jnp.array([1.0, 2.0]), "acc": jnp.array([0.5, 0.25])}, None)
    assert set(res) == {"eval/next_char_accuracy", "eval/bits_per_char"}
    assert float(res["eval/next_char_accuracy"]) == 0.375
    assert float(res["eval/bits_per_char"]) == pytest.approx(1.5 / math.log(2))
