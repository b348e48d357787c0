"""Tests for grpo_jax.data: vocabulary, corpus location, splits and batches."""

import hashlib
import os
import shutil

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ml_collections import config_dict

from grpo_jax import data

N_CHARS = 1_115_394


@pytest.fixture(scope="module")
def text(shakespeare_path):
    return shakespeare_path.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def corpus(shakespeare_path):
    cfg = config_dict.ConfigDict({"path": str(shakespeare_path), "train_fraction": 0.9})
    return data.load_corpus(cfg)


@pytest.fixture
def fresh_env(tmp_path, monkeypatch):
    """No $GRPO_JAX_DATA, an empty cache under tmp_path, and no network."""
    monkeypatch.delenv(data.ENV_VAR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))

    def offline(url, dest):
        raise OSError("network is unreachable")

    monkeypatch.setattr(data, "_fetch", offline)
    return tmp_path


def test_canonical_hash_matches_shared_file(shakespeare_path, text):
    digest = hashlib.sha256(shakespeare_path.read_bytes()).hexdigest()
    assert digest == data.CANONICAL_SHA256
    assert len(text) == N_CHARS


def test_vocab_size_and_round_trip(corpus, text):
    vocab = corpus.vocab
    assert vocab.size == 65
    assert vocab.chars == "".join(sorted(set(text)))
    assert vocab.chars[:3] == "\n !" and vocab.chars[-1] == "z"
    ids = vocab.encode(text[:5000])
    assert ids.dtype == np.int32 and ids.shape == (5000,)
    assert vocab.decode(ids) == text[:5000]
    # Ids are ranks in the sorted alphabet.
    assert vocab.encode("A").tolist() == [vocab.chars.index("A")]
    assert vocab.encode("").shape == (0,)
    assert hash(vocab) == hash(data.Vocab(vocab.chars))


def test_unknown_char_is_a_clear_error(corpus):
    with pytest.raises(ValueError, match=r"'é'.*corpus"):
        corpus.vocab.encode("Romeo é")
    with pytest.raises(ValueError, match=r"\[0, 65\)"):
        corpus.vocab.decode([0, 65])


def test_split_sizes_and_contents(corpus, text):
    n_train = int(N_CHARS * 0.9)
    assert corpus.train.shape == (n_train,) and corpus.val.shape == (N_CHARS - n_train,)
    assert corpus.train.dtype == np.int32 and corpus.val.dtype == np.int32
    assert corpus.vocab.decode(corpus.train[:40]) == text[:40]
    assert corpus.vocab.decode(corpus.val[-40:]) == text[-40:]


def test_load_corpus_rejects_bad_fraction_and_tiny_splits(tmp_path):
    path = tmp_path / "small.txt"
    path.write_text("to be or not to be\n" * 5)
    with pytest.raises(ValueError, match="train_fraction"):
        data.load_corpus(config_dict.ConfigDict({"path": str(path), "train_fraction": 1.0}))
    cfg = config_dict.ConfigDict({"path": str(path), "context_len": 30, "horizon": 10})
    with pytest.raises(ValueError, match="val split has 10 chars"):
        data.load_corpus(cfg)
    small = data.load_corpus(config_dict.ConfigDict({"path": str(path)}))
    assert small.vocab.chars == "\n benort"
    assert len(small.train) == 85 and len(small.val) == 10


def test_a_corpus_keeps_its_line_endings(tmp_path):
    """A CRLF corpus reads as its characters: "\r" is in the vocabulary and the splits decode
    to the file's text (universal newlines made it "\n", a vocabulary that then refused the
    file's own "\r\n")."""
    path = tmp_path / "crlf.txt"
    raw = "to be or not to be\r\n" * 5
    path.write_bytes(raw.encode())
    corpus = data.load_corpus(config_dict.ConfigDict({"path": str(path)}))
    assert corpus.vocab.chars == "\n\r benort"
    both = np.concatenate([corpus.train, corpus.val])
    assert corpus.vocab.decode(both) == raw
    np.testing.assert_array_equal(corpus.vocab.encode("be\r\n"), corpus.vocab.encode(raw[16:20]))


def test_sample_windows_are_corpus_slices(corpus):
    train_text = corpus.vocab.decode(corpus.train)
    tokens = jnp.asarray(corpus.train)
    ctx, tgt = data.sample_windows(jax.random.key(0), tokens, 16, 20, 10)
    chex.assert_shape(ctx, (16, 20))
    chex.assert_shape(tgt, (16, 10))
    chex.assert_type([ctx, tgt], jnp.int32)
    for c, t in zip(np.asarray(ctx), np.asarray(tgt), strict=True):
        window = corpus.vocab.decode(np.concatenate([c, t]))
        assert window in train_text
    ctx2, _ = data.sample_windows(jax.random.key(1), tokens, 16, 20, 10)
    assert not np.array_equal(ctx, ctx2)


