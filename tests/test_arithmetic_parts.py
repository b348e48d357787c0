"""Tests for the building blocks of grpo_jax.tasks.arithmetic_problems, on hand-computed values."""

import functools
import itertools
import math
import re

import jax
import numpy as np
import pytest

from grpo_jax.evaluate import pass_at_k
from grpo_jax.tasks.arithmetic_problems import (
    Problems,
    ProblemSpec,
    correctness_reward,
    correctness_tokens,
    decode_completions,
    encode_answers,
    encode_prompts,
    format_reward,
    format_tokens,
    generate_problems,
    max_answer_len,
    max_prompt_len,
    num_problems,
    parse_problem,
)
from grpo_jax.tokenizer import EOS_ID, PAD_ID, CharTokenizer

TOK = CharTokenizer()
# ids: PAD 0, EOS 1, "0".."9" -> 2..11, "+" 12, "-" 13, "*" 14, "=" 15
E, P, MINUS = EOS_ID, PAD_ID, 13


def digits(text):
    return [2 + int(c) if c.isdigit() else {"-": MINUS}[c] for c in text]


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_ids_and_round_trip():
    assert (TOK.vocab_size, TOK.pad_id, TOK.eos_id) == (16, 0, 1)
    ids = TOK.encode("47*8=")
    np.testing.assert_array_equal(ids, [6, 9, 14, 10, 15])
    assert ids.dtype == np.int32
    assert TOK.decode(ids) == "47*8="
    assert TOK.decode([6, 0, 1, 9, 0]) == "47"
    assert TOK.decode_completion([6, 0, 9, 1, 3, 1]) == "4\ufffd7"  # a sampled PAD shows
    assert TOK.decode_completion([0, 0, 6, 0]) == "\ufffd\ufffd4\ufffd"
    assert TOK.decode_completion([1, 6]) == ""
    assert TOK.decode_completion([13, 7]) == "-5"  # no EOS: everything


def test_tokenizer_errors():
    with pytest.raises(ValueError, match="'x'"):
        TOK.encode("4x")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        TOK.decode([16])
    with pytest.raises(ValueError, match="distinct"):
        CharTokenizer("00")


# ---------------------------------------------------------------- problems


def test_problem_space_sizes_and_lengths():
    assert num_problems(ProblemSpec(2, "+-*")) == 30_000
    assert num_problems(ProblemSpec(2, "+-*", mul_max_digits=1)) == 21_000
    assert num_problems(ProblemSpec(3, "+")) == 1_000_000
    assert max_prompt_len(ProblemSpec(2, "+-*")) == 6  # "99+99="
    assert max_prompt_len(ProblemSpec(2, "*", 1)) == 5  # "99*9="
    assert max_prompt_len(ProblemSpec(3, "+")) == 8
    assert max_answer_len(ProblemSpec(2, "+")) == 3  # "198"
    assert max_answer_len(ProblemSpec(2, "-")) == 3  # "-99"
    assert max_answer_len(ProblemSpec(2, "*")) == 4  # "9801"
    assert max_answer_len(ProblemSpec(2, "*", 1)) == 3  # "891"
    assert max_answer_len(ProblemSpec(1, "+-*")) == 2  # "18", "-9", "81"
    for bad in [ProblemSpec(0, "+"), ProblemSpec(2, "/"), ProblemSpec(2, "++"), ProblemSpec(2, "")]:
        with pytest.raises(ValueError, match="ProblemSpec"):
            num_problems(bad)


def test_lengths_match_brute_force():
    spec = ProblemSpec(1, "+-*")
    train, _ = generate_problems(0, num_problems(spec), 0, spec)
    assert max(len(p) for p in train.prompts) == max_prompt_len(spec)
    assert max(len(str(a)) for a in train.answers) == max_answer_len(spec)


