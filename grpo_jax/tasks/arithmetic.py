"""Arithmetic with a verifiable reward: the worked example of a task plug-in.

A prompt is a problem such as "47*8=" or "381+920="; the policy completes it with the answer
in canonical decimal form followed by EOS ("376<EOS>"). Text is tokenized char by char
(grpo_jax.tokenizer.CharTokenizer: PAD, EOS, then the chars); prompts are left-padded so the
last prompt position is the decision point, and completions stop at EOS inside the jitted
sampler (``data.max_completion_length`` tokens at most).

The file has three parts, which is all a task needs:
  1. data: ``generate_problems`` draws distinct problems from ``data.problem_seed`` and
     splits them, so the train and held-out sets are disjoint by construction;
  2. rewards: checked, not learned. ``correctness_reward`` (1.0 when the text before EOS is
     exactly str(answer), else 0.0; None for a prompt that is not a problem) and
     ``format_reward`` are plain Python on decoded strings, the way researchers write them;
     ``correctness_tokens`` / ``format_tokens`` are their jittable twins with the same
     verdicts (``reward.python=False``: nothing leaves the device);
  3. ``build(config, mode)``: validates the task's settings, builds the model, the prompt
     sampler, the reward terms and the held-out evaluation (greedy exact match, unbiased
     pass@k from sampled answers, lengths), and hands them to the engine. ``--mode=pretrain``
     is the supervised warm-up (answer then EOS) that ``pretrain.before_train`` runs first.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import candidates, engine, pretrain, rewards, sharding
from grpo_jax.evaluate import pass_at_k
from grpo_jax.model import init_params, make_model
from grpo_jax.policy import TokenPrompts, policy_reference, sample, transformer_policy
from grpo_jax.rewards import RewardTerm
from grpo_jax.rollout import SamplingParams, Stop
from grpo_jax.specs import EngineSpec, ModelSpec, OptimSpec, boolean, choice, integer, require
from grpo_jax.task import Task
from grpo_jax.tokenizer import EOS_ID, PAD_ID, CharTokenizer
from grpo_jax.train_state import StepInputs, init_state, make_optimizer

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

    Positions with completion_mask 0 count as PAD, exactly as in the token rewards.
    """
    ids = np.where(np.asarray(completion_mask) > 0, np.asarray(tokens), PAD_ID)
    ids = ids.reshape(-1, ids.shape[-1])
    return [tok.decode_completion(row) for row in ids], [bool((row == EOS_ID).any()) for row in ids]


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
    the host's string comparison without a data-dependent gather.
    """
    tokens = jnp.asarray(tokens)
    live = jnp.asarray(completion_mask) > 0
    is_eos = live & (tokens == EOS_ID)
    before_eos = jnp.cumsum(is_eos, axis=-1) == 0
    keep = live & before_eos & (tokens != PAD_ID)
    rank = jnp.cumsum(keep, axis=-1) - 1
    return keep, rank, jnp.any(is_eos, axis=-1)


def correctness_tokens(tokens, completion_mask, answer_tokens, answer_mask) -> jax.Array:
    """[B, K] float32: 1 where completion k's text equals answer b's chars exactly.

    tokens/completion_mask are [B, K, T]; answer_tokens/answer_mask are encode_answers'
    [B, T_a] (chars, EOS, PAD); T_a may differ from T.
    """
    tokens = jnp.asarray(tokens)
    answer_tokens = jnp.asarray(answer_tokens)
    keep, rank, _ = _completion_chars(tokens, completion_mask)
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
    return (same & (jnp.sum(keep, axis=-1) == answer_len)).astype(jnp.float32)


def format_tokens(tokens, completion_mask, tok: CharTokenizer) -> jax.Array:
    """[B, K] float32: 1 where the completion is -?[0-9]+ and ended with EOS."""
    tokens = jnp.asarray(tokens)
    keep, rank, terminated = _completion_chars(tokens, completion_mask)
    digit_ids = jnp.array([tok._ids[c] for c in "0123456789" if c in tok._ids], jnp.int32)
    is_digit = jnp.any(tokens[..., None] == digit_ids, axis=-1)
    # A tokenizer without "-" gets id -1, which no token has.
    is_minus = (tokens == tok._ids.get("-", -1)) & (rank == 0)
    well_formed = jnp.all(~keep | is_digit | is_minus, axis=-1)
    has_digit = jnp.any(keep & is_digit, axis=-1)
    return (terminated & well_formed & has_digit).astype(jnp.float32)


# --- the task, wired into the engine ----------------------------------------------------------

REWARD_TERMS = ("correct", "format")


class Data(NamedTuple):
    """A problem set as device arrays (the step samples prompts from it on device)."""

    prompts: jax.Array  # [N, P] int32, left-padded
    prompt_mask: jax.Array  # [N, P] float32
    answers: jax.Array  # [N, T] int32: answer chars, EOS, PAD
    answer_mask: jax.Array  # [N, T] float32
    values: jax.Array  # [N] int32: the answers as numbers (for Python rewards)


def validate(config) -> tuple[ProblemSpec, int, int]:
    """The task's settings; returns (problem spec, prompt length, completion length)."""
    d = config.data
    spec = ProblemSpec(
        integer("data.max_digits", d.max_digits, 1),
        choice("data.ops", d.ops, ("+", "-", "*", "+-", "+*", "-*", "+-*")),
        integer("data.mul_max_digits", d.mul_max_digits, 1) if d.mul_max_digits else None,
    )
    p, t = max_prompt_len(spec), integer("data.max_completion_length", d.max_completion_length, 1)
    need = max_answer_len(spec) + 1
    fits = f"must be >= {need}: answers need up to {need - 1} chars plus EOS"
    require(t >= need, "data.max_completion_length", t, fits)
    window = integer("model.max_len", config.model.max_len) or p + t
    require(
        p + t <= window,
        "model.max_len",
        window,
        f"must hold prompts of up to {p} tokens plus {t} completion tokens; raise model.max_len",
    )
    rewards.parse_terms(config.reward.terms, REWARD_TERMS)
    boolean("reward.python", config.reward.python)
    integer("data.problem_seed", d.problem_seed)
    integer("data.num_train", d.num_train, 1)
    integer("data.num_heldout", d.num_heldout, 1)
    ModelSpec.from_config(config.model)
    return spec, p, t


