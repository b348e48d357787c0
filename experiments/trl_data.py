"""The TRL side's data for experiments/trl_grpo.py: grpo_jax's char vocabulary as a Hugging Face
tokenizer, the train split's prompt windows, and grpo_jax's ``match`` reward as a TRL reward
function. Imports nothing outside the standard library until a tokenizer is built (the TRL
venv's transformers and tokenizers)."""

import random

EOS = "<|endoftext|>"


def char_tokenizer(chars: str):
    """A HF fast tokenizer with one token per character of ``chars`` (ids 0..V-1 in the given
    order, grpo_jax's sorted-char ids) plus EOS (id V), which is also the pad token."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(chars)}
    vocab[EOS] = len(chars)
    # BPE with no merges and no pre-tokenizer splits the text into its characters, whitespace
    # included; the Fuse decoder concatenates tokens (no spaces between them)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.add_special_tokens([EOS])
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=EOS, bos_token=EOS, padding_side="left"
    )


def load_prompts(path: str, fraction: float, context: int, horizon: int, n: int, seed: int):
    """n random (prompt, target) windows of the train split: text[s:s+C], text[s+C:s+C+H]."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    chars = "".join(sorted(set(text)))  # grpo_jax's Vocab.from_text: the whole text's chars
    train = text[: int(len(text) * fraction)]
    rng = random.Random(seed)
    starts = [rng.randrange(len(train) - context - horizon + 1) for _ in range(n)]
    prompts = [train[s : s + context] for s in starts]
    targets = [train[s + context : s + context + horizon] for s in starts]
    return chars, prompts, targets


def match_reward(char_id: dict, lengths: list):
    """grpo_jax's ``match`` as a TRL reward function: the mean over the horizon of
    completion[i] == target[i] (on ids). Appends every completion's length to ``lengths``,
    which run() checks against the forced horizon."""

    def match(completions, completion_ids, target, **_):
        out = []
        for ids, tgt in zip(completion_ids, target, strict=True):
            lengths.append(len(ids))
            hits = sum(int(i == char_id[c]) for i, c in zip(ids, tgt, strict=False))
            out.append(hits / len(tgt))
        return out

    return match


def checked_tokenizer(chars: str, sample: str):
    """(char_tokenizer(chars), char -> id), checked on chars and a sample prompt: one token per
    char, grpo_jax's ids, an exact round trip."""
    tokenizer = char_tokenizer(chars)
    char_id = {c: i for i, c in enumerate(chars)}
    for text in (chars, sample):
        ids = tokenizer(text)["input_ids"]
        assert ids == [char_id[c] for c in text] and tokenizer.decode(ids) == text, text
    return tokenizer, char_id