def test_generate_problems_distinct_disjoint_correct():
    spec = ProblemSpec(2, "+-*", mul_max_digits=1)
    train, held = generate_problems(7, 1000, 200, spec)
    assert (len(train.prompts), len(held.prompts)) == (1000, 200)
    assert len(set(train.prompts)) == 1000 and len(set(held.prompts)) == 200
    assert not set(train.prompts) & set(held.prompts)
    for prompt, answer in zip(
        train.prompts + held.prompts, train.answers + held.answers, strict=True
    ):
        a, op, b = re.fullmatch(r"(\d+)([+\-*])(\d+)=", prompt).groups()
        assert a == str(int(a)) and b == str(int(b))  # canonical, no leading zeros
        assert int(a) < 100 and int(b) < (10 if op == "*" else 100)
        assert answer == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
    assert min(train.answers) < 0  # "-" gives negative answers
    assert generate_problems(7, 1000, 200, spec) == (train, held)
    assert generate_problems(8, 1000, 200, spec)[0] != train


def test_generate_problems_balances_ops_and_exhausts_space():
    train, held = generate_problems(0, 1000, 500, ProblemSpec(2, "+-*", 1))
    ops = [re.search(r"[+\-*]", p)[0] for p in train.prompts + held.prompts]
    assert {op: ops.count(op) for op in "+-*"} == {"+": 500, "-": 500, "*": 500}
    # "*" with a 1-digit second operand has 1000 problems: it gives the rest of its share away.
    train, _ = generate_problems(0, 3000, 0, ProblemSpec(2, "+*", 1))
    assert sum("*" in p for p in train.prompts) == 1000
    train, _ = generate_problems(0, 300, 0, ProblemSpec(2, "+*", 1))
    assert sum("*" in p for p in train.prompts) == 150
    train, _ = generate_problems(0, 200, 0, ProblemSpec(1, "+*"))
    everything = {f"{a}{op}{b}=" for op in "+*" for a in range(10) for b in range(10)}
    assert set(train.prompts) == everything
    train, held = generate_problems(3, 60, 40, ProblemSpec(1, "+"))
    assert len(set(train.prompts) | set(held.prompts)) == 100
    with pytest.raises(ValueError, match="only 100 distinct problems"):
        generate_problems(3, 60, 41, ProblemSpec(1, "+"))


def test_parse_problem():
    assert parse_problem("47*8=") == 376
    assert parse_problem("3-20=") == -17
    assert parse_problem("0+0=") == 0
    for bad in ["47*8", "047*8=", "4 7*8=", "hello", "-4+1=", "1+2=3"]:
        assert parse_problem(bad) is None


# ---------------------------------------------------------------- encoding


def test_encode_prompts_left_padded():
    tokens, mask = encode_prompts(TOK, ["1+2=", "47*8="], 6)
    np.testing.assert_array_equal(tokens, [[0, 0, 3, 12, 4, 15], [0, 6, 9, 14, 10, 15]])
    np.testing.assert_array_equal(mask, [[0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1]])
    assert tokens.dtype == np.int32 and mask.dtype == np.float32
    with pytest.raises(ValueError, match=r"'381\+920=' has 8 chars > prompt_len=7"):
        encode_prompts(TOK, ["1+2=", "381+920="], 7)


def test_encode_answers_right_padded():
    tokens, mask = encode_answers(TOK, [376, -5, 0], 4)
    np.testing.assert_array_equal(tokens, [[5, 9, 8, 1], [13, 7, 1, 0], [2, 1, 0, 0]])
    np.testing.assert_array_equal(mask, [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]])
    assert tokens.dtype == np.int32 and mask.dtype == np.float32
    with pytest.raises(ValueError, match="answer 3760 .* max_completion_length=4"):
        encode_answers(TOK, [3760], 4)


# ---------------------------------------------------------------- rewards

