"""Arithmetic with a verifiable reward: the worked example of a task plug-in.

A prompt is a problem such as "47*8=" or "381+920="; the policy completes it with the answer
in canonical decimal form followed by EOS ("376<EOS>"). Text is tokenized char by char
(grpo_jax.tokenizer.CharTokenizer: PAD, EOS, then the chars); prompts are left-padded so the
last prompt position is the decision point, and completions stop at EOS inside the jitted
sampler (``data.max_completion_length`` tokens at most).

A task needs three parts:
  1. data and 2. rewards, which know nothing of models or the engine, live in
     grpo_jax/tasks/arithmetic_problems.py: distinct train and held-out problems from
     ``data.problem_seed``, their encoding, and the checked (not learned) rewards, in Python
     on decoded strings and as jittable twins with the same verdicts;
  3. ``build(config, mode)`` here: validates the task's settings, builds the model, the prompt
     sampler, the reward terms and the held-out evaluation (greedy exact match, unbiased
     pass@k from sampled answers, lengths), and hands them to the engine. ``--mode=pretrain``
     is the supervised warm-up (answer then EOS) that ``pretrain.before_train`` runs first.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import candidates, engine, groups, pretrain, rewards, sharding
from grpo_jax.evaluate import pass_at_k
from grpo_jax.model import init_params, make_model
from grpo_jax.policy import TokenPrompts, policy_reference, sample, transformer_policy
from grpo_jax.rewards import RewardTerm
from grpo_jax.rollout import SamplingParams, Stop
from grpo_jax.specs import EngineSpec, ModelSpec, OptimSpec
from grpo_jax.task import Task
from grpo_jax.tasks import arithmetic_problems as problems
from grpo_jax.tokenizer import CharTokenizer
from grpo_jax.train_state import StepInputs, init_state, make_optimizer
from grpo_jax.validate import boolean, choice, integer, require

REWARD_TERMS = ("correct", "format")


class Data(NamedTuple):
    """A problem set as device arrays (the step samples prompts from it on device)."""

    prompts: jax.Array  # [N, P] int32, left-padded
    prompt_mask: jax.Array  # [N, P] float32
    answers: jax.Array  # [N, T] int32: answer chars, EOS, PAD
    answer_mask: jax.Array  # [N, T] float32


def validate(config) -> tuple[problems.ProblemSpec, int, int, int]:
    """The task's settings; returns (problem spec, prompt length, completion length, the
    model's positional window: model.max_len, or prompt plus completion length when 0)."""
    d = config.data
    spec = problems.ProblemSpec(
        integer("data.max_digits", d.max_digits, 1),
        choice("data.ops", d.ops, ("+", "-", "*", "+-", "+*", "-*", "+-*")),
        integer("data.mul_max_digits", d.mul_max_digits, 1) if d.mul_max_digits else None,
    )
    p = problems.max_prompt_len(spec)
    t = integer("data.max_completion_length", d.max_completion_length, 1)
    need = problems.max_answer_len(spec) + 1
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
    return spec, p, t, window


def encode_set(tok, problem_set: problems.Problems, prompt_len: int, completion_len: int) -> Data:
    prompts, pmask = problems.encode_prompts(tok, problem_set.prompts, prompt_len)
    answers, amask = problems.encode_answers(tok, problem_set.answers, completion_len)
    return Data(*map(jnp.asarray, (prompts, pmask, answers, amask)))


def prompts_of(data: Data, idx) -> TokenPrompts:
    fields = {"answer": data.answers[idx], "answer_mask": data.answer_mask[idx]}
    return TokenPrompts(data.prompts[idx], data.prompt_mask[idx], fields)


def reward_terms(config, tok):
    """``reward.terms`` as RewardTerm s: Python on decoded text (``reward.python``) or their
    jittable twins (same verdicts, nothing leaves the device)."""
    host = bool(config.reward.python)

    def correct(state, prompts, tokens, mask, ref):
        f = prompts.fields
        return problems.correctness_tokens(tokens, mask, f["answer"], f["answer_mask"])

    def well_formed(state, prompts, tokens, mask, ref):
        return problems.format_tokens(tokens, mask, tok)

    python = {"correct": problems.correctness_reward, "format": problems.format_reward}
    jitted = {"correct": correct, "format": well_formed}
    table = python if host else jitted
    return tuple(
        RewardTerm(name, w, table[name], host)
        for name, w in rewards.parse_terms(config.reward.terms, REWARD_TERMS)
    )