def encode_set(tok, problems: Problems, prompt_len: int, completion_len: int) -> Data:
    prompts, pmask = encode_prompts(tok, problems.prompts, prompt_len)
    answers, amask = encode_answers(tok, problems.answers, completion_len)
    values = np.asarray(problems.answers, np.int64).astype(np.int32)
    return Data(*map(jnp.asarray, (prompts, pmask, answers, amask, values)))


def prompts_of(data: Data, idx) -> TokenPrompts:
    fields = {"answer": data.answers[idx], "answer_mask": data.answer_mask[idx]}
    fields["value"] = data.values[idx]
    return TokenPrompts(data.prompts[idx], data.prompt_mask[idx], fields)


def reward_terms(config, tok):
    """``reward.terms`` as RewardTerm s: Python on decoded text (``reward.python``) or their
    jittable twins (same verdicts, nothing leaves the device)."""
    host = bool(config.reward.python)

    def correct(state, prompts, tokens, mask, ref):
        f = prompts.fields
        return correctness_tokens(tokens, mask, f["answer"], f["answer_mask"])

    def well_formed(state, prompts, tokens, mask, ref):
        return format_tokens(tokens, mask, tok)

    python = {"correct": correctness_reward, "format": format_reward}
    jitted = {"correct": correct, "format": well_formed}
    table = python if host else jitted
    return tuple(
        RewardTerm(name, w, table[name], host)
        for name, w in rewards.parse_terms(config.reward.terms, REWARD_TERMS)
    )


def make_decode(tok):
    """The host side of Python rewards: texts and fields of every completion, prompt-major."""

    def decode(prompts, tokens, mask):
        b, k, t = tokens.shape
        texts, terminated = decode_completions(tok, tokens.reshape(b * k, t), mask.reshape(-1, t))
        prompt_texts = [tok.decode(p) for p in np.asarray(prompts.tokens) for _ in range(k)]
        answers = [int(a) for a in np.asarray(prompts.fields["value"]) for _ in range(k)]
        return prompt_texts, texts, {"answer": answers, "terminated": terminated}

    return decode


def make_evaluate(config, tok, policy_for, heldout: Data, pass_k):
    """Held-out: greedy exact match, sampled pass@k (unbiased, n = max k samples), lengths."""
    n_samples = max(pass_k)
    n = heldout.prompts.shape[0]
    greedy_sp = SamplingParams(1.0, 1, 1.0)
    sp = SamplingParams(float(config.eval.temperature), 0, 1.0)
    greedy, sampled = policy_for(greedy_sp), policy_for(sp)
    t = greedy.completion_length

    @jax.jit
    def core(params):
        prompts = prompts_of(heldout, jnp.arange(n))
        f = prompts.fields
        zeros = jnp.zeros((n, 1, t))
        tok_g, mask_g = sample(greedy, params, prompts, zeros, greedy_sp)
        u = jax.random.uniform(jax.random.PRNGKey(int(config.eval.seed)), (n, n_samples, t))
        tok_s, mask_s = sample(sampled, params, prompts, u, sp)
        return {
            "greedy_ok": correctness_tokens(tok_g, mask_g, f["answer"], f["answer_mask"])[:, 0],
            "greedy_len": mask_g.sum(-1)[:, 0],
            "greedy": tok_g[:, 0],
            "sampled_ok": correctness_tokens(tok_s, mask_s, f["answer"], f["answer_mask"]),
            "sampled_len": mask_s.sum(-1),
        }

    def evaluate(params):
        res = jax.device_get(core(params))
        num_correct = res["sampled_ok"].sum(1)
        scalars = {
            "eval/accuracy": float(res["greedy_ok"].mean()),
            "eval/mean_length": float(res["greedy_len"].mean()),
            "eval/sampled_mean_length": float(res["sampled_len"].mean()),
        }
        for k in pass_k:
            scalars[f"eval/pass_at_{k}"] = pass_at_k(num_correct, n_samples, k)
        lines = [
            f"{tok.decode(heldout.prompts[i])}{tok.decode_completion(res['greedy'][i])}"
            f"  ({'ok' if res['greedy_ok'][i] else 'wrong'})"
            for i in range(min(int(config.eval.num_samples), n))
        ]
        return scalars, {"samples": "\n".join(lines), "summary": ""}

    return evaluate