# (completion tokens [T=4], answer, correctness, format)
HAND_CASES = [
    (digits("376") + [E], 376, 1.0, 1.0),  # correct
    (digits("375") + [E], 376, 0.0, 1.0),  # wrong digit
    (digits("0376"), 376, 0.0, 0.0),  # leading zero, no EOS
    (digits("037") + [E], 37, 0.0, 1.0),  # leading zero, well formed
    (digits("3761"), 376, 0.0, 0.0),  # extra char, no EOS
    (digits("37") + [E, P], 376, 0.0, 1.0),  # missing char
    (digits("3760"), 3760, 1.0, 0.0),  # right digits fill all T, no EOS
    ([E, P, P, P], 0, 0.0, 0.0),  # empty completion
    (digits("-17") + [E], -17, 1.0, 1.0),  # negative answer
    (digits("17") + [E, P], -17, 0.0, 1.0),  # sign dropped
    ([MINUS, E, P, P], 0, 0.0, 0.0),  # a lone minus
    (digits("1") + [MINUS, 3, E], 1, 0.0, 0.0),  # minus inside
    (digits("0") + [E, 9, 9], 0, 1.0, 1.0),  # garbage after EOS is ignored
    ([3, 12, 4, E], 3, 0.0, 0.0),  # "1+2"
    ([4, P, 9, E], 27, 0.0, 0.0),  # a PAD the policy emitted is no invisible char
    ([P, 4, 9, E], 27, 0.0, 0.0),  # nor a free first action
]


def token_rewards(tokens, mask, answers):
    """Both twins on [B=1, K, T] completions against one answer each (as B rows)."""
    tokens, mask = np.asarray(tokens)[:, None], np.asarray(mask)[:, None]
    answer_tokens, answer_mask = encode_answers(TOK, answers, 8)
    corr = jax.jit(correctness_tokens)(tokens, mask, answer_tokens, answer_mask)
    fmt = jax.jit(functools.partial(format_tokens, tok=TOK))(tokens, mask)
    return np.asarray(corr)[:, 0], np.asarray(fmt)[:, 0]


def host_rewards(tokens, mask, answers, prompts=None):
    texts, terminated = decode_completions(TOK, tokens, mask)
    prompts = prompts or ["1+1="] * len(texts)
    corr = correctness_reward(prompts, texts, answer=list(answers), terminated=terminated)
    fmt = format_reward(prompts, texts, answer=list(answers), terminated=terminated)
    return np.array(corr, np.float32), np.array(fmt, np.float32)


def test_hand_cases_host_and_tokens_agree():
    tokens = np.array([c[0] for c in HAND_CASES], np.int32)
    # Rollout convention: mask 1 up to and including the first EOS.
    mask = (np.cumsum(np.cumsum(tokens == E, axis=1), axis=1) <= 1).astype(np.float32)
    answers = [c[1] for c in HAND_CASES]
    want_corr, want_fmt = [c[2] for c in HAND_CASES], [c[3] for c in HAND_CASES]
    for corr, fmt in [token_rewards(tokens, mask, answers), host_rewards(tokens, mask, answers)]:
        np.testing.assert_array_equal(corr, want_corr)
        np.testing.assert_array_equal(fmt, want_fmt)
        assert corr.dtype == np.float32


def test_token_rewards_shapes_and_masked_positions():
    # B=2 problems, K=2 completions each; answers have T_a=3 while T=4.
    tokens = np.array([[[4, E, 0, 0], [4, 4, 4, 4]], [[6, 0, 9, E], [6, 9, E, 0]]], np.int32)
    mask = np.array([[[1, 1, 0, 0], [1, 1, 1, 1]], [[1, 0, 1, 1], [1, 1, 0, 0]]], np.float32)
    answer_tokens, answer_mask = encode_answers(TOK, [2, 47], 3)
    corr = correctness_tokens(tokens, mask, answer_tokens, answer_mask)
    # [1, 1] is "47" whose EOS is masked: correct text, but not terminated.
    np.testing.assert_array_equal(corr, [[1, 0], [1, 1]])
    np.testing.assert_array_equal(format_tokens(tokens, mask, TOK), [[1, 0], [1, 0]])
    assert corr.shape == (2, 2) and corr.dtype == np.float32


