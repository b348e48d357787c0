"""Single-step fill-in on tiny Shakespeare, rewarded by a frozen judge, as a Task.

A train window of ``data.window_len`` chars gets one masked span (length uniform in
[data.span_min, data.span_max]); the masked positions hold the mask token
``data.mask_char``, added to the vocabulary (id V). A bidirectional generator (encoder.py,
head="tokens") reads the masked window and outputs a distribution over the V real chars at
every position; a group member fills *all* masked positions in one step by sampling them.
The reward is the frozen judge's window logit of the filled window (``judge.reward=logit``)
or its sigmoid, the probability that the window is real (``prob``); nothing else (never the
original text). The KL is exact, per masked position, to the frozen reference generator (the
initial generator: ``init_from`` or a fresh init). The step is the one engine's
(grpo_jax/single_step.py adapts the generator: a member's completion is its span's chars), so
metric names match the other tasks'; the zero-weight term ``fill_accuracy`` logs the share of
sampled chars equal to the original as ``rewards/fill_accuracy/mean``.

Modes: ``train_judge`` trains the judge (judge.py) in its own workdir, its "generator"
negatives sampled by the frozen supervised generator of ``judge.negatives_from`` (a
``pretrain`` workdir; required exactly when ``judge.corruptions`` names "generator");
``pretrain`` trains the generator supervised (cross-entropy of the original chars at the
masked positions), the usual ``init_from`` of a GRPO run and then its frozen reference;
``train`` loads the judge from ``judge.checkpoint`` and runs GRPO; ``eval`` evaluates the
latest generator checkpoint.

Held-out metrics (fixed val windows and spans) and the exact single-char optimum of the
objective, a diagnostic for experiments: grpo_jax/tasks/fill_in_eval.py.
"""

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from grpo_jax import checkpoint as ckpt_lib
from grpo_jax import data as data_lib
from grpo_jax import groups, integrity, sharding, single_step
from grpo_jax import judge as judge_lib
from grpo_jax.encoder import Encoder
from grpo_jax.rewards import RewardTerm
from grpo_jax.specs import EngineSpec, OptimSpec
from grpo_jax.task import Task
from grpo_jax.tasks import fill_in_eval
from grpo_jax.train_state import TrainState, init_state, make_optimizer, supervised_update
from grpo_jax.validate import integer, number, require

MODES = ("train", "eval", "train_judge", "pretrain")
JUDGE_REWARDS = ("prob", "logit")


def validate(config, mode: str):
    d = config.data
    if mode not in MODES:
        raise ValueError(f"task=fill_in has no --mode={mode}; choose from {', '.join(MODES)}")
    if not 1 <= d.span_min <= d.span_max <= d.window_len:
        raise ValueError(
            f"need 1 <= data.span_min ({d.span_min}) <= data.span_max ({d.span_max}) "
            f"<= data.window_len ({d.window_len})"
        )
    j = config.judge
    kinds = judge_lib.parse_corruptions(
        j.corruptions, j.negatives_from if mode == "train_judge" else None
    )
    if not j.negatives_temperature > 0:
        raise ValueError(f"judge.negatives_temperature={j.negatives_temperature} must be > 0")
    if config.judge.reward not in JUDGE_REWARDS:
        raise ValueError(f"judge.reward={config.judge.reward!r} is unknown; choose {JUDGE_REWARDS}")
    integer("data.window_len", d.window_len, 1)
    _check_models(config)
    espec = None
    if mode not in ("train_judge", "pretrain"):
        espec = EngineSpec.from_config(config)
    return kinds, espec


def _check_models(config) -> None:
    """The generator's and the judge's shapes (encoder.py, judge.py); the judge's run sizes."""
    for block in ("model", "judge"):
        b = config[block]
        integer(f"{block}.num_layers", b.num_layers, 1)
        heads = integer(f"{block}.num_heads", b.num_heads, 1)
        width = integer(f"{block}.d_model", b.d_model, 1)
        require(
            width % heads == 0,
            f"{block}.d_model",
            width,
            f"must be divisible by {block}.num_heads={heads}",
        )
    integer("model.mlp_ratio", config.model.mlp_ratio, 1)
    j = config.judge
    integer("judge.batch_size", j.batch_size, 1)
    integer("judge.num_steps", j.num_steps)
    number("judge.learning_rate", j.learning_rate, 0.0, open_low=True)