def build(config, mode: str = "train", workdir=None) -> Task:  # keeps nothing in workdir
    if mode == "train_judge":
        raise ValueError("task=arithmetic has no judge; --mode=train_judge is for task=fill_in")
    spec, p, t = validate(config)
    pretraining = mode == "pretrain"
    espec = None if pretraining else EngineSpec.from_config(config)
    tok = CharTokenizer()
    classes = None
    if espec is not None:
        espec.group.check_vocab(tok.vocab_size)
        require(
            espec.group.value_horizon == 0,
            "group.value_horizon",
            espec.group.value_horizon,
            "must be 0 for task=arithmetic: its reward scores the whole answer, up to EOS",
        )
        classes = candidates.task_classes(
            espec.group, [tok.decode([i]) for i in range(tok.vocab_size)]
        )
    d = config.data
    train_set, heldout = generate_problems(
        int(d.problem_seed), int(d.num_train), int(d.num_heldout), spec
    )  # fmt: skip
    train, held = encode_set(tok, train_set, p, t), encode_set(tok, heldout, p, t)
    model = make_model(ModelSpec.from_config(config.model), tok.vocab_size, p + t)
    stop = Stop(tok.eos_id, tok.pad_id)

    def policy_for(sp):
        return transformer_policy(model, sp, t, stop)

    pass_k = tuple(int(k) for k in config.eval.pass_k)  # >= 1: run_spec.ReportSpec
    evaluate = make_evaluate(config, tok, policy_for, held, pass_k)
    block = config.pretrain if pretraining else config.train
    optim = OptimSpec.from_config(
        config.optim,
        config.pretrain.learning_rate if pretraining else None,
        "pretrain.learning_rate" if pretraining else "optim.learning_rate",
    )
    mu = 1 if pretraining else espec.objective.num_iterations
    tx, schedule = make_optimizer(optim, block.num_steps, updates_per_step=mu)
    b = int(block.batch_size)  # >= 1: run_spec.RunSpec
    num_train = train.prompts.shape[0]

    def sample_prompts(key, data: Data):
        return prompts_of(data, jax.random.randint(key, (b,), 0, num_train))

    def build_step(initial_params, mesh=None):
        if pretraining:

            def batch(key, data):
                prompts = sample_prompts(key, data)
                return prompts, prompts.fields["answer"], prompts.fields["answer_mask"]

            policy = policy_for(SamplingParams())
            return pretrain.make_completion_sft_step(policy, tx, schedule, batch), StepInputs(
                train, None
            )
        policy = policy_for(espec.group.sampling)
        use_ref = espec.objective.beta > 0
        hooks = sharding.step_hooks(mesh)
        step = engine.make_grpo_step(
            espec, policy, policy_reference(policy) if use_ref else None, sample_prompts,
            reward_terms(config, tok), tx, schedule, eos_id=tok.eos_id, decode=make_decode(tok),
            member_map=hooks.member_map, shard_batch=hooks.shard_batch, token_classes=classes,
        )  # fmt: skip
        ref_state = jax.tree.map(jnp.copy, initial_params) if use_ref else None
        return step, StepInputs(train, ref_state)

    if pretraining:
        tokens = b * t
    else:
        tokens = b * engine.groups.generated_per_prompt(espec.group, tok.vocab_size, b, t, classes)
    return Task(
        init_params=lambda key: init_params(model, key),
        make_state=lambda params: init_state(params, tx, config.seed),
        build=build_step,
        evaluate=evaluate,
        tokens_per_step=int(tokens),
        num_steps=int(block.num_steps),
        vocab=tok,
        log_keys=("loss", "reward", "completions/mean_length", "eval/accuracy"),
        heldout_key="eval/accuracy",
    )
