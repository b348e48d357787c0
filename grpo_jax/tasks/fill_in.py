"""Single-step fill-in on tiny Shakespeare, rewarded by a frozen judge, as a Task.

A train window of ``data.window_len`` chars gets one masked span (length uniform in
[data.span_min, data.span_max]); the masked positions hold the mask token
``data.mask_char``, added to the vocabulary (id V). A bidirectional generator (encoder.py,
head="tokens") reads the masked window and outputs a distribution over the V real chars at
every position; a group member fills *all* masked positions in one step by sampling them.
The reward is the frozen judge's window logit of the filled window (``judge.reward=logit``)
or its sigmoid, the probability that the window is real (``prob``); nothing else (never the
original text). The KL is exact,
per masked position, to the frozen reference generator (the initial generator: ``init_from``
or a fresh init). The step is the one engine's (grpo_jax/single_step.py adapts the generator:
a member's completion is its span's chars), so metric names match the other tasks'; the
zero-weight term ``fill_accuracy`` logs the share of sampled chars equal to the original as
``rewards/fill_accuracy/mean``.

Modes: ``train_judge`` trains the judge (judge.py) in its own workdir, its "generator"
negatives sampled by the frozen supervised generator of ``judge.negatives_from`` (a
``pretrain`` workdir; required exactly when ``judge.corruptions`` names "generator");
``pretrain`` trains the generator supervised (cross-entropy of the original chars at the
masked positions), the usual ``init_from`` of a GRPO run and then its frozen reference;
``train`` loads the judge from ``judge.checkpoint`` and runs GRPO; ``eval`` evaluates the
latest generator checkpoint.

Held-out metrics (fixed val windows and spans):
  eval/fill_accuracy          greedy fill: share of masked chars equal to the original
  eval/fill_accuracy/lenK     the same over the spans of K chars only (the per-position
                              policy is exact on 1-char spans, only factorised on longer ones)
  eval/sampled_fill_accuracy  mean π(original char) over masked positions
  eval/pass_at_k              P(one of k sampled fills restores the whole span), exact
  eval/judge_reward           the judge's reward of the greedy fills
  eval/judge_reward_original  the judge's reward of the original windows (a ceiling)
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from grpo_jax import checkpoint as ckpt_lib
from grpo_jax import data as data_lib
from grpo_jax import judge as judge_lib
from grpo_jax import single_step
from grpo_jax.encoder import Encoder
from grpo_jax.rewards import RewardTerm
from grpo_jax.specs import EngineSpec, OptimSpec, integer, number, require
from grpo_jax.task import Task
from grpo_jax.train_state import TrainState, init_state, make_optimizer, supervised_update

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


def build(config, mode: str = "train", workdir=None) -> Task:  # keeps nothing in workdir
    kinds, espec = validate(config, mode)
    d, j = config.data, config.judge
    corpus = data_lib.load_corpus(config.data)
    v = corpus.vocab.size
    mask_id = mask_token(config, corpus.vocab)
    vocab = data_lib.Vocab(corpus.vocab.chars + d.mask_char)  # id v = mask (decode only)
    length = d.window_len
    train_tokens = jnp.asarray(corpus.train)
    log_uni = judge_lib.log_unigram_of(corpus.train, v)
    log_bi = judge_lib.log_bigram_of(corpus.train, v)
    n_val = min(config.eval.num_windows, max(1, (len(corpus.val) - length) // length))
    val_ctx, val_tgt = data_lib.eval_windows(corpus.val, n_val, length - 1, 1)
    val_windows = np.concatenate([val_ctx, val_tgt], 1)
    judge_model = judge_lib.make_judge_model(j, v, length)
    generator = make_generator(config, v)
    init_generator = lambda key: generator.init(key, jnp.zeros((1, length), jnp.int32))["params"]

    if mode == "train_judge":
        tx, schedule = make_optimizer(
            OptimSpec.from_config(config.optim, j.learning_rate, "judge.learning_rate"),
            j.num_steps,
        )
        gen_params, gen_fill = None, None
        if "generator" in kinds:  # negatives sampled by a frozen supervised generator
            gen_params = load_generator(j.negatives_from, init_generator(jax.random.PRNGKey(0)))
            temp = float(j.negatives_temperature)

            def gen_fill(key, params, windows, span):
                return judge_lib.generator_fill(
                    key, generator, params, windows, span, mask_id, temp
                )

        cdata = judge_lib.CorruptionData(train_tokens, log_uni, log_bi, gen_params)

        def build_judge(initial_params, mesh=None):  # single-device task: mesh is unused
            step = judge_lib.make_judge_step(
                config, judge_model, tx, schedule, kinds, v, gen_fill=gen_fill
            )
            return step, cdata

        return Task(
            init_params=lambda key: judge_model.init(key, jnp.zeros((1, length), jnp.int32))[
                "params"
            ],
            make_state=lambda params: init_state(params, tx, config.seed),
            build=build_judge,
            evaluate=judge_lib.make_judge_eval(
                config, judge_model, val_windows, cdata, kinds, config.seed, gen_fill
            ),
            tokens_per_step=int(2 * j.batch_size * length),
            num_steps=int(j.num_steps),
            vocab=vocab,
            data_sha256=corpus.sha256,
        )

    use_judge = mode == "train" or (
        mode == "eval" and bool(j.checkpoint)
    )  # eval: judge metrics when one is given
    judge_params = judge_lib.load_judge(config, judge_model, v) if use_judge else None
    b = config.train.batch_size

    def masked_input(windows, span):
        return jnp.where(span > 0, mask_id, windows).astype(jnp.int32)

    def policy_logits(params, masked):
        return generator.apply({"params": params}, masked)  # [B, L, V]

    def sample_prompts(key, tokens):
        k_win, k_span = jax.random.split(key)
        windows = data_lib.random_windows(k_win, tokens, b, length)
        span = judge_lib.random_spans(k_span, b, length, d.span_min, d.span_max)
        start, span_len = single_step.spans_of(span)
        return single_step.SpanPrompts(
            masked_input(windows, span), start, span_len, {"window": windows}
        )

    judge_reward = make_judge_reward(judge_model, j.reward)

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

    terms = (RewardTerm("judge", 1.0, judge_term), RewardTerm("fill_accuracy", 0.0, accuracy_term))

    # held-out: fixed val windows and spans (eval.seed: the same for every training seed)
    ev_span = judge_lib.random_spans(
        jax.random.PRNGKey(int(config.eval.get("seed", config.seed)) + 104729),
        len(val_windows),
        length,
        d.span_min,
        d.span_max,
    )
    ev_win = jnp.asarray(val_windows)
    ev_in = masked_input(ev_win, ev_span)
    pass_k = tuple(int(k) for k in config.eval.pass_k)

    @jax.jit
    def eval_core(params, jparams):
        logits = generator.apply({"params": params}, ev_in)
        logp = jax.nn.log_softmax(logits, -1)
        greedy = jnp.argmax(logits, -1)
        filled = jnp.where(ev_span > 0, greedy, ev_win)
        lp_orig = jnp.take_along_axis(logp, ev_win[..., None], -1)[..., 0]  # [N, L]
        n_masked = ev_span.sum()
        hits = jnp.sum((greedy == ev_win) * ev_span, -1)  # [N]
        out = {
            "eval/fill_accuracy": hits.sum() / n_masked,
            "eval/sampled_fill_accuracy": jnp.sum(jnp.exp(lp_orig) * ev_span) / n_masked,
            "filled": filled,
        }
        span_len = ev_span.sum(-1)
        for k in range(d.span_min, d.span_max + 1):
            sel = span_len == k
            out[f"eval/fill_accuracy/len{k}"] = jnp.sum(hits * sel) / jnp.maximum(k * sel.sum(), 1)
        p_span = jnp.exp(jnp.sum(lp_orig * ev_span, -1))  # P(one sample restores the span)
        for k in pass_k:
            out[f"eval/pass_at_{k}"] = jnp.mean(1.0 - (1.0 - p_span) ** k)
        if jparams is not None:
            out["eval/judge_reward"] = judge_reward(jparams, filled).mean()
            out["eval/judge_reward_original"] = judge_reward(jparams, ev_win).mean()
        return out

    def evaluate(params):
        res = jax.device_get(eval_core(params, judge_params))
        filled = res.pop("filled")
        scalars = {k: float(x) for k, x in res.items()}
        lines = []
        for i in range(min(config.eval.num_samples, len(filled))):
            lines.append(f"--- masked  : {vocab.decode(np.asarray(ev_in[i]))!r}")
            lines.append(f"    filled  : {vocab.decode(filled[i])!r}")
            lines.append(f"    original: {vocab.decode(val_windows[i])!r}")
        return scalars, {"samples": "\n".join(lines), "summary": ""}

    if mode == "pretrain":
        pc = config.pretrain
        tx, schedule = make_optimizer(
            OptimSpec.from_config(config.optim, pc.learning_rate, "pretrain.learning_rate"),
            pc.num_steps,
        )

        def build_pretrain(initial_params, mesh=None):  # single-device task: mesh is unused
            return make_pretrain_step(pc, generator, masked_input, tx, schedule, d), train_tokens

        return Task(
            init_params=init_generator,
            make_state=lambda params: init_state(params, tx, config.seed),
            build=build_pretrain,
            evaluate=evaluate,
            tokens_per_step=int(pc.batch_size * length),
            num_steps=int(pc.num_steps),
            vocab=vocab,
            data_sha256=corpus.sha256,
        )

    mu = espec.objective.num_iterations  # updates per step: the schedule spans them all
    optim = OptimSpec.from_config(config.optim)
    tx, schedule = make_optimizer(optim, config.train.num_steps, updates_per_step=mu)

    def build_step(initial_params, mesh=None):  # single-device task: mesh is unused
        logging.info("fill-in: judge from %s, reference = initial generator", j.checkpoint)
        fns = (policy_logits, v, d.span_max, sample_prompts, terms, tx, schedule)
        return single_step.build(espec, *fns, initial_params, train_tokens, judge_params)

    return Task(
        init_params=init_generator,
        make_state=lambda params: init_state(params, tx, config.seed),
        build=build_step,
        evaluate=evaluate,
        tokens_per_step=int(b * config.group.size * (d.span_min + d.span_max) / 2),
        num_steps=int(config.train.num_steps),
        vocab=vocab,
        log_keys=("loss", "reward", "kl", "eval/fill_accuracy"),
        heldout_key="eval/fill_accuracy",
        data_sha256=corpus.sha256,
    )


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


def single_char_optimum(config, ref_params, judge_params, policies=(), num_windows=1024):
    """Greedy fill accuracy on held-out single-char spans of: the reference generator, the
    exact per-window KL-regularised optimum of the GRPO objective, z_ref + (T / beta) · r with
    r the judge's reward of each of the V fills (what a perfect optimiser of the same judge
    would reach), and each of ``policies`` (param trees), on the same windows;
    ``optimum_changed`` is the share of windows where the optimum's fill differs from the
    reference's.

    A diagnostic for experiments (V judge passes per window), not a training metric."""
    corpus = data_lib.load_corpus(config.data)
    v, length = corpus.vocab.size, config.data.window_len
    n = min(num_windows, max(1, (len(corpus.val) - length) // length))
    ctx, tgt = data_lib.eval_windows(corpus.val, n, length - 1, 1)
    windows = jnp.asarray(np.concatenate([ctx, tgt], 1))
    key = jax.random.PRNGKey(int(config.eval.seed) + 7)  # not the eval spans' key
    pos = jax.random.randint(key, (n,), 0, length)
    rows = jnp.arange(n)
    masked = windows.at[rows, pos].set(v)  # the mask token
    original = windows[rows, pos]
    generator = make_generator(config, v)
    judge_model = judge_lib.make_judge_model(config.judge, v, length)
    judge_reward = make_judge_reward(judge_model, config.judge.reward)

    def fill_rewards(window_and_pos):  # [L], () -> [V]: the judge's reward of every fill
        window, p = window_and_pos
        filled = jnp.broadcast_to(window, (v, length)).at[jnp.arange(v), p].set(jnp.arange(v))
        return judge_reward(judge_params, filled)

    # V judge passes per window, 64 windows at a time (memory)
    r = jax.jit(lambda w, p: jax.lax.map(fill_rewards, (w, p), batch_size=64))(windows, pos)
    logits = jax.jit(lambda p: generator.apply({"params": p}, masked)[rows, pos])
    accuracy = lambda z: float(jnp.mean(jnp.argmax(z, -1) == original))
    strength = float(config.group.temperature) / float(config.grpo.beta)
    z_ref = logits(ref_params)
    z_opt = z_ref + strength * r
    return {
        "num_windows": n,
        "reference": accuracy(z_ref),
        "optimum": accuracy(z_opt),
        "optimum_changed": float(jnp.mean(jnp.argmax(z_opt, -1) != jnp.argmax(z_ref, -1))),
        "policies": [accuracy(logits(p)) for p in policies],
    }


def load_generator(path: str, template):
    """The frozen supervised generator whose samples are the judge's "generator" negatives."""
    try:
        return ckpt_lib.load_params(path, template)
    except ckpt_lib.CheckpointError as err:
        raise ValueError(
            f"judge.negatives_from={path!r}: {str(err).splitlines()[0]}; pass the workdir of a "
            "--mode=pretrain run of this config"
        ) from err


def make_pretrain_step(pc, generator, masked_input, tx, schedule, d):
    """--mode=pretrain: supervised fill-in (cross-entropy of the original chars at the masked
    positions), a reference generator and an ``init_from`` for GRPO."""
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
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (loss, acc), grads = grad_fn(state.params, masked_input(windows, span), windows, span)
        # the fill-in name, beside the held-out eval/fill_accuracy of the same quantity
        return supervised_update(state, loss, grads, tx, schedule, train_fill_accuracy=acc)

    return step
