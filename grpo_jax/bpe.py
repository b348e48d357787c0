"""A subword vocabulary for the Shakespeare task: byte-pair encoding (HuggingFace ``tokenizers``)
trained offline on the train split only, kept as ``tokenizer.json`` beside the checkpoints.

The alphabet is the corpus's characters, not its bytes: a 256-token vocabulary then already
holds ~190 merges (a byte alphabet would spend all 256 on bytes), and every token is a fixed
string, so decoding concatenates token strings, exactly (decode(encode(text)) == text), and
gives the per-token char counts and first chars that the per-char metrics need. The alphabet
is taken from the whole file, like data.Vocab, so that a character seen only in the val split
still encodes; the merges see the train split only. Pre-tokenization splits GPT-2 style (a
word with its leading space, a run of punctuation, whitespace), so no token spans two words,
and nothing is normalised or dropped. No PAD or EOS: Shakespeare completions have a fixed
horizon.

A run trains its tokenizer once (deterministic: the same split and size give the same file,
from tokenizers 0.20 to 0.23 at least) and the trainer writes it into the workdir when the run
goes ahead (``Task.files``); a resume loads the workdir's file, whose sha256 the checkpoints
record as their vocabulary digest (integrity.py).
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from grpo_jax import data as data_lib

FILE_NAME = "tokenizer.json"
# GPT-2's split, on characters: contractions, a word or a number with its leading space, a run
# of other symbols, whitespace (its last space left to the next word). It covers every char.
SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"


@dataclasses.dataclass(frozen=True)
class BpeTokenizer:
    """A trained BPE vocabulary: ids 0..size-1, each the string ``pieces[id]``.

    Frozen and hashable like data.Vocab; it holds only the tokenizer.json text, exactly as
    saved, so its digest is the file's."""

    json: str
    file_name = FILE_NAME  # integrity.py names it in a resume's refusal

    @functools.cached_property
    def _hf(self) -> Tokenizer:
        return Tokenizer.from_str(self.json)

    @functools.cached_property
    def pieces(self) -> tuple[str, ...]:
        """Each id's string (the decoding of that one token)."""
        pieces = tuple(self._hf.id_to_token(i) for i in range(self._hf.get_vocab_size()))
        if not all(pieces):  # ids with a hole, or an empty token, would not round-trip
            raise ValueError("token ids are not contiguous strings")
        return pieces

    @property
    def size(self) -> int:
        return len(self.pieces)

    def to_str(self) -> str:
        """The tokenizer.json text (integrity.vocab_sha256 digests it)."""
        return self.json

    @functools.cached_property
    def num_chars(self) -> np.ndarray:
        """int32 [V]: characters each token decodes to."""
        return np.array([len(p) for p in self.pieces], np.int32)

    @functools.cached_property
    def first_char(self) -> np.ndarray:
        """int32 [V]: code point of each token's first character (next-char accuracy)."""
        return np.array([ord(p[0]) for p in self.pieces], np.int32)

    def encode(self, text: str) -> np.ndarray:
        """str -> int32 [L] ids; a character outside the alphabet is an error, not dropped."""
        ids = np.array(self._hf.encode(text).ids, np.int32)
        if int(self.num_chars[ids].sum()) != len(text):
            alphabet = {p for p in self.pieces if len(p) == 1}
            missing = sorted(set(text) - alphabet)
            raise ValueError(
                f"character {missing[0] if missing else '?'!r} is not in the {self.size}-token "
                "BPE vocabulary's alphabet, which comes from the corpus (data.path): use only "
                "characters of the corpus"
            )
        return ids

    def decode(self, ids) -> str:
        """int ids (any int array-like; flattened) -> the concatenation of their strings."""
        ids = np.asarray(ids).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.size):
            raise ValueError(f"token ids must lie in [0, {self.size}) to decode")
        return "".join(self.pieces[i] for i in ids.tolist())


def train(text: str, vocab_size: int, alphabet: str) -> BpeTokenizer:
    """BPE with ``vocab_size`` tokens (the ``alphabet``'s characters, then merges) on ``text``."""
    if vocab_size < len(alphabet):
        raise ValueError(
            f"data.vocab_size={vocab_size} must be >= the corpus's {len(alphabet)} characters "
            "(each is a token of the BPE vocabulary)"
        )
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Split(Regex(SPLIT), behavior="isolated")
    hf.decoder = decoders.Fuse()  # the file alone decodes right (HF's default joins with " ")
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=list(alphabet),
        limit_alphabet=len(alphabet),
        special_tokens=[],
        show_progress=False,
    )
    hf.train_from_iterator([text], trainer=trainer)
    tokenizer = BpeTokenizer(hf.to_str())
    if tokenizer.size != vocab_size:
        raise ValueError(
            f"data.vocab_size={vocab_size}: the train split yields only {tokenizer.size} "
            "tokens (every pair of its words is merged); lower data.vocab_size"
        )
    return tokenizer


def load(path: Path) -> BpeTokenizer:
    """The tokenizer a workdir keeps; its bytes as they are (the digest is the file's)."""
    try:
        tokenizer = BpeTokenizer(path.read_bytes().decode("utf-8"))
        tokenizer.pieces  # noqa: B018 -- parse now: a damaged file is one line here
    except Exception as err:  # tokenizers raises a bare Exception on a malformed file
        raise ValueError(
            f"{path} is not a readable BPE tokenizer ({type(err).__name__}); restore the one "
            "this workdir's run was trained with, or use a fresh --workdir"
        ) from err
    return tokenizer


def for_workdir(workdir: Path | None, text: str, vocab_size: int, alphabet: str) -> BpeTokenizer:
    """The workdir's tokenizer.json when it has one (a resume: the vocabulary its checkpoints
    were trained with), else a new one trained on ``text`` (the train split)."""
    path = workdir / FILE_NAME if workdir is not None else None
    if path is None or not path.is_file():
        return train(text, vocab_size, alphabet)
    tokenizer = load(path)
    if tokenizer.size != vocab_size:
        raise ValueError(
            f"{path} holds a {tokenizer.size}-token vocabulary but data.vocab_size="
            f"{vocab_size}; resume with --config.data.vocab_size={tokenizer.size} (variant "
            f":bpe{tokenizer.size}) or use a fresh --workdir"
        )
    return tokenizer


def load_corpus(data_config, workdir: Path | None = None) -> data_lib.Corpus:
    """data.load_corpus with a BPE vocabulary of ``data_config.vocab_size`` tokens: the splits
    are cut in the text (as for chars) and each is encoded on its own."""
    text, split, sha256 = data_lib.read_corpus(data_config)
    alphabet = "".join(sorted(set(text)))
    tokenizer = for_workdir(workdir, text[:split], int(data_config.vocab_size), alphabet)
    train_ids, val_ids = tokenizer.encode(text[:split]), tokenizer.encode(text[split:])
    data_lib.check_splits(train_ids, val_ids, data_config, "tokens")
    return data_lib.Corpus(tokenizer, train_ids, val_ids, sha256)
