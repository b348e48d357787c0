"""Arithmetic problems and their verifiable rewards, apart from any model or engine.

A prompt is a problem such as "47*8="; its answer is str(value) then EOS ("376<EOS>"), in the
char tokenizer's ids (grpo_jax.tokenizer.CharTokenizer: PAD, EOS, then the chars).
  - problems: ``ProblemSpec`` bounds the space; ``generate_problems`` draws distinct problems
    from a seed and splits them, so the train and held-out sets are disjoint by construction;
    ``parse_problem`` reads one back;
  - encoding: prompts left-padded (the last position is the decision point), answers then EOS
    right-padded, and completions decoded back to text;
  - rewards: checked, not learned. ``correctness_reward`` (1.0 when the text before EOS is
    exactly str(answer), else 0.0; None for a prompt that is not a problem) and
    ``format_reward`` are plain Python on decoded strings, the way researchers write them;
    ``correctness_tokens`` / ``format_tokens`` are their jittable twins with the same
    verdicts (``reward.python=False``: nothing leaves the device).
The task that wires them into the engine is grpo_jax/tasks/arithmetic.py.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.tokenizer import EOS_ID, PAD_ID, CharTokenizer

_OPS = "+-*"
_PROBLEM_RE = re.compile(r"(0|[1-9][0-9]*)([+\-*])(0|[1-9][0-9]*)=")
_INTEGER_RE = re.compile(r"-?[0-9]+")


class ProblemSpec(NamedTuple):
    """Problem space: operands uniform in [0, 10**max_digits), ops a subset of "+-*".

    `mul_max_digits` bounds the second operand of "*" separately (None: max_digits),
    because multiplication is the hard op: "47*8=" is far easier than "47*38=".
    """

    max_digits: int = 2
    ops: str = "+-*"
    mul_max_digits: int | None = None


class Problems(NamedTuple):
    prompts: tuple[str, ...]
    answers: tuple[int, ...]


def _operand_sizes(spec: ProblemSpec) -> dict[str, tuple[int, int]]:
    """{op: (number of first operands, number of second operands)}, after validation."""
    digits = (
        spec.max_digits,
        spec.max_digits if spec.mul_max_digits is None else spec.mul_max_digits,
    )
    # 9 digits keeps every op's space (10**18) inside int64 for numpy's sampler.
    if not all(isinstance(d, int) and 1 <= d <= 9 for d in digits):
        raise ValueError(f"ProblemSpec digits must be ints in [1, 9]: {spec}")
    if not spec.ops or len(set(spec.ops)) != len(spec.ops) or set(spec.ops) - set(_OPS):
        raise ValueError(f"ProblemSpec.ops must be distinct chars of {_OPS!r}: {spec.ops!r}")
    n_a = 10**spec.max_digits
    return {op: (n_a, 10 ** digits[1] if op == "*" else n_a) for op in spec.ops}


def num_problems(spec: ProblemSpec) -> int:
    """Number of distinct problems (prompt strings) the spec can produce."""
    return sum(n_a * n_b for n_a, n_b in _operand_sizes(spec).values())


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def max_prompt_len(spec: ProblemSpec) -> int:
    """Longest prompt in chars, e.g. "99+99=" -> 6 for max_digits=2."""
    return max(
        len(str(n_a - 1)) + len(str(n_b - 1)) + 2 for n_a, n_b in _operand_sizes(spec).values()
    )


def max_answer_len(spec: ProblemSpec) -> int:
    """Longest str(answer) in chars (no EOS), from the extreme operands of each op."""
    lengths = []
    for op, (n_a, n_b) in _operand_sizes(spec).items():
        # Each op is monotone in each operand, so the extremes sit at the corners.
        corners = [_apply(a, op, b) for a in (0, n_a - 1) for b in (0, n_b - 1)]
        lengths.append(max(len(str(v)) for v in corners))
    return max(lengths)


def _quotas(n: int, sizes: dict[str, int]) -> dict[str, int]:
    """Splits n problems evenly over ops; an op too small to take its share gives the rest
    to the larger ones (smallest first, so every cap is known before it matters)."""
    quotas, left = {}, n
    for i, op in enumerate(sorted(sizes, key=sizes.get)):
        quotas[op] = min(sizes[op], -(-left // (len(sizes) - i)))
        left -= quotas[op]
    return quotas


def generate_problems(
    seed: int, num_train: int, num_heldout: int, spec: ProblemSpec
) -> tuple[Problems, Problems]:
    """Deterministic (train, held-out) problem sets: all prompts distinct, the sets disjoint.

    Ops are balanced (each gets an equal share unless its space is too small) and the
    operands of an op are a uniform draw without replacement from its space. All
    problems are drawn at once and then split, which is what makes the sets disjoint.
    The split is by prompt: a held-out a+b or a*b may have its commuted twin b+a / b*a in
    the train set (181 of the default config's 512 held-out problems), so held-out accuracy
    measures generalisation over strings, not over unseen sums and products.
    """
    grid = _operand_sizes(spec)
    sizes = {op: n_a * n_b for op, (n_a, n_b) in grid.items()}
    total = num_train + num_heldout
    if num_train < 0 or num_heldout < 0:
        raise ValueError(f"problem counts must be >= 0: {num_train=}, {num_heldout=}")
    if total > sum(sizes.values()):
        raise ValueError(
            f"{spec} has only {sum(sizes.values())} distinct problems; "
            f"cannot draw {num_train} train + {num_heldout} held-out"
        )
    rng = np.random.default_rng(seed)
    problems = []
    for op, quota in _quotas(total, sizes).items():
        # Distinct indices into the op's (a, b) grid give distinct prompt strings.
        for index in rng.choice(sizes[op], size=quota, replace=False, shuffle=False):
            a, b = divmod(int(index), grid[op][1])
            problems.append((f"{a}{op}{b}=", _apply(a, op, b)))
    problems = [problems[i] for i in rng.permutation(total)]

    def as_problems(part):
        return Problems(tuple(p for p, _ in part), tuple(a for _, a in part))

    return as_problems(problems[:num_train]), as_problems(problems[num_train:])


def parse_problem(prompt: str) -> int | None:
    """The answer to a prompt like "47*8=", or None if it is not a problem in this format."""
    match = _PROBLEM_RE.fullmatch(prompt)
    if match is None:
        return None
    return _apply(int(match[1]), match[2], int(match[3]))


def encode_prompts(tok: CharTokenizer, prompts, prompt_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [N, P] int32, mask [N, P] float32), LEFT-padded with PAD."""
    tokens = np.full((len(prompts), prompt_len), PAD_ID, np.int32)
    mask = np.zeros((len(prompts), prompt_len), np.float32)
    for i, prompt in enumerate(prompts):
        ids = tok.encode(prompt)
        if len(ids) > prompt_len:
            raise ValueError(f"prompt {prompt!r} has {len(ids)} chars > prompt_len={prompt_len}")
        if len(ids):
            tokens[i, -len(ids) :], mask[i, -len(ids) :] = ids, 1.0
    return tokens, mask


def encode_answers(
    tok: CharTokenizer, answers, max_completion_length: int
) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [N, T] int32, mask [N, T] float32): str(answer) chars, EOS, then PAD."""
    tokens = np.full((len(answers), max_completion_length), PAD_ID, np.int32)
    mask = np.zeros((len(answers), max_completion_length), np.float32)
    for i, answer in enumerate(answers):
        ids = np.append(tok.encode(str(answer)), EOS_ID)
        if len(ids) > max_completion_length:
            raise ValueError(
                f"answer {answer} + EOS needs {len(ids)} tokens > "
                f"max_completion_length={max_completion_length}"
            )
        tokens[i, : len(ids)], mask[i, : len(ids)] = ids, 1.0
    return tokens, mask


def decode_completions(tok: CharTokenizer, tokens, completion_mask) -> tuple[list[str], list[bool]]:
    """Host view of completions [..., T]: (texts before the first EOS, ended with EOS?).

    Positions with completion_mask 0 are left out, exactly as in the token rewards; a PAD the
    policy emitted reads as tokenizer.PAD_TEXT.
    """
    tokens = np.asarray(tokens)
    live = np.asarray(completion_mask).reshape(-1, tokens.shape[-1]) > 0
    rows = [row[keep] for row, keep in zip(tokens.reshape(live.shape), live, strict=True)]
    return [tok.decode_completion(r) for r in rows], [bool((r == EOS_ID).any()) for r in rows]


def correctness_reward(prompts, completions, answer, **_) -> list[float | None]:
    """1.0 if the completion is exactly str(answer) ("0376", " 376" are wrong), else 0.0;
    None where the prompt is not a parsable problem."""
    return [
        None if parse_problem(p) is None else float(c == str(a))
        for p, c, a in zip(prompts, completions, answer, strict=True)
    ]


def format_reward(prompts, completions, terminated, **_) -> list[float | None]:
    """1.0 if the completion is an integer (-?[0-9]+) that ended with EOS, else 0.0."""
    return [
        float(bool(_INTEGER_RE.fullmatch(c)) and bool(t))
        for c, t in zip(completions, terminated, strict=True)
    ]


def _completion_chars(tokens, completion_mask):
    """(keep [..., T], rank [..., T], terminated [...]) of the text a host reward would see.

    keep marks the chars before the first (unmasked) EOS, PADs and masked positions
    dropped; rank is each kept char's index in that text, so the comparison below is
    the host's string comparison without a data-dependent gather. clean [...] is False where
    a live PAD precedes the EOS: its text holds tokenizer.PAD_TEXT, neither correct nor
    well formed.
    """
    tokens = jnp.asarray(tokens)
    live = jnp.asarray(completion_mask) > 0
    is_eos = live & (tokens == EOS_ID)
    before_eos = live & (jnp.cumsum(is_eos, axis=-1) == 0)
    keep = before_eos & (tokens != PAD_ID)
    rank = jnp.cumsum(keep, axis=-1) - 1
    clean = ~jnp.any(before_eos & (tokens == PAD_ID), axis=-1)
    return keep, rank, jnp.any(is_eos, axis=-1), clean


def correctness_tokens(tokens, completion_mask, answer_tokens, answer_mask) -> jax.Array:
    """[B, K] float32: 1 where completion k's text equals answer b's chars exactly.

    tokens/completion_mask are [B, K, T]; answer_tokens/answer_mask are encode_answers'
    [B, T_a] (chars, EOS, PAD); T_a may differ from T.
    """
    tokens = jnp.asarray(tokens)
    answer_tokens = jnp.asarray(answer_tokens)
    keep, rank, _, clean = _completion_chars(tokens, completion_mask)
    is_char = (jnp.asarray(answer_mask) > 0) & (answer_tokens != EOS_ID) & (answer_tokens != PAD_ID)
    answer_len = jnp.sum(is_char, axis=-1)[:, None]
    # A rank past the answer's end can only come with too many chars, which the length
    # check rejects, so clipping the gather index never changes a verdict.
    index = jnp.clip(rank, 0, answer_tokens.shape[-1] - 1)
    answer = jnp.broadcast_to(
        answer_tokens[:, None, :], (*tokens.shape[:2], answer_tokens.shape[-1])
    )
    expected = jnp.take_along_axis(answer, index, axis=-1)
    same = jnp.all(~keep | (tokens == expected), axis=-1)
    return (same & clean & (jnp.sum(keep, axis=-1) == answer_len)).astype(jnp.float32)


def format_tokens(tokens, completion_mask, tok: CharTokenizer) -> jax.Array:
    """[B, K] float32: 1 where the completion is -?[0-9]+ and ended with EOS."""
    tokens = jnp.asarray(tokens)
    keep, rank, terminated, clean = _completion_chars(tokens, completion_mask)
    digit_ids = jnp.array([tok._ids[c] for c in "0123456789" if c in tok._ids], jnp.int32)
    is_digit = jnp.any(tokens[..., None] == digit_ids, axis=-1)
    # A tokenizer without "-" gets id -1, which no token has.
    is_minus = (tokens == tok._ids.get("-", -1)) & (rank == 0)
    well_formed = jnp.all(~keep | is_digit | is_minus, axis=-1)
    has_digit = jnp.any(keep & is_digit, axis=-1)
    return (terminated & clean & well_formed & has_digit).astype(jnp.float32)