def mask_token(config, vocab: data_lib.Vocab) -> int:
    """The mask token's id (V, appended to the vocabulary); a one-line error without one."""
    ch = config.data.mask_char
    if not ch:
        raise ValueError(
            "data.mask_char is empty: the fill-in data has no mask token; set it to one "
            "character the corpus lacks, e.g. --config.data.mask_char='█'"
        )
    if len(ch) != 1 or ch in vocab.chars:
        raise ValueError(
            f"data.mask_char={ch!r} must be one character that the corpus lacks (the mask "
            "token is added to the vocabulary)"
        )
    return vocab.size


class Setup(NamedTuple):
    """What every mode builds first, from the corpus (a bad mask token fails before models)."""

    corpus: data_lib.Corpus
    v: int  # the corpus's chars: the generator's outputs, the judge's inputs
    mask_id: int
    vocab: data_lib.Vocab  # the chars then the mask token (decode only)
    train_tokens: jax.Array
    val_windows: np.ndarray  # [N, data.window_len]: the held-out windows
    judge_model: Encoder
    judge_reward: Callable  # make_judge_reward's: (judge params, windows [N, L]) -> [N]
    generator: Encoder

    def masked_input(self, windows, span):
        """(windows [B, L], span [B, L]) -> the windows with the mask token where span > 0."""
        return jnp.where(span > 0, self.mask_id, windows).astype(jnp.int32)


def load_setup(config) -> Setup:
    """The corpus (and its mask token, checked), the held-out windows and both models."""
    corpus = data_lib.load_corpus(config.data)
    v = corpus.vocab.size
    mask_id = mask_token(config, corpus.vocab)
    vocab = data_lib.Vocab(corpus.vocab.chars + config.data.mask_char)
    length = config.data.window_len
    val_windows = fill_in_eval.heldout_windows(corpus, config.eval.num_windows, length)
    judge_model = judge_lib.make_judge_model(config.judge, v, length)
    judge_reward = make_judge_reward(judge_model, config.judge.reward)
    generator = make_generator(config, v)
    train_tokens = jnp.asarray(corpus.train)
    return Setup(
        corpus, v, mask_id, vocab, train_tokens, val_windows, judge_model, judge_reward, generator
    )


def build(config, mode: str = "train", workdir=None) -> Task:  # keeps nothing in workdir
    kinds, espec = validate(config, mode)
    s = load_setup(config)
    if espec is not None:  # group sizes against the vocabulary, known once it is loaded
        espec.group.check_vocab(s.v)
    if mode == "train_judge":
        return judge_task(config, s, kinds)
    # eval: judge metrics when one is given
    use_judge = mode == "train" or (mode == "eval" and bool(config.judge.checkpoint))
    judge_params = judge_lib.load_judge(config, s.judge_model, s.vocab) if use_judge else None
    evaluate = fill_in_eval.make_evaluate(
        config, s.generator, s.masked_input, s.judge_reward, judge_params, s.val_windows, s.vocab
    )
    if mode == "pretrain":
        return pretrain_task(config, s, evaluate)
    return grpo_task(config, espec, s, judge_params, evaluate)


def make_task(config, s: Setup, tx, **fields) -> Task:
    """A Task on this corpus whose state steps with the optimizer ``tx``."""
    return Task(
        make_state=lambda params: init_state(params, tx, config.seed),
        vocab=s.vocab,
        data_sha256=s.corpus.sha256,
        **fields,
    )


def init_fn(model, length: int):
    """key -> fresh params of ``model`` (the generator or the judge: both read windows)."""
    return lambda key: model.init(key, jnp.zeros((1, length), jnp.int32))["params"]


