"""Char-level tokenizers with the special tokens an EOS-terminated task needs.

``CharTokenizer``: id 0 = PAD, id 1 = EOS, then the characters of ``chars`` in order. It is
all a small task with a closed alphabet needs (the arithmetic task uses it); subword
vocabularies come from HuggingFace ``tokenizers``.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

PAD_ID = 0
EOS_ID = 1
PAD_TEXT = "\ufffd"  # a PAD inside a completion, as its text reads (decode_completion)


@dataclasses.dataclass(frozen=True)
class CharTokenizer:
    """Char-level tokenizer: id 0 = PAD, id 1 = EOS, then the chars of `chars` in order."""

    chars: str = "0123456789+-*="

    def __post_init__(self):
        if not self.chars or len(set(self.chars)) != len(self.chars):
            raise ValueError(f"CharTokenizer chars must be non-empty and distinct: {self.chars!r}")

    @property
    def vocab_size(self) -> int:
        return len(self.chars) + 2

    @property
    def pad_id(self) -> int:
        return PAD_ID

    @property
    def eos_id(self) -> int:
        return EOS_ID

    @functools.cached_property
    def _ids(self) -> dict[str, int]:
        return {c: i + 2 for i, c in enumerate(self.chars)}

    def encode(self, text: str) -> np.ndarray:
        """int32 ids of `text` (no EOS added)."""
        for c in text:
            if c not in self._ids:
                raise ValueError(f"char {c!r} in {text!r} is not in the tokenizer's {self.chars!r}")
        return np.array([self._ids[c] for c in text], np.int32)

    def decode(self, ids) -> str:
        """Text of all ids; PAD and EOS show as nothing."""
        ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        if any(i < 0 or i >= self.vocab_size for i in ids):
            raise ValueError(f"ids {ids} outside the vocabulary [0, {self.vocab_size})")
        return "".join(self.chars[i - 2] for i in ids if i >= 2)

    def decode_completion(self, ids) -> str:
        """Text of the ids before the first EOS: what a reward sees. A PAD there was sampled
        (the policy may emit any id; an exhaustive group forces it) and reads as PAD_TEXT, so
        that no text reward takes "2<PAD>70" for "270" (TRL decodes with
        skip_special_tokens, which drops it)."""
        ids = np.asarray(ids).reshape(-1)
        ends = np.flatnonzero(ids == EOS_ID)
        head = ids[: ends[0]] if ends.size else ids
        runs = np.split(head, np.flatnonzero(head == PAD_ID))  # each run after the first: a PAD
        return PAD_TEXT.join(self.decode(run) for run in runs)
