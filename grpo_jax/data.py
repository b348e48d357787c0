"""Tiny Shakespeare: locating the corpus, the character vocabulary and batches.

Host-side pieces (`resolve_data_path`, `load_corpus`, `eval_windows`) are plain
numpy; the per-step samplers (`sample_windows`, `lm_batch`) are jitted and
gather windows on device so the hot loop never copies the corpus per step.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import pathlib
import urllib.request
import uuid
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

CANONICAL_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
)
CANONICAL_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
ENV_VAR = "GRPO_JAX_DATA"
CACHE_NAME = "tinyshakespeare.txt"


@dataclasses.dataclass(frozen=True)
class Vocab:
    """Sorted distinct characters of the corpus; id i <-> chars[i].

    Frozen and hashable (it is just a string), so it can be a static argument
    or a dict key; the lookup arrays are derived lazily.
    """

    chars: str

    @classmethod
    def from_text(cls, text: str) -> Vocab:
        if not text:
            raise ValueError("cannot build a vocabulary from an empty corpus")
        return cls("".join(sorted(set(text))))

    @property
    def size(self) -> int:
        return len(self.chars)

    @functools.cached_property
    def _codepoints(self) -> np.ndarray:
        # Sorted chars -> sorted code points, so encoding is one searchsorted.
        return np.array([ord(c) for c in self.chars], dtype=np.int64)

    def encode(self, text: str) -> np.ndarray:
        """str of length L -> int32 [L] ids."""
        cps = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
        ids = np.searchsorted(self._codepoints, cps)
        ids_clipped = np.minimum(ids, self.size - 1)
        bad = self._codepoints[ids_clipped] != cps
        if bad.any():
            ch = chr(int(cps[np.argmax(bad)]))
            raise ValueError(
                f"character {ch!r} is not in the {self.size}-char vocabulary, which "
                "comes from the corpus (data.path): use only characters of the corpus"
            )
        return ids_clipped.astype(np.int32)

    def decode(self, ids) -> str:
        """int ids [L] (any int array-like; flattened) -> str of length L."""
        ids = np.asarray(ids).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.size):
            raise ValueError(f"token ids must lie in [0, {self.size}) to decode")
        return "".join(self.chars[i] for i in ids.tolist())


def file_sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def cache_path() -> pathlib.Path:
    """Where the downloaded corpus lives: $XDG_CACHE_HOME or ~/.cache."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(root) / "grpo_jax" / CACHE_NAME


def _fetch(url: str, dest: pathlib.Path) -> None:
    """Writes the bytes at `url` to `dest`; raises OSError when offline."""
    with urllib.request.urlopen(url, timeout=30) as resp, open(dest, "wb") as f:
        for block in iter(lambda: resp.read(1 << 16), b""):
            f.write(block)


def download_corpus(dest: pathlib.Path) -> pathlib.Path:
    """Downloads the canonical file to `dest`, verified, via an atomic rename.

    A temp file in the same directory means a crash or a concurrent run never
    leaves a half-written `dest` behind.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    # a unique name, not a mkstemp file: that is created 0o600, which the download writing
    # into it and the rename would keep; _fetch creates it with the umask's mode instead
    tmp = dest.parent / f"{dest.name}.{uuid.uuid4().hex}.download"
    try:
        _fetch(CANONICAL_URL, tmp)
        digest = file_sha256(tmp)
        if digest != CANONICAL_SHA256:
            raise ValueError(
                f"downloaded {CANONICAL_URL} has sha256 {digest[:16]}..., expected "
                f"{CANONICAL_SHA256[:16]}...: pass --config.data.path=FILE instead"
            )
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def _explicit(path: pathlib.Path, fix: str) -> pathlib.Path:
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} not found: {fix}")
    if file_sha256(path) != CANONICAL_SHA256:
        # Not an error: an explicitly named file is the user's own corpus.
        logging.warning("%s is not the canonical tiny Shakespeare; using it.", path)
    return path


def resolve_data_path(path: str = "") -> pathlib.Path:
    """Finds the corpus: `path` > $GRPO_JAX_DATA > user cache > download."""
    if path:
        fix = "fix --config.data.path (or pass '' to search the defaults)"
        return _explicit(pathlib.Path(path).expanduser(), fix)
    env = os.environ.get(ENV_VAR, "")
    if env:
        fix = f"fix {ENV_VAR} (or unset it to use the cache or download)"
        return _explicit(pathlib.Path(env).expanduser(), fix)
    cached = cache_path()
    if cached.is_file():
        digest = file_sha256(cached)
        if digest != CANONICAL_SHA256:
            # The cache is ours, so a mismatch is corruption, never a user corpus.
            raise ValueError(
                f"cached corpus {cached} has sha256 {digest[:16]}..., not tiny "
                f"Shakespeare's {CANONICAL_SHA256[:16]}...: delete it to "
                "re-download, or pass --config.data.path=FILE"
            )
        return cached
    try:
        return download_corpus(cached)
    except OSError as e:
        reason = " ".join(str(e).split()) or type(e).__name__
        raise FileNotFoundError(
            f"tiny Shakespeare not found and download failed ({reason}): pass "
            f"--config.data.path=FILE or set {ENV_VAR}=FILE or place it at {cached}"
        ) from None


class Corpus(NamedTuple):
    vocab: Vocab  # or a bpe.BpeTokenizer (data.tokenizer=bpe): encode, decode, size
    train: np.ndarray  # int32 [N_train]
    val: np.ndarray  # int32 [N_val]
    sha256: str = ""  # of the file read: checkpoints record it (integrity.py)


def read_corpus(data_config) -> tuple[str, int, str]:
    """The corpus text, where its train split ends (train first, contiguous) and the file's
    sha256. `data_config` is `config.data`; missing fields take their defaults. The text is
    the file's characters as they are: "\r\n" and "\r" stay (no universal newlines), so
    the vocabulary and the decoded text are the file's, whose sha256 the checkpoints hold."""
    frac = float(data_config.get("train_fraction", 0.9))
    if not 0.0 < frac < 1.0:
        raise ValueError(f"data.train_fraction={frac} must lie strictly in (0, 1)")
    path = resolve_data_path(data_config.get("path", ""))
    with open(path, encoding="utf-8", newline="") as f:
        text = f.read()
    return text, int(len(text) * frac), file_sha256(path)