def judge_task(config, s: Setup, kinds) -> Task:
    """--mode=train_judge: the judge, real train windows against ``judge.corruptions``."""
    j, length = config.judge, config.data.window_len
    log_uni = judge_lib.log_unigram_of(s.corpus.train, s.v)
    log_bi = judge_lib.log_bigram_of(s.corpus.train, s.v)
    tx, schedule = make_optimizer(
        OptimSpec.from_config(config.optim, j.learning_rate, "judge.learning_rate"),
        j.num_steps,
    )
    gen_params, gen_fill = None, None
    if "generator" in kinds:  # negatives sampled by a frozen supervised generator
        template = init_fn(s.generator, length)(jax.random.PRNGKey(0))
        gen_params = load_generator(j.negatives_from, template, s.vocab)
        temp = float(j.negatives_temperature)

        def gen_fill(key, params, windows, span):
            return judge_lib.generator_fill(
                key, s.generator, params, windows, span, s.mask_id, temp
            )

    cdata = judge_lib.CorruptionData(s.train_tokens, log_uni, log_bi, gen_params)

    def build_judge(initial_params, mesh=None):
        step = judge_lib.make_judge_step(
            config, s.judge_model, tx, schedule, kinds, s.v, gen_fill,
            sharding.step_hooks(mesh).shard_batch,
        )  # fmt: skip
        return step, cdata

    evaluate = judge_lib.make_judge_eval(
        config, s.judge_model, s.val_windows, cdata, kinds, int(config.eval.seed), gen_fill
    )  # eval.seed: every judge trained on any seed is scored on the same corruptions
    return make_task(
        config, s, tx,
        init_params=init_fn(s.judge_model, length), build=build_judge, evaluate=evaluate,
        tokens_per_step=int(2 * j.batch_size * length), num_steps=int(j.num_steps),
        batch_setting="judge.batch_size",
    )  # fmt: skip


def pretrain_task(config, s: Setup, evaluate) -> Task:
    """--mode=pretrain: the generator, supervised on the original chars of masked spans."""
    pc, d = config.pretrain, config.data
    tx, schedule = make_optimizer(
        OptimSpec.from_config(config.optim, pc.learning_rate, "pretrain.learning_rate"),
        pc.num_steps,
    )

    def build_pretrain(initial_params, mesh=None):
        step = make_pretrain_step(
            pc, s.generator, s.masked_input, tx, schedule, d, sharding.step_hooks(mesh).shard_batch
        )
        return step, s.train_tokens

    return make_task(
        config, s, tx,
        init_params=init_fn(s.generator, d.window_len), build=build_pretrain, evaluate=evaluate,
        tokens_per_step=int(pc.batch_size * d.window_len), num_steps=int(pc.num_steps),
        batch_setting="pretrain.batch_size",
    )  # fmt: skip


def reward_terms(judge_reward, length: int) -> tuple[RewardTerm, ...]:
    """The judge's reward of the filled window, and the zero-weight share of sampled chars
    equal to the original (a diagnostic: the reward never sees the original text)."""

    def judge_term(params, prompts, tokens, mask, ref):
        filled = single_step.fill_span(
            prompts.fields["window"], prompts.start, prompts.length, tokens
        )
        bb, g, _ = tokens.shape
        return judge_reward(params, filled.reshape(bb * g, length)).reshape(bb, g)

    def accuracy_term(params, prompts, tokens, mask, ref):
        pos = single_step.span_positions(prompts.start, tokens.shape[-1], length)
        original = jnp.take_along_axis(prompts.fields["window"], pos, axis=1)
        return (tokens == original[:, None]).astype(jnp.float32)  # per char; masked by caller

    return (RewardTerm("judge", 1.0, judge_term), RewardTerm("fill_accuracy", 0.0, accuracy_term))