def test_sample_windows_cover_every_start_uniformly():
    tokens = jnp.arange(10, dtype=jnp.int32)
    ctx, tgt = data.sample_windows(jax.random.key(3), tokens, 7000, 3, 1)
    starts = np.asarray(ctx[:, 0])
    # Contiguous: each row is start, start+1, ...
    np.testing.assert_array_equal(ctx, starts[:, None] + np.arange(3))
    np.testing.assert_array_equal(tgt[:, 0], starts + 3)
    # Valid starts are 0..6 (the last window ends at the last token).
    counts = np.bincount(starts, minlength=7)
    assert counts.shape == (7,) and counts.min() > 850 and counts.max() < 1150
    with pytest.raises(ValueError, match="shorter than a window"):
        data.sample_windows(jax.random.key(0), tokens, 2, 8, 3)


def test_lm_batch_labels_are_shifted_inputs():
    tokens = jnp.arange(100, dtype=jnp.int32) * 3 % 65
    inputs, labels = data.lm_batch(jax.random.key(0), tokens, 4, 12)
    chex.assert_shape([inputs, labels], (4, 12))
    np.testing.assert_array_equal(inputs[:, 1:], labels[:, :-1])
    np.testing.assert_array_equal(labels, (inputs + 3) % 65)


def test_eval_windows_deterministic_and_evenly_spaced():
    tokens = np.arange(1000, dtype=np.int32)
    ctx, tgt = data.eval_windows(tokens, 5, 8, 2)
    assert ctx.shape == (5, 8) and tgt.shape == (5, 2) and ctx.dtype == np.int32
    np.testing.assert_array_equal(ctx[:, 0], [0, 248, 495, 742, 990])
    np.testing.assert_array_equal(tgt[:, 0], ctx[:, -1] + 1)
    again, _ = data.eval_windows(tokens, 5, 8, 2)
    np.testing.assert_array_equal(ctx, again)


def test_resolve_precedence_config_env_cache(fresh_env, shakespeare_path, monkeypatch):
    cache = data.cache_path()
    assert cache == fresh_env / "xdg" / "grpo_jax" / "tinyshakespeare.txt"
    cache.parent.mkdir(parents=True)
    shutil.copyfile(shakespeare_path, cache)
    own = fresh_env / "own.txt"
    own.write_text("my own corpus\n")
    env_file = fresh_env / "env.txt"
    env_file.write_text("from the environment\n")
    monkeypatch.setenv(data.ENV_VAR, str(env_file))

    assert data.resolve_data_path(str(own)) == own
    assert data.resolve_data_path("") == env_file
    monkeypatch.delenv(data.ENV_VAR)
    assert data.resolve_data_path() == cache
    # Without XDG_CACHE_HOME the cache is ~/.cache.
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert data.cache_path() == fresh_env / "home/.cache/grpo_jax/tinyshakespeare.txt"


def test_explicit_non_canonical_file_warns(fresh_env, monkeypatch):
    warnings = []
    monkeypatch.setattr(data.logging, "warning", lambda *a: warnings.append(a))
    own = fresh_env / "own.txt"
    own.write_text("abc\n")
    assert data.resolve_data_path(str(own)) == own
    assert len(warnings) == 1


def test_missing_explicit_files_name_the_fix(fresh_env, monkeypatch):
    missing = fresh_env / "nope.txt"
    with pytest.raises(FileNotFoundError, match=r"nope\.txt.*--config\.data\.path"):
        data.resolve_data_path(str(missing))
    monkeypatch.setenv(data.ENV_VAR, str(missing))
    with pytest.raises(FileNotFoundError, match=r"nope\.txt.*GRPO_JAX_DATA"):
        data.resolve_data_path("")


def test_offline_error_is_one_line(fresh_env):
    with pytest.raises(FileNotFoundError) as info:
        data.resolve_data_path("")
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith("tiny Shakespeare not found and download failed")
    assert "network is unreachable" in msg
    assert "--config.data.path=FILE" in msg and "GRPO_JAX_DATA=FILE" in msg
    assert str(data.cache_path()) in msg
    # No half-written temp file is left behind.
    assert not any(data.cache_path().parent.glob("*"))


def test_download_verifies_and_renames(fresh_env, shakespeare_path, monkeypatch):
    calls = []

    def fake_fetch(url, dest):
        calls.append(url)
        assert dest != data.cache_path()  # writes a temp file, not the cache
        shutil.copyfile(shakespeare_path, dest)

    monkeypatch.setattr(data, "_fetch", fake_fetch)
    path = data.resolve_data_path("")
    assert path == data.cache_path() and calls == [data.CANONICAL_URL]
    assert data.file_sha256(path) == data.CANONICAL_SHA256
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
    umask = os.umask(0o022)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # as open() makes it, not 0o600
    data.resolve_data_path("")  # now cached: no second download
    assert len(calls) == 1


def test_download_hash_mismatch_deletes_temp(fresh_env, monkeypatch):
    monkeypatch.setattr(data, "_fetch", lambda url, dest: dest.write_text("<html>"))
    with pytest.raises(ValueError, match="sha256"):
        data.resolve_data_path("")
    assert not data.cache_path().exists()
    assert not any(data.cache_path().parent.glob("*"))


def test_corrupt_cache_is_an_error_not_used(fresh_env):
    cache = data.cache_path()
    cache.parent.mkdir(parents=True)
    cache.write_text("not shakespeare\n")
    with pytest.raises(ValueError, match=r"cached corpus .*delete it"):
        data.resolve_data_path("")
    with pytest.raises(ValueError, match="cached corpus"):
        data.load_corpus(config_dict.ConfigDict({"path": ""}))