def window_len(data_config) -> int:
    """Tokens per window: ``data.window_len`` where the task sets it (fill_in), else
    context_len + horizon (0 when unset)."""
    if data_config.get("window_len") is not None:
        return int(data_config.window_len)
    return int(data_config.get("context_len", 0)) + int(data_config.get("horizon", 0))


def check_splits(train, val, data_config, unit: str = "chars") -> None:
    """Each split must hold more than one window (window_len) of tokens (``unit`` names them)."""
    window = window_len(data_config)
    size = (
        "data.window_len" if data_config.get("window_len") is not None else "context_len + horizon"
    )
    for name, part in (("train", train), ("val", val)):
        if len(part) <= window:
            raise ValueError(
                f"{name} split has {len(part)} {unit}, too few for windows of {size} = {window}: "
                "change data.train_fraction or use a larger corpus"
            )


def load_corpus(data_config) -> Corpus:
    """Reads, encodes and splits the corpus into char ids (contiguous split, train first).

    `data_config` is `config.data` (path, train_fraction, context_len, horizon);
    missing fields take their defaults.
    """
    text, split, sha256 = read_corpus(data_config)
    vocab = Vocab.from_text(text)  # from the whole text so val chars encode
    tokens = vocab.encode(text)
    train, val = tokens[:split], tokens[split:]
    check_splits(train, val, data_config)
    return Corpus(vocab, train, val, sha256)


def random_windows(key, tokens, batch_size: int, width: int) -> jax.Array:
    """[B, width] contiguous windows at uniform random starts (traced)."""
    n = tokens.shape[0]
    if n < width:
        raise ValueError(f"token array of length {n} is shorter than a window {width}")
    # randint's maxval is exclusive: starts cover every valid 0..n-width.
    starts = jax.random.randint(key, (batch_size,), 0, n - width + 1)
    tokens = jnp.asarray(tokens, jnp.int32)
    return jax.vmap(lambda s: jax.lax.dynamic_slice(tokens, (s,), (width,)))(starts)


@functools.partial(jax.jit, static_argnames=("batch_size", "context_len", "horizon"))
def sample_windows(key, tokens, batch_size: int, context_len: int, horizon: int):
    """Random prompts and their true continuations.

    Args:
      key: PRNG key.
      tokens: int32 [N] split (a device array, so it is not re-copied per call).
    Returns:
      context int32 [B, C] and target int32 [B, H], where
      concat(context, target) is tokens[s : s + C + H] for a uniform s.
    """
    w = random_windows(key, tokens, batch_size, context_len + horizon)
    return w[:, :context_len], w[:, context_len:]


@functools.partial(jax.jit, static_argnames=("batch_size", "seq_len"))
def lm_batch(key, tokens, batch_size: int, seq_len: int):
    """Next-char pretraining batch: inputs [B, L] and labels [B, L] (shifted by 1)."""
    w = random_windows(key, tokens, batch_size, seq_len + 1)
    return w[:, :-1], w[:, 1:]


def eval_windows(tokens, num_windows: int, context_len: int, horizon: int):
    """Deterministic, evenly spaced windows over a split (numpy).

    Returns context int32 [W, C] and target int32 [W, H]; the same windows every
    call, so held-out metrics are comparable across steps and runs.
    """
    tokens = np.asarray(tokens)
    width = context_len + horizon
    if num_windows < 1 or len(tokens) < width:
        raise ValueError(
            f"need num_windows >= 1 and a split of >= {width} chars "
            f"(got {num_windows} windows, {len(tokens)} chars)"
        )
    starts = np.linspace(0, len(tokens) - width, num_windows).round().astype(np.int64)
    w = tokens[starts[:, None] + np.arange(width)].astype(np.int32)
    return w[:, :context_len], w[:, context_len:]