def make_decode(tok):
    """The host side of Python rewards: texts and fields of every completion, prompt-major.

    The answers are computed from the prompts' text: a device int32 would wrap for answers of
    10 digits (9-digit operands are valid), and the rewards would then mark them wrong."""

    def decode(prompts, tokens, mask):
        b, k, t = tokens.shape
        texts, terminated = problems.decode_completions(
            tok, tokens.reshape(b * k, t), mask.reshape(-1, t)
        )
        per_prompt = [tok.decode(p) for p in np.asarray(prompts.tokens)]
        answers = [problems.parse_problem(text) for text in per_prompt]
        repeat = lambda xs: [x for x in xs for _ in range(k)]  # prompt-major, k per prompt
        return repeat(per_prompt), texts, {"answer": repeat(answers), "terminated": terminated}

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
        answer = (prompts.fields["answer"], prompts.fields["answer_mask"])
        zeros = jnp.zeros((n, 1, t))
        tok_g, mask_g = sample(greedy, params, prompts, zeros, greedy_sp)
        u = jax.random.uniform(jax.random.PRNGKey(int(config.eval.seed)), (n, n_samples, t))
        tok_s, mask_s = sample(sampled, params, prompts, u, sp)
        return {
            "greedy_ok": problems.correctness_tokens(tok_g, mask_g, *answer)[:, 0],
            "greedy_len": mask_g.sum(-1)[:, 0],
            "greedy": tok_g[:, 0],
            "sampled_ok": problems.correctness_tokens(tok_s, mask_s, *answer),
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


def token_classes(espec: EngineSpec, tok: CharTokenizer):
    """The group's checks against this task, then its token classes (None: no classes)."""
    espec.group.check_vocab(tok.vocab_size)
    require(
        espec.group.value_horizon == 0,
        "group.value_horizon",
        espec.group.value_horizon,
        "must be 0 for task=arithmetic: its reward scores the whole answer, up to EOS",
    )
    return candidates.task_classes(espec.group, [tok.decode([i]) for i in range(tok.vocab_size)])


def problem_sets(d, spec: problems.ProblemSpec, tok: CharTokenizer, p: int, t: int):
    """(train, held-out) Data for prompts of ``p`` and completions of ``t`` tokens, drawn from
    ``data.problem_seed`` (disjoint by construction)."""
    train_set, heldout = problems.generate_problems(
        int(d.problem_seed), int(d.num_train), int(d.num_heldout), spec
    )
    return tuple(encode_set(tok, s, p, t) for s in (train_set, heldout))


def optimizer(config, espec: EngineSpec | None, num_steps):
    """(tx, schedule) of the warm-up (``espec`` None) or of GRPO, whose steps make
    ``grpo.num_iterations`` updates each: the schedule spans them all."""
    pretraining = espec is None
    optim = OptimSpec.from_config(
        config.optim,
        config.pretrain.learning_rate if pretraining else None,
        "pretrain.learning_rate" if pretraining else "optim.learning_rate",
    )
    mu = 1 if pretraining else espec.objective.num_iterations
    return make_optimizer(optim, num_steps, updates_per_step=mu)


def make_build_step(config, espec, tok, policy_for, opt, train: Data, b: int, classes):
    """The Task's ``build(initial_params, mesh)``: the warm-up's supervised step (``espec``
    None) or the GRPO step, each sampling ``b`` train problems per step."""
    tx, schedule = opt
    num_train = train.prompts.shape[0]

    def sample_prompts(key, data: Data):
        return prompts_of(data, jax.random.randint(key, (b,), 0, num_train))

    def sft_batch(key, data):
        prompts = sample_prompts(key, data)
        return prompts, prompts.fields["answer"], prompts.fields["answer_mask"]

    def build_step(initial_params, mesh=None):
        if espec is None:
            policy = policy_for(SamplingParams())
            step = pretrain.make_completion_sft_step(
                policy, tx, schedule, sft_batch, sharding.step_hooks(mesh).shard_batch
            )
            return step, StepInputs(train, None)
        sp = espec.group.sampling
        policy = policy_for(sp)
        ref = policy_reference(policy, sp.temperature) if espec.objective.beta > 0 else None
        step = engine.make_grpo_step(
            espec, policy, ref, sample_prompts,
            reward_terms(config, tok), tx, schedule, eos_id=tok.eos_id, decode=make_decode(tok),
            hooks=sharding.step_hooks(mesh, config), token_classes=classes,
        )  # fmt: skip
        ref_state = None if ref is None else jax.tree.map(jnp.copy, initial_params)
        return step, StepInputs(train, ref_state)

    return build_step


def build(config, mode: str = "train", workdir=None) -> Task:  # keeps nothing in workdir
    if mode == "train_judge":
        raise ValueError("task=arithmetic has no judge; --mode=train_judge is for task=fill_in")
    spec, p, t, window = validate(config)
    pretraining = mode == "pretrain"
    espec = None if pretraining else EngineSpec.from_config(config)
    tok = CharTokenizer()
    classes = None if espec is None else token_classes(espec, tok)
    train, held = problem_sets(config.data, spec, tok, p, t)
    model = make_model(ModelSpec.from_config(config.model), tok.vocab_size, window)
    stop = Stop(tok.eos_id, tok.pad_id)

    def policy_for(sp):
        return transformer_policy(model, sp, t, stop)

    pass_k = tuple(int(k) for k in config.eval.pass_k)  # >= 1: run_spec.ReportSpec
    evaluate = make_evaluate(config, tok, policy_for, held, pass_k)
    block = config.pretrain if pretraining else config.train
    tx, schedule = optimizer(config, espec, block.num_steps)
    b = int(block.batch_size)  # >= 1: run_spec.RunSpec
    if pretraining:
        tokens = b * t
    else:
        tokens = b * groups.generated_per_prompt(espec.group, tok.vocab_size, b, t, classes)
    return Task(
        init_params=lambda key: init_params(model, key),
        make_state=lambda params: init_state(params, tx, config.seed),
        build=make_build_step(config, espec, tok, policy_for, (tx, schedule), train, b, classes),
        evaluate=evaluate,
        tokens_per_step=int(tokens),
        num_steps=int(block.num_steps),
        vocab=tok,
        log_keys=("loss", "reward", "completions/mean_length", "eval/accuracy"),
        heldout_key="eval/accuracy",
        batch_setting="pretrain.batch_size" if pretraining else "train.batch_size",
    )