def test_correctness_reward_none_for_unparsable_prompt():
    got = correctness_reward(["47*8=", "what?", "47*8="], ["376", "376", "0376"], answer=[376] * 3)
    assert got == [1.0, None, 0.0]
    assert correctness_reward(["1+1="], [" 2"], answer=[2]) == [0.0]
    assert format_reward(["x"], ["12"], terminated=[True]) == [1.0]
    assert format_reward(["x"], ["+12"], terminated=[True]) == [0.0]


def test_random_tokens_host_and_tokens_agree():
    rng = np.random.default_rng(0)
    n, t = 500, 6
    answers = rng.integers(-999, 100_000, n)
    # Mostly digits, EOS and minus so that well-formed completions are common.
    probs = np.ones(TOK.vocab_size)
    probs[[E, MINUS]], probs[2:12] = 4.0, 6.0
    tokens = rng.choice(TOK.vocab_size, size=(n, t), p=probs / probs.sum()).astype(np.int32)
    for i in np.flatnonzero(rng.random(n) < 0.4):  # plant the correct answer
        ids = list(TOK.encode(str(answers[i]))) + [E]
        tokens[i, : min(len(ids), t)] = ids[:t]
    mask = (np.cumsum(np.cumsum(tokens == E, axis=1), axis=1) <= 1).astype(np.float32)
    random_rows = rng.random(n) < 0.3  # arbitrary masks: masked positions count as PAD
    mask[random_rows] = rng.random((random_rows.sum(), t)) < 0.8
    host = host_rewards(tokens, mask, answers)
    twin = token_rewards(tokens, mask, answers)
    np.testing.assert_array_equal(host[0], twin[0])
    np.testing.assert_array_equal(host[1], twin[1])
    # The comparison is only meaningful if both verdicts occur often.
    assert 100 < host[0].sum() < 400 and 100 < host[1].sum() < 400


def test_python_reward_of_answers_past_int32_through_the_task():
    # 99999*99999 = 9,999,800,001 and 46341*46341 = 2,147,488,281 do not fit an int32 (a device
    # int wrapped them and the Python reward scored these exact answers 0)
    from grpo_jax.tasks.arithmetic import encode_set, make_decode, prompts_of

    problem_set = Problems(("99999*99999=", "46341*46341=", "7-11="), (9999800001, 2147488281, -4))
    data = encode_set(TOK, problem_set, 12, 11)
    tokens, mask = data.answers[:, None, :], data.answer_mask[:, None, :]
    prompt_texts, texts, fields = make_decode(TOK)(prompts_of(data, np.arange(3)), tokens, mask)
    assert prompt_texts == list(problem_set.prompts)
    assert texts == ["9999800001", "2147488281", "-4"]
    assert fields["answer"] == [9999800001, 2147488281, -4]
    assert correctness_reward(prompt_texts, texts, **fields) == [1.0, 1.0, 1.0]


# ---------------------------------------------------------------- pass@k


def test_pass_at_k_golden():
    assert pass_at_k(np.array([1]), 2, 1) == 0.5
    assert pass_at_k(np.array([2]), 5, 2) == pytest.approx(1 - 3 / 10)
    assert pass_at_k(np.array([0, 2, 5]), 5, 2) == pytest.approx((0 + 0.7 + 1) / 3)
    assert pass_at_k(np.array([4]), 5, 2) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(np.array([6]), 5, 2)
    with pytest.raises(ValueError):
        pass_at_k(np.array([1]), 5, 6)


def test_pass_at_k_matches_enumeration():
    for n in range(1, 7):
        for k in range(1, n + 1):
            for c in range(n + 1):
                samples = [True] * c + [False] * (n - c)
                subsets = list(itertools.combinations(samples, k))
                brute = sum(any(s) for s in subsets) / len(subsets)
                assert pass_at_k(np.array([c]), n, k) == pytest.approx(brute, abs=1e-12)
    assert math.isclose(pass_at_k(np.array([0, 3]), 6, 2), (0 + 1 - 3 / 15) / 2)