def grpo_task(config, espec: EngineSpec, s: Setup, judge_params, evaluate) -> Task:
    """--mode=train (and eval): GRPO on the generator, rewarded by the frozen judge
    (``judge_params``; None in eval without ``judge.checkpoint``)."""
    d, j, b = config.data, config.judge, config.train.batch_size
    length, mean_span = d.window_len, (d.span_min + d.span_max) / 2

    def policy_logits(params, masked):
        return s.generator.apply({"params": params}, masked)  # [B, L, V]

    def sample_prompts(key, tokens):
        k_win, k_span = jax.random.split(key)
        windows = data_lib.random_windows(k_win, tokens, b, length)
        span = judge_lib.random_spans(k_span, b, length, d.span_min, d.span_max)
        start, span_len = single_step.spans_of(span)
        return single_step.SpanPrompts(
            s.masked_input(windows, span), start, span_len, {"window": windows}
        )

    terms = reward_terms(s.judge_reward, length)
    mu = espec.objective.num_iterations  # updates per step: the schedule spans them all
    optim = OptimSpec.from_config(config.optim)
    tx, schedule = make_optimizer(optim, config.train.num_steps, updates_per_step=mu)

    def build_step(initial_params, mesh=None):
        logging.info("fill-in: judge from %s, reference = initial generator", j.checkpoint)
        fns = (policy_logits, s.v, d.span_max, sample_prompts, terms, tx, schedule)
        hooks = sharding.step_hooks(mesh, config)
        return single_step.build(espec, *fns, initial_params, s.train_tokens, judge_params, hooks)

    return make_task(
        config, s, tx,
        init_params=init_fn(s.generator, length), build=build_step, evaluate=evaluate,
        tokens_per_step=int(b * groups.members_per_prompt(espec.group, s.v, b) * mean_span),
        num_steps=int(config.train.num_steps),
        log_keys=("loss", "reward", "kl", "eval/fill_accuracy"),
        heldout_key="eval/fill_accuracy",
    )  # fmt: skip


def make_generator(config, vocab_size: int) -> Encoder:
    """The bidirectional generator: reads V chars + the mask token, outputs the V chars."""
    m = config.model
    return Encoder(
        vocab_size=vocab_size + 1,
        out_size=vocab_size,
        num_layers=m.num_layers,
        num_heads=m.num_heads,
        d_model=m.d_model,
        mlp_ratio=m.mlp_ratio,
        max_len=config.data.window_len,
        head="tokens",
    )


def make_judge_reward(judge_model, kind: str):
    """(judge params, filled windows [N, L]) -> [N] rewards: the judge's window logit (> 0:
    judged real) or, for ``judge.reward=prob``, its sigmoid."""

    def judge_reward(params, filled):
        logit = judge_model.apply({"params": params}, filled)
        return jax.nn.sigmoid(logit) if kind == "prob" else logit

    return judge_reward


def load_generator(path: str, template, vocab):
    """The frozen supervised generator whose samples are the judge's "generator" negatives,
    trained on ``vocab``."""
    try:
        return ckpt_lib.load_params(path, template, integrity.run_identity(vocab))
    except ckpt_lib.CheckpointError as err:
        raise ValueError(
            f"judge.negatives_from={path!r}: {str(err).splitlines()[0]}; pass the workdir of a "
            "--mode=pretrain run of this config"
        ) from err


def make_pretrain_step(pc, generator, masked_input, tx, schedule, d, shard_batch):
    """--mode=pretrain: supervised fill-in (cross-entropy of the original chars at the masked
    positions), a reference generator and an ``init_from`` for GRPO. ``shard_batch`` splits
    the windows over a mesh's data axis."""
    length = d.window_len

    def loss_fn(params, masked, windows, span):
        logits = generator.apply({"params": params}, masked)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, windows)
        hit = (jnp.argmax(logits, -1) == windows).astype(jnp.float32)
        n = jnp.maximum(span.sum(), 1.0)
        return jnp.sum(ce * span) / n, jnp.sum(hit * span) / n

    def step(state: TrainState, tokens):
        key = jax.random.fold_in(state.rng, state.step)
        k_win, k_span = jax.random.split(key)
        windows = data_lib.random_windows(k_win, tokens, pc.batch_size, length)
        span = judge_lib.random_spans(k_span, pc.batch_size, length, d.span_min, d.span_max)
        windows, span = shard_batch((windows, span))
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (loss, acc), grads = grad_fn(state.params, masked_input(windows, span), windows, span)
        # the fill-in name, beside the held-out eval/fill_accuracy of the same quantity
        return supervised_update(state, loss, grads, tx, schedule, train_fill_accuracy=acc)

    return step
